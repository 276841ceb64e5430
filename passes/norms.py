"""norms: LayerNorm and RMSNorm over the last dim -> torch.ops.accelc.layer_norm / rms_norm
(kernels/layernorm.py), with the residual add before it fused where nothing else reads the sum (a
post-norm block, `LayerNorm(x + sublayer(x))`: BERT, the original Transformer). A pre-norm
stream's add, whose sum is also the next residual, stays PyTorch and the norm alone is rewritten.

RMSNorm as nn.RMSNorm / F.rms_norm (capture's canonical form) or written out as HF's Llama, T5,
Mistral, Qwen write it: `w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)`
with h = x.to(float32) (or x itself in fp32; T5: x * rsqrt(...) with x in half; Gemma: the weight
`1 + w` applied in fp32 before the cast back, `.type_as(x)`: its weight cast to x's dtype), the square as
pow or h * h; the step before the rules folds such a chain into F.rms_norm where its statistics
are taken in fp32 and its result has x's dtype and shape (a half-precision square, which eager
may overflow, stays as written).

Runs after linear_act: an add that a GEMM's epilogue already took (`linear[residual]`) is not
taken again. Only where the glue is eager: Inductor fuses a LayerNorm with the ops around it (a
pre-norm stream's add and its norm become one kernel writing both), and with that glue the
whole models measured no faster with accelc's kernel (BERT-base 4% slower with it, GPT-2 the same,
H100), though the kernel alone is 1.2x-2.3x eager's LayerNorm.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from accelc import meta
from accelc.graph_order import in_graph_order
from accelc.capture import erase_dead
from accelc.capture.written import matches_reference
from accelc.kernels.layernorm import why_unsupported
from accelc.numerics import REL_L2_FLOOR
from accelc.rewrite import Pass, Pattern, Replacement, Rule, replace_uses

LAYER_NORM = torch.ops.accelc.layer_norm.default
RMS_NORM = torch.ops.accelc.rms_norm.default


def _add_layer_norm(x, residual, shape, weight, bias, eps):
    return F.layer_norm(x + residual, shape, weight, bias, eps)


def _layer_norm(x, shape, weight, bias, eps):
    return F.layer_norm(x, shape, weight, bias, eps)


def _add_rms_norm(x, residual, shape, weight, eps):
    return F.rms_norm(x + residual, shape, weight, eps)


def _rms_norm(x, shape, weight, eps):
    return F.rms_norm(x, shape, weight, eps)


def _sum_read_once(m) -> bool:
    """The add's sum feeds only the LayerNorm (else it is needed as it is: not fused)."""
    add = next(n for n in m.nodes if n.target is operator.add)
    return len(add.users) == 1 and all(isinstance(m.input(k), torch.fx.Node) for k in ("x", "residual"))


def _operands(m):
    return [meta.meta_tensor(m.input(k)) if m.input(k, None) is not None else None for k in ("weight", "bias")]


INDUCTOR_GLUE = ("left to the Inductor glue, which fuses it with its neighbours: accelc's kernel, faster than "
                 "eager's LayerNorm alone, made whole models no faster there (BERT-base 2.28 vs 2.19 ms on an H100); "
                 "glue='eager' rewrites it")


def _check(m, ctx) -> str | None:
    if ctx.inductor_glue:
        return INDUCTOR_GLUE
    x = meta.meta_tensor(m.input("x"))
    res = meta.meta_tensor(m.input("residual")) if m.has("residual") else None
    if x is None or (m.has("residual") and res is None):
        return "input shapes unknown"
    w, b = _operands(m)
    if (m.input("weight") is not None and w is None) or (m.input("bias", None) is not None and b is None):
        return "weight shapes unknown"
    if not isinstance(m.input("eps"), (int, float)) and not (m.input("eps") is None and _is_rms(m)):
        return "eps is not a constant"
    shape = _static_shape(m.input("shape"), m.anchor.args[0])
    if shape is None:
        return "normalized_shape is neither constant nor the input's last dim"
    return why_unsupported(x, w, b, res, shape)


def _static_shape(shape, inp):
    """normalized_shape as ints, where it is constants or read off the norm's own input
    (`x.shape[-1:]`, `(x.shape[-1],)`, `(x.size(-1),)`: its last dim, whatever the call's shape);
    None otherwise."""
    def last_dim(n) -> bool:
        if not isinstance(n, torch.fx.Node):
            return False
        if n.op == "call_method" and n.target == "size" and n.args[:1] == (inp,):
            return tuple(n.args[1:]) == (-1,)
        return (n.target is operator.getitem and n.args[1] == -1 and isinstance(n.args[0], torch.fx.Node)
                and _shape_of(n.args[0]) is inp)
    x = meta.tensor_meta(inp)
    if x is None or not x.shape:
        return None
    if isinstance(shape, torch.fx.Node):     # x.shape[-1:]
        if shape.target is operator.getitem and shape.args[1] == slice(-1, None) and _shape_of(shape.args[0]) is inp:
            return (x.shape[-1],)
        return None
    if not isinstance(shape, (tuple, list)):
        return None
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        elif last_dim(d) and len(shape) == 1:
            out.append(x.shape[-1])
        else:
            return None
    return tuple(out)


def _shape_of(n):
    """X for a node reading X.shape (getattr) or X.size() (no argument), else None."""
    if not isinstance(n, torch.fx.Node):
        return None
    if n.op == "call_function" and n.target is getattr and n.args[1] == "shape":
        return n.args[0]
    if n.op == "call_method" and n.target == "size" and len(n.args) == 1:
        return n.args[0]
    return None


def _is_rms(m) -> bool:
    return m.pattern.name.endswith("rms_norm")


def _build(m, ctx) -> Replacement:
    residual = m.input("residual") if m.has("residual") else None
    label = "[residual]" if residual is not None else ""
    if _is_rms(m):
        eps = m.input("eps")
        if eps is None:      # F.rms_norm's default: the dtype's machine epsilon
            eps = torch.finfo(meta.tensor_meta(m.input("x")).dtype).eps
        return Replacement(RMS_NORM, (m.input("x"), m.input("weight"), residual, float(eps)), kind="rms_norm",
                           kernel="accelc::rms_norm" + label)
    args = (m.input("x"), m.input("weight"), m.input("bias"), residual, float(m.input("eps")))
    return Replacement(LAYER_NORM, args, kind="layer_norm", kernel="accelc::layer_norm" + label)


# ---------------------------------------------------------------------------------------------
# RMSNorm written out -> F.rms_norm

_CAST_KWARGS = {"dtype", "copy", "non_blocking"}


def _cast_to(n) -> torch.dtype | None:
    """The dtype a cast node (x.to(dtype), x.float(), aten.to.dtype / _to_copy) converts to, else None."""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        return None
    name = meta.op_name(n)
    if name == "float" and len(n.args) == 1 and not n.kwargs:
        return torch.float32
    if name == "type_as" and len(n.args) == 2 and not n.kwargs:     # (Gemma's output.type_as(x))
        out = meta.tensor_meta(n)
        return out.dtype if out is not None else None
    if name not in ("to", "_to_copy") or set(n.kwargs) - _CAST_KWARGS:
        return None
    def dtype_arg(a):     # a dtype, or one read off a tensor (x.dtype): the cast's output metadata says which
        if isinstance(a, torch.dtype):
            return a
        if isinstance(a, fx.Node) and a.target is getattr and a.args[1] == "dtype":
            out = meta.tensor_meta(n)
            return out.dtype if out is not None else None
        return None
    given = [*n.args[1:], *([n.kwargs["dtype"]] if "dtype" in n.kwargs else [])]
    dtypes = [dtype_arg(a) for a in given if not isinstance(a, bool)]
    return dtypes[0] if len(dtypes) == 1 and dtypes[0] is not None else None


def _uncast(n):
    """The tensor a float32 cast reads (the node itself where it is no cast)."""
    return n.args[0] if _cast_to(n) is torch.float32 else n


def _is(n, name: str, nargs: int) -> bool:
    return (isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and meta.op_name(n) == name
            and len(n.args) == nargs)


def _mean_over_last(v, rank) -> bool:
    args = meta.bound_args(v, ("input", "dim", "keepdim"))
    dim = args.get("dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    return (set(args) <= {"input", "dim", "keepdim"} and args.get("keepdim") is True
            and isinstance(dim, int) and dim in (-1, rank - 1))


def written_rms_norm(r: fx.Node):
    """For an rsqrt node: (x, weight or None, eps, the node whose value is RMSNorm(x), the chain's
    nodes) where it is the rsqrt of an RMSNorm written out in fp32 (see the module docstring);
    None otherwise."""
    if not _is(r, "rsqrt", 1) or r.kwargs or not _is(r.args[0], "add", 2):
        return None
    add = r.args[0]
    nodes = [a for a in add.args if isinstance(a, fx.Node)]
    numbers = [a for a in add.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(nodes) != 1 or len(numbers) != 1 or nodes[0].op not in ("call_function", "call_method") \
            or meta.op_name(nodes[0]) != "mean":
        return None
    v, eps = nodes[0], float(numbers[0])
    p = v.args[0] if v.args else None
    h2 = None
    if _is(p, "pow", 2) and p.args[1] in (2, 2.0) and not p.kwargs:
        h2 = p.args[0]
    elif _is(p, "mul", 2) and p.args[0] is p.args[1] and not p.kwargs:
        h2 = p.args[0]
    hm = meta.tensor_meta(h2) if isinstance(h2, fx.Node) else None
    if hm is None or hm.dtype != torch.float32 or not hm.shape or not _mean_over_last(v, len(hm.shape)):
        return None
    if any(len(n.users) != 1 for n in (add, v, p, r)):
        return None
    x = _uncast(h2)
    out = meta.sole_user(r)
    if not _is(out, "mul", 2) or out.kwargs:
        return None
    h = out.args[1] if out.args[0] is r else out.args[0]
    if _uncast(h) is not x or r not in out.args:
        return None
    chain = [add, v, p, r, out]
    nxt = meta.sole_user(out)
    if _cast_to(nxt) is not None and nxt.args[0] is out:
        out = nxt
        chain.append(out)
        nxt = meta.sole_user(out)
    weight = None
    N = hm.shape[-1]
    if _is(nxt, "mul", 2) and not nxt.kwargs and out in nxt.args and nxt.args[0] is not nxt.args[1]:
        w = nxt.args[1] if nxt.args[0] is out else nxt.args[0]
        wm = meta.tensor_meta(w) if isinstance(w, fx.Node) else None
        if wm is not None and tuple(wm.shape) == (N,):
            weight, out = w, nxt
            chain.append(out)
            nxt = meta.sole_user(out)
            if _cast_to(nxt) is not None and nxt.args[0] is out:    # Gemma: (h * w) in fp32, then the cast
                out = nxt
                chain.append(out)
    xm, om = meta.tensor_meta(x), meta.tensor_meta(out)
    if xm is None or om is None or (tuple(om.shape), om.dtype) != (tuple(xm.shape), xm.dtype):
        return None
    casts = [n for n in dict.fromkeys((h2, h)) if n is not x and isinstance(n, fx.Node)]
    dtype_reads = [a for n in chain + casts for a in n.args if isinstance(a, fx.Node) and a.target is getattr]
    return x, weight, eps, out, chain + casts + dtype_reads


def _cast(g: fx.Graph, n: fx.Node, dtype: torch.dtype) -> fx.Node:
    """n.to(dtype), with its metadata (inserted where the graph's insertion point is)."""
    cast = g.call_method("to", (n, dtype))
    cast.meta.update(n.meta)
    cast.meta.pop(meta.REWRITE, None)
    cast.meta.pop("val", None)       # (export's fake value: of the other dtype)
    m = meta.tensor_meta(n)
    cast.meta[meta.VALUE] = meta.TensorMeta(m.shape, dtype, m.device, m.contiguous)
    return cast


_CONFIRMED = "accelc_rms_norm_confirmed"    # out.meta: computes_rms_norm's verdict on its chain


def computes_rms_norm(x, weight, eps, out, chain) -> bool:
    """The chain's shape matched; confirm what it computes: run on random x (and weight) in their
    dtypes against F.rms_norm's arithmetic (statistics in fp32), within two roundings of x's dtype.
    Once a chain (the verdict kept on its output node: a chain the norms pass leaves written is asked
    again by norm_linear)."""
    if _CONFIRMED not in out.meta:
        out.meta[_CONFIRMED] = _probe_rms_norm(x, weight, eps, out, chain)
    return out.meta[_CONFIRMED]


def _probe_rms_norm(x, weight, eps, out, chain) -> bool:
    nodes = in_graph_order(set(chain))
    if nodes[-1] is not out:
        return False
    inputs = (x,) if weight is None else (x, weight)
    dtypes = tuple(meta.tensor_meta(t).dtype for t in inputs)
    tol = 2 * REL_L2_FLOOR.get(dtypes[0], REL_L2_FLOOR[torch.float32])

    def reference(x, weight=None):
        y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
        return y if weight is None else (weight.to(x.dtype) * y)

    return matches_reference(nodes, inputs, reference, dtypes, rtol=tol, atol=tol)


def fold_written_rms_norms(gm: fx.GraphModule, ctx) -> None:
    """The norms pass's step before its rules: each written-out RMSNorm the kernel can take becomes
    F.rms_norm(x, (N,), weight, eps); under Inductor glue, or where the kernel cannot take it, the
    chain stays as written with the reason."""
    g = gm.graph
    for r in list(g.nodes):
        if r.graph is not g or meta.op_name(r) != "rsqrt":
            continue
        found = written_rms_norm(r)
        if found is None or not computes_rms_norm(*found):
            continue
        x, weight, eps, out, chain = found
        dtype = meta.tensor_meta(x).dtype
        reason = INDUCTOR_GLUE if ctx.inductor_glue else why_unsupported(
            meta.meta_tensor(x), meta.meta_tensor(weight).to(dtype) if weight is not None else None)
        if reason:
            for n in chain:
                meta.explain(n, f"an RMSNorm written out: {reason}")
            continue
        with g.inserting_before(out):
            if weight is not None and meta.tensor_meta(weight).dtype != dtype:   # Gemma's (1 + w) in fp32
                weight = _cast(g, weight, dtype)
            new = g.call_function(F.rms_norm, (x, (meta.tensor_meta(x).shape[-1],), weight, eps))
        new.meta.update(out.meta)
        replace_uses(gm, out, new)      # (also in the inputs of the layers linear_act made)
        erase_dead(chain)


RULES = (
    Rule(Pattern("add+layer_norm", _add_layer_norm), build=_build, check=_check, applies=_sum_read_once),
    Rule(Pattern("layer_norm", _layer_norm), build=_build, check=_check),
    Rule(Pattern("add+rms_norm", _add_rms_norm), build=_build, check=_check, applies=_sum_read_once),
    Rule(Pattern("rms_norm", _rms_norm), build=_build, check=_check),
)
PASS = Pass("norms", RULES, before_rules=fold_written_rms_norms)
