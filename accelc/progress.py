"""What a long optimize shows while it works: its phase (capture, passes, checking layers, warm-up, the
generation step), and within a phase that has items (the guard's layers: their first calls tune the
kernels) a bar of i of N with tqdm's estimate of what is left. tqdm's bar where tqdm is installed (it
comes with HF's stack), else one plain line a phase.

On by default in an interactive session (a Python prompt, IPython, Jupyter) and in the CLI on a terminal;
`optimize(..., progress=True / False)` says so explicitly. Quiet otherwise: a library in an application
writes nothing unless asked (its steps still go to the "accelc" logger).
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
import time

try:
    from tqdm.auto import tqdm
except ImportError:      # optional: a plain line a phase instead
    tqdm = None

_active: contextvars.ContextVar = contextvars.ContextVar("accelc_progress", default=None)


def wanted(progress) -> bool:
    """progress as optimize takes it: True / False, or None for the default (an interactive session)."""
    if progress is not None:
        return bool(progress)
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "ipykernel" in sys.modules


class Bar:
    """The progress of one optimize (see the module docstring)."""

    def __init__(self, label: str, stream=None):
        self.label, self.stream = label, stream or sys.stderr
        self.bar, self.t0, self.prefix = None, time.perf_counter(), ""

    def phase(self, name: str, total: int | None = None) -> None:
        self._end_bar()
        desc = f"{self.label}: {self.prefix}{name}"
        if tqdm is not None and (self.stream.isatty() or "ipykernel" in sys.modules):   # a bar, gone at the next phase
            self.bar = tqdm(total=total, desc=desc, leave=False, file=self.stream, unit="layer", dynamic_ncols=True,
                            bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}" if total
                            else "{desc} [{elapsed}]")
        else:
            self.write(f"{desc}" + (f" ({total} layers)" if total else ""))

    def step(self, text: str = "") -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text[:48], refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        """A line above the bar (a log record while the bar is shown)."""
        if self.bar is not None and tqdm is not None:
            tqdm.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        self._end_bar()
        self.write(f"{self.label}: done in {time.perf_counter() - self.t0:.1f} s")

    def _end_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextlib.contextmanager
def showing(label: str, enabled: bool, part: str = ""):
    """Show optimize's progress inside the block. Nested (the generation step's optimize inside an
    LM's), the outer bar goes on, its phases named `part` first."""
    outer = _active.get()
    if outer is not None:
        saved, outer.prefix = outer.prefix, part
        try:
            yield outer
        finally:
            outer.prefix = saved
        return
    if not enabled:
        yield None
        return
    bar = Bar(label)
    token = _active.set(bar)
    try:
        yield bar
    finally:
        _active.reset(token)
        bar.close()


def phase(name: str, total: int | None = None) -> None:
    bar = _active.get()
    if bar is not None:
        bar.phase(name, total)


def step(text: str = "") -> None:
    bar = _active.get()
    if bar is not None:
        bar.step(text)


def active() -> bool:
    """Whether optimize's progress is shown here (a bar or its lines)."""
    return _active.get() is not None


def write(text: str) -> bool:
    """Write a line through the shown progress (False where none is shown)."""
    bar = _active.get()
    if bar is None:
        return False
    bar.write(text)
    return True
