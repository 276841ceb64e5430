"""What a process's first kernel launches would compute or build, made ahead: Triton's key of its own installation
(key_early, in a thread when an optimize on a GPU begins) and, in the compile workers, a compiled kernel's launcher
(launcher_ahead). Nothing here is a result: what fails is left to the launch, which does it as it would have."""
from __future__ import annotations

import contextlib
import threading


_key_thread: list = []


def key_early() -> None:
    """Triton's key of its own installation (`triton_key`: a hash of its compiler's files and of libtriton, some
    hundred MB) computed in a thread, once a process: else the process's first kernel launch computes it, 0.35-0.65 s
    of a warm optimize's main thread (py-spy, H200 host). File reads and hashlib release the GIL; a failure here is
    left to that launch, which computes it as it would have."""
    if _key_thread:
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return

    def compute():
        with contextlib.suppress(Exception):
            triton_key()
    _key_thread.append(threading.Thread(target=compute, name="accelc-triton-key", daemon=True))
    _key_thread[0].start()


def launcher_ahead(kernel) -> bool:
    """In a worker: the compiled kernel's launcher built into Triton's cache folder too, where this Triton builds
    one per kernel signature (a C module the host's compiler builds at a kernel's first launch in a process, kept
    there under its source's hash): the main process's first launch then loads it. A cold causal LM's optimize
    spent 7.5 s of its main thread in those builds (py-spy, H200, triton 3.6: the races' first launches); a Triton
    with one launcher for every kernel has nothing to build. The launcher is only made, never called: no GPU.
    Whether one was built."""
    try:
        import inspect
        from triton.backends.nvidia import driver

        launcher = getattr(driver, "CudaLauncher", None)
        if launcher is None or "compile_module_from_src" not in inspect.getsource(launcher.__init__):
            return False
        launcher(kernel.src, kernel.metadata)
        return True
    except Exception:   # (the first launch builds it, as it would have)
        return False
