"""Exceptions accelc raises on purpose; each message says what went wrong and what to try."""


class AccelcError(Exception):
    """Base class of accelc's own errors."""


class CaptureError(AccelcError):
    """The model could not be captured as a torch.fx graph by any method."""


class PassError(AccelcError):
    """A graph pass raised; the message names the pass and the passes that ran before it."""
