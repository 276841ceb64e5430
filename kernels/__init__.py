"""accelc's Triton kernels, one file a kernel (its launcher, reference and op); importing this package registers
every torch.ops.accelc.* op and gives their tables (accelc.kernels.ops: LAUNCHERS, REFERENCES).

This folder sits at the repository's root and installs as accelc.kernels. Where the root is on sys.path (Python run
from it: `python -m pytest`, `python -c`, a notebook), a plain `import kernels` finds this folder first, and that
name is Hugging Face's `kernels` package, which transformers 5.24+ imports as it loads any model. So imported under
that name, this package hands the name to the installed package of that name, as if this folder were not on the
path; with none installed it stays an empty module without a version (what transformers before 5.24 takes for none).
"""
if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(__name__, [p for p in _sys.path if _os.path.abspath(p or ".") != _root])
    if _spec is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _module        # (what the import statement returns: Python reads it back after this)
        _spec.loader.exec_module(_module)
    # else none is installed: this module stays, empty, no version (transformers before 5.24, finding this folder,
    # imports it to read a version and takes a package without one for no kernels package; an error there stopped
    # every model's import)
else:
    from accelc.kernels.ops import *  # noqa: F401,F403
    from accelc.kernels.ops import __all__  # noqa: F401
