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
`RegionalGlue` runs the cut graph with the interface of runner.CompiledGlue: compiled for dynamic shapes
where the graph takes them, plus static compiles for the shapes warmed up (specialize), each kind's
compiles shared by its blocks. ACCELC_REGIONAL_GLUE=0 compiles the whole graph instead (for measuring one
against the other).
"""
from __future__ import annotations

import contextvars
import copy
import logging
import operator
import os
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from accelc import meta

log = logging.getLogger("accelc")

_STATIC = contextvars.ContextVar("accelc_static_regions", default=False)   # a call at a specialized signature
_INDEX = re.compile(r"^\d+$")
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
    shapes = [tuple(_attr(gm, a.target).shape) if a.op == "get_attr" and isinstance(_attr(gm, a.target), torch.Tensor)
              else a.op for a in seg.inputs]
    modules = [id(m) for m in seg.modules.values()]      # a block calling a module of its own: its own kind
    seg.key = g.python_code("self").src + repr((shapes, modules))


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


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


class _Static:
    """Inside the block, regions run their static compiles for the shapes they are called with."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.token = _STATIC.set(self.on)

    def __exit__(self, *exc):
        _STATIC.reset(self.token)


class Region:
    """One kind of region: its graph module (no weights of its own: they are inputs), compiled dynamic or
    static as the glue is, and static for each shape a specialized call brings (at most `static_most`)."""

    def __init__(self, seg: Segment, dynamic: bool, compile_fn, static_most: int, key_of):
        self.gm = fx.GraphModule(seg.modules, seg.graph, class_name="Region")
        self.dynamic, self.compile_fn, self.static_most, self.key_of = dynamic, compile_fn, static_most, key_of
        self.compiled = compile_fn(self.gm, dynamic)
        self.static: dict = {}
        self.blocks = 0          # segments of this kind

    def __call__(self, *args):
        if self.dynamic and _STATIC.get():
            key = self.key_of(args, {})
            fn = self.static.get(key)
            if fn is None and key is not None and len(self.static) < self.static_most:
                # a module of its own forward code: Dynamo keeps its compiles per code object
                twin = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph), class_name="Region")
                fn = self.static[key] = self.compile_fn(twin, False)
            if fn is not None:
                return fn(*args)
        return self.compiled(*args)


class _Call(nn.Module):
    """The parent graph's call of one region (the region itself is shared: not a submodule)."""

    def __init__(self, region: Region):
        super().__init__()
        self.__dict__["region"] = region

    def forward(self, *args):
        return self.region(*args)


def parent_module(gm: fx.GraphModule, cut: Plan, regions: list) -> fx.GraphModule:
    """gm's graph with each segment a call of its region: the same inputs (and calling convention), the same
    tensors read (not copies: in-place state updates reach the model's), the same outputs."""
    g = fx.Graph()
    env: dict = {}
    root: dict = {}
    for n in gm.graph.nodes:       # inputs and attributes first: a segment may read one defined after its start
        if n.op in ("placeholder", "get_attr"):
            env[n] = g.node_copy(n, lambda x: env[x])
            if n.op == "get_attr":
                root[n.target] = _attr(gm, n.target)
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


class RegionalGlue:
    """runner.CompiledGlue's interface over a graph cut into regions (plan): one compile per kind of region;
    a call at a signature specialize() named runs every region's static compile for its shapes. Where Dynamo
    or Inductor fail on a region, the whole graph runs plain from then on, said once."""

    def __init__(self, gm: fx.GraphModule, plain, dynamic: bool, cut: Plan, compile_fn, static_most: int, key_of):
        """compile_fn(module, dynamic) -> its compiled callable; key_of(args, kwargs) -> a call's signature
        (runner.signature_or_none)."""
        self.gm, self.plain, self.dynamic, self.cut, self.key_of = gm, plain, dynamic, cut, key_of
        kinds: dict = {}
        regions = []
        for seg in cut.segments:
            region = kinds.get(seg.key)
            if region is None:
                region = kinds[seg.key] = Region(seg, dynamic, compile_fn, static_most, key_of)
            region.blocks += 1
            regions.append(region)
        self.regions = list(kinds.values())
        self.parent = parent_module(gm, cut, regions)
        self.static: set = set()        # whole-call signatures that run the static compiles
        self.static_most = static_most
        self.failed = ""
        self.dynamic_done = False       # compile_dynamic ran

    def specialize(self, key) -> bool:
        if not self.dynamic or self.failed or key is None:
            return False
        if key not in self.static and len(self.static) >= self.static_most:
            return False
        self.static.add(key)
        return True

    def compile_dynamic(self, *args, **kwargs) -> bool:
        """Every kind's dynamic compile made now, by one call of them on these inputs (runner.Runner's
        compile_other_shapes), not at the first call of a shape not warmed up."""
        if not self.dynamic or self.failed or self.dynamic_done:
            return False
        self.dynamic_done = True
        try:
            with _Static(False):
                self.parent(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            self.failed = compile_failed(e)
        return not self.failed

    def __call__(self, *args, **kwargs):
        if not self.failed:
            static = bool(self.static) and self.key_of(args, kwargs) in self.static
            try:
                with _Static(static):
                    return self.parent(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                self.failed = compile_failed(e)
        return self.plain(*args, **kwargs)

    def status(self) -> str:
        if self.failed:
            return self.failed
        blocks = sum(1 for s in self.cut.segments if s.label)
        text = (f"glue compiled by region: {len(self.cut.segments)} regions ({blocks} of them repeated blocks), "
                f"{len(self.regions)} compile(s)")
        if self.static:
            text += (f"; for dynamic shapes, and for static ones at {len(self.static)} shape(s) (those warmed up, "
                     "or the first captured)")
        return text
