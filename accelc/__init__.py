"""accelc: a layer-by-layer acceleration compiler for PyTorch models on NVIDIA GPUs.

    opt = accelc.optimize(model, example_inputs)   # drop-in nn.Module calling Triton kernels
    print(opt.summary())                           # what was rewritten, what was kept and why
"""
import logging as _logging
import os as _os
import signal as _signal
import sys as _sys


def _interrupted_while_importing(signum, frame):
    print("accelc: interrupted", file=_sys.stderr, flush=True)
    _os._exit(130)


# the CLI (the `accelc` command): Ctrl-C while it imports torch and its kernels ends it in one line, not a
# page of import traceback; accelc.cli.main takes Ctrl-C back (KeyboardInterrupt) once it runs
if _sys.argv and _os.path.basename(_sys.argv[0]) == "accelc" and _signal.getsignal(_signal.SIGINT) is \
        _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, _interrupted_while_importing)

# accelc's progress and decisions go to the "accelc" logger: silent unless the application
# configures logging (logging.basicConfig(level=logging.INFO)); the CLI shows INFO, -v DEBUG
_logging.getLogger("accelc").addHandler(_logging.NullHandler())

from accelc.version import __version__  # noqa: E402


def _help_only() -> bool:
    """The `accelc` command asked only for its help or version: answered without importing torch and the
    kernels (1.5 s idle, 6-12 s on a busy machine), as the parser alone needs nothing of them."""
    return bool(_sys.argv) and _os.path.basename(_sys.argv[0]) == "accelc" and any(
        a in ("-h", "--help", "--version") for a in _sys.argv[1:])


if not _help_only():
    from accelc import runtime  # noqa: F401,E402  (first: decides interpreter vs GPU before any kernel is defined)
    from accelc import kernels  # noqa: F401,E402  (registers torch.ops.accelc.*)
    from accelc import models
    from accelc.api import optimize
    from accelc.config import Fp8Config, Int8Config, OptimizeConfig, PRESETS
    from accelc.convert import convert
    from accelc.errors import (AccelcError, CaptureError, InputError, ModelFileError, PassError, ReportFailedError,
                               WrongOutputError)
    from accelc.generation import OptimizedLM
    from accelc.optimized import OptimizedModule
    from accelc.records import LayerRecord
    from accelc.report import report
    from accelc.report_rows import Report
    from accelc.serialize import load, save

    def _say_environment() -> None:
        import warnings as _warnings

        from accelc.version import environment_problems
        for _line in environment_problems():
            _warnings.warn(_line if _line.startswith("accelc") else f"accelc: {_line}", stacklevel=3)

    _say_environment()


__all__ = [
    "AccelcError", "CaptureError", "Fp8Config", "InputError", "Int8Config", "LayerRecord", "ModelFileError",
    "OptimizeConfig", "OptimizedModule", "PRESETS", "PassError", "Report", "ReportFailedError", "WrongOutputError",
    "__version__", "convert", "load", "models", "optimize", "report", "save",
]


def __dir__():
    """dir(accelc): the documented names (__all__), not the internal modules importing them made attributes
    (accelc.api, accelc.near_miss, ...: still importable by their full names)."""
    return sorted(__all__)
