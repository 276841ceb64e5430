"""One timer for kernels, layers and whole models (bench scripts and reports alike).

On a GPU: triton.testing.do_bench (CUDA events, L2 flushed before each run, median), or the
same over a captured CUDA graph for layers so short that Python launch overhead would be
timed instead of the GPU (`cuda_graph=True`). On the CPU: perf_counter, median.

The report compares engines that cannot all be captured in one CUDA graph (ONNX Runtime runs
its own), so it times every side with one of two functions, the same for all sides
(`side_ms`): per layer, `kernel_ms` (the GPU time of one call's kernels and copies as CUPTI
records it, L2 flushed before each call: no engine's host cost, every engine's GPU work); per
whole model, `median_ms` on plain calls (as a user calls it: host cost, launches and syncs
included).
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch

from accelc import runtime


def median_ms(fn: Callable[[], object], device: torch.device | str = "cuda", cuda_graph: bool = False,
              warmup_ms: float = 25, rep_ms: float = 100, calls: int | None = None) -> float:
    """calls: plain calls exactly this many (after three to warm up) rather than as many as fit rep_ms, for a
    program whose calls must be as many in every process (a tensor-parallel one's collectives pair up)."""
    device = torch.device(device)
    if calls is not None:
        return statistics.median(_counted_samples_ms(fn, device, calls))
    if device.type == "cuda" and cuda_graph:
        return _graph_median_ms(fn, rep_ms)
    return statistics.median(_call_samples_ms(fn, device, warmup_ms, rep_ms))


def _counted_samples_ms(fn, device: torch.device, calls: int) -> list:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _call_samples_ms(fn, device: torch.device, warmup_ms: float = 25, rep_ms: float = 100) -> list:
    """ms of each plain call of fn that median_ms takes the median of."""
    if device.type == "cuda":
        import triton.testing

        times = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
        return times if isinstance(times, list) else [times]
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def spread(samples: list) -> float | None:
    """(p90 - p10) / median of a timer's samples, None for fewer than 5: how far to trust their median; a busy
    machine's timings spread wide (two identical layers read 0.009 and 53 ms on one)."""
    ordered = sorted(samples)
    med = statistics.median(ordered) if ordered else 0.0
    if len(ordered) < 5 or med <= 0:
        return None
    return (ordered[-1 - len(ordered) // 10] - ordered[len(ordered) // 10]) / med


def quick_graph_us(fn, work_ms: float = 1.0, replays: int = 5, most: int = 200) -> float:
    """The tuner's timer (accelc.tuning), in microseconds: `fn` captured `n` times in one CUDA graph (about
    `work_ms` of work, at most `most` calls), the median of `replays` replays over n (plain launches would
    time Triton's host-side launch cost, ~100 us, instead of small kernels). About 10 ms a candidate with
    the defaults (a race's first round); its closest are timed again with more work and replays
    (tuning.time_config)."""
    with runtime.side_stream(torch.cuda.current_device()) as stream, torch.cuda.stream(stream):
        fn()
        one = torch.cuda.CUDAGraph()
        with torch.cuda.graph(one, stream=stream):
            fn()
        n = max(1, min(most, int(work_ms / max(min(_replay_ms(one, 1) for _ in range(3)), 1e-3))))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(n):
                fn()
        _replay_ms(graph, 1)
        times = [_replay_ms(graph, n) for _ in range(replays)]
    return statistics.median(times) * 1e3


def _replay_ms(graph, n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def _graph_median_ms(fn, rep_ms: float) -> float:
    """Median time of `fn` replayed from a CUDA graph: `n` calls captured in one graph, the
    graph replayed with events around each replay, L2 flushed in between."""
    # the GPU's one side stream (a new stream per timed layer left cuBLAS a workspace on each)
    with runtime.side_stream(torch.cuda.current_device()) as stream, torch.cuda.stream(stream):
        fn()  # warm-up on the side stream: compilation, autotuning, allocations
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
        n = max(1, min(100, int(1.0 / est_ms)))  # ~1 ms of work per replay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(n):
                fn()
    torch.cuda.synchronize()
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 10 or (time.perf_counter() < deadline and len(times) < 200):
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


def layer_ms(fn: Callable[[], object], device: torch.device | str, rep_ms: float = 100) -> tuple[float, bool]:
    """The report's timer for eager and accelc layers and models: median_ms over a captured CUDA
    graph on a GPU, so that kernel time is measured rather than Python launch overhead; plain
    do_bench where capture fails (an op that synchronizes, a CPU fallback). Returns (ms, graph?)."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return median_ms(fn, device, cuda_graph=True, rep_ms=rep_ms), True
        except Exception:  # capture refused: time plain calls instead (said in the report row)
            torch.cuda.synchronize()
    return median_ms(fn, device, rep_ms=rep_ms), False


def kernel_ms(fn: Callable[[], object], device: torch.device | str = "cuda", rep_ms: float = 100) -> float:
    """The GPU time one call of `fn` takes, in ms: the durations of the kernels, copies and
    memsets it enqueues (on any stream, by any library: PyTorch, Triton, ONNX Runtime), as CUPTI
    records them through torch.profiler, summed per call; the median over calls, each after an
    L2 flush. Gaps between kernels (host launch cost) are not GPU time and are not counted. On
    the CPU: median_ms."""
    return statistics.median(_kernel_samples_ms(fn, torch.device(device), rep_ms))


def _kernel_samples_ms(fn, device: torch.device, rep_ms: float) -> list:
    """ms of GPU time of each call that kernel_ms takes the median of (plain calls' ms on the CPU)."""
    if device.type != "cuda":
        return _call_samples_ms(fn, device, rep_ms=rep_ms)
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()   # warm-up: compilation, autotuning, allocations
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = max(5, min(200, int(rep_ms / max((time.perf_counter() - t0) * 1e3, 1e-3))))
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            _l2_flush(flush)
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    calls = _per_call_gpu_us(prof)
    if len(calls) < n:
        raise RuntimeError(f"the profiler recorded {len(calls)} of {n} calls")
    return [us / 1e3 for us in calls[-n:]]


_FLUSH_NAME = "accelc_l2_flush"


def _l2_flush(buf: torch.Tensor) -> None:
    """Overwrites `buf` (larger than L2) with a kernel of its own name: the marker between calls."""
    import triton

    _flush_kernel()[(triton.cdiv(buf.numel(), 4096),)](buf, buf.numel(), BLOCK=4096)


@functools.cache
def _flush_kernel():
    """The marker kernel, defined at first use (not at import: accelc.runtime picks interpreter
    or GPU before any kernel is defined)."""
    import triton
    import triton.language as tl

    @triton.jit
    def accelc_l2_flush(ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(ptr + offs, 0, mask=offs < n)

    return accelc_l2_flush


def _per_call_gpu_us(prof) -> list[float]:
    """The summed durations (us) of the device activities between consecutive flush kernels."""
    events = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            events.append((e.start_ns(), e.duration_ns(), e.name()))
    events.sort()
    calls, current = [], None
    for _, dur, name in events:
        if _FLUSH_NAME in name:
            if current is not None:
                calls.append(current)
            current = 0.0
        elif current is not None:
            current += dur / 1e3
    if current is not None:
        calls.append(current)
    return calls


class Timing(float):
    """A median in ms that also holds the spread of the samples behind it (`spread`, latency.spread)."""

    def __new__(cls, samples: list):
        t = super().__new__(cls, statistics.median(samples))
        t.spread = spread(samples)
        return t


def side_ms(fn: Callable[[], object], device: torch.device | str, rep_ms: float = 100,
            whole_model: bool = False) -> Timing:
    """The report's one timer for every side it compares (eager, accelc, ONNX Runtime): a whole
    model per call as a user calls it (median_ms: CUDA events around each plain call, L2
    flushed, median), a layer by its GPU time (kernel_ms); the spread of its samples beside it."""
    device = torch.device(device)
    return Timing(_call_samples_ms(fn, device, rep_ms=rep_ms) if whole_model else _kernel_samples_ms(fn, device, rep_ms))


def side_method(device: torch.device | str) -> str:
    """side_ms in words, for the report's header."""
    if torch.device(device).type != "cuda":
        return "CPU perf_counter median per call, the same for every side"
    return ("the same timer for every side: per layer, GPU time of one call (CUPTI kernel, copy and memset "
            "durations summed, via torch.profiler; L2 flushed before each call; median; host cost not "
            "counted); whole model, plain calls as a user makes them (CUDA events around each call, L2 "
            "flushed, median; host cost counted)")


def per_call_us(fn: Callable[[], object], n: int, rounds: int = 5, wall: bool = False, warmup: int = 100) -> float:
    """Median over `rounds` of microseconds per call of `n` back-to-back calls of fn: host time only
    (wall=False: the GPU is synchronised between rounds, not inside one; on shapes where the GPU
    keeps up this is the host's cost), or the GPU's work included (wall=True: synchronised at the
    end of each round)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if wall:
            torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def back_to_back_ms(fn: Callable[[], object], rounds: int = 7, budget_s: float = 0.25) -> float:
    """ms per call of a whole model called back to back: the median over `rounds` rounds of about
    budget_s each (per_call_us, wall time), the GPU synchronised at the end of each round. The same
    for every side of a whole-model comparison (eager, torch.compile, ONNX Runtime, accelc)."""
    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        n = max(3, min(200, int(budget_s / max(time.perf_counter() - t0, 1e-5))))
        return per_call_us(fn, n, rounds, wall=True, warmup=0) / 1e3
