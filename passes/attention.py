"""attention: attention however it is written -> torch.ops.accelc.flash_attention
(kernels/flash_attention.py).

1. nn.MultiheadAttention modules are lowered to what they compute: in-projection (one F.linear
   for self-attention, three otherwise), heads split by views, F.scaled_dot_product_attention,
   heads merged, out-projection. The projections are then the linear pass's; the SDPA call is
   step 2's.
2. F.scaled_dot_product_attention calls (mask, is_causal, scale; dropout_p 0 as in eval).
3. The decomposed form softmax(q @ k^T * scale (+ mask)) @ v, the patterns at the end of this
   file: scale multiplied or divided (a constant, math.sqrt(d) included), or applied to q first,
   or absent; matmul or bmm (3-D q, k, v of batch * heads); the scores as one
   baddbmm(bias, q, k^T, beta, alpha). Eval-mode dropout was removed at capture.
Whatever the kernel cannot take (fp32, head dims outside 16-256 in multiples of 8, other mask
dtypes) stays PyTorch with the reason in the summary.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from accelc import meta
from accelc.kernels.flash_attention import why_unsupported
from accelc.meta import attr_value, tensor_meta
from accelc.rewrite import Pass, Pattern, Replacement, Rule

FLASH = torch.ops.accelc.flash_attention.default


# ---------------------------------------------------------------------------------------------
# 1. nn.MultiheadAttention -> linear + SDPA + linear

def _lower_mha(gm: fx.GraphModule, ctx) -> None:
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(modules.get(node.target), nn.MultiheadAttention):
            reason = _mha_why_not(node, modules[node.target])
            if reason:
                meta.explain(node, reason)
            else:
                _lower_one_mha(gm, node, modules[node.target])


_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
             "average_attn_weights", "is_causal")


def _mha_args(node) -> dict:
    return meta.bound_args(node, _MHA_ARGS)


def _mha_why_not(node, mha: nn.MultiheadAttention) -> str | None:
    a = _mha_args(node)
    if any(u.op != "call_function" or u.target is not operator.getitem for u in node.users):
        return "its output tuple is used as a whole"
    if any(u.args[1] == 1 and u.users for u in node.users):
        return "the attention weights are used (need_weights)"
    if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
        return "separate q/k/v projection weights, bias_k/bias_v or add_zero_attn"
    if a.get("attn_mask") is not None or a.get("is_causal"):
        return "attn_mask / is_causal on nn.MultiheadAttention (key_padding_mask is supported)"
    kpm = a.get("key_padding_mask")
    if kpm is not None and (tensor_meta(kpm) is None or len(tensor_meta(kpm).shape) != 2):
        return "key_padding_mask is not a (batch, keys) tensor"
    mq = tensor_meta(a["query"])
    if mq is None or len(mq.shape) != 3:
        return "unbatched (2-D) input"
    return None


def _lower_one_mha(gm, node, mha):
    g = gm.graph
    a = _mha_args(node)
    path = node.meta.get(meta.PATH, node.target)
    E, H = mha.embed_dim, mha.num_heads
    new_nodes = []

    def call(fn, *args, sub="", **kwargs):
        n = g.call_function(fn, args, kwargs)
        n.meta[meta.PATH] = f"{path}.{sub}" if sub else path
        new_nodes.append(n)
        return n

    with g.inserting_before(node):
        q_in, k_in, v_in = a["query"], a["key"], a["value"]
        if not mha.batch_first:  # (L, B, E) -> (B, L, E): views
            q_in, k_in, v_in = (call(torch.transpose, t, 0, 1) for t in (q_in, k_in, v_in))
        w = g.get_attr(f"{node.target}.in_proj_weight")
        b = g.get_attr(f"{node.target}.in_proj_bias") if mha.in_proj_bias is not None else None
        if a["query"] is a["key"] is a["value"]:  # self-attention: one GEMM for q, k and v
            qkv = call(F.linear, q_in, w, b, sub="in_proj")
            q, k, v = (call(operator.getitem, call(torch.split, qkv, E, -1), i) for i in range(3))
        else:
            ws = [call(operator.getitem, w, slice(i * E, (i + 1) * E)) for i in range(3)]
            bs = [call(operator.getitem, b, slice(i * E, (i + 1) * E)) if b is not None else None
                  for i in range(3)]
            q, k, v = (call(F.linear, t, ws[i], bs[i], sub="in_proj") for i, t in enumerate((q_in, k_in, v_in)))
        # (B, L, E) -> (B, H, L, E/H): views the kernel reads through their strides
        q, k, v = (call(torch.transpose, call(torch.unflatten, t, -1, (H, E // H)), 1, 2) for t in (q, k, v))
        mask = None
        kpm = a.get("key_padding_mask")
        if kpm is not None:  # (B, S), True = ignore  ->  (B, 1, 1, S) keep-mask or additive mask
            if tensor_meta(kpm).dtype == torch.bool:
                kpm = call(torch.logical_not, kpm)
            mask = call(operator.getitem, kpm, (slice(None), None, None, slice(None)))
        attn = call(F.scaled_dot_product_attention, q, k, v, mask, 0.0, False, scale=None, enable_gqa=False)
        merged = call(torch.flatten, call(torch.transpose, attn, 1, 2), 2)
        out = call(F.linear, merged, g.get_attr(f"{node.target}.out_proj.weight"),
                   g.get_attr(f"{node.target}.out_proj.bias") if mha.out_proj.bias is not None else None,
                   sub="out_proj")
        if not mha.batch_first:
            out = call(torch.transpose, out, 0, 1)
    for u in list(node.users):
        u.replace_all_uses_with(out) if u.args[1] == 0 else None
        g.erase_node(u)
    g.erase_node(node)
    _set_meta(gm, new_nodes, a)


def _set_meta(gm, nodes, a):
    """Shapes for the lowered nodes (the later patterns check them): run them on meta tensors."""
    env = {}

    dev = tensor_meta(a["query"]).device

    def value(x):
        if isinstance(x, fx.Node):
            if x in env:
                return env[x]
            if x.op == "get_attr":  # the projection weights: give the new get_attr nodes shapes too
                meta.set_tensor_meta(x, attr_value(gm, x))
            return meta.meta_tensor(x)
        return x

    for n in nodes:
        out = n.target(*fx.node.map_aggregate(n.args, value), **fx.node.map_aggregate(n.kwargs, value))
        env[n] = out
        if isinstance(out, torch.Tensor):
            n.meta[meta.VALUE] = meta.TensorMeta(tuple(out.shape), out.dtype, dev)


# ---------------------------------------------------------------------------------------------
# 2 and 3: SDPA calls and the decomposed form -> accelc::flash_attention

def _example_mask(mask):
    """The mask as the example inputs had it: an optional argument left at None counts as no
    mask for the checks (the node still goes to the op, which checks a mask given later)."""
    return None if mask is None or (isinstance(mask, fx.Node) and mask.meta.get(meta.IS_NONE)) else mask


def _kernel_problem(q, k, v, mask) -> str | None:
    mask = _example_mask(mask)
    ts = [meta.meta_tensor(t) for t in (q, k, v)]
    if any(t is None for t in ts) or (mask is not None and meta.meta_tensor(mask) is None):
        return "input shapes unknown"
    return why_unsupported(*ts, meta.meta_tensor(mask))


def _kernel_label(mask, is_causal) -> str:
    parts = (["causal"] if is_causal else []) + (["mask"] if _example_mask(mask) is not None else [])
    return "accelc::flash_attention" + (f"[{'+'.join(parts)}]" if parts else "")


def _sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    # capture writes every SDPA call in this one form (its canonical arguments)
    return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _check_sdpa(m, ctx) -> str | None:
    if m.input("dropout_p") != 0.0:
        return "dropout_p > 0 (training)"
    q, k = (meta.tensor_meta(m.input(n)) for n in ("q", "k"))
    if q is not None and k is not None and len(q.shape) == len(k.shape) == 4 and q.shape[1] != k.shape[1] \
            and not m.input("enable_gqa"):
        return "query and key/value head counts differ without enable_gqa"
    if _example_mask(m.input("mask")) is not None and m.input("is_causal"):
        return "attn_mask together with is_causal"
    if isinstance(m.input("scale"), fx.Node):
        return "scale computed at run time"
    return _kernel_problem(m.input("q"), m.input("k"), m.input("v"), m.input("mask"))


def _build_sdpa(m, ctx) -> Replacement:
    mask, causal = m.input("mask"), bool(m.input("is_causal"))
    k, v, repeats = _ungrouped(m)
    return Replacement(FLASH, (m.input("q"), k, v, mask, causal, m.input("scale")),
                       _precision(m, ctx), kind="attention", kernel=_kernel_label(mask, causal), absorbed=repeats)


# the ops a K/V repeat is written with, as torch.export (aten) and fx's symbolic trace (torch
# functions and tensor methods) capture them
_OPS = {torch.ops.aten.unsqueeze.default: "unsqueeze", torch.unsqueeze: "unsqueeze",
        torch.ops.aten.expand.default: "expand",
        torch.ops.aten.reshape.default: "reshape", torch.ops.aten.view.default: "reshape",
        torch.ops.aten._unsafe_view.default: "reshape", torch.reshape: "reshape",
        torch.ops.aten.repeat_interleave.self_int: "repeat_interleave", torch.repeat_interleave: "repeat_interleave"}
_METHODS = {"unsqueeze": "unsqueeze", "expand": "expand", "reshape": "reshape", "view": "reshape",
            "repeat_interleave": "repeat_interleave"}


def _op(n) -> str:
    if not isinstance(n, fx.Node):
        return ""
    if n.op == "call_method":
        return _METHODS.get(n.target, "")
    if n.op == "call_function":
        if n.target is operator.getitem and _new_axis_2(n.args[1] if len(n.args) > 1 else None):
            return "unsqueeze"
        return _OPS.get(n.target, "") if _hashable(n.target) else ""
    return ""


def _hashable(t) -> bool:
    try:
        hash(t)
        return True
    except TypeError:
        return False


def _new_axis_2(index) -> bool:
    """x[:, :, None] (and x[:, :, None, :, :], x[:, :, None, ...]): a new axis at dim 2."""
    if not isinstance(index, tuple) or len(index) < 3 or index[2] is not None:
        return False
    full = slice(None, None, None)
    return index[0] == full and index[1] == full and all(i == full or i is Ellipsis for i in index[3:])


def _ungrouped(m) -> tuple:
    """(k, v, nodes) the kernel is given: where the match's K and V are both the K / V of fewer
    heads repeated to the query's (grouped-query attention as HF's eager and SDPA paths write it,
    repeat_kv), their sources and the repeats' nodes, which the layer takes over: the kernel reads
    each K/V head once for its query group instead of a copy of the cache made per query head
    (a decode step of TinyLlama's shape copied 8x its cache a layer). Else the match's K and V."""
    k, v = m.input("k"), m.input("v")
    gk, gv = _repeated_heads(k), _repeated_heads(v)
    if gk is None or gv is None or k is v or gk[1] != gv[1]:
        return k, v, []
    return gk[0], gv[0], gk[2] + gv[2]


def _repeated_heads(x) -> tuple | None:
    """(source, repeats, nodes) where node x is a 4-D (B, Hkv, S, D) source with each head repeated
    `repeats` times in place (head j of x is head j // repeats of the source), read by nothing
    but its one consumer: x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv * n, S, D), or
    x.repeat_interleave(n, dim=1)."""
    if _op(x) == "repeat_interleave" and len(x.users) == 1:
        src, nodes = x.args[0], [x]
        repeats = meta.arg(x, 1, "repeats")
        # a repeats tensor may repeat heads unevenly: only a constant count is a query grouping
        if meta.arg(x, 2, "dim") not in (1, -3) or not isinstance(repeats, int) or isinstance(repeats, bool):
            return None
    elif _op(x) == "reshape" and len(x.users) == 1 and _op(x.args[0]) == "expand" and _op(x.args[0].args[0]) == "unsqueeze":
        expand, unsqueeze = x.args[0], x.args[0].args[0]
        src, nodes = unsqueeze.args[0], [unsqueeze, expand, x]
        if unsqueeze.target is not operator.getitem and meta.arg(unsqueeze, 1, "dim") not in (2, -3):
            return None
        if len(expand.users) != 1 or len(unsqueeze.users) != 1:
            return None
    else:
        return None
    ms, mx = tensor_meta(src), tensor_meta(x)
    if not isinstance(src, fx.Node) or ms is None or mx is None or len(ms.shape) != 4 or len(mx.shape) != 4:
        return None
    (b, hkv, s, d), (b2, h, s2, d2) = ms.shape, mx.shape
    if (b, s, d) != (b2, s2, d2) or hkv == 0 or h % hkv or h == hkv:
        return None
    if len(nodes) == 3 and tuple(tensor_meta(nodes[1]).shape) != (b, hkv, h // hkv, s, d):
        return None
    if len(nodes) == 1 and meta.arg(x, 1, "repeats") != h // hkv:
        return None
    return src, h // hkv, nodes


def _precision(m, ctx) -> dict:
    """fp32 attention: TF32 tensor cores where the config's fp32_precision asks (else true fp32)."""
    q = meta.tensor_meta(m.input("q"))
    return {"allow_tf32": True} if q is not None and q.dtype == torch.float32 and \
        ctx.config.fp32_precision == "tf32" else {}


def _t(k, d0, d1):
    return torch.transpose(k, d0, d1)


def _mul(q, k, v, scale, d0, d1, sdim):
    return torch.matmul(F.softmax(torch.matmul(q, _t(k, d0, d1)) * scale, sdim), v)


def _div(q, k, v, scale, d0, d1, sdim):
    return torch.matmul(F.softmax(torch.matmul(q, _t(k, d0, d1)) / scale, sdim), v)


def _mul_mask(q, k, v, scale, mask, d0, d1, sdim):
    return torch.matmul(F.softmax(torch.matmul(q, _t(k, d0, d1)) * scale + mask, sdim), v)


def _div_mask(q, k, v, scale, mask, d0, d1, sdim):
    return torch.matmul(F.softmax(torch.matmul(q, _t(k, d0, d1)) / scale + mask, sdim), v)


def _q_scaled(q, k, v, scale, d0, d1, sdim):
    return torch.matmul(F.softmax(torch.matmul(q * scale, _t(k, d0, d1)), sdim), v)


def _no_scale(q, k, v, d0, d1, sdim):
    return torch.matmul(F.softmax(torch.matmul(q, _t(k, d0, d1)), sdim), v)


def _no_scale_mask(q, k, v, mask, d0, d1, sdim):
    return torch.matmul(F.softmax(torch.matmul(q, _t(k, d0, d1)) + mask, sdim), v)


def _baddbmm(q, k, v, bias, beta, scale, d0, d1, sdim):
    # softmax(beta * bias + scale * q @ k^T) @ v, the scores of (batch * heads, length, head_dim)
    # tensors in one baddbmm (ALiBi-style biases, attention written with bmm)
    return torch.matmul(F.softmax(torch.baddbmm(bias, q, _t(k, d0, d1), beta=beta, alpha=scale), sdim), v)


def _baddbmm_mask(m):
    # beta=0: baddbmm ignores its bias (NaN in it included)
    return m.input("bias") if m.input("beta") == 1 else None


def _check_baddbmm(m, ctx) -> str | None:
    if m.input("beta") not in (0, 1) or isinstance(m.input("beta"), bool):
        return f"baddbmm scales its bias by beta={m.input('beta')}"
    return _decomposed_problem(m, _baddbmm_mask(m))


def _check_decomposed(m, ctx) -> str | None:
    return _decomposed_problem(m, m.input("mask"))


def _decomposed_problem(m, mask) -> str | None:
    scale = m.input("scale", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale == 0:
        return "attention scale is not a constant"
    mk = tensor_meta(m.input("k"))
    rank = len(mk.shape) if mk else 0
    dims = {d % rank for d in (m.input("d0"), m.input("d1"))} if rank else set()
    if dims != {rank - 2, rank - 1} or m.input("sdim") not in (-1, rank - 1):
        return "not a softmax over keys of q @ k^T"
    return _kernel_problem(m.input("q"), m.input("k"), m.input("v"), mask)


def _decomposed(scale_of, mask_of=lambda m: m.input("mask")):
    """The build of a decomposed pattern whose softmax scale is scale_of(the matched constant)
    and whose additive mask is mask_of(the match)."""
    def build(m, ctx) -> Replacement:
        mask = mask_of(m)
        k, v, repeats = _ungrouped(m)
        # a row whose keys are all masked: eager's softmax gives NaN there (SDPA gives 0)
        return Replacement(FLASH, (m.input("q"), k, v, mask, False,
                                   float(scale_of(m.input("scale", 1.0)))), {"empty_nan": True, **_precision(m, ctx)},
                           kind="attention", kernel=_kernel_label(mask, False), absorbed=repeats)
    return build


def _rule(name, fn, scale_of) -> Rule:
    return Rule(Pattern(name, fn), build=_decomposed(scale_of), check=_check_decomposed)


RULES = (
    Rule(Pattern("scaled_dot_product_attention", _sdpa), build=_build_sdpa, check=_check_sdpa),
    # pattern                                                  softmax scale from the matched constant
    _rule("softmax(q@k^T*s+mask)@v", _mul_mask,                lambda s: s),
    _rule("softmax(q@k^T/s+mask)@v", _div_mask,                lambda s: 1.0 / s),
    _rule("softmax(q@k^T+mask)@v", _no_scale_mask,             lambda s: 1.0),
    _rule("softmax(q@k^T*s)@v", _mul,                          lambda s: s),
    _rule("softmax(q@k^T/s)@v", _div,                          lambda s: 1.0 / s),
    _rule("softmax((q*s)@k^T)@v", _q_scaled,                   lambda s: s),
    _rule("softmax(q@k^T)@v", _no_scale,                       lambda s: 1.0),
    Rule(Pattern("softmax(baddbmm(bias,q,k^T))@v", _baddbmm), build=_decomposed(lambda s: s, _baddbmm_mask),
         check=_check_baddbmm),
)
PASS = Pass("attention", RULES, before_rules=_lower_mha)   # lowering first: nn.MultiheadAttention -> linears + SDPA
