"""The glue compiled by region: one Inductor compile for each kind of repeated block, not one of the whole graph.

A model's repeated blocks (model.layers.0, .1, ...; blocks.0, .1, ...) run the same glue ops on their own
weights. Inductor compiling the whole graph takes time that grows with every block (its scheduler weighs
fusions over all of them): a 22-block 1.1B Llama's glue took tens of seconds a compile, and optimize compiles
it more than once (the forward, the generation step at its prompt and at a decode step). Cut at the blocks,
the graph is a row of regions: each block's nodes, and the stretches between blocks. A region's graph takes
every tensor it reads, the block's weights and caches included, as an input, so blocks whose graphs are
the same (ops, constants, weight shapes) are one kind and share one compile, called with each block's
tensors; nothing crosses a block's border that did not before (a region's inputs and outputs are the values
the block boundary carries), so what Inductor may fuse is what lies inside a block.

`plan(gm)` cuts a graph where that pays (fewer nodes compiled than half the graph's, at least one kind met
twice) and returns None otherwise (a graph with no repeated blocks compiles whole, as before).
`Glue` runs a graph's glue compiled, cut (RegionalGlue) or whole (runner.CompiledGlue): compiled for dynamic shapes
where the graph takes them, plus static compiles for the shapes warmed up (specialize), each kind's
compiles shared by its blocks. ACCELC_REGIONAL_GLUE=0 compiles the whole graph instead (for measuring one
against the other).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import operator
import os
import re
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from accelc import fx_tracing, meta
from accelc.capture.contract import mutated_state
from accelc.cuda_graphs import copy_as_is, memory_holder

log = logging.getLogger("accelc")

_STATIC = contextvars.ContextVar("accelc_static_regions", default=False)   # a call at a specialized signature
_LATER: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()   # background compiles (Glue.compile_dynamic_later)
_INDEX = re.compile(r"^\d+$")
# While a background compile runs, the interpreter hands the GIL to a waiting thread after this many seconds rather
# than its default 5 ms: a call's ops each let go of the GIL, and each waited up to the whole interval for a compiling
# thread to give it back (a BERT call meanwhile took 1.3 s where it takes 20 ms; 300 small ops beside a busy thread
# on the CPU: ~1 s at 5 ms, ~30 ms at 0.2 ms, the busy thread's own pace unchanged)
BACKGROUND_SWITCH_S = 2e-4
_SWITCH = {"held": 0, "before": None, "ours": None}
_SWITCH_LOCK = threading.Lock()
MAX_LEVELS = 2           # block levels tried: model.layers.N, then model.layers.N.blocks.M
PAYS = 0.5               # a cut pays where the nodes compiled are at most this share of the graph's


@dataclass
class Segment:
    label: str | None                 # the block ("model.layers.3"), None for a stretch between blocks
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)     # values it reads from elsewhere, in order of first use
    outputs: list = field(default_factory=list)    # its values read elsewhere, in graph order
    key: str = ""                      # its graph's code and weight shapes: equal keys, one kind
    graph: fx.Graph | None = None
    modules: dict = field(default_factory=dict)    # call_module targets it calls -> the modules


@dataclass
class Plan:
    segments: list
    kinds: int              # distinct keys
    compiled_nodes: int     # nodes of one segment of each kind (what Inductor compiles)
    total_nodes: int


def enabled() -> bool:
    return os.environ.get("ACCELC_REGIONAL_GLUE", "1").strip().lower() not in ("0", "false", "no", "off")


def _compute(n: fx.Node) -> bool:
    return n.op in ("call_function", "call_method", "call_module")


def block_label(path: str, level: int) -> str | None:
    """The repeated block a module path lies in, at this level: "model.layers.3" for
    "model.layers.3.mlp.up_proj" at level 1 (its first numeric part), None where it has fewer."""
    parts = path.split(".") if path else []
    seen = 0
    for i, p in enumerate(parts):
        if _INDEX.match(p):
            seen += 1
            if seen == level:
                return ".".join(parts[:i + 1])
    return None


def _labels(nodes: list, level: int) -> list:
    """Each compute node's block at `level`; a node without a path (a getitem, a reshape of the root's
    code) takes its neighbours' block where the nearest labelled nodes before and after agree."""
    raw = [block_label(meta.path(n), level) if meta.path(n) else "?" for n in nodes]
    out = list(raw)
    for i, lab in enumerate(raw):
        if lab != "?":
            continue
        before = next((raw[j] for j in range(i - 1, -1, -1) if raw[j] != "?"), None)
        after = next((raw[j] for j in range(i + 1, len(raw)) if raw[j] != "?"), None)
        out[i] = before if before == after else None
    return out


def _segments(gm: fx.GraphModule, level: int) -> list:
    nodes = [n for n in gm.graph.nodes if _compute(n)]
    segs: list = []
    for n, lab in zip(nodes, _labels(nodes, level)):
        if not segs or segs[-1].label != lab:
            segs.append(Segment(lab))
        segs[-1].nodes.append(n)
    return segs


def _build(seg: Segment, gm: fx.GraphModule, used_after: dict) -> None:
    """seg's graph over canonical names (in0.., v0..) with every value from elsewhere an input, and its key."""
    own = set(seg.nodes)
    for n in seg.nodes:
        for a in n.all_input_nodes:
            if a not in own and a not in seg.inputs:
                seg.inputs.append(a)
    seg.outputs = [n for n in seg.nodes if used_after[n] - own]
    g = fx.Graph()
    env = {a: g.placeholder(f"in{i}") for i, a in enumerate(seg.inputs)}
    for i, n in enumerate(seg.nodes):
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda x: env[x])
        target = n.target
        if n.op == "call_module":
            target = f"m{len(seg.modules)}"
            seg.modules[target] = gm.get_submodule(n.target)
        env[n] = g.create_node(n.op, target, args, kwargs, name=f"v{i}")
        env[n].meta = dict(n.meta)
    g.output(tuple(env[o] for o in seg.outputs))
    seg.graph = g
    read = [operator.attrgetter(a.target)(gm) if a.op == "get_attr" else None for a in seg.inputs]
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else a.op for a, t in zip(seg.inputs, read)]
    modules = [id(m) for m in seg.modules.values()]      # a block calling a module of its own: its own kind
    seg.key = g.python_code("self").src + repr((shapes, modules))


def plan(gm: fx.GraphModule) -> Plan | None:
    """The cut of gm's glue into regions that pays best (see the module docstring), or None."""
    if not enabled():
        return None
    total = sum(_compute(n) for n in gm.graph.nodes)
    users = {n: set(n.users) for n in gm.graph.nodes}
    best = None
    for level in range(1, MAX_LEVELS + 1):
        segs = _segments(gm, level)
        if not any(s.label for s in segs) or len(segs) < 3:
            continue
        for s in segs:
            _build(s, gm, users)
        kinds: dict = {}
        for s in segs:
            kinds.setdefault(s.key, len(s.nodes))
        shared = len(kinds) < len(segs)
        compiled = sum(kinds.values())
        if shared and compiled <= PAYS * total and (best is None or compiled < best.compiled_nodes):
            best = Plan(segs, len(kinds), compiled, total)
    return best


def compile_failed(e: Exception) -> str:
    """Why the glue runs uncompiled from now on, said as a warning too (accelc's logger is silent unless
    configured: an uncompiled glue ran a GPU decode step three times slower, unnoticed)."""
    why = f"Inductor could not compile the glue ({type(e).__name__}: {str(e).splitlines()[0][:150]})"
    warnings.warn(f"accelc: {why}; running it uncompiled (slower, same results)", stacklevel=3)
    return why


def copy_module(gm: fx.GraphModule, targets: dict | None = None) -> fx.GraphModule:
    """A GraphModule over a copy of gm's graph, with its own forward code, sharing gm's weights,
    buffers and submodules (not copies: in-place state updates reach the same tensors); its call_function
    nodes of a target in `targets` call what it maps them to. The code is generated once, for the final
    graph (a 24-layer LM's step program: ~0.9 s a generation on the GPU host's CPU)."""
    graph = _copy_graph(gm.graph)
    for n in graph.nodes if targets else ():
        if n.op == "call_function" and n.target in targets:
            n.target = targets[n.target]
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    g = fx.Graph()
    out = g.graph_copy(graph, {})
    g.output(out)
    g._codegen = graph._codegen
    return g


@contextlib.contextmanager
def _static(on: bool):
    """Inside the block, regions run their static compiles for the shapes they are called with."""
    token = _STATIC.set(on)
    try:
        yield
    finally:
        _STATIC.reset(token)


class Region:
    """A graph module compiled by Inductor as the glue is (dynamic or static), and static for each shape a call
    inside _static(True) brings (at most `static_most`): one kind of block's region (its weights are inputs,
    shared by the blocks of the kind), or the whole graph."""

    def __init__(self, gm: fx.GraphModule, dynamic: bool, compile_fn, static_most: int, key_of):
        self.gm, self.dynamic, self.compile_fn, self.static_most, self.key_of = gm, dynamic, compile_fn, static_most, key_of
        self.compiled = compile_fn(gm, dynamic)
        self.static: dict = {}

    def __call__(self, *args, **kwargs):
        if self.dynamic and _STATIC.get():
            key = self.key_of(args, kwargs)
            fn = self.static.get(key)
            if fn is None and key is not None and len(self.static) < self.static_most:
                # a module of its own forward code (the same weights and submodules): Dynamo compiles per code object
                fn = self.static[key] = self.compile_fn(copy_module(self.gm), False)
            if fn is not None:
                return fn(*args, **kwargs)
        return self.compiled(*args, **kwargs)


class _Call(nn.Module):
    """The parent graph's call of one region (the region itself is shared: not a submodule)."""

    def __init__(self, region: Region):
        super().__init__()
        self.__dict__["region"] = region

    def forward(self, *args):
        return self.region(*args)


def parent_module(gm: fx.GraphModule, cut: Plan, regions: list, replace: dict | None = None) -> fx.GraphModule:
    """gm's graph with each segment a call of its region: the same inputs (and calling convention), the same
    tensors read (not copies: in-place state updates reach the model's), the same outputs. replace: {attribute:
    tensor} read instead of gm's (copies of its state, for a call that must not write the model's)."""
    g = fx.Graph()
    env: dict = {}
    root: dict = {}
    replace = replace or {}
    for n in gm.graph.nodes:       # inputs and attributes first: a segment may read one defined after its start
        if n.op in ("placeholder", "get_attr"):
            env[n] = g.node_copy(n, lambda x: env[x])
            if n.op == "get_attr":
                root[n.target] = replace[n.target] if n.target in replace else operator.attrgetter(n.target)(gm)
    for i, (seg, region) in enumerate(zip(cut.segments, regions)):
        name = f"region{i}"
        root[name] = _Call(region)
        call = g.call_module(name, tuple(env[a] for a in seg.inputs))
        for j, o in enumerate(seg.outputs):
            env[o] = g.call_function(operator.getitem, (call, j))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    g.node_copy(out, lambda x: env[x])
    g._codegen = gm.graph._codegen
    return fx.GraphModule(root, g, class_name=type(gm).__name__)


def _sizes_apart():
    """Dynamo's duck sizing off while the dynamic glue compiles: it makes sizes that are equal in the example one
    size (an example's length of 64 and a head dim of 64), so a request at any other length failed the equality
    and compiled again."""
    from torch.fx.experimental import _config

    return _config.patch(use_duck_shape=False) if hasattr(_config, "use_duck_shape") else contextlib.nullcontext()


class Glue:
    """A graph's glue compiled by Inductor: `module` (the whole graph as one Region, or the parent of its
    regions) called as the graph is, compiled for dynamic shapes where the graph takes them; a call at a
    signature specialize() named runs the regions' static compiles for its shapes (at most `static_most`
    signatures). Where Dynamo or Inductor fail, the plain graph runs from then on, said once (a model's own
    error raises from that plain call, as it would have in eager)."""

    def __init__(self, module, regions: list, plain, dynamic: bool, static_most: int, key_of, cut: Plan | None = None,
                 state: tuple = ()):
        """key_of(args, kwargs) -> a call's signature (runner.signature_or_none); state: the attributes the graph
        updates in place (capture.mutated_state: a generation step's cache)."""
        self.module, self.regions, self.plain, self.dynamic, self.cut = module, regions, plain, dynamic, cut
        self.state = tuple(state)
        self.static_most, self.key_of = static_most, key_of
        self.static: set = set()        # whole-call signatures that run the static compiles
        self.failed = ""
        self.dynamic_done: set = set()  # the call signatures compile_dynamic ran at
        self.later: threading.Thread | None = None   # compile_dynamic_later's thread
        self.later_seconds: float | None = None       # its time, once it ended
        self.due = False        # compile_dynamic_later held to start soon (hold_later)

    def specialize(self, key) -> bool:
        """Calls with signature `key` run static compiles for their shapes (made at the first such call); False
        where that is not done: a glue compiled static already, `static_most` signatures named."""
        if not self.dynamic or self.failed or key is None:
            return False
        if key not in self.static and len(self.static) >= self.static_most:
            return False
        self.static.add(key)
        return True

    def compile_dynamic(self, *args, **kwargs) -> bool:
        """Every dynamic compile made now, by one call on these inputs (runner.Runner's compile_other_shapes),
        not at the first call of a shape not warmed up. Dynamo specializes a size of 1 (a batch of one
        compiles apart from the others): a call at such sizes compiles that variant; once per signature."""
        return self._compile_dynamic(self.module, args, kwargs)

    def _compile_dynamic(self, module, args, kwargs) -> bool:
        """compile_dynamic by a call of `module` (self.module, or a parent over copies of the state: state_apart)."""
        key = self.key_of(args, kwargs)
        if not self.dynamic or self.failed or key in self.dynamic_done:
            return False
        self.dynamic_done.add(key)
        with _sizes_apart():
            self._run(False, args, kwargs, module)
        return not self.failed

    def state_apart(self):
        """The glue's module for a compile's call that must leave the model's state alone (the background thread's,
        beside the caller's calls; asked only where apart_ok): self.module, which updates none here (RegionalGlue's
        override copies the state it updates)."""
        return self.module

    def apart_ok(self) -> bool:
        """Whether compile_dynamic_later may run: its calls can leave the model's state alone (state_apart)."""
        return not self.state

    def hold_later(self) -> bool:
        """compile_dynamic_later due (a generation step's, once its forward's optimize ends): till then calls at a
        signature not compiled static run the plain graph (the step's speed timed at optimize had compiled the glue
        in the caller's thread); whether held (not where compile_dynamic_later would not start)."""
        self.due = not self.dynamic_done and self.later is None and self.dynamic and not self.failed and self.apart_ok()
        return self.due

    def compile_dynamic_later(self, inputs: list, device: torch.device) -> bool:
        """compile_dynamic on each of `inputs` (graph inputs of their own, the example's first) in a thread of its
        own (OptimizeConfig.other_shapes="background"), its GPU work on a stream of its own. Until it ends
        (pending), a call at a signature not compiled static runs the plain graph, no compile waited for (the
        Runner captures no CUDA graph for it meanwhile); a failure is said as a compile's at a call is. False
        where there is nothing to compile (a static glue, done already, failed)."""
        self.due = False
        if not self.dynamic or self.failed or self.dynamic_done or self.later is not None or not self.apart_ok():
            return False
        self.later = threading.Thread(target=fx_tracing.own_flag(self._compile_later), args=(inputs, device),
                                      name="accelc-glue-later")     # (its traces seen by its own thread alone)
        _LATER.add(self.later)
        self.later.start()
        return True

    def _compile_later(self, inputs: list, device: torch.device) -> None:
        t0 = time.perf_counter()
        _switch_quickly(True)
        on_gpu = device.type == "cuda"
        stream = None
        try:
            # a cache the caller's calls write meanwhile: the thread's calls write copies, made on the caller's
            # stream (their memory goes back to its pool, not to one of this thread's stream)
            try:
                with torch.no_grad(), torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
                    module = self.state_apart()
            except torch.OutOfMemoryError:    # (nothing compiled: a first call at another shape compiles it, said)
                warnings.warn("accelc: the glue for other shapes not compiled in the background: copies of the state "
                              "it writes did not fit in memory; a first call at another shape compiles it", stacklevel=1)
                return
            stream = torch.cuda.Stream(device) if on_gpu else None
            if stream is not None:       # (the inputs and copies were made on the caller's stream)
                stream.wait_stream(torch.cuda.current_stream(device))
            with torch.no_grad(), torch.cuda.device(device) if on_gpu else contextlib.nullcontext(), \
                    torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
                for args in inputs:
                    self._compile_dynamic(module, args, {})
        except Exception as e:      # (the model's own error at a size Dynamo compiles apart, a CUDA error)
            self.failed = self.failed or compile_failed(e)
        finally:
            try:
                if stream is not None:   # (the copies, freed as this returns, no longer read by its work)
                    stream.synchronize()
            except Exception as e:
                self.failed = self.failed or compile_failed(e)
            _switch_quickly(False)
        self.later_seconds = round(time.perf_counter() - t0, 2)
        log.info("accelc: the glue for other shapes compiled in the background (%.1f s)%s", self.later_seconds,
                 f": {self.failed}" if self.failed else "")

    def pending(self) -> bool:
        """Whether compile_dynamic_later's thread is still compiling."""
        return self.later is not None and self.later.is_alive()

    def deferred(self) -> bool:
        """Whether calls at a signature not compiled static run the plain graph: compiling later (or due: hold_later)."""
        return self.due or self.pending()

    def wait(self, timeout: float | None = None) -> bool:
        """compile_dynamic_later's thread ended (within `timeout` seconds); True where none is left running."""
        if self.later is not None:
            self.later.join(timeout)
        return not self.pending()

    def __call__(self, *args, **kwargs):
        if not self.failed:
            static = bool(self.static) and self.key_of(args, kwargs) in self.static
            if not static and self.deferred():     # (compiling in the background, or due to: no compile waited for)
                return self.plain(*args, **kwargs)
            if not static and self.dynamic and not self.dynamic_done:    # (a causal LM's forward leaves it here)
                log.info("accelc: compiling the glue for other shapes at this call, once (OptimizeConfig."
                         "warmup_shapes compiles it at optimize)")
                self.dynamic_done.add(self.key_of(args, kwargs))
            out = self._run(static, args, kwargs)
            if not self.failed:
                return out
        return self.plain(*args, **kwargs)

    def _run(self, static: bool, args, kwargs, module=None):
        try:
            with _static(static):
                return (self.module if module is None else module)(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            self.failed = compile_failed(e)

    def status(self) -> str:
        if self.failed:
            return self.failed
        parts = []
        if self.cut is not None:
            blocks = sum(1 for s in self.cut.segments if s.label)
            parts.append(f"glue compiled by region: {len(self.cut.segments)} regions ({blocks} of them repeated "
                         f"blocks), {len(self.regions)} compile(s)")
        if self.static:
            parts.append(("" if parts else "glue compiled ") + f"for dynamic shapes, and for static ones at "
                         f"{len(self.static)} shape(s) (those warmed up, or the first captured)")
        if self.pending():
            parts.append("the glue for other shapes compiling in the background (calls at other shapes run "
                         "uncompiled glue, no CUDA graph, until it is done)")
        elif self.later_seconds is not None:
            parts.append("the glue for other shapes compiled in the background after optimize "
                         f"({self.later_seconds:.1f} s)")
        return "; ".join(parts)


def _switch_quickly(on: bool) -> None:
    """BACKGROUND_SWITCH_S as the interpreter's switch interval while any background compile runs (on: one more
    runs; off: one ended), the interval before the first put back after the last, unless it was changed since."""
    with _SWITCH_LOCK:
        if on:
            if _SWITCH["held"] == 0:
                _SWITCH["before"] = sys.getswitchinterval()
                sys.setswitchinterval(min(_SWITCH["before"], BACKGROUND_SWITCH_S))
                _SWITCH["ours"] = sys.getswitchinterval()
            _SWITCH["held"] += 1
            return
        _SWITCH["held"] -= 1
        if _SWITCH["held"] == 0 and sys.getswitchinterval() == _SWITCH["ours"]:
            sys.setswitchinterval(_SWITCH["before"])


def background_running() -> bool:
    """Whether a background glue compile (Glue.compile_dynamic_later) is still running."""
    return any(t.is_alive() for t in list(_LATER))


def wait_background(timeout: float | None = None) -> None:
    """Every background glue compile (Glue.compile_dynamic_later) ended: before a CUDA graph capture, which
    another thread's allocations and launches would break."""
    for thread in list(_LATER):
        if thread is not threading.current_thread():
            thread.join(timeout)


class RegionalGlue(Glue):
    """The glue of a graph cut into regions (plan): one Region per kind, shared by its segments."""

    def __init__(self, gm: fx.GraphModule, plain, dynamic: bool, cut: Plan, compile_fn, static_most: int, key_of):
        """compile_fn(module, dynamic) -> its compiled callable; key_of as Glue's."""
        kinds: dict = {}
        for seg in cut.segments:
            if seg.key not in kinds:
                kinds[seg.key] = Region(fx.GraphModule(seg.modules, seg.graph, class_name="Region"), dynamic,
                                        compile_fn, static_most, key_of)
        self._gm, self._order = gm, [kinds[seg.key] for seg in cut.segments]
        super().__init__(parent_module(gm, cut, self._order), list(kinds.values()), plain, dynamic, static_most,
                         key_of, cut, state=mutated_state(gm))

    def apart_ok(self) -> bool:
        """Copies of the state fit beside it: at most half the device's free memory (a large cache compiles now)."""
        on_gpu = [memory_holder(operator.attrgetter(a)(self._gm)) for a in self.state]
        on_gpu = [t for t in on_gpu if t.is_cuda]
        return not on_gpu or sum(t.nbytes for t in on_gpu) <= torch.cuda.mem_get_info(on_gpu[0].device)[0] // 2

    def state_apart(self):
        """The parent over copies of the state the graph writes (a region takes its block's cache as an input, so
        the same compiles serve the model's own), made for one background compile and dropped after it."""
        if not self.state:
            return self.module
        return parent_module(self._gm, self.cut, self._order,
                             replace={a: copy_as_is(operator.attrgetter(a)(self._gm)) for a in self.state})
