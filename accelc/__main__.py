import sys

from accelc.cli import main

sys.exit(main())
