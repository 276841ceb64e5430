"""A tuner's candidates compiled in worker processes, into Triton's disk cache, before compile_ahead's threads
compile them (which then load them from there).

The threads of compile_ahead overlap Triton's compiles only in part (16 threads compiled a cold BERT's candidates
4-5x faster than one after another). Here each candidate's launch first runs under Triton's `jit_cache_hook`,
which hands over what it would compile (the kernel's specialization data: signature, constexprs, attributes,
options) and compiles nothing; the workers build each from that data with `triton.compile`, which writes the disk
cache under the key the launch's own compile computes, and the kernel's launcher where Triton builds one per
signature (triton_cache.launcher_ahead: the main process's first launch loads it instead of running the host's C
compiler). A worker never initialises the GPU (the main process's target comes with each job).

Nothing done here is a result: a kernel a worker cannot find or compile, a Triton without the hook, workers that
do not start, all leave the compile to the threads, as before. Except a compile that ended its worker (Triton's
LLVM aborting on one kernel's code, seen with triton 3.6): that specialization is never compiled in this process,
where the same abort would end the user's program; its launch raises CompilerCrashed instead (the race drops the
candidate, the guard leaves the layer in PyTorch and says why). What a worker compiled is recorded in the Triton
cache folder (compiled()): a later process loads those kernels from there without a worker's round trip (a warm
optimize). ACCELC_COMPILE_PROCS: the workers (default:
compile_ahead's thread count; 0 or 1: off). An optimize holds them (`hold` / `release`): started as its capture begins
to trace (`start`; a warm optimize whose graph is read back starts none unless a compile is handed over), so that
they are up by the time the guard's first tuner asks, and closed at its end.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from accelc import meanwhile, runtime, triton_cache

log = logging.getLogger("accelc")

_lock = threading.Lock()
_workers: list = []     # the running worker processes
_failed: list = []      # workers that could not start: not tried again in this process
_sent: set = set()      # the specializations handed to the workers in this process
_crashed: dict = {}     # specialization data -> how its compile ended the worker that ran it
_inflight: dict = {}    # specialization data -> threading.Event, set when a worker's compile of it has ended
_compiled: dict = {}    # Triton cache folder -> digests of the specializations a worker compiled into it (compiled())
COMPILED_RECORD = "accelc/worker-compiled.txt"   # their record in that folder, a digest a line
# the kernels whose compiles met inside an optimize go to a worker first (refuse_crashed): accelc's own (a model's
# kernels from modules of its own are compiled as they always were: a worker would import those modules)
FIRST_BY_A_WORKER: tuple = ("accelc.",)


class CompilerCrashed(RuntimeError):
    """A kernel's compile ended the worker process that ran it; this process does not compile it."""


def workers() -> int:
    """Worker processes (ACCELC_COMPILE_PROCS; default, as many as compile_ahead's threads: ACCELC_COMPILE_THREADS,
    else the CPUs, at most 16)."""
    for name in ("ACCELC_COMPILE_PROCS", "ACCELC_COMPILE_THREADS"):
        given = os.environ.get(name)
        if given is not None and given.strip().isdigit():
            return int(given)
    return min(16, os.cpu_count() or 1)


def enabled() -> bool:
    return workers() >= 2 and not runtime.interpreted() and not _failed and _hook_supported()


def active() -> bool:
    """Whether compiles handed over now go to the workers: enabled, and inside an optimize that holds them (a
    later call's few candidates would wait longer for the workers' imports than the threads take)."""
    return any(_holders) and enabled()


def _hook_supported() -> bool:
    try:
        from triton import knobs
        return hasattr(knobs.runtime, "jit_cache_hook")
    except ImportError:
        return False


class _Worker:
    """One worker: a Python process of its own (started with -c, so that a script without a __main__ guard is
    not imported again, as multiprocessing's spawn would), one job a line on its stdin, one answer a line on
    its stdout (serve)."""

    def __init__(self, cache_dir: str):
        env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
        self.proc = subprocess.Popen([sys.executable, "-c", "from accelc.compile_workers import serve; serve()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, text=True, bufsize=1)
        self.lock = threading.Lock()

    def compile(self, job) -> bool:
        with self.lock:      # one job at a time: two batches (submit) may feed the same worker
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        if not answer:
            raise EOFError("a compile worker ended")
        return answer.strip() == "1"

    def ended(self) -> str:
        """How the process ended ('' while it runs): its signal or exit status."""
        try:
            code = self.proc.wait(timeout=10)
        except Exception:
            return ""
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit status {code}"

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass


def _running() -> list:
    """The workers (started on first use); [] where they cannot start."""
    with _lock:
        if not _workers and not _failed:
            try:
                from triton import knobs
                cache_dir = str(knobs.cache.dir)
                _workers.extend(_Worker(cache_dir) for _ in range(workers()))
            except Exception as e:   # (no process may be started here): the threads compile
                log.debug("accelc: no compile workers: %s", e)
                _failed.append(e)
        return list(_workers)


def _close() -> None:
    with _lock:
        for w in _workers:
            w.close()
        _workers.clear()


_holders: list = []     # the optimizes running now (nested: a causal LM's step program inside its forward's)


def hold(on: bool = True) -> None:
    """An optimize begins (on: on a GPU): the compiles that ended a worker refused from then on (refuse_crashed); the
    workers start as its first fresh capture begins (start), or at a first hand-over, not here: a warm optimize (its
    graph read back, its kernels compiled) needs none, and 16 processes importing torch beside it took the host's
    cores from its passes, capture read-back and warm-up. Each hold is released (release) when its optimize ends."""
    _holders.append(on)
    if on:
        triton_cache.key_early()
    if on and enabled():
        refuse_crashed()


def start() -> None:
    """The workers started now, inside an optimize that holds them (not waited for): called as a capture begins to
    trace (capture.capture's `tracing`), so that their imports, seconds long, are done by the time the guard's
    first tuner asks."""
    if active():
        _running()


def crashed() -> dict:
    """{specialization data: how its compile ended a worker} in this process."""
    with _lock:
        return dict(_crashed)


def refuse_crashed() -> None:
    """Triton's jit_cache_hook (the one in place, if any, called after it) raising CompilerCrashed for a
    specialization whose compile ended a worker, before this process would compile it; inside an optimize, a
    compile of one of accelc's kernels that no worker was handed first (a kernel launched directly at a new size,
    a key of one candidate) is made by a worker first, this process then loading it. Installed once; stays."""
    from triton import knobs

    previous = knobs.runtime.jit_cache_hook
    if getattr(previous, "accelc_refuses_crashed", False):
        return

    def hook(*, fn, compile, **kwargs):
        data = _specialization(compile)
        known = compiled() if data else set()
        with _lock:
            first = (bool(data) and data not in _sent and str(fn.module).startswith(FIRST_BY_A_WORKER)
                     and _digest(data) not in known)
            handed = _inflight.get(data) if data else None
        if first and active():
            try:
                compile_jobs([(f"{fn.module}.{fn.name}", data)])
            except Exception as e:   # not handed over: this process compiles it, as outside an optimize
                log.debug("accelc: %s not handed to a compile worker: %s", fn.name, e)
        elif handed is not None:     # a worker compiles it now (submit): its outcome first
            handed.wait(timeout=300)
        with _lock:
            how = _crashed.get(data) if data else None
        if how:
            raise CompilerCrashed(f"Triton's compiler ended the process compiling {fn.name} at this specialization "
                                  f"({how}); not compiled in this process")
        return previous(fn=fn, compile=compile, **kwargs) if previous else None

    hook.accelc_refuses_crashed = True
    knobs.runtime.jit_cache_hook = hook


def release() -> None:
    """An optimize ends: the workers closed when it was the outermost (each holds a few hundred MB of host memory)."""
    _holders.pop()
    if not _holders:
        _close()


atexit.register(_close)


def serve() -> None:
    """A worker's loop (see _Worker): [kernel, specialization data, target] a line -> "1" (compiled into the disk
    cache) or "0"."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)            # anything else written to stdout (a compiler's print) goes where stderr goes
    sys.stdout = sys.stderr
    for line in sys.stdin:
        try:
            ok = compile_one(*json.loads(line))
        except Exception:
            ok = False
        answers.write("1\n" if ok else "0\n")
        answers.flush()


def collect(launch_cfg, candidates: list, compile_only) -> list[tuple[str, str]]:
    """[(the kernel's module.qualname, its specialization data)] of what launching each candidate would compile,
    compiling nothing (a kernel compiled already in this process asks for nothing). compile_only: compile_ahead's
    block in which a launch compiles (Triton's warmup) instead of running."""
    with handing_over() as found, compile_only():
        for cfg in candidates:
            try:
                launch_cfg(cfg)
            except Exception as e:   # not a candidate for this call: its timing says so
                log.debug("accelc: %s not collected for the compile workers: %s", cfg, e)
    return found


def compile_all(launch_cfg, candidates: list, compile_only) -> int:
    """The candidates' compiles done by the workers into the disk cache; how many were."""
    if not active():
        return 0
    try:
        jobs = collect(launch_cfg, candidates, compile_only)
    except Exception as e:
        log.debug("accelc: the compile workers' jobs not collected: %s", e)
        return 0
    return compile_jobs(jobs)


@contextlib.contextmanager
def handing_over():
    """Inside the block nothing Triton would compile is compiled (nor, then, launched): what it would compile
    goes to the list the block yields, for compile_jobs (a kernel compiled already in this process runs)."""
    from triton import knobs

    found: list = []
    saved = knobs.runtime.jit_cache_hook

    def hook(*, fn, compile, **_):
        data = _specialization(compile)
        if data:
            found.append((f"{fn.module}.{fn.name}", data))
        return True

    knobs.runtime.jit_cache_hook = hook
    try:
        yield found
    finally:
        knobs.runtime.jit_cache_hook = saved


def _specialization(compile) -> str | None:
    """The specialization data (JSON) a jit_cache_hook call carries: what a worker compiles from, and the key of
    what ended one."""
    return compile.get("specialization_data") if isinstance(compile, dict) else None


def compile_jobs(jobs: list, fill: bool = False) -> int:
    """Collected compiles (collect, handing_over) done by the workers, each once a process, all at once; how many
    compiled (fill: Pending.wait's)."""
    return submit(jobs).wait(fill=fill)


def submit(jobs: list) -> "Pending":
    """compile_jobs without waiting: the workers compile while the caller goes on (the guard's checks at the
    example's sizes run while the other sizes' kernels compile); Pending.wait() for the count. A launch in this
    process that meets one of these specializations before its compile ended waits for it (refuse_crashed)."""
    if not active():
        return Pending([], [])
    try:
        from triton.runtime import driver
        target = dict(vars(driver.active.get_current_target()))
    except Exception as e:
        log.debug("accelc: no target for the compile workers: %s", e)
        return Pending([], [])
    done_before = compiled()
    with _lock:
        todo = []
        for name, data in jobs:
            if data not in _sent and _digest(data) not in done_before:
                _sent.add(data)
                todo.append((name, data, target))
        todo.reverse()
    running = _running() if todo else []
    if not running:
        with _lock:
            _sent.difference_update(data for _, data, _ in todo)
        return Pending([], [])
    return Pending(todo, running)


def compiled() -> set:
    """Digests of the specializations a worker compiled into the Triton cache folder in use, by any process (its
    record there, read once a process): a launch here loads those from the cache, handed to no worker (a compile
    that once succeeded in a worker does not end this process; one that ended a worker is never recorded). An
    empty cache folder has no record."""
    try:
        from triton import knobs
        folder = str(knobs.cache.dir)
    except Exception:   # (no Triton cache folder: nothing recorded)
        return set()
    with _lock:
        if folder not in _compiled:
            try:
                text = (Path(folder) / COMPILED_RECORD).read_text()
            except OSError:
                text = ""
            _compiled[folder] = set(text.split())
        return _compiled[folder]


def _record_compiled(data: str) -> None:
    """A worker compiled `data` into the cache folder: said in its record (one short line appended, whole)."""
    try:
        from triton import knobs
        folder = str(knobs.cache.dir)
        digest = _digest(data)
        known = compiled()
        if digest in known:
            return
        with _lock:
            known.add(digest)
            path = Path(folder) / COMPILED_RECORD
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(digest + "\n")
    except Exception as e:   # a record not written: a later process hands the kernel to a worker again
        log.debug("accelc: the worker compiles' record not written: %s", e)


def _digest(data: str) -> str:
    """A specialization's digest in the record, this Triton's (another version's compiler may end a worker where
    this one did not)."""
    import triton
    return hashlib.sha256(f"{triton.__version__}\n{data}".encode()).hexdigest()[:32]


class Pending:
    """Compiles handed to the workers (submit), one thread a worker feeding it the jobs; each job's specialization
    in _inflight until its compile ended (or no worker is left to make it)."""

    def __init__(self, todo: list, running: list):
        self._todo, self._done = todo, []
        self._events = {data: threading.Event() for _, data, _ in todo}
        with _lock:
            _inflight.update(self._events)
            self._alive = len(running)
        self._threads = [threading.Thread(target=self._feed, args=(w,), daemon=True) for w in running]
        for t in self._threads:
            t.start()

    def wait(self, timeout: float = 300, fill: bool = False) -> int:
        """How many compiled, once every job ended. fill: the work offered to this thread (accelc.meanwhile) done
        first, while they compile (a wait where any work may run: not inside a tuner's or Triton's hooks)."""
        if fill and any(t.is_alive() for t in self._threads):
            meanwhile.fill()
        for t in self._threads:
            t.join(timeout=timeout)
        return sum(self._done)

    def _feed(self, worker) -> None:
        try:
            while True:
                with _lock:
                    if not self._todo:
                        return
                    job = self._todo.pop()
                try:
                    self._done.append(worker.compile(job))
                    if self._done[-1]:
                        _record_compiled(job[1])
                except Exception as e:   # a worker that died: the threads compile what it would have, except a job
                    ended = worker.ended()   # that ended it by a signal (an abort, a crash): refused (refuse_crashed)
                    if ended.startswith("signal"):
                        log.warning("accelc: a compile worker ended (%s) compiling %s; that kernel is not compiled in "
                                    "this process", ended, job[0])
                    else:
                        log.debug("accelc: a compile worker stopped (%s): %s", ended or "running", e)
                    with _lock:
                        if ended.startswith("signal"):
                            _crashed[job[1]] = ended
                        if worker in _workers:
                            _workers.remove(worker)
                    return
                finally:
                    self._ended(job[1])
        finally:
            with _lock:
                self._alive -= 1
                left = [] if self._alive else list(self._todo)
                if not self._alive:
                    self._todo.clear()
            for _, data, _ in left:      # no worker left to make them: this process compiles them, as before
                self._ended(data)

    def _ended(self, data) -> None:
        with _lock:
            if _inflight.get(data) is self._events[data]:
                del _inflight[data]
        self._events[data].set()


def compile_one(full_name: str, specialization: str, target: dict | None = None) -> bool:
    """In a worker: compile one kernel specialization into Triton's disk cache (as JITFunction.preload builds
    it, without the GPU: the target, the main process's, comes with the job; a Triton that writes it into the
    data has it there too). False where it could not."""
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import ASTSource, make_backend
        from triton.runtime.jit import JITFunction

        module, _, name = full_name.rpartition(".")
        fn = getattr(importlib.import_module(module), name, None)
        if not isinstance(fn, JITFunction):
            return False
        # the source class the kernel's binder would set (the binder asks the GPU driver for the target)
        source = ASTSource
        try:
            from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
            if isinstance(fn, GluonJITFunction):
                source = GluonASTSource
        except ImportError:
            pass
        data = json.loads(specialization)
        target = GPUTarget(**(target or data["target"]))
        backend = make_backend(target)

        def listed(v):
            return tuple(listed(x) for x in v) if isinstance(v, list) else v

        def constant(v):
            if isinstance(v, str) and tl.dtype.is_dtype(v):
                return tl.dtype(v)
            if isinstance(v, dict) and "constexpr" in v:
                return tl.constexpr(listed(v["constexpr"]))
            if isinstance(v, dict) and "jit_function" in v:
                mod, _, qual = v["jit_function"].partition(":")
                return getattr(importlib.import_module(mod), qual)
            return listed(v)

        constexprs = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
        attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
        signature = {k: listed(v) for k, v in data["signature"].items()}
        options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v
                                         for k, v in data["options"].items()})
        kernel = triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        if target.backend == "cuda":
            triton_cache.launcher_ahead(kernel)
        return True
    except Exception:   # the thread's compile of it says what is wrong, if anything
        return False
