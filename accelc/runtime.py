"""Where accelc's Triton kernels run: on a CUDA GPU, or in Triton's CPU interpreter.

Triton picks interpreter or compiler when a kernel is decorated, from the environment
variable TRITON_INTERPRET. accelc imports this module before any kernel module, so on a
machine without a CUDA GPU the variable is set here and every kernel is interpreted.
A user who sets TRITON_INTERPRET themselves keeps their choice.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import types
import warnings

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (correct, but not fast)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _no_unasserted_overflow_checks() -> None:
    """The interpreter computes an overflow check of every integer add and multiply (each operand cast to
    int64, the result compared with the type's range) and then asserts it only in debug mode, which the
    interpreter never sets: the checks cost a conv kernel's index arithmetic 40% of its time for nothing. Off
    where nothing asserts them; a Triton whose interpreter asserts keeps them."""
    try:
        from triton.runtime import interpreter
        builder = interpreter.interpreter_builder
        if not builder.options.debug and builder.options.sanitize_overflow:
            builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):
        pass


class _OncePerKernel:
    """The interpreter's _patch_lang, patching triton.language once a kernel: the interpreter patches its
    builtins (every member of tl, tl.tensor, tl.math looked up) when a kernel starts, restoring them when it
    ends, and again at every call of a @triton.jit helper inside it, where what it sets is never restored (a
    conv kernel: 50k such calls, most of its time). Here a helper whose language modules are patched already
    patches nothing more; one that names another (triton.language.core where the kernel names
    triton.language) patches it, restored with the kernel's."""

    def __init__(self, original, language_modules):
        self.original, self.language_modules = original, language_modules
        self.depth, self.langs, self.nested = 0, set(), []

    def __call__(self, fn):
        langs = {id(v) for v in fn.__globals__.values()
                 if isinstance(v, types.ModuleType) and any(v is m for m in self.language_modules)}
        if self.depth:
            if not langs <= self.langs:
                self.nested.append(self.original(fn))
                self.langs |= langs
            return _Restore(self, None)
        scope = self.original(fn)
        self.depth, self.langs, self.nested = 1, langs, []
        return _Restore(self, scope)


class _Restore:
    """What _OncePerKernel returns: the kernel's scope restores every patch of its run; a helper's nothing."""

    def __init__(self, owner: _OncePerKernel, scope):
        self.owner, self.scope = owner, scope

    def restore(self) -> None:
        if self.scope is None:
            return
        while self.owner.nested:
            self.owner.nested.pop().restore()
        self.owner.depth, self.owner.langs = 0, set()
        self.scope.restore()


def _patch_language_once_a_kernel() -> None:
    """_OncePerKernel in the interpreter; a Triton whose interpreter is laid out otherwise is left as it is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
        if not isinstance(interpreter._patch_lang, _OncePerKernel):
            interpreter._patch_lang = _OncePerKernel(interpreter._patch_lang, (tl, tl.core))
    except (ImportError, AttributeError):
        pass


# Triton's CPU interpreter keeps its state in globals: two threads running kernels at once fail or
# give wrong numbers. Every interpreted kernel's run holds this lock (_one_kernel_at_a_time), and so do calls
# of optimized modules (their kernels and the host work between them: the GPU path has the runner's).
INTERPRETER_LOCK = threading.RLock()


def _one_kernel_at_a_time() -> None:
    """Each interpreted kernel's run under INTERPRETER_LOCK (a kernel launched by the guard or a report in one
    thread while another thread's optimized model ran its own failed in the interpreter's shared state: another
    kernel's grid, tl patched half-way); a Triton whose interpreter is laid out otherwise is left as it is."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    run = InterpretedFunction.run
    if getattr(run, "_accelc_locked", False):
        return

    def locked_run(self, *args, **kwargs):
        with INTERPRETER_LOCK:
            return run(self, *args, **kwargs)
    locked_run._accelc_locked = True
    locked_run.__wrapped__ = run
    InterpretedFunction.run = locked_run


if interpreted():
    _no_unasserted_overflow_checks()
    _patch_language_once_a_kernel()
    _one_kernel_at_a_time()


def serialized():
    """The lock a call holds while kernels may run in the interpreter; a no-op context on the GPU."""
    return INTERPRETER_LOCK if interpreted() else contextlib.nullcontext()


def autotune_enabled() -> bool:
    """ACCELC_AUTOTUNE=0 launches each kernel with its first candidate config for the shape
    instead of timing all candidates: faster start (tests), slower kernels."""
    return os.environ.get("ACCELC_AUTOTUNE", "1") not in ("", "0")


def can_run_on(device: torch.device) -> bool:
    """Whether accelc kernels can take tensors on `device` in this process."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreted()


def can_time(device: torch.device) -> bool:
    """Whether kernel timings taken on `device` are performance figures: a CUDA device, not the
    interpreter. (The guard chooses int8 or float, and accelc or PyTorch, only where they are.)"""
    return device.type == "cuda" and not interpreted()


def device_reason(device: torch.device) -> str | None:
    """Why accelc kernels cannot take tensors on `device` in this process, or None. (The one
    message every pass and the optimizer give.)"""
    if can_run_on(device):
        return None
    return (f"tensors on {device}: accelc kernels need a CUDA device "
            "(or Triton's interpreter, TRITON_INTERPRET=1)")


def launch_or_fallback(op: str, device: torch.device, launch, reference, *args):
    """The body of every accelc op: its Triton launcher where Triton can run on `device`, else
    (a saved program loaded on a machine without GPU or interpreter, say) its PyTorch reference,
    saying so once per op."""
    if can_run_on(device):
        return launch(*args)
    warn_once(f"{op}-fallback", f"accelc::{op} got tensors on {device}, where Triton cannot run in this "
              "process; computing it with PyTorch instead", stacklevel=3)
    return reference(*args)


def resolve_glue(glue: str, on_gpu: bool) -> str:
    """OptimizeConfig.glue with "auto" resolved: Inductor on a GPU, eager elsewhere."""
    return glue if glue != "auto" else ("inductor" if on_gpu else "eager")


def device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's (a no-op when it already is)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def backend_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu (Triton interpreter)" if interpreted() else "cpu"


_warned: set[str] = set()


def warn_once(key: str, message: str, stacklevel: int = 2) -> None:
    """One warning per process and key: repeated calls of optimize() do not repeat it.
    stacklevel counts from the caller of warn_once, as in warnings.warn."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=stacklevel + 1)


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run accelc's kernels in this environment, or None.
    - Triton before 3.7 converts 1-element arrays to Python scalars, which numpy 2.4 refuses: every
      interpreted kernel then fails with "only 0-dimensional arrays can be converted to Python
      scalars" (seen with triton 3.4 and 3.6 beside numpy 2.4.0; numpy 2.3.5 and triton 3.7.1 -
      3.9.0 are fine).
    - Triton imported before TRITON_INTERPRET was set (before accelc, on a machine without a GPU):
      its own library functions (tl.cdiv, tl.sigmoid...) were then made for the compiler, and every
      interpreted kernel that calls one fails with "Cannot call @triton.jit'd outside of the scope
      of a kernel"."""
    import numpy
    import triton
    if _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s CPU interpreter cannot run with numpy {numpy.__version__}: "
                "install triton>=3.7 or numpy<2.4")
    if interpreted() and _library_compiled():
        return ("triton was imported before accelc (or before TRITON_INTERPRET=1 was set), so its own functions "
                "were made for the GPU compiler and Triton's CPU interpreter cannot run accelc's kernels: import "
                "accelc before triton, or set TRITON_INTERPRET=1 before either")
    return None


def _library_compiled() -> bool:
    """Whether triton.language's own jit functions were made for the compiler (not the interpreter)."""
    try:
        import triton.language.standard as std
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    fn = getattr(std, "cdiv", None)
    return fn is not None and not isinstance(fn, InterpretedFunction)


def warn_if_interpreted(stacklevel: int = 2) -> None:
    """Warns once, pointing `stacklevel` frames above the caller (the user's optimize call)."""
    if interpreted():
        problem = interpreter_problem()
        if problem is not None:
            warn_once("interpreter-numpy", f"accelc: {problem}; every accelc layer will be kept in PyTorch",
                      stacklevel=stacklevel + 1)
        warn_once(
            "interpreter",
            "accelc: no CUDA GPU in use, so its Triton kernels run in Triton's CPU interpreter: "
            "each layer is checked against PyTorch as on a GPU (the interpreter's numpy arithmetic: bf16 "
            "rounds unlike a GPU's), far slower than PyTorch; "
            "timings taken this way are not performance figures.",
            stacklevel=stacklevel + 1,
        )


@functools.lru_cache(maxsize=None)
def import_gluon(module: str, what: str, op: str):
    """(the module accelc.kernels.<module>, None), or (None, why it cannot be imported): Gluon is
    experimental and its API moves between Triton releases, so a Triton that cannot build a Gluon
    kernel keeps the op's tl kernel (said once in the log, and by the op's gluon_problem)."""
    import importlib
    import logging

    import triton
    try:
        return importlib.import_module(f"accelc.kernels.{module}"), None
    except Exception as e:  # ImportError / AttributeError from another Triton's Gluon
        reason = f"the Gluon {what} does not build with triton {triton.__version__} ({type(e).__name__}: {e})"
        logging.getLogger("accelc").info("accelc: %s; accelc::%s uses its tl kernel", reason, op)
        return None, reason


def gluon_target_problem(t: torch.Tensor, what: str) -> str | None:
    """Why a Gluon kernel (written for sm90, fp16 / bf16) cannot take tensor t's call, or None: the
    checks the Gluon GEMM's and attention's gluon_problem share."""
    if interpreted() or not t.is_cuda:
        return "Gluon kernels need a GPU (the interpreter runs tl kernels only)"
    if torch.cuda.get_device_capability(t.device) != (9, 0):
        return f"the Gluon {what} is written for sm90 (Hopper)"
    if t.dtype not in (torch.float16, torch.bfloat16):
        return f"the Gluon {what} takes fp16 / bf16, not {t.dtype}"
    return None


_SIDE_STREAMS: dict = {}
_SIDE_LOCK = threading.RLock()


@contextlib.contextmanager
def side_stream(device: torch.device):
    """The one side stream of a GPU that accelc warms up, captures and times CUDA graphs on (the
    Runner's graphs, the guard's and the report's timers), held by this thread for the block.

    One for the process, not one per use: cuBLAS keeps a workspace (16-32 MiB on Hopper) for every
    stream it has run on, for the process's life. A new stream per timed layer left the guard's
    race 30 of them, 495 MiB, after optimize (GPT-2 and BERT-base, H100); the optimized model's
    calls, on the caller's stream, and this one hold two, as torch.compile's CUDA graphs do. The
    lock keeps two threads' captures off the stream at the same time (a capture is per stream)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _SIDE_LOCK:
        stream = _SIDE_STREAMS.get(index)
        if stream is None:
            stream = _SIDE_STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
        yield stream


class _ExportGate:
    """accelc's own exports (torch.export, the ONNX exporter) kept apart from the optimized modules' calls in other
    threads. While any thread exports, torch sets process-wide flags (torch.compiler.is_exporting, is_compiling) and
    edits process-wide trace metadata at every custom op's call (fx.traceback's current_meta: the calls of accelc's
    ops in another thread failed with KeyError 'custom' as accelc.save exported; the export put fake tensors in the
    module's place too, which save now avoids by exporting a copy). So an export waits for the calls other threads
    have in flight, and a call waits while an export runs, unless its own thread is the one exporting (a generate
    that optimizes its step again for more sequences). Calls in many threads at once still run at once; exports
    too. An export waits at most WAIT_S for other threads' calls (two threads each exporting from inside a call
    would wait on each other): then it goes on, as before this gate."""
    WAIT_S = 60.0

    def __init__(self):
        self._cond = threading.Condition()
        self._exports = 0
        self._calls: dict = {}        # thread id -> calls in flight
        self._local = threading.local()

    @contextlib.contextmanager
    def call(self):
        me = threading.get_ident()
        with self._cond:
            while self._exports and not getattr(self._local, "exporting", 0):
                self._cond.wait()
            self._calls[me] = self._calls.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._calls[me] -= 1
                if not self._calls[me]:
                    del self._calls[me]
                if self._exports:       # (an export waiting for the calls in flight: none on a call's usual path)
                    self._cond.notify_all()

    @contextlib.contextmanager
    def export(self):
        me = threading.get_ident()
        with self._cond:
            self._exports += 1
            self._cond.wait_for(lambda: not any(t != me for t in self._calls), timeout=self.WAIT_S)
        self._local.exporting = getattr(self._local, "exporting", 0) + 1
        try:
            yield
        finally:
            self._local.exporting -= 1
            with self._cond:
                self._exports -= 1
                self._cond.notify_all()


EXPORTS = _ExportGate()
