"""Canonical form, part two: the rewrites that need the values' shapes, run after record_meta
(accelc.capture.trace.make_canonical): HF's Conv1D flatten / addmm / view-back -> F.linear; a chunk's
dim counted from the end; shape reads moved past the shape-preserving chain they would split.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from accelc import meta
from accelc.capture.nodes import reshape_of


def settle_shaped(g: fx.Graph) -> bool:
    """Every rewrite of this module on g; returns whether anything changed."""
    return unflatten_addmm(g) | dims_from_end(g) | shape_reads_last(g)


def unflatten_addmm(g: fx.Graph) -> bool:
    """HF's Conv1D (GPT-2, GPT-J's MLPs in some ports): addmm(b, x.view(-1, K), W).view(*lead, N)
    -> F.linear(x, W.t(), b). Eager runs the same kernel either way (F.linear flattens a contiguous
    input into that addmm), and the activation and residual add that follow then meet the GEMM
    directly instead of through the view, so the epilogue takes them. Returns whether it changed g."""
    changed = False
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not torch.addmm or len(n.args) != 3 or n.kwargs:
            continue
        bias, flat, w = n.args
        x, out = reshape_of(flat), meta.sole_user(n)
        if x is None or reshape_of(out) is not n:
            continue
        mx, mw, mo = meta.tensor_meta(x), meta.tensor_meta(w), meta.tensor_meta(out)
        if None in (mx, mw, mo) or len(mx.shape) < 2 or len(mw.shape) != 2 \
                or tuple(mo.shape) != (*mx.shape[:-1], mw.shape[1]):
            continue
        with g.inserting_before(n):
            wt = g.call_function(torch.t, (w,))
            linear = g.call_function(F.linear, (x, wt, bias))
        wt.meta.update(n.meta)
        wt.meta[meta.VALUE] = meta.TensorMeta(tuple(mw.shape[::-1]), mw.dtype, mw.device, contiguous=False)
        linear.meta.update(n.meta)
        linear.meta[meta.VALUE] = mo
        out.replace_all_uses_with(linear)
        g.erase_node(out)
        g.erase_node(n)
        if not flat.users:
            g.erase_node(flat)
        changed = True
    return changed


def dims_from_end(graph: fx.Graph) -> bool:
    """A chunk's dim counted from the end (chunk(2, dim=2) of a 3-D value is chunk(2, -1)), so that
    one pattern matches however the model wrote it; needs the values' shapes (record_meta).
    Returns whether anything changed."""
    changed = False
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch.chunk and isinstance(n.args[2], int) and n.args[2] >= 0:
            value = meta.meta_tensor(n.args[0])
            if value is not None:
                n.args = (n.args[0], n.args[1], n.args[2] - value.dim())
                changed = True
    return changed


_SHAPE_ATTRS = ("ndim", "shape")     # (not dtype / device: a cast in the chain keeps the shape, not the dtype)
_SHAPE_METHODS = ("dim", "size")


def _reads_shape_only(n: fx.Node, of: fx.Node) -> bool:
    """n reads only the rank or shape of `of` (timm's `_assert(x.ndim == 4)`)."""
    if n.op == "call_function" and n.target is getattr:
        return n.args[0] is of and n.args[1] in _SHAPE_ATTRS
    return n.op == "call_method" and n.target in _SHAPE_METHODS and n.args[0] is of


# ops whose output has their input's shape whatever that shape is (per-channel norms, elementwise
# activations, casts): a shape read may move past them
_SAME_SHAPE = {"batch_norm", "layer_norm", "rms_norm", "group_norm", "relu", "relu6", "gelu", "silu", "sigmoid",
               "tanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "mish", "softplus", "dropout", "contiguous",
               "clone", "to", "type_as", "float", "half", "bfloat16", "neg", "abs", "exp", "sqrt", "rsqrt"}


def shape_reads_last(graph: fx.Graph) -> bool:
    """A value read for its shape alone (`x.ndim`, `x.size()`) besides its one real reader is read at
    the end of the chain of shape-preserving single readers that follows it instead (conv -> BN ->
    act: the shape of act's output is the conv's), the shape reads and what uses them moved after
    it: an extra reader of a layer's inside no longer stops the rules from taking the chain (timm's
    BatchNormAct2d asserts the rank of its input, the conv's output). Needs the values' shapes
    (record_meta). Returns whether anything changed."""
    changed = False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.nodes):
        shape_users = [u for u in n.users if _reads_shape_only(u, n)]
        if not shape_users or not isinstance(meta.meta_tensor(n), torch.Tensor):
            continue
        dependents, frontier = set(), list(shape_users)     # what the shape reads feed (a reshape by them...)
        while frontier:
            u = frontier.pop()
            if u not in dependents:
                dependents.add(u)
                frontier.extend(u.users)
        end = n
        while True:
            values = [u for u in end.users if not _reads_shape_only(u, end)]
            if len(values) != 1 or values[0].op not in ("call_function", "call_method", "call_module") \
                    or not values[0].args or values[0].args[0] is not end or values[0] in dependents:
                break
            here, there = meta.meta_tensor(end), meta.meta_tensor(values[0])
            if there is None or here.shape != there.shape or meta.op_name(values[0]) not in _SAME_SHAPE:
                break       # (a linear of as many features out as in keeps the example's shape, not any input's)
            end = values[0]
        if end is n:
            continue
        moving = sorted((u for u in dependents if order[u] < order[end]), key=order.__getitem__)
        for u in shape_users:
            u.replace_input_with(n, end)
        at = end
        for u in moving:
            at.append(u)
            at = u
        order = {x: i for i, x in enumerate(graph.nodes)}
        changed = True
    return changed
