"""torch.fx's "is a trace running" flag, seen by each thread as its own while accelc traces.

torch keeps that flag in one module global (torch.fx._symbolic_trace._is_fx_tracing_flag, set by every
fx.Tracer.trace: symbolic_trace, torch.export's and Inductor's make_fx). A compiled function checks it at every call
and refuses to run inside a trace ("Detected that you are using FX to symbolically trace a dynamo-optimized
function"). So while accelc traced in one thread (optimize's capture, the background compile of the glue for other
shapes), every torch.compile'd function the user called in another thread failed: HF's own compiled generate right
after optimize returned, a server's other requests. (torch itself makes the flag thread-local in a later release.)

`each_thread_its_own()`, held while accelc may trace (optimize; a background compile's thread), makes the flag's
readers (`is_fx_tracing`, `is_fx_symbolic_tracing`: their code, which compiled functions hold by reference) also ask
whether the calling thread is inside a trace (a depth kept per thread by a wrapper of fx.Tracer.trace). A thread's
own trace reads as before; another thread's no longer leaks into it. Counted: the first holder installs it, the last
one out puts torch's code back as it was.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types

from torch import fx
from torch.fx import _symbolic_trace as st

_MARK = "_accelc_traced_in_this_thread"


# the code swapped into torch's two readers (their names are read from torch's module: the originals' copies, set there
# by _Readers.install, and traced_in_this_thread)
def _is_fx_tracing() -> bool:
    return _accelc_is_fx_tracing() and _accelc_traced_in_this_thread()  # noqa: F821


def _is_fx_symbolic_tracing() -> bool:
    return _accelc_is_fx_symbolic_tracing() and _accelc_traced_in_this_thread()  # noqa: F821


class _Readers:
    """The swap of torch's readers, counted (the first holder installs it, the last one out puts torch's code back),
    and each thread's depth of traces while it is in place."""

    def __init__(self):
        self.local, self.lock, self.count, self.saved = threading.local(), threading.Lock(), 0, None

    def traced_in_this_thread(self) -> bool:
        return getattr(self.local, "depth", 0) > 0

    def counted(self, trace):
        local = self.local

        def trace_counted(tracer, *args, **kwargs):
            local.depth = getattr(local, "depth", 0) + 1
            try:
                return trace(tracer, *args, **kwargs)
            finally:
                local.depth -= 1
        trace_counted.__wrapped__ = trace
        return trace_counted

    def install(self) -> None:
        readers = [(st.is_fx_tracing, _is_fx_tracing), (st.is_fx_symbolic_tracing, _is_fx_symbolic_tracing)]
        if any(f.__code__.co_freevars for f, _ in readers):
            return       # (another torch's readers: left as they are)
        added = {_MARK: self.traced_in_this_thread}
        for f, mine in readers:     # (copies of torch's readers as they are, which the swapped code calls)
            added["_accelc_" + mine.__name__.lstrip("_")] = types.FunctionType(f.__code__, f.__globals__, f.__name__)
        self.saved = (fx.Tracer.trace, [(f, f.__code__) for f, _ in readers], list(added))
        vars(st).update(added)
        fx.Tracer.trace = self.counted(fx.Tracer.trace)
        for f, mine in readers:
            f.__code__ = mine.__code__

    def uninstall(self) -> None:
        saved, self.saved = self.saved, None
        if saved is None:
            return
        trace, codes, added = saved
        fx.Tracer.trace = trace
        for f, code in codes:
            f.__code__ = code
        for name in added:
            vars(st).pop(name, None)


_READERS = _Readers()


@contextlib.contextmanager
def each_thread_its_own():
    """The flag per thread while the block runs (module docstring); nested and concurrent holders counted."""
    with _READERS.lock:
        if _READERS.count == 0:
            _READERS.install()
        _READERS.count += 1
    try:
        yield
    finally:
        with _READERS.lock:
            _READERS.count -= 1
            if _READERS.count == 0:
                _READERS.uninstall()


def own_flag(fn):
    """fn run with each_thread_its_own held (accelc's entry points that trace: optimize, report, save; the background
    compile's thread)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with each_thread_its_own():
            return fn(*args, **kwargs)
    return run
