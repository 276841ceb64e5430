"""Choosing each kernel's launch config once per shape, and remembering the choice on disk.

Every accelc kernel launches through a Tuner: `config = tuner.pick(key, sizes, launch)` is a dict
hit after the first call for a key, so the per-call host cost is the launcher's own (no
triton.autotune bookkeeping per call). On a miss the config comes from, in order:
  - Triton's CPU interpreter: one small config (the interpreter has no device to time on);
  - ACCELC_AUTOTUNE=0: the kernel's default config for the sizes (fast start, slower kernels);
  - the on-disk cache: a JSON file per (kernel, key) under ACCELC_CACHE_DIR (default
    $XDG_CACHE_HOME/accelc or ~/.cache/accelc), named by a hash of the kernel's source (with the
    jit functions it calls, and of the other kernels its candidates launch), its candidate configs,
    the key, the device, the Triton, PyTorch and CUDA versions and the tuner's launch_identity, so a
    change to any of them tunes again. Files are written to a temporary
    name and renamed: concurrent processes each write a whole file, the last one stays;
  - tuning: every candidate the prune function keeps is run and timed over a captured CUDA graph
    (a config that fails to compile or launch is skipped and logged), the fastest kept;
  - except inside `serving()` (an optimized model's calls): a key not tuned yet borrows the
    config tuned for the nearest sizes (the same key otherwise; nearest in log2 of the key's
    leading size fields), or the kernel's default, rather than stalling a request for seconds
    of compiling and timing candidates. Optimize tunes the sizes the guard checks; warm-up
    (OptimizedModule.warm_up, optimize's warmup_shapes) tunes others, after forget_borrowed().
Tuning is logged on the `accelc` logger at INFO (what is tuned, how many candidates).
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import triton
from triton import knobs

from accelc import files, runtime, tuning_table
from accelc import compile_workers
from accelc.compile_ahead import compile_only, precompile
from accelc.latency import quick_graph_us

log = logging.getLogger("accelc")

_FORMAT = 1   # of the cache files
_task = contextvars.ContextVar("accelc_tuning_task", default="")
_serving = contextvars.ContextVar("accelc_serving", default=False)
_collecting = contextvars.ContextVar("accelc_collecting", default=None)   # a list: see collecting()
_TUNERS: list = []    # every Tuner made in this process (forget_borrowed, borrowed_count)
_STATS = {"races": 0, "candidates": 0, "compile_s": 0.0, "race_s": 0.0}    # this process's tuning (stats())


@contextlib.contextmanager
def serving(say: bool = True):
    """Kernel launches inside the block do not tune (see the module docstring). say=False: a key that
    borrows a config is logged at DEBUG, not INFO (the guard's checks at other sizes borrow by design)."""
    token = _serving.set("say" if say else "quiet")
    try:
        yield
    finally:
        _serving.reset(token)


def all_tuners() -> list:
    """Every kernel's tuner (bench/tuning_table.py reads their races)."""
    return list(_TUNERS)


def stats() -> dict:
    """This process's tuning so far: races run, candidates in them, seconds compiling them ahead and
    seconds racing them (a candidate not compiled ahead compiles in its race)."""
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in _STATS.items()}


def forget_borrowed() -> None:
    """The keys that borrowed a config are chosen again at their next launch (tuned, outside
    serving()); their remembered launches go with them."""
    for tuner in list(_TUNERS):
        keys = list(tuner.borrowed)    # (a snapshot: a model served in another thread may borrow meanwhile)
        for key in keys:
            tuner.chosen.pop(key, None)
            tuner.borrowed.pop(key, None)
        if keys:
            tuner.calls.clear()


@contextlib.contextmanager
def collecting():
    """Inside the block a key to tune hands what compiling its candidates would take (compile_workers.collect:
    the kernels' specializations, nothing compiled) to the list the block yields and runs with its first
    candidate: nothing is raced, and every tuner's choices, calls and timings are as before the block when it
    ends. The guard's first pass over the layers runs once inside it, so that the workers compile every layer's
    candidates at once, not each race's alone."""
    saved = [(t, dict(t.chosen), dict(t.calls), dict(t.borrowed), dict(t.timings)) for t in _TUNERS]
    jobs: list = []
    token = _collecting.set(jobs)
    try:
        yield jobs
    finally:
        _collecting.reset(token)
        for t, chosen, calls, borrowed, timings in saved:
            t.chosen, t.calls, t.borrowed, t.timings = chosen, calls, borrowed, timings


def borrowed_count() -> int:
    """Keys running on a borrowed config in this process, over every kernel."""
    return sum(len(t.borrowed) for t in _TUNERS)


@contextlib.contextmanager
def task(text: str):
    """What the kernels launched inside the block are for ("layer 3/50 blocks.0.fc1+gelu"):
    the tuning log line names it, so a long optimize says what it tunes and how far it is."""
    token = _task.set(text)
    try:
        yield
    finally:
        _task.reset(token)


def device_identity() -> tuple[str, str]:
    """(name, compute capability) of the current CUDA device: part of every cache key."""
    dev = torch.cuda.get_device_properties(torch.cuda.current_device())
    return dev.name, f"{dev.major}.{dev.minor}"


def cache_dir() -> Path:
    return files.cache_root() / "tuning"


def config_dict(cfg: triton.Config) -> dict:
    """A config as plain data (its constexprs and launch options), for the cache file and logs."""
    return {k: v for k, v in sorted(cfg.all_kwargs().items()) if isinstance(v, (int, float, str, bool))}


class CompiledCall:
    """One launch of a kernel with its config, grid and constant arguments fixed: a launcher's
    call signature (shapes, strides, dtypes, alignment, flags) seen before. The first launch goes
    through Triton; later ones call the compiled kernel's launcher directly, which skips Triton's
    per-call binding, specialisation and cache lookup (about four fifths of a launch's host time, triton
    3.6 on an H100). Only where that is safe: compiled code
    (not the interpreter), Triton's launcher as this version exposes it, no launch hooks set (a
    profiler's); anything else launches through Triton every time."""

    def __init__(self, kernel, grid: tuple, args: tuple, constexprs: dict):
        self.kernel, self.grid, self.constexprs = kernel, grid, constexprs
        self.direct = None
        compiled = kernel[grid](*args, **constexprs)
        if runtime.interpreted():
            return
        try:
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            binder = kernel.device_caches[torch.cuda.current_device()][-1]
            values = list(binder(*args, **constexprs)[0].values())
            if len(values) >= len(args) and all(v is a for v, a in zip(values, args)):
                self.tail = tuple(values[len(args):])            # the constexprs, in signature order
                self.grid3 = tuple(grid) + (1,) * (3 - len(grid))
                self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata
                self.direct = True
        except Exception as e:  # another Triton's internals: launch through Triton, always correct
            log.debug("accelc: %s launches through Triton (%s)", getattr(kernel, "__name__", kernel), e)

    def __call__(self, args: tuple, device_index: int) -> None:
        if self.direct and _no_launch_hooks():
            g0, g1, g2 = self.grid3
            self.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device_index), self.function, self.packed,
                     None, None, None, *args, *self.tail)
        else:
            self.kernel[self.grid](*args, **self.constexprs)


def check_once(seen: set, sig, why_unsupported: Callable[[], "str | None"], op: str) -> None:
    """A launcher's operand checks, once per call signature (shapes, dtypes, devices, flags): a
    ValueError naming the op and what is wrong, or the signature remembered as accepted."""
    if sig not in seen:
        reason = why_unsupported()
        if reason is not None:
            raise ValueError(f"accelc::{op}: {reason}")
        seen.add(sig)


def _no_launch_hooks() -> bool:
    """No profiler is watching launches (hooks unset: None in triton 3.6, an empty HookChain later)."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


_warned_profiler: list = []   # the warning above, once a process


def profiler() -> str | None:
    """What is watching this process's kernels, or None: a CUDA tool injected through
    CUDA_INJECTION64_PATH (Nsight Compute, Nsight Systems, compute-sanitizer) or a Triton launch
    hook (Proton). Kernels timed then run replayed, serialised or instrumented."""
    injected = os.environ.get("CUDA_INJECTION64_PATH")
    if injected:
        return f"CUDA_INJECTION64_PATH={injected}"
    if not _no_launch_hooks():
        return "a Triton launch hook"
    return None


class NotACandidate(Exception):
    """Tuner.force: the forced config is not one the tuner would try for these sizes."""


def out_of_resources(e: Exception) -> bool:
    """Whether `e` says a config does not fit this GPU (its shared memory or registers): a candidate a race
    times as failed, and a sweep of forced candidates skips."""
    return "OutOfResources" in type(e).__name__ or "out of resource" in str(e).lower()


class Tuner:
    """The launch config of one Triton kernel, chosen per key (see the module docstring).

    configs:     the candidates, in the order ties are broken;
    prune:       (configs, sizes) -> the candidates worth timing for these sizes;
    default:     sizes -> the config used without tuning (ACCELC_AUTOTUNE=0);
    interpreter: sizes -> the config used under TRITON_INTERPRET;
    size_fields: how many leading key fields are sizes (bucketed M, L, ...): a key borrows from
                 keys equal to it beyond them.
    launch_identity: what else a candidate's time depends on that neither the configs nor the kernels'
                 source say (a helper kernel's launch parameters set by the launcher): it keys the disk
                 cache too, so a change to it tunes again.
    """

    def __init__(self, name: str, kernel, configs: list, *, prune: Callable | None = None,
                 default: Callable[[dict], triton.Config], interpreter: Callable[[dict], triton.Config],
                 other_kernels: Callable[[], list] | None = None, size_fields: int = 1, launch_identity: str = ""):
        self.name = name
        self.launch_identity = launch_identity
        self.size_fields = size_fields
        self.borrowed: dict[tuple, tuple | None] = {}   # key -> the key its config came from (None: the default)
        self.kernel = kernel
        self.other_kernels = other_kernels   # -> further kernels its candidates launch (their source keys the cache too)
        self.configs = list(configs)
        self.prune = prune or (lambda configs, sizes: configs)
        self.default = default
        self.interpreter = interpreter
        self.chosen: dict[tuple, triton.Config] = {}
        self.calls: dict[tuple, object] = {}     # launcher's call signature -> its CompiledCall and arguments
        self.timings: dict[tuple, list] = {}    # key -> [(config dict, us or None when it failed)], as tuned
        self._source_hash = None
        self._forced: triton.Config | None = None
        _TUNERS.append(self)

    @contextlib.contextmanager
    def force(self, cfg: triton.Config):
        """Every launch inside the block runs with cfg, whatever was chosen before (the candidate
        sweep, tests/test_candidates.py); the choices and remembered calls are restored after.
        A launch whose sizes the prune function would not give cfg raises NotACandidate; the
        keys picked inside the block are in `chosen` there."""
        saved = self.chosen, self.calls, self._forced
        self.chosen, self.calls, self._forced = {}, {}, cfg
        try:
            yield
        finally:
            self.chosen, self.calls, self._forced = saved

    def pick(self, key: tuple, sizes: dict, launch: Callable[[triton.Config], object]) -> triton.Config:
        """The config for `key`. `sizes`: what prune / default / interpreter look at; `launch(cfg)`
        runs the kernel once with cfg on the real arguments (tuning times it)."""
        if self._forced is not None:
            offered = [config_dict(c) for c in self.prune(self.configs, sizes)]    # by value: Config's == varies
            if config_dict(self._forced) not in offered and not runtime.interpreted():
                raise NotACandidate(f"{self.name}: {config_dict(self._forced)} is not a candidate for {_describe(sizes)}")
            self.chosen[key] = self._forced
            return self._forced
        cfg = self.chosen.get(key)
        if cfg is None:
            cfg = self.chosen[key] = self._choose(key, sizes, launch)
        return cfg

    def _choose(self, key, sizes, launch) -> triton.Config:
        if runtime.interpreted():
            return self.interpreter(sizes)
        if not runtime.autotune_enabled():
            return self.default(sizes)
        candidates = self.prune(self.configs, sizes) or [self.default(sizes)]
        if len(candidates) == 1:
            return candidates[0]
        path = self._cache_file(key)
        cfg = self._read(path, candidates, key)
        if cfg is not None:
            return cfg
        if _serving.get():
            return self._borrow(key, sizes, candidates)
        offered = len(candidates)
        kept = tuning_table.shortlist(self.name, device_identity()[0], [str(k) for k in key],
                                      [config_dict(c) for c in candidates])
        if kept is not None:    # the shipped races' winners for this key on this GPU
            candidates = [c for c in candidates if config_dict(c) in kept]
            if len(candidates) == 1:
                log.info("accelc: %s (%s) for %s: the shipped tuning table's config", self.name,
                         _describe(sizes), _task.get() or "a call")
                return candidates[0]
        jobs = _collecting.get()
        if jobs is not None:    # (collecting(): the candidates' compiles handed over, nothing raced)
            jobs.extend(compile_workers.collect(launch, candidates, compile_only))
            return candidates[0]
        log.info("accelc: tuning %s (%s) for %s: %d candidates%s", self.name, _describe(sizes),
                 _task.get() or "a call", len(candidates),
                 f" of {offered} (the shipped tuning table's shortlist)" if len(candidates) < offered else "")
        t0 = time.perf_counter()
        precompile(launch, candidates)
        t1 = time.perf_counter()
        timed, (best, best_us) = race(launch, candidates)
        _STATS["races"] += 1
        _STATS["candidates"] += len(candidates)
        _STATS["compile_s"] += t1 - t0
        _STATS["race_s"] += time.perf_counter() - t1
        for c, us in timed:
            if math.isinf(us):
                log.debug("accelc: %s candidate %s failed for %s", self.name, config_dict(c), _describe(sizes))
        if math.isinf(best_us):
            raise RuntimeError(f"{self.name}: no candidate config ran for {_describe(sizes)}")
        self.timings[key] = [(config_dict(c), None if math.isinf(us) else round(us, 3)) for c, us in timed]
        watcher = profiler()
        if watcher is None:
            self._write(path, key, best)
        elif not _warned_profiler:
            _warned_profiler.append(watcher)
            _say(f"accelc: tuning under a profiler ({watcher}): the configs chosen now are used in this process "
                 "but not written to the tuning cache")
        return best

    def _borrow(self, key, sizes, candidates) -> triton.Config:
        """The config of the nearest tuned key that is a candidate here, else the default."""
        n = self.size_fields
        own = [k for k, c in self.chosen.items() if k not in self.borrowed and len(k) == len(key)
               and k[n:] == key[n:] and c in candidates]

        def distance(k):
            return sum(abs(math.log2(max(a, 1)) - math.log2(max(b, 1))) for a, b in zip(k[:n], key[:n])), -k[0]
        near = min(own, key=distance) if own else None
        cfg = self.chosen[near] if near is not None else self.default(sizes)
        self.borrowed[key] = near
        log.log(logging.INFO if _serving.get() == "say" else logging.DEBUG,
                "accelc: %s at %s not tuned: a call runs it with %s (warm_up tunes it)", self.name, _describe(sizes),
                f"the config tuned for sizes {near[:n]}" if near is not None else "its default config")
        return cfg

    def spread(self, key) -> dict | None:
        """The tuning run of `key` in numbers: candidates timed, how many ran, the fastest and the
        slowest (us); None when `key` was not tuned (interpreter, ACCELC_AUTOTUNE=0, one candidate)."""
        timed = self.timings.get(key)
        ran = [us for _, us in timed or () if us is not None]
        if not ran:
            return None
        return {"candidates": len(timed), "ran": len(ran), "fastest_us": min(ran), "slowest_us": max(ran)}

    # -- the disk cache ----------------------------------------------------------------------

    def _cache_file(self, key) -> Path:
        if self._source_hash is None:
            kernels = [self.kernel, *(self.other_kernels() if self.other_kernels else ())]
            src = [getattr(k, "cache_key", None) or getattr(k, "src", "") for k in kernels]
            self._source_hash = hashlib.sha256(str(src if len(src) > 1 else src[0]).encode()).hexdigest()
        ident = json.dumps([_FORMAT, self.name, self._source_hash, [config_dict(c) for c in self.configs],
                            [str(k) for k in key], *device_identity(), triton.__version__, torch.__version__,
                            torch.version.cuda, *([self.launch_identity] if self.launch_identity else [])])
        return cache_dir() / f"{self.name}-{hashlib.sha256(ident.encode()).hexdigest()[:40]}.json"

    def _read(self, path: Path, candidates: list, key) -> triton.Config | None:
        try:
            record = json.loads(path.read_text())
            want = record["config"]
        except FileNotFoundError:
            return None     # not tuned yet
        except (IsADirectoryError, UnicodeDecodeError) as e:     # (the entry's own fault: tuned again, rewritten)
            return _bad_entry(path, f"unreadable ({type(e).__name__})")
        except OSError as e:     # the folder's: a file in its place, no permission
            files.cache_unusable(e)
            return None
        except (ValueError, KeyError, TypeError) as e:
            return _bad_entry(path, f"unreadable ({type(e).__name__})")
        timings = record.get("timings_us")
        if not isinstance(want, dict) or not _timings_ok(timings):
            return _bad_entry(path, "not an entry this version writes")
        cfg = next((c for c in candidates if config_dict(c) == want), None)
        if cfg is not None:
            self.timings[key] = [tuple(t) for t in timings]
        return cfg

    def _write(self, path: Path, key, best) -> None:
        record = {"kernel": self.name, "key": [str(k) for k in key], "config": config_dict(best),
                  "timings_us": [list(t) for t in self.timings[key]],
                  "device": device_identity()[0], "triton": triton.__version__, "torch": torch.__version__}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)
        except OSError as e:   # a read-only home: tuning still works, it is just not remembered
            files.cache_unusable(e)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def _timings_ok(timings) -> bool:
    """A cache entry's timings as _write writes them: [config dict, microseconds or None] pairs."""
    return isinstance(timings, list) and all(
        isinstance(t, list) and len(t) == 2 and isinstance(t[0], dict)
        and (t[1] is None or (isinstance(t[1], (int, float)) and not isinstance(t[1], bool))) for t in timings)


def _bad_entry(path: Path, why: str) -> None:
    """A tuning-cache file another version or an interrupted write left: tuned again and
    overwritten, said once a file."""
    if str(path) not in _warned_entries:
        _warned_entries.add(str(path))
        _say(f"accelc: ignoring the tuning-cache file {path} ({why}): tuning again")
    return None


_warned_entries: set = set()


def _say(message: str) -> None:
    """A warning the user sees (warnings, as accelc's other fallbacks: its logger is silent unless
    configured) and the log records."""
    log.warning("%s", message)
    warnings.warn(message, stacklevel=3)


FINAL_MARGIN = 0.10    # candidates within 10% of the first round's fastest are timed again, closely
FINALISTS = 4


def race(launch, candidates: list) -> tuple[list, tuple]:
    """([(config, us)] of every candidate, (the winner, its us)): a first round on the quick timer
    (quick_time, ~10 ms a candidate), then the few within FINAL_MARGIN of its fastest (at most FINALISTS)
    again on the close one (time_config), whose times decide among them: a close timer for every one of the
    few hundred candidates of a 12-layer model (triton's do_bench_cudagraph replays a 20 ms graph 10 times,
    over 200 ms a candidate) was most of a cold optimize's tuning."""
    first = [(c, quick_time(launch, c)) for c in candidates]
    ran = sorted((us, i) for i, (_, us) in enumerate(first) if not math.isinf(us))
    close = [i for us, i in ran[:FINALISTS] if us <= ran[0][0] * (1 + FINAL_MARGIN)]
    if len(close) < 2:
        return first, min(first, key=lambda t: t[1])
    again = {i: time_config(launch, first[i][0]) for i in close}
    final = min(((first[i][0], us) for i, us in again.items()), key=lambda t: t[1])
    if math.isinf(final[1]):     # (the close timer failed where the quick one ran: its figure stands)
        final = first[ran[0][1]]
    return [(c, again.get(i, us)) for i, (c, us) in enumerate(first)], final


def quick_time(launch, cfg) -> float:
    """Microseconds per launch of cfg on the first round's timer; inf when it cannot run."""
    return _timed(launch, cfg)


def time_config(launch, cfg) -> float:
    """Microseconds per launch of cfg, timed closely over a captured CUDA graph (plain launches would time
    the host's launch cost instead of small kernels): 15 replays of ~2 ms of its launches, the median;
    inf when it cannot run."""
    return _timed(launch, cfg, work_ms=2.0, replays=15)


def _timed(launch, cfg, **timer) -> float:
    try:
        return quick_graph_us(lambda: launch(cfg), **timer)
    except Exception as e:  # out of shared memory, a PTX error, ...: not a candidate here
        log.debug("accelc: config %s failed: %s", config_dict(cfg), e)
        torch.cuda.synchronize()
        return math.inf


def _describe(sizes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sizes.items() if not isinstance(v, torch.Tensor))
