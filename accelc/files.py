"""Writing files so that a reader never sees a half-written one."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from accelc.errors import ModelFileError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yields a temporary path beside `path`; renames it to `path` if the block succeeds and
    removes it otherwise (exceptions and Ctrl-C alike)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ModelFileError(f"output folder {str(path.parent)!r} does not exist")
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")  # keeps the suffix readers check
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` to `path`, atomically."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)
