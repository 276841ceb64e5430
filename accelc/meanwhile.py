"""Work the main thread does while it would only wait for the compile workers.

A cold optimize's main thread waits on the compile workers (accelc.compile_workers) at the start of each guard
while the example's tuning candidates compile: on the GPU host, a cold Qwen2-0.5B LM's forward 3.6 s (one attention
kernel's compile bounding it), its generation step's 5.5 s (one flash-attention candidate's), the other workers
idle. Work that is needed later and depends on nothing the wait is for is offered (`offered`) and done in the
first such wait (`fill`, at the guard's first wait: compile_workers.Pending.wait(fill=True)), or where it is asked
for (Work.result) if no wait came first: a causal LM's generation step captured in its forward's wait (the model's
eager run and torch.export), the forward's warm-up (its glue compiled, its CUDA graph captured) in the step's.
Either way it is done once, in the thread that offered it, and its outcome (a value or the exception it raised)
is what result() gives: a failure surfaces where the work's result is used, as it did before the work moved.
Nothing here runs where nothing waits: an optimize whose compiles are all done (warm) or made without workers
(the CPU) does the work at result(), in its old place.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

_offered: list["Work"] = []
_lock = threading.Lock()


class Work:
    """fn's outcome, made once: in the first wait after it was offered, or at result()."""

    def __init__(self, fn: Callable[[], object], label: str):
        self.label = label
        self._fn, self._value, self._error = fn, None, None
        self._thread = threading.current_thread()
        self.ran_early = False      # done in a wait (fill), not at result()

    def _run(self) -> None:
        fn, self._fn = self._fn, None
        if fn is None:     # (done already, or being done: a wait inside the work itself)
            return
        try:
            self._value = fn()
        except Exception as e:   # kept for result(): the caller says what failed, where it used to
            self._error = e

    def result(self):
        """fn's value (or its exception raised again); fn run now if no wait ran it."""
        _withdraw(self)
        self._run()
        if self._error is not None:
            raise self._error
        return self._value


@contextlib.contextmanager
def offered(fn: Callable[[], object], label: str, enabled: bool = True):
    """Within: fn offered to this thread's waits; yields its Work (None where not enabled: the caller does the work
    itself). Withdrawn at the block's end if no wait took it (an optimize that failed first)."""
    if not enabled:
        yield None
        return
    work = Work(fn, label)
    with _lock:
        _offered.append(work)
    try:
        yield work
    finally:
        _withdraw(work)


def fill() -> int:
    """The work offered by this thread done now, in order (a wait that has nothing else to do); how many."""
    me = threading.current_thread()
    done = 0
    while True:
        with _lock:
            work = next((w for w in _offered if w._thread is me), None)
            if work is None:
                return done
            _offered.remove(work)
        work.ran_early = True
        work._run()
        done += 1


def _withdraw(work: Work) -> None:
    with _lock:
        if work in _offered:
            _offered.remove(work)
