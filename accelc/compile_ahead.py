"""Compiling a tuner's candidates ahead, all at once, before they are timed one by one.

Every tuned kernel launches through `launch_kernel`; inside `compiling_ahead()` such a launch is a compile
(Triton's warmup), submitted to a pool of threads (Triton's async compile mode), all finished when the block
ends. `precompile` does this for a tuner's candidates; the guard for the kernels of its other sizes.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os

from accelc import compile_workers, runtime

log = logging.getLogger("accelc")

_precompiling = contextvars.ContextVar("accelc_precompiling", default=False)


def launch_kernel(kernel, grid, args: tuple, constexprs: dict) -> None:
    """kernel[grid](*args, **constexprs): how a tuner's candidate launches, so that precompile can
    compile it instead (in its block: Triton's warmup, which compiles without running)."""
    if _precompiling.get():
        kernel.warmup(*args, grid=grid, **constexprs)
    else:
        kernel[grid](*args, **constexprs)


@contextlib.contextmanager
def compile_only():
    """Inside the block, a tuned kernel's launch (launch_kernel) compiles it (Triton's warmup) instead of
    running it, in this thread (compiling_ahead spreads the compiles over a pool)."""
    token = _precompiling.set(True)
    try:
        yield
    finally:
        _precompiling.reset(token)


def compile_threads() -> int:
    """Threads compiling a tuner's candidates at once (ACCELC_COMPILE_THREADS, default: the CPUs, at most 16)."""
    given = os.environ.get("ACCELC_COMPILE_THREADS")
    return max(1, int(given)) if given and given.isdigit() else min(16, os.cpu_count() or 1)


def precompile(launch_cfg, candidates: list) -> None:
    """Compile every candidate at once before they are timed one by one: Triton's compile of a candidate
    (LLVM, then ptxas in a process of its own) took 0.6 s, 95 of the 216 s of a cold BERT optimize
    (H100), one after another. A candidate that cannot take the call, or fails to compile, is left to
    its timing, which says so (inf)."""
    if len(candidates) < 2:
        return
    # first in worker processes, into Triton's disk cache (their compiles overlap fully; threads' only in
    # part): the threads below then load them
    compile_workers.compile_all(launch_cfg, candidates, compile_only)
    with compiling_ahead(len(candidates)) as ahead:
        for cfg in candidates if ahead else ():
            try:
                launch_cfg(cfg)
            except Exception as e:   # not a candidate for this call: its timing says so
                log.debug("accelc: %s not compiled ahead: %s", cfg, e)


@contextlib.contextmanager
def compiling_ahead(most: int | None = None):
    """Inside the block, a tuned kernel's launch (launch_kernel) compiles it instead of running it, the
    compiles in a pool of threads (Triton's async compile mode, triton.runtime._async_compile, where this
    Triton has it), all finished when the block ends. A kernel launched otherwise inside the block runs,
    compiled first. Nothing happens in the interpreter, with one compile thread, or on an older Triton (the
    block runs as it is: kernels launched in it run). Nothing done in the block is a result: an exception in
    it ends the block, logged, not raised, and a compile that fails is left to the real launch, which fails
    again and says so. Yields whether launches compile ahead. most: at most this many threads."""
    threads = min(compile_threads(), most or compile_threads())
    mode = None
    if threads >= 2 and not runtime.interpreted():
        try:
            from triton.runtime._async_compile import AsyncCompileMode
        except ImportError:     # an older Triton: compiled one by one at their first launch
            AsyncCompileMode = None
        if AsyncCompileMode is not None:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(threads, thread_name_prefix="accelc-compile")
            try:
                mode = AsyncCompileMode(pool, ignore_errors=True)
            except TypeError:   # (a Triton whose mode re-raises a failed compile: caught below)
                mode = AsyncCompileMode(pool)
    if mode is None:
        yield False
        return
    try:
        with compile_only(), mode:
            yield True
    except Exception as e:   # a compile that failed: the kernel's own launch fails again, and says so
        log.debug("accelc: a kernel failed to compile ahead: %s", e)
    finally:
        pool.shutdown(wait=True)
