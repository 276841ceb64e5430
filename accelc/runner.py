"""How an optimized module runs its graph, called as a user calls a model.

On a CUDA device, by default (OptimizeConfig.glue "auto", cuda_graphs True):
  - glue: what accelc did not rewrite (norms, softmax, pooling, elementwise chains, reshapes) is
    compiled by Inductor (torch.compile), accelc's kernels staying opaque custom ops inside it;
  - CUDA graphs: each new input signature (the structure of the arguments; per tensor its shape,
    strides, dtype and device; other arguments by value) is warmed up and captured in a CUDA graph
    the first time it is seen. A later call with that signature copies its tensors into the
    graph's input buffers, replays the graph and returns copies of its outputs: one call's outputs
    are never overwritten by the next. A signature whose graph cannot be captured (an op that
    waits for the host, a CPU tensor argument) runs as plain calls, and the reason is kept
    (OptimizedModule.summary()). All graphs of a module capture into one memory pool (each keeps
    only its outputs alive there, so graphs reuse one another's intermediates: memory does not
    grow with the number of shapes), at most MAX_GRAPHS at a time: a new signature beyond them
    evicts the least recently used one. Replays are serialised (one pool).
  - glue over a graph that takes varying shapes (accelc.capture.InputShapes) is compiled with
    dynamic shapes, once, instead of once per shape.
Elsewhere (the CPU interpreter), or with glue="eager" and cuda_graphs=False: plain calls of the
graph with every accelc op calling its launcher directly (kernels.LAUNCHERS), which skips the
op dispatcher's host cost; the graph with the ops stays what export, save and torch.compile see.
Everything runs under torch.no_grad(): accelc compiles for inference.
"""
from __future__ import annotations

import logging
import threading
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

MAX_GRAPHS = 16    # CUDA graphs kept per module; a new signature beyond them evicts the least recently used


class Uncapturable(Exception):
    """Why a signature cannot have a CUDA graph."""


def direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm whose accelc op nodes call their launchers directly (same arguments)."""
    direct = fx.GraphModule(gm, _copy_graph(gm.graph), class_name=type(gm).__name__)
    for n in direct.graph.nodes:
        if n.op == "call_function" and n.target in LAUNCHERS:
            n.target = LAUNCHERS[n.target]
    direct.recompile()
    return direct


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


@dataclass
class _Entry:
    graph: object = None                  # torch.cuda.CUDAGraph, None: plain calls
    inputs: list = field(default_factory=list)     # the graph's input buffers, per tensor leaf
    outputs: object = None                # the graph's outputs (a pytree)
    reason: str = ""                      # why plain calls, when graph is None


class Runner:
    """Calls `fn` (the compiled or direct graph) as the module docstring says. `capture`: the
    function that captures fn on given inputs (capture_cuda_graph; tests give another)."""

    def __init__(self, fn: Callable, cuda_graphs: bool, capture: Callable | None = None):
        self.fn = fn
        self.cuda_graphs = cuda_graphs
        self.capture = capture or capture_cuda_graph
        self.entries: OrderedDict = OrderedDict()   # signature -> _Entry, least recently used first
        self.captures = 0                            # graphs captured so far (evicted ones included)
        self.pool = None                             # the memory pool every graph of this runner shares
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with torch.no_grad():
            if not self.cuda_graphs:
                return self.fn(*args, **kwargs)
            try:
                key, leaves = signature(args, kwargs)
            except Uncapturable as e:
                self._note(("uncapturable", str(e)), str(e))
                return self.fn(*args, **kwargs)
            with self._lock:
                entry = self.entries.get(key)
                if entry is None:
                    entry = self._record(key, args, kwargs)
                else:
                    self.entries.move_to_end(key)
                if entry.graph is None:
                    out = None
                else:
                    for buf, x in zip(entry.inputs, leaves):
                        if buf is not None and buf.data_ptr() != x.data_ptr():
                            buf.copy_(x)
                    entry.graph.replay()
                    out = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.outputs)
            return self.fn(*args, **kwargs) if entry.graph is None else out

    def _record(self, key, args, kwargs) -> _Entry:
        graphs = [k for k, e in self.entries.items() if e.graph is not None]
        if len(graphs) >= MAX_GRAPHS:    # the least recently used graph goes: its outputs leave the pool
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
                graph, outputs, self.pool = capture_cuda_graph(self.fn, *static, pool=self.pool)
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

    def _note(self, key, reason):
        self.entries.setdefault(key, _Entry(reason=reason))

    def status(self) -> str:
        """One line for the summary: what ran how."""
        graphs = [e for e in self.entries.values() if e.graph is not None]
        plain = {e.reason for e in self.entries.values() if e.graph is None}
        glue = getattr(self.fn, "failed", "")
        evicted = self.captures - len(graphs)
        text = (f"{len(graphs)} input signature(s) replayed from CUDA graphs"
                + (f" ({self.captures} captured, {evicted} evicted: at most {MAX_GRAPHS} kept)" if evicted else "")
                if self.cuda_graphs else "")
        text += f"; plain calls where: {'; '.join(sorted(plain))}" if plain else ""
        return "; ".join(t for t in (text.strip("; "), glue) if t)


def capture_cuda_graph(fn: Callable, args: tuple, kwargs: dict, pool=None):
    """(graph, outputs, pool): fn warmed up on a side stream (compiling and tuning happen here), then
    captured on it into the memory pool `pool` (a new one when None: the one returned). Raises
    Uncapturable with the cause when capture fails."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not tensors or any(x.device.type != "cuda" for x in tensors):
        raise Uncapturable("a tensor argument not on a CUDA device (or none at all)")
    device = tensors[0].device
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*args, **kwargs)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            outputs = fn(*args, **kwargs)
    except Exception as e:   # an op that syncs with the host, reads CPU memory, ...
        torch.cuda.synchronize(device)
        raise Uncapturable(f"CUDA graph capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return graph, outputs, pool


def _describe(leaves) -> str:
    return ", ".join("x".join(map(str, x.shape)) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)[:200]


class CompiledGlue:
    """gm compiled by Inductor, accelc's ops opaque inside (without Inductor's CUDA graphs: the
    Runner captures its own, over the compiled code). Where Dynamo or Inductor fail on the graph,
    it runs as the plain graph instead, saying why once (a model's own error raises from that
    plain call, as it would have in eager)."""

    def __init__(self, gm: fx.GraphModule, plain: Callable, dynamic: bool = False):
        self.compiled = torch.compile(gm, backend="inductor", dynamic=dynamic, options={"triton.cudagraphs": False})
        self.plain = plain
        self.failed = ""

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                self.failed = f"Inductor could not compile the glue ({type(e).__name__}: {str(e).splitlines()[0][:150]})"
                log.warning("accelc: %s; running it uncompiled", self.failed)
        return self.plain(*args, **kwargs)


def plan(config, device: torch.device, gm: fx.GraphModule | None = None) -> tuple[str, bool, str]:
    """(glue, CUDA graphs?, both in words) that `config` asks for on `device`. A graph that
    updates module state in place (a call counter, a cache) runs as it is, eager glue and plain
    calls: a CUDA graph's warm-up and Inductor's compile would run the update more often than eager."""
    on_gpu = runtime.can_time(device)
    glue = resolve_glue(config.glue, on_gpu)
    graphs = bool(config.cuda_graphs and on_gpu)
    state = mutated_state(gm) if gm is not None else []
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
    return Runner(CompiledGlue(gm, plain, dynamic) if glue == "inductor" else plain, graphs), how
