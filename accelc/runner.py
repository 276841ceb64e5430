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
    size met once runs as a plain call); with OptimizeConfig(padding="auto"), a call large enough
    to be GPU-bound runs instead at its own size, as a plain call, once its bucket's graph has been
    timed and the padding is found to cost more than launching the kernels one by one would
    (exact_pays; such a call's numbers are the plain call's, within the tolerance the pad was
    checked to; at a size unlike those met before, the plain call may compile kernels for it);
  - memory: every graph captures into one memory pool and ends by copying its outputs into one
    byte arena outside it, so the pool holds no graph's outputs and its size is the largest
    graph's working memory, however many graphs there are (replays are serialised, and each
    call's outputs are copied out at once). At most MAX_GRAPHS graphs are kept: a new signature
    beyond them evicts the least recently used one. A plain call at its own size takes its memory
    from the pool too (accelc.cuda_graphs.run_in_pool), no second working set beside it.
Elsewhere (the CPU interpreter), or with glue="eager" and cuda_graphs=False: plain calls of the
graph with every accelc op calling its launcher directly (kernels.LAUNCHERS), which skips the
op dispatcher's host cost; the graph with the ops stays what export, save and torch.compile see.
Everything runs under torch.no_grad(): accelc compiles for inference.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx
from torch.utils import _pytree as pytree

from accelc import buckets, regions, runtime, tensor_parallel
from accelc.cuda_graphs import GpuTimer, Uncapturable, capture_cuda_graph, clone_tensors, run_in_pool
from accelc.runtime import resolve_glue
from accelc.capture import aliased_state, mutated_state
from accelc.capture.shapes import SHAPES
from accelc.kernels import LAUNCHERS

log = logging.getLogger("accelc")

MAX_GRAPHS = 256   # CUDA graphs kept per module; a new signature beyond them evicts the least recently used
# a call padded up to a bucket runs instead at its own size, as a plain call, where that is estimated
# under EXACT_SHARE of the bucket graph's measured GPU time: its share of the bucket's work at
# EXACT_COST per unit (the dynamic glue, odd sizes), and no less than the host's time to launch it
EXACT_SHARE = 0.9
EXACT_COST = 1.05
STATIC_GLUE = 4    # shapes a dynamic glue is also compiled for with static shapes (regions.Glue.specialize)
# gm.meta key: the graph's in-place state updates leave the same state when a call is run again on
# the same inputs (they set, not accumulate: a KV cache written at given positions), so a CUDA
# graph's warm-up runs and Inductor may run them (a model's `replayable_state = True` sets it)
REPLAYABLE_STATE = "accelc_replayable_state"


def declares_replayable_state(model) -> bool:
    """Whether a model declares `replayable_state = True` (its in-place updates set, not accumulate: a generation
    step's cache writes, or a model of the user's so declared): the one place optimize reads that declaration."""
    return bool(getattr(model, "replayable_state", False))


def direct_calls(gm: fx.GraphModule, table: dict | None = None) -> fx.GraphModule:
    """A copy of gm whose accelc op nodes call their launchers directly (same arguments), or what
    `table` maps each op to (kernels.REFERENCES: the ops' PyTorch references)."""
    return regions.copy_module(gm, LAUNCHERS if table is None else table)


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
    host_ms: float | None = None          # a plain call's launch time at this signature (the capture's warm-up)
    replays: int = 0
    timer: object = None                  # GpuTimer of the graph's second replay, until read
    gpu_ms: float | None = None           # that replay's GPU time

    def gpu_time(self) -> float | None:
        """The graph's measured replay time in ms, None until the GPU has done the timed replay."""
        if self.gpu_ms is None and self.timer is not None:
            self.gpu_ms = self.timer.ms()
            self.timer = None if self.gpu_ms is not None else self.timer
        return self.gpu_ms


def exact_pays(host_ms: float | None, gpu_ms: float | None, work_share: float) -> bool:
    """Whether a call that would replay a bucket's graph of gpu_ms runs faster as a plain call at
    its own size, work_share of the bucket's work (its padded dims' sizes over the bucket's): see
    EXACT_SHARE. A large call is GPU-bound and its padding is time; a small one is bound by the host
    launching its kernels one by one, which a graph replay saves (vLLM runs its large batches
    without graphs the same way)."""
    if host_ms is None or gpu_ms is None:
        return False
    return max(host_ms, gpu_ms * work_share * EXACT_COST) < EXACT_SHARE * gpu_ms


class Runner:
    """Calls `fn` (the compiled or direct graph) as the module docstring says. `capture`: the
    function that captures fn on given inputs (capture_cuda_graph; tests give another). `padding`
    (accelc.buckets.Padding): calls are padded up to bucket sizes, the outputs cut back.
    `capture_after`: calls of one signature before it is captured (2 where the sizes are many and
    exact: a size met once runs as a plain call). `exact_calls` (OptimizeConfig(padding="auto")): a
    padded call runs at its own size where that pays (exact_pays, from its bucket graph's times)."""

    def __init__(self, fn: Callable, cuda_graphs: bool, capture: Callable | None = None, padding=None,
                 capture_after: int = 1, exact_calls: bool = False):
        self.fn = fn
        self.cuda_graphs = cuda_graphs
        self.capture = capture or capture_cuda_graph
        self.padding = padding
        self.capture_after = capture_after
        self.exact_calls = exact_calls
        self.entries: OrderedDict = OrderedDict()   # signature -> _Entry, least recently used first
        self.seen: OrderedDict = OrderedDict()      # signature -> calls so far, for those not captured yet
        self.captures = 0                            # graphs captured so far (evicted ones included)
        self.calls = self.padded = self.plain = 0    # calls; of them padded to a bucket; run as plain calls
        self.exact = 0                               # calls run at their own size rather than their bucket's
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
                    padded = self.padding.pad(args, target)
                    if self._exact_pays(padded, kwargs, sizes, target):
                        return self._exact(args, kwargs)
                    self.padded += 1
                    try:
                        return self._call(padded, kwargs, sizes, force=False)
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
        for its shapes where the glue takes every shape (regions.Glue.specialize; at a call, only the
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

    def compile_other_shapes(self, *args, **kwargs) -> bool:
        """Compile the glue that serves shapes not warmed up (the dynamic one) now, by one plain call on
        these inputs, rather than at the first call of another shape (a request stalled for its compile).
        False where there is none to compile (a static glue, eager glue, done already)."""
        if not isinstance(self.fn, regions.Glue):
            return False
        with torch.no_grad():
            return self.fn.compile_dynamic(*args, **kwargs)

    def compile_other_shapes_later(self, inputs: list, device: torch.device) -> bool:
        """compile_other_shapes on each of `inputs` in a thread of its own (regions.Glue.compile_dynamic_later);
        False where there is none to compile."""
        return isinstance(self.fn, regions.Glue) and self.fn.compile_dynamic_later(inputs, device)

    def compiling(self) -> bool:
        """Whether the glue for other shapes is still compiling in the background (or due to: regions.Glue.
        hold_later)."""
        return isinstance(self.fn, regions.Glue) and self.fn.deferred()

    def _call(self, args, kwargs, sizes, force):
        """One call on (padded) args: its graph replayed, captured first if due, or a plain call;
        outputs cut back to `sizes` (the call's own, where it was padded) and copied."""
        def finish(out, copy_all):
            if sizes is not None:
                out = self.padding.cut(out, sizes)
            return clone_tensors(out) if copy_all or sizes is not None else out
        try:
            key, leaves = signature(args, kwargs)
        except Uncapturable as e:
            self._note(("uncapturable", str(e)), str(e))
            return finish(self.fn(*args, **kwargs), False)
        if not force and key not in self.entries and self.compiling():    # (a replay's path asks no thread)
            self.plain += 1     # (no graph of the uncompiled glue kept: captured once it is compiled)
            return finish(self.fn(*args, **kwargs), False)
        with self._lock:
            entry, fresh = self.entries.get(key), False
            if entry is None and (force or self._due(key)):
                if (force or not self.captures) and isinstance(self.fn, regions.Glue):
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
                entry.replays += 1
                if entry.replays == 2 and isinstance(entry.graph, torch.cuda.CUDAGraph):   # the first after capture's
                    with GpuTimer() as entry.timer:
                        entry.graph.replay()
                else:
                    entry.graph.replay()
                return finish(entry.outputs, True)
        self.plain += 1
        return finish(self.fn(*args, **kwargs), False)

    def _exact_pays(self, padded: tuple, kwargs: dict, sizes: dict, target: dict) -> bool:
        """Whether this call, padded to `padded`, runs faster at its own size (exact_pays)."""
        if not self.exact_calls:
            return False
        entry = self.entries.get(signature_or_none(padded, kwargs))
        if entry is None or entry.graph is None:
            return False
        share = math.prod(sizes.values()) / math.prod(target.values())
        return exact_pays(entry.host_ms, entry.gpu_time(), share)

    def _exact(self, args: tuple, kwargs: dict):
        """A plain call at the call's own size, in the graphs' pool, serialised with their replays."""
        with self._lock:
            self.exact += 1
            if self.pool is None:      # a test's capture function: no pool
                return clone_tensors(self.fn(*args, **kwargs))
            device = next(x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))
            return run_in_pool(self.fn, args, kwargs, self.pool, device)

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
            host_ms = None
            if self.capture is capture_cuda_graph:
                regions.wait_background()     # (another thread's launches and allocations would break a capture)
                graph, outputs, self.pool, host_ms = capture_cuda_graph(self.fn, *static, pool=self.pool,
                                                                        arena=self._arena)
            else:
                graph, outputs = self.capture(self.fn, *static)
            entry = _Entry(graph, inputs, outputs, host_ms=host_ms)
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
        glue = self.fn.status() if isinstance(self.fn, regions.Glue) else ""
        evicted = self.captures - len(graphs)
        text = ""
        if self.cuda_graphs:
            text = (f"{len(graphs)} input signature(s) replayed from CUDA graphs"
                    + (f" ({self.captures} captured, {evicted} evicted: at most {MAX_GRAPHS} kept)" if evicted else ""))
            if self.padding is not None:
                text += f"; {self.padded} of {self.calls} call(s) padded to a bucket"
                if self.exact:
                    text += (f"; {self.exact} ran at their own size as plain calls (GPU-bound: their padding "
                             "would have cost more than launching their kernels)")
                if self.unpadded:
                    text += (f"; {len(self.unpadded)} size(s) run as they are: the model's own check refused "
                             "their bucket's size")
            if self.capture_after > 1 and self.plain:
                text += (f"; {self.plain} call(s) at a size not met before ran as plain calls (captured "
                         f"at its call number {self.capture_after})")
        text += f"; plain calls where: {'; '.join(sorted(plain))}" if plain else ""
        return "; ".join(t for t in (text.strip("; "), glue) if t)


def _describe(leaves) -> str:
    return ", ".join("x".join(map(str, x.shape)) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)[:200]


class CompiledGlue(regions.Glue):
    """gm compiled by Inductor, accelc's ops opaque inside (without Inductor's CUDA graphs: the
    Runner captures its own, over the compiled code). Where Dynamo or Inductor fail on the graph,
    it runs as the plain graph instead, saying why once (a model's own error raises from that
    plain call, as it would have in eager).

    With dynamic shapes, one compile serves every shape; `specialize(key)` adds one
    compiled for exactly those inputs' shapes (static: Inductor's kernels and their launch sizes
    fixed, as a one-shape model gets them; GPT-2 at 4 x 1024 tokens ran 7% slower on the dynamic
    glue alone, H100), which calls with that signature then run. The Runner specializes the
    shapes it warms up (at optimize time: the example's, or a generation step's decode call instead
    of its example; the warm-up shapes) and the first one it captures at a call, at most STATIC_GLUE."""

    def __init__(self, gm: fx.GraphModule, plain: Callable, dynamic: bool = False):
        whole = regions.Region(gm, dynamic, _inductor, STATIC_GLUE, signature_or_none)
        super().__init__(whole, [whole], plain, dynamic, STATIC_GLUE, signature_or_none, state=mutated_state(gm))


def compiled_glue(gm: fx.GraphModule, plain: Callable, dynamic: bool):
    """The glue compiled by Inductor: by region where the graph repeats blocks (accelc.regions: a compile
    per kind of block), else whole (CompiledGlue)."""
    cut = regions.plan(gm)
    if cut is None:
        return CompiledGlue(gm, plain, dynamic)
    log.info("accelc: glue compiled by region: %d regions, %d kinds (%d of the graph's %d nodes compiled)",
             len(cut.segments), cut.kinds, cut.compiled_nodes, cut.total_nodes)
    return regions.RegionalGlue(gm, plain, dynamic, cut, _inductor, STATIC_GLUE, signature_or_none)


def inductor_options() -> dict:
    """The Inductor options the glue compiles with: its CUDA graphs off (the Runner captures its
    own), and any set in ACCELC_INDUCTOR_OPTIONS ("combo_kernels=1,triton.enable_pdl=1"), for
    measuring what an option gives (bench/decode.py --profile states them)."""
    options = {"triton.cudagraphs": False}
    for item in filter(None, os.environ.get("ACCELC_INDUCTOR_OPTIONS", "").split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = value.strip().lower() not in ("0", "false", "")
    return options


def _inductor(gm: fx.GraphModule, dynamic: bool):
    return torch.compile(gm, backend="inductor", dynamic=dynamic, options=inductor_options())


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
    # Inductor takes two constants for two tensors: where one is written over another's memory, the
    # glue runs eager, in the graph's order (CUDA graphs replay that order, and stay)
    aliased = aliased_state(gm) if gm is not None and glue == "inductor" else []
    if aliased:
        glue = "eager"
    how = (("Inductor-compiled glue" if glue == "inductor" else "eager glue, direct kernel launches")
           + (", CUDA graph per input signature" if graphs else ", plain calls"))
    if state:
        how += f" (the forward updates module state in place: {', '.join(state[:3])})"
    if aliased:
        w, o = aliased[0]
        how += (f" (eager glue: the forward writes {w} in place, and {o} is the same memory, which Inductor would "
                "take for another tensor)")
    return glue, graphs, how


def make_runner(gm: fx.GraphModule, config, device: torch.device) -> tuple[Runner, str]:
    """The Runner the config asks for on `device`, and what it does, in words."""
    glue, graphs, how = plan(config, device, gm)
    plain = direct_calls(gm) if runtime.can_run_on(device) else gm
    shapes = gm.meta.get(SHAPES)
    dynamic = bool(shapes is not None and shapes.dynamic)
    padding = buckets.call_plan(gm).padding if dynamic and config.padding else None
    # sizes that vary and do not all pad: many exact signatures, each captured at its second call
    exact = dynamic and (padding is None or not padding.covers(shapes))
    fn = compiled_glue(gm, plain, dynamic) if glue == "inductor" else plain
    # (a padded call's own size chosen by its measured times could differ between the ranks of a tensor-parallel
    # program, whose collectives must take the same shapes on every rank: padded alike there)
    sharded = tensor_parallel.group_of(gm) is not None
    return Runner(fn, graphs, padding=padding if graphs else None, capture_after=2 if exact else 1,
                  exact_calls=config.padding == "auto" and not sharded), how
