"""One timer for kernels, layers and whole models (bench scripts and reports alike).

On a GPU: triton.testing.do_bench (CUDA events, L2 flushed before each run, median), or the
same over a captured CUDA graph for layers so short that Python launch overhead would be
timed instead of the GPU (`cuda_graph=True`). On the CPU: perf_counter, median.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device | str = "cuda", cuda_graph: bool = False,
              warmup_ms: float = 25, rep_ms: float = 100) -> float:
    device = torch.device(device)
    if device.type == "cuda":
        import triton.testing

        if cuda_graph:
            return _graph_median_ms(fn, rep_ms)
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_kernel_us(fn) -> float:
    """The tuner's timer (accelc.tuning), in microseconds: median over replays of a captured CUDA
    graph. Timing plain launches would measure Triton's host-side launch cost (~100 us on the
    machines here) instead of small kernels, and pick configs at random for them (seen at
    16x4096x4096)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def _graph_median_ms(fn, rep_ms: float) -> float:
    """Median time of `fn` replayed from a CUDA graph: `n` calls captured in one graph, the
    graph replayed with events around each replay, L2 flushed in between."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
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
