"""Exceptions accelc raises on purpose; each message says what went wrong and what to try."""


class AccelcError(Exception):
    """Base class of accelc's own errors."""


class CaptureError(AccelcError):
    """The model could not be captured as a torch.fx graph by any method."""


class PassError(AccelcError):
    """A graph pass raised; the message names the pass and the passes that ran before it."""


class ModelFileError(AccelcError):
    """A model file that accelc cannot read, or inputs that do not fit it."""


class InputError(AccelcError, ValueError):
    """Example inputs the guard cannot check rewritten layers on (empty, NaN or inf)."""


def short_error(e: BaseException, limit: int = 300) -> str:
    """`Type: first words of the message`, on one line: for messages that quote another
    library's error (exporters and loaders print pages)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}"
