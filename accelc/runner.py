"""How an optimized module runs its graph, called as a user calls a model.

On a CUDA device, by default (OptimizeConfig.glue "auto", cuda_graphs True):
  - glue: what accelc did not rewrite (norms, softmax, pooling, elementwise chains, reshapes) is
    compiled by Inductor (torch.compile), accelc's kernels staying opaque custom ops inside it;
    over a graph that takes varying shapes (accelc.capture.InputShapes) with dynamic shapes, once,
    not once per shape;
  - CUDA graphs: each new input signature (the structure of the arguments; per tensor its shape,
    strides, dtype and device; other arguments by value) is warmed up and captured in a CUDA graph
    the first time it is seen, all on one side stream. A later call with that signature copies its tensors into the
    graph's input buffers, replays the graph and returns copies of its outputs: one call's outputs
    are never overwritten by the next. A signature whose graph cannot be captured (an op that
    waits for the host, a CPU tensor argument) runs as plain calls, and the reason is kept
    (OptimizedModule.summary());
  - shapes that vary: a call is padded up to its bucket (accelc.buckets: batch and length, where
    the pad was found inert), so a few graphs serve every size, each captured at its first call;
    where a dim that varies does not pad, sizes are captured exactly, each at its second call (a
    size met once runs as a plain call);
  - memory: every graph captures into one memory pool and ends by copying its outputs into one
    byte arena outside it, so the pool holds no graph's outputs and its size is the largest
    graph's working memory, however many graphs there are (replays are serialised, and each
    call's outputs are copied out at once). At most MAX_GRAPHS graphs are kept: a new signature
    beyond them evicts the least recently used one.
Elsewhere (the CPU interpreter), or with glue="eager" and cuda_graphs=False: plain calls of the
graph with every accelc op calling its launcher directly (kernels.LAUNCHERS), which skips the
op dispatcher's host cost; the graph with the ops stays what export, save and torch.compile see.
Everything runs under torch.no_grad(): accelc compiles for inference.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx
from torch.utils import _pytree as pytree

from accelc import runtime
from accelc.runtime import resolve_glue
from accelc.capture import mutated_state
from accelc.capture.shapes import SHAPES
from accelc.kernels import LAUNCHERS

log = logging.getLogger("accelc")

MAX_GRAPHS = 256   # CUDA graphs kept per module; a new signature beyond them evicts the least recently used
STATIC_GLUE = 4    # shapes a dynamic glue is also compiled for with static shapes (CompiledGlue.specialize)
# gm.meta key: the graph's in-place state updates leave the same state when a call is run again on
# the same inputs (they set, not accumulate: a KV cache written at given positions), so a CUDA
# graph's warm-up runs and Inductor may run them (a model's `replayable_state = True` sets it)
REPLAYABLE_STATE = "accelc_replayable_state"


class Uncapturable(Exception):
    """Why a signature cannot have a CUDA graph."""


def direct_calls(gm: fx.GraphModule, table: dict | None = None) -> fx.GraphModule:
    """A copy of gm whose accelc op nodes call their launchers directly (same arguments), or what
    `table` maps each op to (kernels.REFERENCES: the ops' PyTorch references)."""
    table = LAUNCHERS if table is None else table
    direct = copy_module(gm)
    for n in direct.graph.nodes:
        if n.op == "call_function" and n.target in table:
            n.target = table[n.target]
    direct.recompile()
    return direct


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of gm's graph, with its own forward code, sharing gm's weights,
    buffers and submodules (not copies: in-place state updates reach the same tensors)."""
    return fx.GraphModule(gm, _copy_graph(gm.graph), class_name=type(gm).__name__)


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    g = fx.Graph()
    out = g.graph_copy(graph, {})
    g.output(out)
    g._codegen = graph._codegen
    return g


def signature(args: tuple, kwargs: dict) -> tuple:
    """(key, leaves): the key a CUDA graph is kept under (equal keys take the same graph) and the
    arguments' leaves. Raises Uncapturable for an argument a graph cannot be keyed on."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):   # the common case, kept fast
        return tuple((a.shape, a.stride(), a.dtype, a.device) for a in args), args
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append((x.shape, x.stride(), x.dtype, x.device))
        else:
            try:
                hash(x)
            except TypeError:
                raise Uncapturable(f"an argument of type {type(x).__name__} (not a tensor, not hashable)") from None
            key.append((type(x), x))
    return tuple(key), leaves


def signature_or_none(args: tuple, kwargs: dict):
    """signature's key, None for arguments a graph cannot be keyed on."""
    try:
        return signature(args, kwargs)[0]
    except Uncapturable:
        return None


@dataclass
class _Entry:
    graph: object = None                  # torch.cuda.CUDAGraph, None: plain calls
    inputs: list = field(default_factory=list)     # the graph's input buffers, per tensor leaf
    outputs: object = None                # the graph's outputs (a pytree)
    reason: str = ""                      # why plain calls, when graph is None


class Runner:
    """Calls `fn` (the compiled or direct graph) as the module docstring says. `capture`: the
    function that captures fn on given inputs (capture_cuda_graph; tests give another). `padding`
    (accelc.buckets.Padding): calls are padded up to bucket sizes, the outputs cut back.
    `capture_after`: calls of one signature before it is captured (2 where the sizes are many and
    exact: a size met once runs as a plain call)."""

    def __init__(self, fn: Callable, cuda_graphs: bool, capture: Callable | None = None, padding=None,
                 capture_after: int = 1):
        self.fn = fn
        self.cuda_graphs = cuda_graphs
        self.capture = capture or capture_cuda_graph
        self.padding = padding
        self.capture_after = capture_after
        self.entries: OrderedDict = OrderedDict()   # signature -> _Entry, least recently used first
        self.seen: OrderedDict = OrderedDict()      # signature -> calls so far, for those not captured yet
        self.captures = 0                            # graphs captured so far (evicted ones included)
        self.calls = self.padded = self.plain = 0    # calls; of them padded to a bucket; run as plain calls
        self.pool = None                             # the memory pool every graph of this runner shares
        self.arena = None                            # the bytes graphs copy their outputs into (output_slots)
        self._lock = threading.Lock()
        self.unpadded: set = set()                   # call sizes whose bucket the model refused: run as they are

    def __call__(self, *args, **kwargs):
        with torch.no_grad():
            if not self.cuda_graphs:
                return self.fn(*args, **kwargs)
            self.calls += 1
            sizes = None
            if self.padding is not None and not kwargs:
                sizes = self.padding.sizes(args)
                target = self.padding.target(sizes) if sizes is not None else sizes
                key = tuple(sorted(sizes.items())) if sizes is not None else None
                if target != sizes and key not in self.unpadded:
                    self.padded += 1
                    try:
                        return self._call(self.padding.pad(args, target), kwargs, sizes, force=False)
                    except Exception:
                        # the model's own check refused the bucket's size (`assert batch < 100` met at
                        # 104): this size runs as it is from now on, and the check, if it refuses that
                        # too, says so with the call's own sizes
                        self.padded -= 1
                        if len(self.unpadded) < 64 * MAX_GRAPHS:
                            self.unpadded.add(key)
            return self._call(args, kwargs, None, force=False)

    def warm_up(self, *args, **kwargs) -> None:
        """Capture the graph of these inputs' bucket (or exact signature) now, its glue compiled
        for its shapes where the glue takes every shape (CompiledGlue.specialize; at a call, only the
        first signature captured is: a runner made at a call, after .to() or accelc.load, gets it
        for its first shape as optimize's runner gets it for the example's)."""
        with torch.no_grad():
            if not self.cuda_graphs:
                self.fn(*args, **kwargs)
                return
            if self.padding is not None and not kwargs:
                sizes = self.padding.sizes(args)
                if sizes is not None:
                    args = self.padding.pad(args, self.padding.target(sizes))
            self._call(args, kwargs, None, force=True)

    def _call(self, args, kwargs, sizes, force):
        """One call on (padded) args: its graph replayed, captured first if due, or a plain call;
        outputs cut back to `sizes` (the call's own, where it was padded) and copied."""
        def finish(out, copy_all):
            if sizes is not None:
                out = self.padding.cut(out, sizes)
            return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out) \
                if copy_all or sizes is not None else out
        try:
            key, leaves = signature(args, kwargs)
        except Uncapturable as e:
            self._note(("uncapturable", str(e)), str(e))
            return finish(self.fn(*args, **kwargs), False)
        with self._lock:
            entry, fresh = self.entries.get(key), False
            if entry is None and (force or self._due(key)):
                if (force or not self.captures) and hasattr(self.fn, "specialize"):
                    self.fn.specialize(key)
                entry, fresh = self._record(key, args, kwargs), True
            elif entry is not None:
                self.entries.move_to_end(key)
            if entry is not None and entry.graph is not None:
                # a graph just captured holds this call's inputs as they were at the call: its warm-up
                # runs may have changed an input that is also state the graph updates (a cache's
                # length given as the step's start), and copying it again would count the update twice
                for buf, x in zip(entry.inputs if not fresh else (), leaves):
                    if buf is not None and buf.data_ptr() != x.data_ptr():
                        buf.copy_(x)
                entry.graph.replay()
                return finish(entry.outputs, True)
        self.plain += 1
        return finish(self.fn(*args, **kwargs), False)

    def _due(self, key) -> bool:
        """Whether a signature not captured yet is captured at this call (its capture_after-th)."""
        if self.capture_after <= 1:
            return True
        n = self.seen.pop(key, 0) + 1
        if n >= self.capture_after:
            return True
        self.seen[key] = n
        while len(self.seen) > 64 * MAX_GRAPHS:
            self.seen.popitem(last=False)
        return False

    def _record(self, key, args, kwargs) -> _Entry:
        graphs = [k for k, e in self.entries.items() if e.graph is not None]
        if len(graphs) >= MAX_GRAPHS:    # the least recently used graph goes
            del self.entries[graphs[0]]
        leaves = pytree.tree_leaves((args, kwargs))
        inputs = [torch.empty_like(x) if isinstance(x, torch.Tensor) else None for x in leaves]
        for buf, x in zip(inputs, leaves):
            if buf is not None:
                buf.copy_(x)
        static = pytree.tree_unflatten([b if b is not None else x for b, x in zip(inputs, leaves)],
                                       pytree.tree_flatten((args, kwargs))[1])
        try:
            if self.capture is capture_cuda_graph:
                graph, outputs, self.pool = capture_cuda_graph(self.fn, *static, pool=self.pool, arena=self._arena)
            else:
                graph, outputs = self.capture(self.fn, *static)
            entry = _Entry(graph, inputs, outputs)
            self.captures += 1
        except Uncapturable as e:
            entry = _Entry(reason=str(e))
        if entry.reason:
            log.info("accelc: plain calls for inputs %s: %s", _describe(leaves), entry.reason)
        self.entries[key] = entry
        return entry

    def _arena(self, nbytes: int, device) -> torch.Tensor:
        """At least nbytes of device memory outside the graphs' pool, shared by every graph (replays
        are serialised and copied out at once). Grown to at least twice its size: graphs captured
        on a smaller one keep it alive until they are evicted."""
        if self.arena is None or self.arena.numel() < nbytes or self.arena.device != device:
            size = max(nbytes, 2 * self.arena.numel() if self.arena is not None else 0)
            self.arena = torch.empty(size, dtype=torch.uint8, device=device)
        return self.arena

    def _note(self, key, reason):
        self.entries.setdefault(key, _Entry(reason=reason))

    def status(self) -> str:
        """One line for the summary: what ran how."""
        graphs = [e for e in self.entries.values() if e.graph is not None]
        plain = {e.reason for e in self.entries.values() if e.graph is None}
        glue = self.fn.status() if hasattr(self.fn, "status") else ""
        evicted = self.captures - len(graphs)
        text = ""
        if self.cuda_graphs:
            text = (f"{len(graphs)} input signature(s) replayed from CUDA graphs"
                    + (f" ({self.captures} captured, {evicted} evicted: at most {MAX_GRAPHS} kept)" if evicted else ""))
            if self.padding is not None:
                text += f"; {self.padded} of {self.calls} call(s) padded to a bucket"
                if self.unpadded:
                    text += (f"; {len(self.unpadded)} size(s) run as they are: the model's own check refused "
                             "their bucket's size")
            if self.capture_after > 1 and self.plain:
                text += (f"; {self.plain} call(s) at a size not met before ran as plain calls (captured "
                         f"at its call number {self.capture_after})")
        text += f"; plain calls where: {'; '.join(sorted(plain))}" if plain else ""
        return "; ".join(t for t in (text.strip("; "), glue) if t)


def capture_cuda_graph(fn: Callable, args: tuple, kwargs: dict, pool=None, arena: Callable | None = None):
    """(graph, outputs, pool): fn warmed up on the GPU's one side stream (runtime.side_stream;
    compiling and tuning happen here), then captured on it into the memory pool `pool` (a new one
    when None: the one returned). One stream for every capture: graphs that share a pool must share
    the stream too (the caching allocator keeps a stream's freed blocks for that stream, so a new
    stream per capture would hold a new warm-up's and capture's worth of memory each), and cuBLAS
    keeps a workspace per stream. With
    `arena` (nbytes, device -> a uint8 tensor), the graph ends by copying its outputs into it
    (output_slots) and those copies are the outputs: the pool keeps no graph's outputs alive, so
    its size is the largest graph's working memory however many graphs there are. Raises
    Uncapturable with the cause when capture fails."""
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
        for _ in range(2):
            warm = fn(*args, **kwargs)
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
    return graph, outputs, pool


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


def _describe(leaves) -> str:
    return ", ".join("x".join(map(str, x.shape)) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)[:200]


class CompiledGlue:
    """gm compiled by Inductor, accelc's ops opaque inside (without Inductor's CUDA graphs: the
    Runner captures its own, over the compiled code). Where Dynamo or Inductor fail on the graph,
    it runs as the plain graph instead, saying why once (a model's own error raises from that
    plain call, as it would have in eager).

    With dynamic shapes, one compile serves every shape; `specialize(args, kwargs)` adds one
    compiled for exactly those inputs' shapes (static: Inductor's kernels and their launch sizes
    fixed, as a one-shape model gets them; GPT-2 at 4 x 1024 tokens ran 7% slower on the dynamic
    glue alone, H100), which calls with that signature then run. The Runner specializes the
    shapes it warms up (at optimize time: the example's, a decode step's, the warm-up shapes) and
    the first one it captures at a call, at most STATIC_GLUE."""

    def __init__(self, gm: fx.GraphModule, plain: Callable, dynamic: bool = False):
        self.gm, self.plain, self.dynamic = gm, plain, dynamic
        self.compiled = _inductor(gm, dynamic)
        self.static: dict = {}       # signature -> gm compiled for exactly its shapes
        self.failed = ""

    def specialize(self, key) -> bool:
        """Compile (at the next call with it) the glue for exactly the shapes of signature `key`
        (runner.signature's); False where it is not done: a glue compiled for static shapes
        already, STATIC_GLUE shapes done."""
        if not self.dynamic or self.failed or len(self.static) >= STATIC_GLUE:
            return False
        if key not in self.static:
            # a copy with its own forward code: Dynamo keeps its compiles per code object
            self.static[key] = _inductor(copy_module(self.gm), False)
        return True

    def __call__(self, *args, **kwargs):
        if not self.failed:
            fn = self.static.get(signature_or_none(args, kwargs), self.compiled) if self.static else self.compiled
            try:
                return fn(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                self.failed = f"Inductor could not compile the glue ({type(e).__name__}: {str(e).splitlines()[0][:150]})"
                # a warning, not only the log (accelc's logger is silent unless configured): the
                # uncompiled glue ran a GPU decode step three times slower, unnoticed
                warnings.warn(f"accelc: {self.failed}; running it uncompiled (slower, same results)", stacklevel=2)
        return self.plain(*args, **kwargs)

    def status(self) -> str:
        if self.failed:
            return self.failed
        if self.static:
            return (f"glue compiled for dynamic shapes, and for static ones at {len(self.static)} shape(s) "
                    "(those warmed up, or the first captured)")
        return ""


def _inductor(gm: fx.GraphModule, dynamic: bool):
    return torch.compile(gm, backend="inductor", dynamic=dynamic, options={"triton.cudagraphs": False})


def plan(config, device: torch.device, gm: fx.GraphModule | None = None) -> tuple[str, bool, str]:
    """(glue, CUDA graphs?, both in words) that `config` asks for on `device`. A graph that
    updates module state in place (a call counter, a cache) runs as it is, eager glue and plain
    calls: a CUDA graph's warm-up and Inductor's compile would run the update more often than eager;
    unless its updates are replayable (REPLAYABLE_STATE)."""
    on_gpu = runtime.can_time(device)
    glue = resolve_glue(config.glue, on_gpu)
    graphs = bool(config.cuda_graphs and on_gpu)
    state = mutated_state(gm) if gm is not None and not gm.meta.get(REPLAYABLE_STATE) else []
    if state:
        glue, graphs = "eager", False
    how = (("Inductor-compiled glue" if glue == "inductor" else "eager glue, direct kernel launches")
           + (", CUDA graph per input signature" if graphs else ", plain calls"))
    if state:
        how += f" (the forward updates module state in place: {', '.join(state[:3])})"
    return glue, graphs, how


def make_runner(gm: fx.GraphModule, config, device: torch.device) -> tuple[Runner, str]:
    """The Runner the config asks for on `device`, and what it does, in words."""
    glue, graphs, how = plan(config, device, gm)
    plain = direct_calls(gm) if runtime.can_run_on(device) else gm
    shapes = gm.meta.get(SHAPES)
    dynamic = bool(shapes is not None and shapes.dynamic)
    padding = shapes.padding if dynamic and config.padding else None
    # sizes that vary and do not all pad: many exact signatures, each captured at its second call
    exact = dynamic and (padding is None or not padding.covers(shapes))
    fn = CompiledGlue(gm, plain, dynamic) if glue == "inductor" else plain
    return Runner(fn, graphs, padding=padding if graphs else None, capture_after=2 if exact else 1), how
