"""norm_linear: an RMSNorm read only by one linear or gated layer, taken into that layer as the norm before its
projection (accelc::linear / gated_linear, and their weight-only int8 / fp8 forms, with norm_weight and norm_eps).

A decoder block's two norms (Llama, Mistral, Qwen: `input_layernorm` before q / k / v, `post_attention_layernorm`
before the gated MLP) each feed one projection. In a decode step each was a kernel of its own between two GEMVs:
here gemv_kernel multiplies each x value by its norm weight as it loads it and sums the squares in the same K
loop, scaling the products by rsqrt(mean + eps) at the end, and the norm's kernel and its launch are gone. Rows
past gemv_kernel's (a prompt) run the norm kernel and the GEMM, as before (kernels/gemm.py: normed_rows).

The norm is found as the norms pass leaves it: written out (HF's `w * (h * rsqrt(h.pow(2).mean(-1) + eps))
.to(dtype)`, under Inductor glue), as F.rms_norm, or as its accelc::rms_norm layer (eager glue), with a constant
weight (or none) and no residual add of its own: a weight of another dtype (Gemma's `1 + w.float()`, which
fold_weights computes), or one computed from one parameter by casts and arithmetic with numbers (where that pass
is off), is computed once here in x's dtype, a constant of the new layer's own. The new layer's original is the
norm's nodes (and those computing its weight from the parameter) and the projection's original together, which the
guard checks and races as one layer (reverted, both go back).

Runs last, on the layers the passes before left: float ones, those with one-byte weights and float activations
(weight-only int8 / fp8: the same gemv_kernel), and fp8 weights and activations (kernels/fp8_gemm.py: the rows'
quantization normalizes each row in the same read, at any row count); W8A8 int8 keeps its norm. A float layer
of more than NORM_IN_MOST_WEIGHTS weight elements keeps its norm apart (said in its note).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import fx

from accelc import meta
from accelc.graph_order import in_graph_order
from accelc.capture import erase_dead
from accelc.meta import attr_value
from accelc.passes.norms import RMS_NORM, computes_rms_norm, written_rms_norm
from accelc.records import Fallback, Rewrite
from accelc.rewrite import (Pass, add_constant, extract, inline, layers, register_layer, replace_uses,
                            unique_name)

LINEAR = torch.ops.accelc.linear.default
GATED = torch.ops.accelc.gated_linear.default
# the layers that take a norm: float, and one-byte weights with float activations (the same gemv_kernel), and fp8
# weights and activations (the rows' quantization normalizes them first); W8A8 int8 keeps its norm
TAKES_NORM = (LINEAR, GATED, torch.ops.accelc.linear_w8a16.default, torch.ops.accelc.gated_linear_w8a16.default,
              torch.ops.accelc.linear_fp8w.default, torch.ops.accelc.gated_linear_fp8w.default,
              # fp8 weights and activations: the norm in the rows' quantization kernel, at every row count
              torch.ops.accelc.linear_fp8.default, torch.ops.accelc.gated_linear_fp8.default)
NOTE = "the RMSNorm before it taken in: a decode step's rows normalized in the GEMV's K loop, no kernel of its own"
# the float layers: the norm in gemv_kernel's one-row K loop costs work at every weight element (each x value times
# its norm weight), its own kernel a few microseconds once. bench/fp8.py --norm times both: with the squares summed
# once a block, taken in paid 1.3x at a 4096 x 6144 weight and tied (1.00x) at 4096 x 28672 in fp16, where one-byte
# weights (int8 / fp8, half the bytes a weight element for the same work) still gained 1.04-1.10x: above this many
# elements a float layer's norm stays apart, a weight-only layer's is taken in at any size.
NORM_IN_MOST_WEIGHTS = 32 * 2**20
FLOAT_LAYERS = (LINEAR, GATED)
# fp8 weights and activations take the norm in the rows' quantization, once a row: at any size
QUANTIZED_ROWS = (torch.ops.accelc.linear_fp8.default, torch.ops.accelc.gated_linear_fp8.default)


def norm_of(x: fx.Node):
    """(the norm's input, its weight node or None, eps, the nodes that compute it or None, its rewritten layer or
    None) where `x` is an RMSNorm's output (see the module docstring), else None."""
    if x.op != "call_function":
        return None
    if x.target is RMS_NORM and meta.rewrite_of(x) is not None:       # its layer under eager glue
        h, weight, residual, eps = (list(x.args) + [None, None, 1e-6])[:4]
        eps = x.kwargs.get("eps", eps)
        return None if residual is not None or x.kwargs.get("residual") is not None else (h, weight, eps, None, x)
    if x.target is F.rms_norm:
        h, _, weight, eps = (list(x.args) + [None, None])[:4]
        return h, weight, eps, [x], None
    rsqrts = [n for n in _ancestors(x, 8) if meta.op_name(n) == "rsqrt"]
    for r in rsqrts:
        found = written_rms_norm(r)
        if found is not None and found[3] is x and computes_rms_norm(*found):
            h, weight, eps, out, chain = found
            return h, weight, eps, list(chain), None
    return None


def _ancestors(n: fx.Node, depth: int) -> list:
    seen, frontier = [], [n]
    for _ in range(depth):
        frontier = [a for f in frontier for a in f.all_input_nodes if a not in seen]
        seen += frontier
    return seen


def _why_not(gm, n: fx.Node, found) -> str | None:
    h, weight, eps, _, _ = found
    x = n.args[0]
    read = [a for a in (*n.args, *n.kwargs.values()) if a is x]
    if len(x.users) != 1 or len(read) != 1:       # (the layer's own residual is another reader)
        return "its input's RMSNorm has other readers"
    if not isinstance(eps, (int, float)):
        return "its input's RMSNorm has no constant eps"
    dtype = meta.tensor_meta(h).dtype if meta.tensor_meta(h) is not None else None
    if dtype is None or dtype != meta.tensor_meta(x).dtype:
        return "its input's RMSNorm changes the dtype"
    if weight is not None and weight.op != "get_attr" and weight_steps(weight) is None:
        return "its input's RMSNorm weight is computed other than from one parameter by casts and numbers"
    if weight is not None and weight.op == "get_attr" and not attr_value(gm, weight).is_floating_point():
        return "its input's RMSNorm weight is not floating-point"
    w = meta.tensor_meta(n.args[1]) if isinstance(n.args[1], fx.Node) else None
    elements = math.prod(w.shape) if w is not None else 0
    if n.target in FLOAT_LAYERS and elements > NORM_IN_MOST_WEIGHTS:
        return (f"a weight of {elements:,} elements: the norm's own kernel costs less than its work at every weight "
                "element of the GEMV")
    return None


_CASTS = {"_to_copy", "to", "float", "half", "bfloat16", "type", "convert_element_type"}
_ARITH = {"add": "add", "sub": "sub", "rsub": "rsub", "mul": "mul", "div": "div", "truediv": "div"}
_NUMBER_FIRST = {"add": "add", "mul": "mul", "sub": "rsub", "rsub": "sub", "div": "rdiv"}
_CAST_KWARGS = {"dtype", "device", "layout", "copy", "non_blocking", "memory_format"}


def weight_steps(weight: fx.Node):
    """(the parameter's get_attr node, the steps from it to `weight`, the nodes that take them) where `weight` is
    one parameter through dtype casts and arithmetic with numbers, each node read once (Gemma's norm weight,
    `1 + w.float()`); None otherwise. A step: ("cast", dtype), or (op, number) with op in add / sub / rsub (the
    number less the tensor) / mul / div / rdiv (the number over the tensor)."""
    steps, nodes, n = [], [], weight
    while isinstance(n, fx.Node) and n.op != "get_attr":
        m, name = meta.tensor_meta(n), meta.op_name(n)
        tensors = [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, fx.Node)]
        if n.op not in ("call_function", "call_method") or len(n.users) != 1 or len(tensors) != 1 or m is None:
            return None
        numbers = [a for a in n.args if a is not tensors[0]]
        if name in _CASTS and set(n.kwargs) <= _CAST_KWARGS:
            steps.append(("cast", m.dtype))
        elif name in _ARITH and not n.kwargs and len(numbers) == 1 and isinstance(numbers[0], (int, float)) \
                and not isinstance(numbers[0], bool):
            op = _ARITH[name]
            steps.append((op if n.args[0] is tensors[0] else _NUMBER_FIRST[op], numbers[0]))
        else:
            return None
        nodes.append(n)
        n = tensors[0]
    if not isinstance(n, fx.Node) or not nodes:
        return None
    return n, tuple(reversed(steps)), nodes


def apply_steps(steps: tuple, dtype: torch.dtype, w: torch.Tensor) -> torch.Tensor:
    """weight_steps' steps on the parameter `w`, the result in `dtype`."""
    ops = {"add": lambda t, c: t + c, "sub": lambda t, c: t - c, "rsub": lambda t, c: c - t,
           "mul": lambda t, c: t * c, "div": lambda t, c: t / c, "rdiv": lambda t, c: c / t}
    for op, c in steps:
        w = w.to(c) if op == "cast" else ops[op](w, c)
    return w.to(dtype)


def _composed(gm, norm_part, rw: Rewrite, link: fx.Node, computing: list = ()) -> tuple[fx.GraphModule, list]:
    """The original of the norm and the projection as one layer: norm_part (the norm's nodes, or its rewritten
    layer's Rewrite) then rw's original, its input `link` (the norm's output) taken from the first part; with a
    rewritten norm whose weight `computing` computes (weight_steps' nodes, the weight first), that too."""
    g, inputs, holders = fx.Graph(), [], {}

    def holder(node):
        if node not in holders:
            holders[node] = g.placeholder(f"in{len(inputs)}")
            holders[node].meta.update(node.meta)
            inputs.append(node)
        return holders[node]
    if isinstance(norm_part, Rewrite):
        first, first_inputs = norm_part.original, norm_part.inputs
    else:       # (extract takes its nodes in graph order)
        first, first_inputs = extract(gm, in_graph_order(norm_part))
    # (placeholders first: the graph reads its inputs before any node)
    weight = computing[0] if computing and isinstance(norm_part, Rewrite) else None
    args = [None if i is weight else holder(i) for i in first_inputs]
    rest = [holder(i) for i in rw.inputs if i is not link]
    if weight is not None:      # (its nodes read the parameter only: no placeholder)
        value, _ = inline(g, extract(gm, in_graph_order(computing))[0], [])
        args = [value if a is None else a for a in args]
    normed, _ = inline(g, first, args)
    it = iter(rest)
    out, _ = inline(g, rw.original, [normed if i is link else next(it) for i in rw.inputs])
    g.output(out)
    return fx.GraphModule(gm, g, class_name="OriginalLayer"), inputs


def _take(gm, n: fx.Node, found) -> fx.Node:
    h, weight, eps, chain, norm_layer = found
    rw, x = meta.rewrite_of(n), n.args[0]
    aux, computing, dtype = list(rw.aux), [], meta.tensor_meta(h).dtype
    if weight is not None and (weight.op != "get_attr" or attr_value(gm, weight).dtype != dtype):
        # computed from one parameter, or of another dtype (Gemma's `1 + w.float()`, computed by fold_weights):
        # once, here, in x's dtype
        source, steps, computing = weight_steps(weight) if weight.op != "get_attr" else (weight, (), [])
        if norm_layer is None:      # (the layer's original computes it from the parameter, as before)
            chain = list(chain) + computing
        with torch.no_grad():
            value = apply_steps(steps, dtype, attr_value(gm, source))
        weight = add_constant(gm, rw.layer.replace(".", "_").replace("+", "_") + "_norm_weight", value, before=n,
                              path=meta.path(source))
        aux.append(weight)
    norm_part = meta.rewrite_of(norm_layer) if norm_layer is not None else chain
    original, inputs = _composed(gm, norm_part, rw, x, computing)
    if weight is None:
        k = meta.tensor_meta(h).shape[-1]
        weight = add_constant(gm, rw.layer.replace(".", "_").replace("+", "_") + "_norm_ones",
                              torch.ones(k, dtype=meta.tensor_meta(h).dtype), before=n)
        aux.append(weight)
    g = gm.graph
    with g.inserting_before(n):
        new = g.call_function(n.target, (h, *n.args[1:]), {**n.kwargs, "norm_weight": weight, "norm_eps": float(eps)})
    new.meta.update({k: v for k, v in n.meta.items() if k != meta.REWRITE})
    norm_name = norm_layer is not None and meta.rewrite_of(norm_layer).layer or meta.path(x) or "rms_norm"
    fb = rw.fallback      # (a one-byte weight's float call: takes the norm the same way)
    if fb is not None:
        fb = Fallback(fb.target, (h, *fb.args[1:]), {**fb.kwargs, "norm_weight": weight, "norm_eps": float(eps)},
                      fb.kind, _taken(fb.kernel), fb.aux)
    register_layer(gm, new, Rewrite(
        layer=unique_name(gm, _joined(norm_name, rw.layer)), kind=rw.kind, kernel=_taken(rw.kernel),
        original=original, inputs=inputs, aux=aux, fallback=fb, note=_note(rw.note), weight_bytes=rw.weight_bytes))
    replace_uses(gm, n, new)
    g.erase_node(n)
    erase_dead([norm_layer, *computing] if norm_layer is not None else chain)
    return new


def _taken(kernel: str) -> str:
    return kernel.replace("accelc::", "accelc::rms_norm+", 1)


def _note(note: str) -> str:
    return f"{note}; {NOTE}" if note else NOTE


def _joined(norm: str, layer: str) -> str:
    """The fused layer's name: the norm's, then the projection's past their common parent module
    (blocks.0.norm1+attn.qkv, not blocks.0.norm1+blocks.0.attn.qkv)."""
    parent = norm.rpartition(".")[0]
    return f"{norm}+{layer[len(parent) + 1:] if parent and layer.startswith(parent + '.') else layer}"


def _transform(gm: fx.GraphModule, ctx) -> int:
    count = 0
    for n in [n for n in layers(gm) if n.target in TAKES_NORM]:
        if n.kwargs.get("norm_eps") is not None or not isinstance(n.args[0], fx.Node):
            continue
        found = norm_of(n.args[0])
        if found is None:
            continue
        reason = _why_not(gm, n, found)
        if reason:
            meta.explain(n, f"norm not taken in: {reason}")
            continue
        _take(gm, n, found)
        count += 1
    return count


PASS = Pass("norm_linear", transform=_transform)
