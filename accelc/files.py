"""Writing files so that a reader never sees a half-written one; cache records (pickles accelc keeps for a later
optimize: verdicts, captured graphs) written whole, read back or said and removed, their folders within bounds."""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable

from accelc.errors import ModelFileError

log = logging.getLogger("accelc")


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


def check_output_file(path: str | os.PathLike, suffix: str, what: str) -> Path:
    """Refuses, before any long work, an output file path accelc could not write: another suffix,
    a missing or read-only folder, a folder where the file goes."""
    if not str(path).strip():
        raise ModelFileError(f"the output file name is empty: give a file name ending in {suffix}")
    path = Path(path)
    if path.suffix != suffix:
        raise ModelFileError(f"output {str(path)!r} must end in {suffix} ({what})")
    if path.is_dir():
        raise ModelFileError(f"output {str(path)!r} is a folder: give a file name ending in {suffix}")
    if path.parent.exists() and not path.parent.is_dir():
        raise ModelFileError(f"output folder {str(path.parent)!r} is a file")
    if not path.parent.is_dir():
        raise ModelFileError(f"output folder {str(path.parent)!r} does not exist")
    _check_writable(path.parent, f"output folder {str(path.parent)!r}")
    return path


def check_output_folder(path: str | os.PathLike) -> Path:
    """Refuses, before any long work, an output folder accelc could not make or write into: an
    existing file in its place, a read-only folder on the way."""
    if not str(path).strip():    # Path("") is the working folder: files would land there unasked
        raise ModelFileError("the output folder name is empty: give a folder (it is made if missing)")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ModelFileError(f"output folder {str(path)!r} is a file: give a folder (it is made if missing)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ModelFileError(f"cannot make output folder {str(path)!r}: {str(existing)!r} is a file")
    _check_writable(existing, f"output folder {str(path)!r}" if existing == path
                    else f"{str(existing)!r} (where output folder {str(path)!r} would be made)")
    return path


def _check_writable(folder: Path, what: str) -> None:
    try:   # a real write: permission bits do not tell for root, read-only mounts or full disks
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ModelFileError(f"{what} is not writable ({e.strerror or e})") from None


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` to `path`, atomically."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)


def trim_folder(folder: Path, newest: Path, max_files: int, max_bytes: int) -> None:
    """A cache folder's least recently used records (`*.pkl`, by their times) removed until it holds at most
    max_files of them and max_bytes; `newest` (the one just written) stays."""
    files = []
    for p in folder.glob("*.pkl"):
        try:
            st = p.stat()
        except OSError:      # (removed by another process meanwhile)
            continue
        files.append((st.st_mtime, st.st_size, p))
    files.sort(key=lambda f: (f[2] == newest, f[0]))       # oldest first, the newest last whatever its clock
    count, size = len(files), sum(f[1] for f in files)
    for _, bytes_, p in files[:-1]:
        if count <= max_files and size <= max_bytes:
            break
        p.unlink(missing_ok=True)
        count, size = count - 1, size - bytes_


_said: set = set()      # what was said once a process: records that could not be read, cache folders unusable
_said_lock = threading.Lock()


def cache_root() -> Path:
    """The folder of everything accelc keeps between processes (tuning, verdicts, captures): ACCELC_CACHE_DIR, else
    accelc/ in the user's cache folder (XDG_CACHE_HOME, ~/.cache)."""
    root = os.environ.get("ACCELC_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "accelc"


def cache_unusable(e: OSError) -> None:
    """A cache folder that cannot be read or written (a read-only mount, a file where a folder goes, a full disk):
    optimize goes on without it, and says so once a process and folder (a warning, and the log)."""
    root = str(cache_root())
    with _said_lock:
        first = ("folder", root) not in _said
        _said.add(("folder", root))
    if first:
        message = (f"accelc: cannot use the cache folder {root} ({type(e).__name__}: {e.strerror or e}): optimize "
                   "goes on without it, so what it would keep is done again next time (ACCELC_CACHE_DIR names "
                   "another folder)")
        log.warning("%s", message)
        warnings.warn(message, stacklevel=3)


def read_record(path: Path, load: Callable, what: str, then: str):
    """load(the record unpickled from path), None where there is none. One that cannot be read or loaded (another
    version's, a damaged file) is said once ("accelc: {what} {path} cannot be read (...): removed, {then}") and
    removed; one read is marked recently used (its time, which trim_folder reads)."""
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)    # (pytree's specs of an older spelling)
            out = load(pickle.load(f))
    except FileNotFoundError:
        return None
    except OSError as e:       # the folder, not the record: a file in its place, no permission
        cache_unusable(e)
        return None
    except Exception as e:
        with _said_lock:
            first = str(path) not in _said
            _said.add(str(path))
        if first:
            log.warning("accelc: %s %s cannot be read (%s: %s): removed, %s", what, path, type(e).__name__, e, then)
        remove(path)
        return None
    try:
        os.utime(path)
    except OSError as e:       # (read, but a read-only folder: its use not marked)
        cache_unusable(e)
    return out


def remove(path: Path) -> None:
    """A cache file removed where there is one; a folder that cannot be written is said once (cache_unusable)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        cache_unusable(e)


def write_record(path: Path, record, max_files: int, max_bytes: int, what: str) -> None:
    """record pickled to path, whole or not at all (two threads writing alike each through a file of its own),
    then its folder trimmed to its bounds; a record that does not pickle, or a cache that cannot be written, is
    said in the log ("accelc: {what} (...)") and only means the next optimize does the work again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        data = pickle.dumps(record)     # (before any file: an object that does not pickle leaves none)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
        trim_folder(path.parent, path, max_files, max_bytes)
    except OSError as e:
        cache_unusable(e)
    except Exception as e:
        log.info("accelc: %s (%s: %s)", what, type(e).__name__, e)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
