"""What every pass uses: patterns, matching, replacing a node group by one accelc op, undoing it.

A pattern is a small eager function over its inputs (tensors or constants), traced once and put
in canonical form (accelc.capture). Matching uses torch.fx's SubgraphMatcher: a pattern input
matches any node or literal, so constants (eps, scale) are matched and read, never hard-coded.

A rewritten group becomes one call_function node of a torch.ops.accelc op whose meta["accelc"]
is a Rewrite: the layer's name, its kernel, and the original nodes extracted as their own
GraphModule together with the graph nodes that feed it. The guard runs that module as the
layer's eager reference, the report times and exports it, and `revert` inlines it back.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from accelc.capture import canonicalize, tensor_meta


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
        replaced = self.gm.meta.get("accelc_replaced", {})
        while isinstance(value, fx.Node) and value in replaced:
            value = replaced[value]
        return value

    def is_live(self) -> bool:
        """False when an earlier rewrite took one of the matched nodes."""
        replaced = self.gm.meta.get("accelc_replaced", {})
        return not any(n in replaced or n.graph is not self.gm.graph for n in self.nodes)


@dataclass
class Fallback:
    """The float accelc call an int8 layer goes back to when the guard rejects its int8 numbers."""
    target: object
    args: tuple
    kwargs: dict
    kind: str
    kernel: str
    aux: list                    # the Rewrite.aux of the float layer


@dataclass
class Rewrite:
    layer: str                   # e.g. "blocks.0.fc1+gelu"
    kind: str                    # "linear", ...
    kernel: str                  # e.g. "accelc::linear[gelu]"
    original: fx.GraphModule     # the replaced nodes as a module; placeholders <- inputs
    inputs: list = field(default_factory=list)   # main-graph nodes feeding original's placeholders
    aux: list = field(default_factory=list)      # nodes the pass added for the op (e.g. weight.t())
    fallback: Fallback | None = None   # int8 layers: their float call
    note: str = ""               # shown in the summary (why a layer stayed in float, ...)
    weight_bytes: tuple = ()     # int8 layers: (float weight bytes, int8 weight + scale bytes)

    @property
    def quantized(self) -> bool:
        """int8 layers (the ones with a float fallback): judged by SQNR, not the float tolerance."""
        return self.fallback is not None


@functools.lru_cache(maxsize=None)
def _pattern_graph(fn: Callable) -> fx.Graph:
    gm = fx.symbolic_trace(fn)
    canonicalize(gm)
    return gm.graph


def find(gm: fx.GraphModule, pattern: Pattern) -> list[Match]:
    """Non-overlapping matches of `pattern` in gm, in graph order."""
    pg = _pattern_graph(pattern.fn)
    matcher = SubgraphMatcher(pg, match_output=False, match_placeholder=False,
                              remove_overlapping_matches=True, ignore_literals=False)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    matches = []
    for m in matcher.match(gm.graph):
        inputs = {pn.target: m.nodes_map[pn] for pn in pg.nodes if pn.op == "placeholder"}
        nodes = sorted((gn for pn, gn in m.nodes_map.items() if pn.op not in ("placeholder", "output")),
                       key=order.__getitem__)
        matches.append(Match(pattern, gm, inputs, nodes))
    return sorted(matches, key=lambda mt: order[mt.anchor])


def attr_value(gm: fx.GraphModule, node: fx.Node):
    """The parameter / buffer a get_attr node reads ("layer1.0.conv1.weight")."""
    return functools.reduce(getattr, node.target.split("."), gm)


# ---------------------------------------------------------------------------------------------
# fused epilogue: what may follow a GEMM-shaped op and be folded into its kernel

def activation_name(node) -> str | None:
    """The kernels/epilogue.py name of a canonical activation node, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is F.gelu:
        return "gelu_tanh" if node.kwargs.get("approximate") == "tanh" else "gelu"
    return {F.relu: "relu", F.silu: "silu", torch.sigmoid: "sigmoid", torch.tanh: "tanh"}.get(node.target)


@dataclass
class Epilogue:
    nodes: list                  # the absorbed nodes, in order
    activation: str = "none"
    residual: fx.Node | None = None
    residual_first: bool = False


def absorb_epilogue(anchor: fx.Node) -> Epilogue:
    """Walk forward from `anchor` through sole users: an activation, a residual add of a tensor
    of the same shape and dtype, in either order (act(y) + r, or act(y + r))."""
    ep = Epilogue(nodes=[])
    node = anchor

    def sole_user(n):
        return next(iter(n.users)) if len(n.users) == 1 else None

    def residual_of(add, n):
        if not (isinstance(add, fx.Node) and add.op == "call_function" and add.target is operator.add):
            return None
        other = add.args[1] if add.args[0] is n else add.args[0]
        if other is n or not isinstance(other, fx.Node):
            return None
        mo, mn = tensor_meta(other), tensor_meta(n)
        if mo is None or mn is None or (mo.shape, mo.dtype) != (mn.shape, mn.dtype):
            return None
        return other

    user = sole_user(node)
    res = residual_of(user, node)
    if res is not None and activation_name(sole_user(user)) is not None:
        act_node = sole_user(user)
        ep.nodes += [user, act_node]
        ep.residual, ep.residual_first, ep.activation = res, True, activation_name(act_node)
        return ep
    act = activation_name(user)
    if act is not None:
        ep.nodes.append(user)
        ep.activation = act
        node = user
        user = sole_user(node)
    res = residual_of(user, node)
    if res is not None:
        ep.nodes.append(user)
        ep.residual = res
    return ep


def kernel_label(op: str, ep: Epilogue) -> str:
    parts = [] if ep.activation == "none" else [ep.activation]
    if ep.residual is not None:
        parts.insert(0 if ep.residual_first else len(parts), "residual")
    return f"accelc::{op}" + (f"[{'+'.join(parts)}]" if parts else "")


# ---------------------------------------------------------------------------------------------
# replacing and reverting groups

def replace_group(gm: fx.GraphModule, nodes: list, target, args: tuple, kwargs: dict,
                  kind: str, kernel: str, aux: tuple = ()) -> fx.Node:
    """Replace `nodes` (graph order; only the last may be read from outside) with one call of
    `target`, inserted where the last one was. `aux`: nodes the pass inserted to feed the op,
    removed again if the layer is reverted. Returns the new node."""
    g = gm.graph
    original, inputs = _extract(gm, nodes)
    last = nodes[-1]
    with g.inserting_before(last):
        new = g.call_function(target, args, kwargs)
    new.meta.update({k: v for k, v in last.meta.items() if k in ("accelc_meta", "val", "tensor_meta")})
    new.meta["accelc_path"] = nodes[0].meta.get("accelc_path", "")
    new.meta["accelc"] = Rewrite(layer=_unique_name(gm, layer_name(nodes)), kind=kind, kernel=kernel,
                                 original=original, inputs=inputs, aux=list(aux))
    replace_uses(gm, last, new)
    for n in reversed(nodes):
        if not n.users:
            g.erase_node(n)
    return new


def revert(gm: fx.GraphModule, node: fx.Node, reason: str) -> None:
    """Put the original nodes of a rewritten layer back in place of `node`."""
    rw: Rewrite = node.meta["accelc"]
    g = gm.graph
    placeholders = [p for p in rw.original.graph.nodes if p.op == "placeholder"]
    env = dict(zip(placeholders, rw.inputs))
    result = None
    with g.inserting_before(node):
        for n in rw.original.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = env[n.args[0]]
                break
            env[n] = g.get_attr(n.target) if n.op == "get_attr" else g.node_copy(n, env.__getitem__)
            env[n].meta.update(n.meta)
            env[n].meta["accelc_reverted"] = (rw.layer, reason)
    replace_uses(gm, node, result)
    g.erase_node(node)
    _drop_unused(gm, rw.aux)


def demote(gm: fx.GraphModule, node: fx.Node, note: str) -> fx.Node:
    """Put a quantized layer's float accelc call (its Fallback) in place of `node`."""
    rw: Rewrite = node.meta["accelc"]
    fb = rw.fallback
    g = gm.graph
    with g.inserting_before(node):
        new = g.call_function(fb.target, fb.args, fb.kwargs)
    new.meta.update({k: v for k, v in node.meta.items() if k != "accelc"})
    new.meta["accelc"] = Rewrite(layer=rw.layer, kind=fb.kind, kernel=fb.kernel, original=rw.original,
                                 inputs=rw.inputs, aux=fb.aux, note=note)
    replace_uses(gm, node, new)
    g.erase_node(node)
    _drop_unused(gm, [a for a in rw.aux if a not in fb.aux])
    return new


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
    gm.meta.setdefault("accelc_replaced", {})[old] = new
    for n in gm.graph.nodes:
        rw = n.meta.get("accelc")
        if rw is not None:
            rw.inputs = [new if i is old else i for i in rw.inputs]
            if rw.fallback is not None:
                rw.fallback.args = tuple(new if a is old else a for a in rw.fallback.args)
                rw.fallback.kwargs = {k: new if v is old else v for k, v in rw.fallback.kwargs.items()}


def forget_replacements(gm: fx.GraphModule) -> None:
    """Drop the replacement memory of replace_uses (it holds erased nodes) once no match from
    before the replacements is pending: after each pass, and after the guard's reverts."""
    gm.meta.pop("accelc_replaced", None)


def _extract(gm: fx.GraphModule, nodes: list) -> tuple[fx.GraphModule, list]:
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

def op_name(n: fx.Node) -> str:
    if n.op == "call_module":
        return n.target.rpartition(".")[2]
    if n.op == "call_method":
        return str(n.target)
    name = getattr(n.target, "__name__", str(n.target))
    return name.split(".")[0]


def layer_name(nodes: list) -> str:
    """The anchor's module path, then '+' and each further node's module (relative to the
    anchor's parent) or, for functional ops written in the parent's forward, its op name:
    blocks.0.fc1+gelu, layer1.0.conv1+bn1+relu. Nodes of the anchor's own module add nothing."""
    compute = [n for n in nodes if n.op not in ("get_attr", "placeholder")]
    anchor_path = compute[0].meta.get("accelc_path", "")
    parent = anchor_path.rpartition(".")[0]
    labels = [anchor_path or op_name(compute[0])]
    for n in compute:
        for path in n.meta.get("accelc_absorbed", []):  # e.g. a batch norm folded into this conv
            labels.append(path[len(parent) + 1:] if parent and path.startswith(parent + ".") else path)
    for n in compute[1:]:
        path = n.meta.get("accelc_path", "")
        if path == anchor_path and anchor_path:
            continue  # more of the anchor's own module: blocks.0.attn's softmax is blocks.0.attn
        if path and not anchor_path.startswith(path + ".") and path != parent:
            label = path[len(parent) + 1:] if parent and path.startswith(parent + ".") else path
        else:
            label = op_name(n)
        if label not in labels:
            labels.append(label)
    return "+".join(labels)


def _unique_name(gm: fx.GraphModule, name: str) -> str:
    taken = {n.meta["accelc"].layer for n in gm.graph.nodes if "accelc" in n.meta}
    if name not in taken:
        return name
    i = 2
    while f"{name}#{i}" in taken:
        i += 1
    return f"{name}#{i}"
