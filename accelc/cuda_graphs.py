"""CUDA graphs as accelc's runner takes them: captured on the GPU's one side stream into a memory
pool shared by every graph of a module, their outputs copied out of the pool; plain calls that run
in that pool between replays; the GPU time of a replay, read without waiting for it."""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from accelc import runtime


class Uncapturable(Exception):
    """Why a signature cannot have a CUDA graph."""


def capture_cuda_graph(fn: Callable, args: tuple, kwargs: dict, pool=None, arena: Callable | None = None):
    """(graph, outputs, pool, host_ms): fn warmed up on the GPU's one side stream (runtime.side_stream;
    compiling and tuning happen here), then captured on it into the memory pool `pool` (a new one
    when None: the one returned). One stream for every capture: graphs that share a pool must share
    the stream too (the caching allocator keeps a stream's freed blocks for that stream, so a new
    stream per capture would hold a new warm-up's and capture's worth of memory each), and cuBLAS
    keeps a workspace per stream. With
    `arena` (nbytes, device -> a uint8 tensor), the graph ends by copying its outputs into it
    (output_slots) and those copies are the outputs: the pool keeps no graph's outputs alive, so
    its size is the largest graph's working memory however many graphs there are. host_ms: the
    host's time to launch the second warm-up run (a plain call's launch cost at these shapes: the
    first run compiles). Raises Uncapturable with the cause when capture fails."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not tensors or any(x.device.type != "cuda" for x in tensors):
        raise Uncapturable("a tensor argument not on a CUDA device (or none at all)")
    device = tensors[0].device
    with runtime.side_stream(device) as stream:
        return _capture(fn, args, kwargs, pool, arena, stream, device)


def _capture(fn, args, kwargs, pool, arena, stream, device):
    # the warm-up allocates in a pool that already holds a graph: a new pool exists in the allocator
    # only from its first capture on (warming up in it before would leave it released, and the
    # capture would then fail on entry, leaving the CUDA generator in its capture state)
    warm_in = allocating_in(pool, device) if pool is not None else contextlib.nullcontext()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), warm_in:
        warm = fn(*args, **kwargs)
        del warm
        t0 = time.perf_counter()
        warm = fn(*args, **kwargs)
        host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.current_stream(device).wait_stream(stream)
    slots = output_slots(warm, lambda n: arena(n, device)) if arena is not None else None
    del warm
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            outputs = fn(*args, **kwargs)
            if slots is not None:
                for slot, t in zip(pytree.tree_leaves(slots), pytree.tree_leaves(outputs)):
                    if isinstance(t, torch.Tensor):
                        slot.copy_(t)
                outputs = slots
    except Exception as e:   # an op that syncs with the host, reads CPU memory, ...
        torch.cuda.synchronize(device)
        raise Uncapturable(f"CUDA graph capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return graph, outputs, pool, host_ms


@contextlib.contextmanager
def allocating_in(pool, device: torch.device):
    """The warm-up runs' memory taken from the graphs' pool, one a live graph holds (as Inductor's
    CUDA-graph trees warm up): what they free is what the capture then reuses, instead of a second
    working set cached by the allocator outside the pool. Safe here: the graphs copy their outputs
    out of the pool, and the side stream waits for earlier replays first. Where the allocator lacks
    the hooks, plain warm-up."""
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
    end, release = getattr(torch._C, "_cuda_endAllocateToPool", None), getattr(torch._C, "_cuda_releasePool", None)
    if begin is None or end is None or release is None:
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    begin(index, pool)
    try:
        yield
    finally:
        end(index, pool)
        release(index, pool)


def output_slots(outputs, arena_for: Callable):
    """outputs with each tensor leaf replaced by a view of its shape, dtype and memory layout into
    one byte arena (arena_for(total bytes); each slot 256-byte aligned); other leaves as they are.
    The layout is the output's own where it is dense (a channels_last output stays channels_last,
    as eager returns it; a row-major slot changed every CNN's output layout under CUDA graphs),
    row-major otherwise."""
    leaves, spec = pytree.tree_flatten(outputs)
    sizes = [-(-t.numel() * t.element_size() // 256) * 256 if isinstance(t, torch.Tensor) else 0 for t in leaves]
    arena = arena_for(sum(sizes))
    slots, offset = [], 0
    for t, size in zip(leaves, sizes):
        if isinstance(t, torch.Tensor):
            dense = torch.empty_like(t, device="meta").stride()     # t's strides where t is dense
            slots.append(arena[offset:offset + t.numel() * t.element_size()].view(t.dtype)
                         .as_strided(t.shape, dense))
            offset += size
        else:
            slots.append(t)
    return pytree.tree_unflatten(slots, spec)


def run_in_pool(fn: Callable, args: tuple, kwargs: dict, pool, device: torch.device):
    """fn(*args, **kwargs) as a plain call on the side stream, its memory taken from the graphs' pool
    `pool` (what the graphs' working memory leaves free between replays, rather than a second working
    set cached outside the pool), its tensor outputs copied out of the pool on the caller's stream.
    The caller serialises it with the pool's replays and captures; `pool` holds a live graph."""
    current = torch.cuda.current_stream(device)
    with runtime.side_stream(device) as stream:
        stream.wait_stream(current)
        with torch.cuda.stream(stream), allocating_in(pool, device):
            out = fn(*args, **kwargs)
        current.wait_stream(stream)
        # the copies on the caller's stream, outside the pool; the pool's blocks, freed on return, are
        # taken again on the side stream only after it waits for the caller's (above, and in captures)
        return clone_tensors(out)


def clone_tensors(tree):
    """tree with every tensor leaf cloned (outputs the caller keeps, out of buffers that are reused)."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def memory_holder(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory `t` lies in (its base, for a view)."""
    return t if t._base is None else t._base


def copy_as_is(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` shaped as it is: a view of a copy of its base where it is a view (a compile's guards read a
    view's base: a plain copy compiles code the view's calls fail; regions.RegionalGlue.state_apart)."""
    if t._base is None:
        return t.clone()
    return memory_holder(t).clone().as_strided(t.size(), t.stride(), t.storage_offset())


class GpuTimer:
    """The GPU time of the work recorded inside `with timer:` on the current stream; ms() reads it
    once the GPU has done it (None before: it never waits)."""

    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __enter__(self):
        self.start.record()
        return self

    def __exit__(self, *exc):
        self.end.record()

    def ms(self) -> float | None:
        return self.start.elapsed_time(self.end) if self.end.query() else None
