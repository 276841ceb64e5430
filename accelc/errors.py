"""Exceptions accelc raises on purpose; each message says what went wrong and what to try."""


class AccelcError(Exception):
    """Base class of accelc's own errors."""


class CaptureError(AccelcError):
    """The model could not be captured as a torch.fx graph by any method."""


class PassError(AccelcError):
    """A graph pass raised; the message names the pass and the passes that ran before it."""


class ModelFileError(AccelcError):
    """A model file that accelc cannot read, or inputs that do not fit it."""


class ReportFailedError(AccelcError):
    """`convert` wrote its program, complete, but the report asked beside it failed. `optimized`:
    the optimized module; `program`: the file written."""

    def __init__(self, program: str, cause: BaseException, optimized=None):
        super().__init__(f"{program} is written and complete; only the report failed: {short_error(cause)}")
        self.program, self.optimized = program, optimized


class WrongOutputError(AccelcError):
    """The rewritten graph's output is far from eager's with every layer back in PyTorch: a rewrite outside the
    layers changed the model (accelc.output_check). accelc refuses it rather than return wrong numbers."""


class InputError(AccelcError, ValueError):
    """Example inputs the guard cannot check rewritten layers on (empty, NaN or inf)."""


def short_error(e: BaseException, limit: int = 300) -> str:
    """`Type: first words of the message`, on one line: for messages that quote another
    library's error (exporters and loaders print pages)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}"
