"""sibling_linears: Linear layers that read the same input and whose outputs are only reshaped
(attention's q, k and v projections: BERT, Llama, T5) become one Linear over their stacked
weights, each output a slice of its result. One GEMM instead of two or three: one launch, one
pass over the input, and a grid N times wider (BERT-base's 3072 x 768 x 768 projections are too
small to fill an H100 alone). ONNX Runtime's attention fusion and TensorRT do the same.

A simplification, not a layer: the fused F.linear stands for the first projection and records
the others' module paths (meta.ABSORBED), so linear_act makes one layer of it, named
`...self.query+key+value`, which the guard then checks and races like any other.

Only projections whose every user is a reshape (view / reshape / _unsafe_view) are taken: an
activation or residual add after one of them is an epilogue linear_act fuses into that GEMM,
worth more than the stacking. The slices are strided views of the fused output, so the views
downstream of them (through transposes and other view ops) become reshapes: the same values,
and no error where a view of the strided slice is impossible. Runs after gated_mlp (which takes
a gated MLP's gate and up projections, siblings too, into its own kernel) and before linear_act.
The stacked weight is a new buffer of the graph; the projections' own weights leave the graph.
"""
from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch import fx

from accelc import meta
from accelc.capture import VIEW_OPS, reshape_of
from accelc.meta import attr_value
from accelc.rewrite import Pass, add_constant, replace_uses

aten = torch.ops.aten


def _projection(n: fx.Node):
    """(input, weight get_attr, bias get_attr or None) of a Linear this pass may stack, else None."""
    if n.op != "call_function" or n.target is not F.linear or n.kwargs or len(n.args) not in (2, 3):
        return None
    x, w = n.args[:2]
    b = n.args[2] if len(n.args) == 3 else None
    if not isinstance(x, fx.Node) or not _param(w) or not (b is None or _param(b)):
        return None
    if not n.users or not all(reshape_of(u) is n for u in n.users):
        return None
    wm = meta.tensor_meta(w)
    if wm is None or len(wm.shape) != 2 or meta.tensor_meta(n) is None:
        return None
    return x, w, b


def _param(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "get_attr"


def _groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Stackable projections by (input, in_features, dtype, device, has bias), 2 or more each."""
    by = collections.defaultdict(list)
    for n in gm.graph.nodes:
        p = _projection(n)
        if p is None:
            continue
        x, w, b = p
        wm = meta.tensor_meta(w)
        bm = meta.tensor_meta(b) if b is not None else None
        if b is not None and (bm is None or bm.dtype != wm.dtype or bm.device != wm.device):
            continue
        by[(x, wm.shape[1], wm.dtype, wm.device, b is not None)].append(n)
    return [g for g in by.values() if len(g) >= 2]


def _views_to_reshapes(start: fx.Node) -> None:
    """Every `view` reached from `start` through view ops (capture.VIEW_OPS) becomes a reshape
    (same values; a view of a strided slice can be impossible where one of the contiguous output
    was not). A view to another dtype stays."""
    todo, seen = list(start.users), set()
    while todo:
        n = todo.pop()
        if n in seen or n.op not in ("call_method", "call_function") or meta.op_name(n) not in VIEW_OPS:
            continue
        seen.add(n)
        if meta.op_name(n) in ("view", "_unsafe_view") and not any(isinstance(a, torch.dtype) for a in n.args[1:]):
            if n.op == "call_method":
                n.target = "reshape"
            else:
                n.target = aten.reshape.default if isinstance(n.target, torch._ops.OpOverload) else torch.reshape
        todo.extend(n.users)


def _cat(*tensors):
    """The stacked tensor from its parts (meta.DERIVED)."""
    return torch.cat([t.detach() for t in tensors]).contiguous()


def _stack(gm: fx.GraphModule, group: list[fx.Node]) -> None:
    g = gm.graph
    first = group[0]           # graph order: the fused GEMM goes where the first projection was
    x = first.args[0]
    weights = [n.args[1] for n in group]
    biases = [n.args[2] if len(n.args) == 3 else None for n in group]
    widths = [meta.tensor_meta(w).shape[0] for w in weights]
    stem = weights[0].target.replace(".", "_") + "_accelc_stacked"
    with torch.no_grad():
        w_cat = torch.cat([attr_value(gm, w).detach() for w in weights]).contiguous()
        b_cat = torch.cat([attr_value(gm, b).detach() for b in biases]).contiguous() if biases[0] is not None else None
    w_node = add_constant(gm, stem, w_cat, before=first, path=meta.path(weights[0]), derived=(_cat, weights))
    b_node = add_constant(gm, stem + "_bias", b_cat, before=first, path=meta.path(biases[0]),
                          derived=(_cat, biases)) if b_cat is not None else None
    args = (x, w_node, b_node)
    with g.inserting_before(first):
        fused = g.call_function(F.linear, args)
    fused.meta.update({k: v for k, v in first.meta.items() if k not in ("val", "tensor_meta", "example_value")})
    out_meta = meta.tensor_meta(first)
    fused.meta[meta.VALUE] = meta.TensorMeta(out_meta.shape[:-1] + (sum(widths),), out_meta.dtype, out_meta.device)
    fused.meta[meta.ABSORBED] = first.meta.get(meta.ABSORBED, []) + [meta.path(n) for n in group[1:]]
    offset = 0
    for n, width in zip(group, widths):
        with g.inserting_before(first):
            part = g.call_function(torch.narrow, (fused, -1, offset, width))
        offset += width
        part.meta[meta.PATH] = meta.path(n)
        part.meta[meta.VALUE] = meta.TensorMeta(meta.tensor_meta(n).shape, out_meta.dtype, out_meta.device,
                                                contiguous=False)
        replace_uses(gm, n, part)
        _views_to_reshapes(part)
    for n in group:
        g.erase_node(n)
    for p in weights + [b for b in biases if b is not None]:
        if not p.users and not getattr(p, "_erased", False):
            g.erase_node(p)


def _transform(gm: fx.GraphModule, ctx) -> int:
    groups = _groups(gm)
    for group in groups:
        _stack(gm, group)
    return len(groups)


PASS = Pass("sibling_linears", transform=_transform)
