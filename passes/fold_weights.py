"""fold_weights: what the graph computes from the module's weights alone, computed once here and read as a constant.

A weight-norm parametrization (`torch.nn.utils.parametrizations.weight_norm`: `_weight_norm(v, g)` before each call
of its conv or linear), Gemma's norm weight `1 + w.float()`, a scale taken from a buffer: torch.export writes
each as ops on the parameters, run at every call. A conv whose weight is computed was left to PyTorch ("weight
computed at run time"), and a linear read its weight from that computation each call. Here each such value is
computed once from the weights (in their dtype, as the graph would), and the graph reads it as a buffer of its own;
the passes after this one see a weight they can pack. A layer whose weights were released recomputes it from the
model (meta.DERIVED).

Folded: a node whose inputs are all the graph's parameters or buffers (not one the graph writes in place) or nodes
folded so, through the ops named below, where the value a node outside reads took at least one computing op (not
views and casts alone: a kernel reads those as they are, and a copy would double the weight's memory). Not folded:
ops that make tensors from nothing (no inputs), anything reading a graph input or a size, and values that are not
floating-point tensors, and tensor subclasses (a tensor-parallel program's DTensors).
"""
from __future__ import annotations

import functools

import torch
from torch import fx
from torch.nn.utils import parametrize

from accelc import meta
from accelc.graph_order import in_graph_order
from accelc.capture import erase_dead
from accelc.capture.contract import mutated_state
from accelc.meta import attr_value
from accelc.rewrite import Pass, add_constant, replace_uses

# what a weight's reparametrization computes with
COMPUTING = {"_weight_norm", "_weight_norm_interface", "norm", "linalg_vector_norm", "add", "sub", "rsub", "mul",
             "div", "truediv", "pow", "sqrt", "rsqrt", "neg", "reciprocal", "exp", "abs", "clamp", "clamp_min",
             "clamp_max", "sum", "mean", "square", "softplus", "sigmoid", "tanh"}
# what carries a value along (folded only inside a computed one)
CARRYING = {"to", "_to_copy", "float", "half", "bfloat16", "type", "convert_element_type", "view", "reshape", "t",
            "transpose", "permute", "unsqueeze", "squeeze", "expand", "contiguous", "clone", "detach", "alias",
            "flatten", "unflatten", "_unsafe_view", "type_as"}


def _parametrized(gm: fx.GraphModule, target: str) -> bool:
    """Whether `target` ("conv.weight") is a parametrized tensor (torch.nn.utils.parametrize), computed at each
    read of the attribute: a symbolic_trace's graph reads a weight-normed module's weight so."""
    path, _, name = target.rpartition(".")
    try:
        owner = gm.get_submodule(path)
    except AttributeError:
        return False
    return parametrize.is_parametrized(owner, name)


def _replay(graph: fx.Graph, *sources):
    """The folded value again from its source tensors (meta.DERIVED: a partial of this is picklable)."""
    with torch.no_grad():
        return fx.GraphModule(torch.nn.Module(), graph)(*sources)


def _subgraph(n: fx.Node, inside: set) -> tuple[fx.Graph, list]:
    """(a graph computing n from placeholders for its source get_attr nodes, those nodes)."""
    order, seen, stack = [], set(), [n]
    while stack:       # n's folded ancestors, then in graph order
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        order.append(x)
        stack.extend(a for a in x.all_input_nodes if a in inside or a.op == "get_attr")   # (a get_attr: a source)
    order = in_graph_order(order)
    g, env, sources = fx.Graph(), {}, []
    for x in order:
        if x.op == "get_attr":
            env[x] = g.placeholder(f"w{len(sources)}")
            sources.append(x)
    for x in order:
        if x.op != "get_attr":
            env[x] = g.node_copy(x, env.__getitem__)
    g.output(env[n])
    return g, sources


def _transform(gm: fx.GraphModule, ctx) -> int:
    written = set(mutated_state(gm))
    const, computed = set(), {}
    for n in gm.graph.nodes:     # what is the weights' alone, by the ops' names: nothing run yet
        if n.op == "get_attr" and n.target not in written:
            v = attr_value(gm, n)
            if type(v) in (torch.Tensor, torch.nn.Parameter):   # (not a subclass: a sharded DTensor stays as it is)
                const.add(n)
                computed[n] = _parametrized(gm, n.target)      # (a parametrized weight: computed at each read)
            continue
        if n.op not in ("call_function", "call_method") or not n.all_input_nodes:
            continue
        name = meta.op_name(n)
        if (name in COMPUTING or name in CARRYING) and all(a in const for a in n.all_input_nodes):
            const.add(n)
            computed[n] = name in COMPUTING or any(computed[a] for a in n.all_input_nodes)
    inside = {n for n in const if n.op != "get_attr" or computed[n]}
    folded = 0
    for n in [n for n in gm.graph.nodes if n in inside]:
        m = meta.tensor_meta(n)
        if not computed[n] or m is None or not m.dtype.is_floating_point or all(u in inside for u in n.users):
            continue
        graph, sources = _subgraph(n, inside)
        try:       # (only what is folded is run: a cast of a large weight read as it is costs no copy here)
            value = _replay(graph, *(attr_value(gm, x) for x in sources))
        except Exception:      # (an op the weights alone cannot run: left to the graph)
            continue
        if not isinstance(value, torch.Tensor) or value.dtype != m.dtype:
            continue
        name = "accelc_folded_" + (meta.path(n) or n.name).replace(".", "_")
        const_node = add_constant(gm, name, value.detach().contiguous(), before=n, path=meta.path(n),
                                  derived=(functools.partial(_replay, graph), sources))
        replace_uses(gm, n, const_node)
        folded += 1
    erase_dead([n for n in reversed(list(gm.graph.nodes)) if n in inside])
    return folded


PASS = Pass("fold_weights", transform=_transform)
