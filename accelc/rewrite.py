"""The rewrite engine every pass shares: rules, the one driver that applies them, and the layer
records they leave behind for the guard, the summary and the report.

A Rule is declared, not driven (as Inductor's fuse_attention.py registers a pattern, its
replacement and an extra_check):
  pattern  a small eager function over its inputs, traced once and put in canonical form
           (accelc.capture). A pattern input matches any node or literal, so constants (eps,
           scale) are matched and read, never hard-coded;
  applies  (optional) a structural filter: False means "not this rule's business" and records
           nothing (a matmul of two activations is no linear layer);
  check    why the kernel cannot take the match, or None. Rules ask the kernel's own
           why_unsupported(...) on meta tensors, so a kernel's limits are written once, in it;
  build    the Replacement: which call, with which arguments, absorbing which further nodes.
apply_rules runs a table of rules over a graph and owns everything else: matching, liveness (a
node an earlier match took is not taken twice), the device check, the skip-reason policy
(accelc.meta.explain), the replacement and the count. A Pass is a table of rules (plus, for the
two passes that need one, a step before the rules or a transform of the layers already made).

A rewritten group becomes one call_function node of an accelc op whose meta[REWRITE] is a
Rewrite: the layer's name, its kernel, and the original nodes extracted as their own
GraphModule with the graph nodes that feed it. The guard runs that module as the layer's eager
reference, the report times and exports it, and `revert` inlines it back. A layer moved to another
kernel later (int8) keeps its original and falls back to the call it replaced (`restack`, `demote`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from accelc import graph_order, meta, runtime
from accelc.records import Fallback, Rewrite
from accelc.capture import canonicalize


# ---------------------------------------------------------------------------------------------
# what a pass gets

@dataclass
class PassContext:
    """What every pass may read: the config, the example inputs the graph was captured on, the
    calibration batches (int8 static scales, SmoothQuant; the example inputs when none were
    given), and the device the model runs on."""
    config: object                       # accelc.config.OptimizeConfig
    example_inputs: tuple
    calibration: list
    device: torch.device
    seconds: dict = field(default_factory=dict)   # where optimize's time goes, by phase
    eager_ms: dict = field(default_factory=dict)  # layer name -> eager ms of the original, where timed
    shapes: object = None   # accelc.capture.InputShapes: the input shapes the graph takes
    checked_at: list = field(default_factory=list)   # the guard's record: other sizes every layer passed at
    # (inputs, what they are in words) the guard's speed race times layers on where not the example
    # inputs (a generation step's: a decode step's)
    race: tuple | None = None
    # what the guard decided, in order: ("demote" | "revert", layer, reason, status) (accelc.reuse replays it)
    decisions: list = field(default_factory=list)
    # (eager's output on the example, a callable giving the model's output in higher precision): what the quantized
    # layers' whole-output budget is measured with (Int8Config / Fp8Config.output_error, accelc.guard)
    output_budget: tuple | None = None
    # inputs a later stage calls the graph at and tunes there (the padding check's padded sizes): the guard hands
    # their candidates' compiles to the workers while it checks (accelc.layer_compiles.later_ahead)
    later_inputs: list = field(default_factory=list)

    @property
    def inductor_glue(self) -> bool:
        """Whether what accelc leaves runs compiled by Inductor (OptimizeConfig.glue resolved for
        the model's device, as accelc.runner resolves it): rules whose kernel only pays against
        eager glue (the norms, RoPE) leave their match to Inductor then."""
        return runtime.resolve_glue(self.config.glue, self.device.type == "cuda") == "inductor"


_READERS = "accelc_readers"   # gm.meta: replace_uses' index (_readers)
_NAMES = "accelc_layer_names"   # gm.meta: the layer names taken (unique_name)


# ---------------------------------------------------------------------------------------------
# patterns and matches

@dataclass(frozen=True)
class Pattern:
    """fn: eager pattern; its parameter names name the matched inputs."""
    name: str
    fn: Callable


@dataclass
class Match:
    pattern: Pattern
    gm: fx.GraphModule
    inputs: dict          # pattern parameter name -> graph Node or literal, as matched
    nodes: list           # matched graph nodes in graph order (get_attr inputs excluded)

    @property
    def anchor(self) -> fx.Node:
        return self.nodes[-1]

    def input(self, name: str, default=None):
        """The node or literal bound to pattern input `name` now: a node that an earlier
        rewrite replaced (an activation absorbed into the previous layer) resolves to its
        replacement."""
        value = self.inputs.get(name, default)
        replaced = self.gm.meta.get(meta.REPLACED, {})
        while isinstance(value, fx.Node) and value in replaced:
            value = replaced[value]
        return value

    def has(self, name: str) -> bool:
        return name in self.inputs

    def is_live(self) -> bool:
        """False when an earlier rewrite took one of the matched nodes."""
        replaced = self.gm.meta.get(meta.REPLACED, {})
        return not any(n in replaced or n.graph is not self.gm.graph for n in self.nodes)


@functools.lru_cache(maxsize=None)
def _pattern_graph(fn: Callable) -> fx.Graph:
    gm = fx.symbolic_trace(fn)
    canonicalize(gm)
    return gm.graph


def find(gm: fx.GraphModule, pattern: Pattern) -> list[Match]:
    """Non-overlapping matches of `pattern` in gm, in graph order."""
    pg = _pattern_graph(pattern.fn)
    if not _calls_present(pg, gm.graph):
        return []
    matcher = SubgraphMatcher(pg, match_output=False, match_placeholder=False,
                              remove_overlapping_matches=True, ignore_literals=False)
    with graph_order.by_position(gm.graph) as order:
        found = matcher.match(gm.graph)
    matches = []
    for m in found:
        inputs = {pn.target: m.nodes_map[pn] for pn in pg.nodes if pn.op == "placeholder"}
        nodes = sorted((gn for pn, gn in m.nodes_map.items() if pn.op not in ("placeholder", "output")),
                       key=order.__getitem__)
        matches.append(Match(pattern, gm, inputs, nodes))
    return sorted(matches, key=lambda mt: order[mt.anchor])


_CALLS = ("call_function", "call_method", "call_module")


def _calls_present(pg: fx.Graph, graph: fx.Graph) -> bool:
    """Whether the graph calls every target the pattern calls: the matcher compares each pattern node's op and
    target with a graph node's, so a pattern calling what the graph never calls has no match (an LM's graph and
    the gated MLP's patterns of other activations: two thirds of a 28-layer LM's matching, for nothing)."""
    try:
        have = {(n.op, n.target) for n in graph.nodes if n.op in _CALLS}
        return all((n.op, n.target) in have for n in pg.nodes if n.op in _CALLS)
    except TypeError:       # (a target that does not hash: the matcher asks)
        return True


def add_constant(gm: fx.GraphModule, name: str, value: torch.Tensor, before: fx.Node, path: str = "",
                 derived: tuple | None = None) -> fx.Node:
    """Register `value` as a buffer of gm (a packed or folded weight, int8 weights and scales) and
    read it with a get_attr node inserted before `before`. `derived`: (fn, source get_attr nodes),
    fn(*their tensors) == value, for a tensor a later layer reads as its own weight (a folded or
    stacked one): a released layer is rebuilt from the model with it (meta.DERIVED). A name gm holds gets a
    numbered suffix (names come from a weight's or layer's: one used twice, a Linear on two inputs, gave two
    tensors one name, the second overwriting the first under the first's readers)."""
    stem, i = name, 1
    while hasattr(gm, name):
        name, i = f"{stem}_{i}", i + 1
    gm.register_buffer(name, value)
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    meta.set_tensor_meta(node, value)
    node.meta[meta.PATH] = path
    if derived is not None:
        fn, sources = derived
        node.meta[meta.DERIVED] = (fn, tuple(None if s is None else s.target for s in sources))
    return node


# ---------------------------------------------------------------------------------------------
# rules and the driver

@dataclass
class Replacement:
    """What a rule's build returns: the call that replaces the match (and `absorbed`, further
    nodes it takes over: an epilogue after it, the repeat of a grouped K/V before it). kind ""
    marks a graph simplification that is not a layer of its own (fold_bn): no Rewrite is
    recorded, the call stands for the first matched node and names the others' modules in its
    layer name."""
    target: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    kind: str = ""                  # "linear", "conv2d", "attention", ...
    kernel: str = ""                # label for summaries, e.g. "accelc::linear[gelu]"
    absorbed: list = field(default_factory=list)
    aux: tuple = ()                 # nodes build inserted to feed the call (dropped on revert)


@dataclass(frozen=True)
class Rule:
    pattern: Pattern
    build: Callable[[Match, PassContext], Replacement]
    check: Callable[[Match, PassContext], "str | None"] = lambda m, ctx: None
    applies: Callable[[Match], bool] | None = None
    last_first: bool = False        # visit matches from the end of the graph (conv_gemm)


@dataclass(frozen=True)
class Pass:
    """A named table of rules. `before_rules` runs before them (graph surgery that exposes their
    patterns: attention lowers nn.MultiheadAttention); `transform` after them, for work on the
    layers already made that is not a pattern match (int8)."""
    name: str
    rules: tuple = ()
    before_rules: Callable[[fx.GraphModule, PassContext], None] | None = None
    transform: Callable[[fx.GraphModule, PassContext], int] | None = None


def run_pass(gm: fx.GraphModule, p: Pass, ctx: PassContext) -> int:
    """Run one pass on gm (its graph; gm's code is left to the caller's recompile); returns the number of
    rewrites it made."""
    if p.before_rules is not None:
        p.before_rules(gm, ctx)
        gm.graph.lint()
    count = apply_rules(gm, p.rules, ctx)
    if p.transform is not None:
        count += p.transform(gm, ctx)
    forget_replacements(gm)
    return count


def apply_rules(gm: fx.GraphModule, rules, ctx: PassContext) -> int:
    count = 0
    for rule in rules:
        matches = find(gm, rule.pattern)
        for m in (reversed(matches) if rule.last_first else matches):
            if not m.is_live():
                continue  # taken by an earlier match (its epilogue, its attention)
            if rule.applies is not None and not rule.applies(m):
                continue
            reason = rule.check(m, ctx) or _device_reason(m)
            if reason:
                meta.explain(m.anchor, reason)
                continue
            rep = rule.build(m, ctx)
            # the matched nodes and those the build absorbed (an epilogue after the match, the repeat of a K/V
            # before it), in the order the graph runs them (replace_group's and extract's order)
            nodes = graph_order.in_graph_order(m.nodes + list(rep.absorbed))
            if rep.kind:
                replace_group(gm, nodes, rep.target, rep.args, rep.kwargs, rep.kind, rep.kernel, rep.aux)
            else:
                _simplify(gm, nodes, rep.target, rep.args, rep.kwargs)
            count += 1
    return count


def _device_reason(m: Match) -> str | None:
    for v in m.inputs.values():
        mv = meta.tensor_meta(v)
        if mv is not None and not runtime.can_run_on(mv.device):
            return runtime.device_reason(mv.device)
    return None


def _simplify(gm, nodes, target, args, kwargs) -> fx.Node:
    """`nodes` -> one call standing for the first of them (its module path and class; the
    others' module paths recorded as absorbed, for the layer name), valued as the last."""
    g = gm.graph
    first, last = nodes[0], nodes[-1]
    with g.inserting_before(last):
        new = g.call_function(target, args, kwargs)
    new.meta.update(first.meta)
    new.meta[meta.VALUE] = last.meta.get(meta.VALUE)
    new.meta[meta.ABSORBED] = first.meta.get(meta.ABSORBED, []) + [meta.path(n) for n in nodes[1:]]
    replace_uses(gm, last, new)
    for n in reversed(nodes):
        if not n.users:
            g.erase_node(n)
    return new


# ---------------------------------------------------------------------------------------------
# layers: replacing, moving to another kernel, reverting

def replace_group(gm: fx.GraphModule, nodes: list, target, args: tuple, kwargs: dict,
                  kind: str, kernel: str, aux: tuple = ()) -> fx.Node:
    """Replace `nodes` (graph order; only the last may be read from outside) with one call of
    `target`, inserted where the last one was. `aux`: nodes the pass inserted to feed the op,
    removed again if the layer is reverted. Returns the new node."""
    g = gm.graph
    original, inputs = extract(gm, nodes)
    last = nodes[-1]
    with g.inserting_before(last):
        new = g.call_function(target, args, kwargs)
    new.meta.update({k: v for k, v in last.meta.items() if k in (meta.VALUE, "val", "tensor_meta")})
    new.meta[meta.PATH] = meta.path(nodes[0])
    register_layer(gm, new, Rewrite(layer=unique_name(gm, layer_name(nodes)), kind=kind, kernel=kernel,
                               original=original, inputs=inputs, aux=list(aux)))
    replace_uses(gm, last, new)
    for n in reversed(nodes):
        if not n.users:
            g.erase_node(n)
    return new


def restack(gm: fx.GraphModule, node: fx.Node, target, args: tuple, kwargs: dict, kind: str, kernel: str,
            aux: list = (), note: str = "", weight_bytes: tuple = ()) -> fx.Node:
    """Move a rewritten layer to another call (int8): same layer, same original; the call it had
    becomes its Fallback."""
    rw: Rewrite = node.meta[meta.REWRITE]
    fallback = Fallback(node.target, node.args, dict(node.kwargs), rw.kind, rw.kernel, rw.aux)
    return swap_call(gm, node, target, args, kwargs, Rewrite(
        layer=rw.layer, kind=kind, kernel=kernel, original=rw.original, inputs=rw.inputs,
        aux=rw.aux + list(aux), fallback=fallback, note=note, weight_bytes=weight_bytes))


def demote(gm: fx.GraphModule, node: fx.Node, note: str) -> fx.Node:
    """Put a layer's Fallback call back in place of `node`."""
    rw: Rewrite = node.meta[meta.REWRITE]
    fb = rw.fallback
    new = swap_call(gm, node, fb.target, fb.args, fb.kwargs, Rewrite(
        layer=rw.layer, kind=fb.kind, kernel=fb.kernel, original=rw.original, inputs=rw.inputs, aux=fb.aux,
        note=note))
    _drop_unused(gm, [a for a in rw.aux if a not in fb.aux])
    return new


def swap_call(gm, node, target, args, kwargs, rw: Rewrite) -> fx.Node:
    g = gm.graph
    with g.inserting_before(node):
        new = g.call_function(target, args, kwargs)
    new.meta.update({k: v for k, v in node.meta.items() if k != meta.REWRITE})
    register_layer(gm, new, rw)
    replace_uses(gm, node, new)
    g.erase_node(node)
    return new


def revert(gm: fx.GraphModule, node: fx.Node, reason: str, status: str = "reverted") -> None:
    """Put the original nodes of a rewritten layer back in place of `node`; they carry
    meta[REVERTED] = (the layer's Rewrite, reason, status): "reverted" (its numbers failed) or
    "kept" (PyTorch was the faster)."""
    rw: Rewrite = node.meta[meta.REWRITE]
    g = gm.graph
    with g.inserting_before(node):
        result, copied = inline(g, rw.original, rw.inputs)
    for n in copied:
        n.meta[meta.REVERTED] = (rw, reason, status)
    replace_uses(gm, node, result)
    g.erase_node(node)
    _drop_unused(gm, rw.aux)


def inline(g: fx.Graph, sub: fx.GraphModule, args) -> tuple[object, list]:
    """sub's nodes copied into g (at its insertion point), its placeholders taking `args` in order: (the value
    it returns, the nodes copied). A layer's original put back (revert), or composed into another's."""
    env, it, copied = {}, iter(args), []
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(it)
        elif n.op == "output":
            return fx.map_arg(n.args[0], env.__getitem__), copied
        else:
            env[n] = g.get_attr(n.target) if n.op == "get_attr" else g.node_copy(n, env.__getitem__)
            env[n].meta.update(n.meta)
            copied.append(env[n])
    raise ValueError("a layer's original without an output")


def _drop_unused(gm: fx.GraphModule, aux: list) -> None:
    g = gm.graph
    for a in aux:
        if a.users or getattr(a, "_erased", False):
            continue
        g.erase_node(a)
        # a tensor the pass registered on the graph module's root (a packed weight): drop it
        # once nothing reads it, or it is saved and exported with the model for nothing
        if a.op == "get_attr" and "." not in a.target and not any(
                n.op == "get_attr" and n.target == a.target for n in g.nodes):
            delattr(gm, a.target)


def replace_uses(gm: fx.GraphModule, old: fx.Node, new: fx.Node) -> None:
    """old.replace_all_uses_with(new), also in the input lists of rewritten layers; the
    replacement is remembered so that pending matches resolve their inputs (Match.input). That
    memory is scratch for one pass: forget_replacements ends it."""
    old.replace_all_uses_with(new)
    gm.meta.setdefault(meta.REPLACED, {})[old] = new
    readers = _readers(gm)
    for rw in readers.pop(old, ()):   # the layers reading `old`, found in the index, not by a walk of the graph
        rw.inputs = [new if i is old else i for i in rw.inputs]
        if rw.fallback is not None:
            rw.fallback.args = tuple(new if a is old else a for a in rw.fallback.args)
            rw.fallback.kwargs = {k: new if v is old else v for k, v in rw.fallback.kwargs.items()}
        readers.setdefault(new, []).append(rw)


def _readers(gm: fx.GraphModule) -> dict:
    """{node: the Rewrites whose inputs or fallback call read it}: replace_uses' index, made from the graph
    at its first use in a pass (a walk of every node at each replacement made a pass quadratic in the
    graph's size) and kept up to date by register_layer."""
    index = gm.meta.get(_READERS)
    if index is None:
        index = gm.meta[_READERS] = {}
        for n in gm.graph.nodes:
            rw = meta.rewrite_of(n)
            if rw is not None:
                _index(index, rw)
    return index


def _index(index: dict, rw: Rewrite) -> None:
    fb = rw.fallback
    read = list(rw.inputs) + ([*fb.args, *fb.kwargs.values()] if fb is not None else [])
    for n in dict.fromkeys(a for a in read if isinstance(a, fx.Node)):
        index.setdefault(n, []).append(rw)


def register_layer(gm: fx.GraphModule, node: fx.Node, rw: Rewrite) -> None:
    """node becomes rw's call: in the index of replace_uses and the names taken (unique_name)."""
    node.meta[meta.REWRITE] = rw
    if _READERS in gm.meta:
        _index(gm.meta[_READERS], rw)
    if _NAMES in gm.meta:
        gm.meta[_NAMES].add(rw.layer)


def forget_replacements(gm: fx.GraphModule) -> None:
    """Drop the replacement memory of replace_uses (it holds erased nodes) once no match from
    before the replacements is pending: after each pass, and after the guard's reverts; and the
    indexes a pass keeps (rebuilt from the graph at their next use)."""
    for key in (meta.REPLACED, _READERS, _NAMES):
        gm.meta.pop(key, None)


def layers(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that call an accelc op for a layer, in graph order."""
    return [n for n in gm.graph.nodes if meta.rewrite_of(n) is not None]


def extract(gm: fx.GraphModule, nodes: list) -> tuple[fx.GraphModule, list]:
    """`nodes` as a GraphModule of their own; its placeholders stand for the outside nodes that
    feed them (get_attr inputs become get_attr of the same parameters)."""
    inside = set(nodes)
    g = fx.Graph()
    env, inputs = {}, []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside or a in env:
                continue
            if a.op == "get_attr":
                env[a] = g.get_attr(a.target)
            else:
                env[a] = g.placeholder(f"in{len(inputs)}")
                inputs.append(a)
            env[a].meta.update(a.meta)
        env[n] = g.node_copy(n, env.__getitem__)
        env[n].meta.update(n.meta)
    g.output(env[nodes[-1]])
    return fx.GraphModule(gm, g, class_name="OriginalLayer"), inputs


# ---------------------------------------------------------------------------------------------
# layer names

def layer_name(nodes: list) -> str:
    """The anchor's module path, then '+' and each further node's module (relative to the
    anchor's parent) or, for functional ops written in the parent's forward, its op name:
    blocks.0.fc1+gelu, layer1.0.conv1+bn1+relu. Nodes of the anchor's own module add nothing."""
    compute = [n for n in nodes if n.op not in ("get_attr", "placeholder")]
    anchor_path = meta.path(compute[0])
    parent = anchor_path.rpartition(".")[0]
    labels = [anchor_path or meta.op_name(compute[0])]
    for n in compute:
        for p in n.meta.get(meta.ABSORBED, []):  # e.g. a batch norm folded into this conv
            labels.append(p[len(parent) + 1:] if parent and p.startswith(parent + ".") else p)
    for n in compute[1:]:
        p = meta.path(n)
        if p == anchor_path and anchor_path:
            continue  # more of the anchor's own module: blocks.0.attn's softmax is blocks.0.attn
        if p and not anchor_path.startswith(p + ".") and p != parent:
            label = p[len(parent) + 1:] if parent and p.startswith(parent + ".") else p
        else:
            label = meta.op_name(n)
        if label not in labels:
            labels.append(label)
    return "+".join(labels)


def unique_name(gm: fx.GraphModule, name: str) -> str:
    taken = gm.meta.get(_NAMES)
    if taken is None:
        taken = gm.meta[_NAMES] = {n.meta[meta.REWRITE].layer for n in layers(gm)}
    if name not in taken:
        return name
    i = 2
    while f"{name}#{i}" in taken:
        i += 1
    return f"{name}#{i}"
