"""accelc's version, in one place (the package, the CLI and report headers read it)."""
__version__ = "0.1.0"
