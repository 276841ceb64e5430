"""int8: the float accelc layers that OptimizeConfig.int8 selects, moved to int8 kernels.

Runs after linear_act and attention, on their output, so an int8 layer has exactly the float
layer's fusion (bias, activation, residual) and the same original subgraph for the guard:
  - accelc::linear -> accelc::linear_w8a8 (kernels/int8_gemm.py): the weight quantized here,
    once, per output channel; activations per token at run time (kernels/quantize.py), or with
    one static scale from calibration (Int8Config.static);
  - accelc::flash_attention -> the same op with qk_int8=True (Int8Config.attention);
  - with Int8Config.weights_only, instead: accelc::linear -> accelc::linear_w8a16 and
    accelc::gated_linear -> accelc::gated_linear_w8a16 (kernels/int8_weight.py): the weight (the
    gated layer's interleaved one) quantized per output channel, the activations left in float.
With OptimizeConfig.fp8 (an Fp8Config), the same layers the same way, to accelc::linear_fp8w and
accelc::gated_linear_fp8w (kernels/fp8_weight.py): each weight in float8_e4m3fn per output channel; with
Fp8Config(weights_only=False), linear layers to accelc::linear_fp8 and gated MLPs to accelc::gated_linear_fp8
(kernels/fp8_gemm.py), their input's rows quantized to e4m3 at run time as well; with Fp8Config(attention=True),
accelc::flash_attention -> the same op with fp8=True (both products on e4m3 operands).
Each int8 or fp8 layer keeps its float call as a Fallback: the guard judges int8 layers by SQNR and
puts those under Int8Config.sqnr_floor back in float (accelc.rewrite.demote).

SmoothQuant (Xiao et al. 2023, Int8Config.smoothing = alpha): with a_j = max |x[:, j]| over the
calibration batches and w_j = max |W[:, j]|, s_j = a_j^alpha / w_j^(1 - alpha); the weight's
column j is multiplied by s_j and the activation divided by it in the quantize kernel, so
x W^T is unchanged while an outlier channel of x no longer sets the whole row's scale.
"""
from __future__ import annotations

import fnmatch
import math

import torch
from torch import fx

from accelc import meta
from accelc.kernels import fp8_weight
from accelc.kernels.flash_attention import fp8_problem
from accelc.kernels.int8_gemm import quantize_weight
from accelc.layer_runner import LayerRunner
from accelc.meta import attr_value
from accelc.records import Rewrite
from accelc.rewrite import Pass, add_constant, layers, restack

LINEAR = torch.ops.accelc.linear.default
W8A8 = torch.ops.accelc.linear_w8a8.default
FLASH = torch.ops.accelc.flash_attention.default
GATED = torch.ops.accelc.gated_linear.default
W8A16 = torch.ops.accelc.linear_w8a16.default
GATED_W8A16 = torch.ops.accelc.gated_linear_w8a16.default
FP8W = torch.ops.accelc.linear_fp8w.default
FP8 = torch.ops.accelc.linear_fp8.default
GATED_FP8W = torch.ops.accelc.gated_linear_fp8w.default
GATED_FP8 = torch.ops.accelc.gated_linear_fp8.default


def _module_type(rw: Rewrite) -> str:
    for n in rw.original.graph.nodes:
        cls = n.meta.get(meta.MODULE_TYPE)
        if cls and n.op not in ("placeholder", "get_attr"):
            return cls.rpartition(".")[2]
    return "functional"


def _selected(names: list[str], patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for name in names for p in patterns)


def _weight_tensor(gm, w: fx.Node) -> torch.Tensor | None:
    """The (N, K) weight a float linear node reads, if it is a constant of the model."""
    if w.op == "get_attr":
        return attr_value(gm, w)
    if w.op == "call_function" and w.target is torch.t and w.args[0].op == "get_attr":
        return attr_value(gm, w.args[0]).t()
    return None


def _why_not(gm, n: fx.Node, index: int, count: int, cfg) -> str | None:
    rw = meta.rewrite_of(n)
    names = [rw.layer, meta.path(n)]
    name = type(cfg).__name__
    if cfg.skip_first_last and index in (0, count - 1):
        return f"{'first' if index == 0 else 'last'} linear layer: stays in float ({name}.skip_first_last)"
    if cfg.layers is not None and not _selected(names, cfg.layers):
        return f"not in {name}.layers"
    if cfg.exclude and _selected(names, cfg.exclude):
        return f"in {name}.exclude"
    if cfg.types is not None and _module_type(rw) not in cfg.types:
        return f"type {_module_type(rw)} not in {name}.types"
    if _weight_tensor(gm, n.args[1]) is None:
        return "weight is computed at run time, not a constant: stays in float"
    mx = meta.tensor_meta(n.args[0])
    rows = math.prod(mx.shape[:-1]) if mx is not None else 0
    if rows < cfg.min_rows:
        return f"{rows} rows < {name}.min_rows={cfg.min_rows}: stays in float, where it is faster"
    return None


def _calibrate(gm, nodes: list[fx.Node], batches: list) -> dict[fx.Node, torch.Tensor]:
    """Per-input-channel absmax (K,) of each node's x over the calibration batches."""
    stats: dict[fx.Node, torch.Tensor] = {}
    wanted = set(nodes)     # accelc linear layers (layers(gm)): LayerRunner hands each to at_layer

    def at_layer(runner, node, rw):
        if node in wanted:
            x = runner.env[node.args[0]].detach().float()
            amax = x.abs().reshape(-1, x.shape[-1]).amax(0)
            stats[node] = amax if node not in stats else torch.maximum(stats[node], amax)
        return runner.run_as_graph(node)

    with torch.no_grad():
        for args in batches:
            LayerRunner(gm, at_layer).run(*args)
    return stats


def _to_w8a8(gm, n: fx.Node, amax: torch.Tensor | None, cfg) -> None:
    rw = meta.rewrite_of(n)
    x, w_node, bias, residual = n.args[:4]
    weight = _weight_tensor(gm, w_node).detach()
    prefix = _prefix(rw) + "_int8"
    smooth = None
    s = None
    if cfg.smoothing is not None and amax is not None:
        a = cfg.smoothing
        s = (amax.clamp_min(1e-5) ** a / weight.float().abs().amax(0).clamp_min(1e-5) ** (1 - a)).clamp(1e-4, 1e4)
        smooth = (1.0 / s).float().contiguous()
    w_q, w_scale = quantize_weight(weight, s)
    aux = [add_constant(gm, prefix + "_w", w_q, before=n), add_constant(gm, prefix + "_w_scale", w_scale, before=n)]
    kwargs = dict(activation=n.kwargs.get("activation", "none"), residual_first=n.kwargs.get("residual_first", False))
    if smooth is not None:
        aux.append(add_constant(gm, prefix + "_smooth", smooth, before=n))
        kwargs["smooth"] = aux[-1]
    if cfg.static and amax is not None:
        a_max = (amax * smooth).max() if smooth is not None else amax.max()
        aux.append(add_constant(gm, prefix + "_act_scale", (a_max / 127.0).clamp_min(1e-12).reshape(1).float(),
                                before=n))
        kwargs["static_scale"] = aux[-1]
    note = (("static act scale; " if "static_scale" in kwargs else "")
            + (f"SmoothQuant alpha={cfg.smoothing}" if smooth is not None else ""))
    restack(gm, n, W8A8, (x, aux[0], aux[1], bias, residual), kwargs, kind="linear_int8",
            kernel=rw.kernel.replace("accelc::linear", "accelc::linear_w8a8"), aux=aux, note=note,
            weight_bytes=(weight.numel() * weight.element_size(), w_q.numel() + w_scale.numel() * 4))


# the forms with one-byte weights besides W8A8 int8: (quantize, linear op, gated op, the
# ops' names, kind suffix, constant suffix, the summary's note)
_ONE_BYTE = {
    "int8 weights": (quantize_weight, W8A16, GATED_W8A16, "w8a16", "int8", "int8w", "int8 weights"),
    "fp8 weights": (fp8_weight.quantize_weight, FP8W, GATED_FP8W, "fp8w", "fp8", "fp8w", "fp8 weights"),
    "fp8": (fp8_weight.quantize_weight, FP8, GATED_FP8, "fp8", "fp8", "fp8", "fp8 weights and activations"),
}


def _prefix(rw: Rewrite) -> str:
    """The stem of the constants a layer's quantized call reads."""
    return f"{rw.layer}".replace(".", "_").replace("+", "_").replace("#", "_")


def _to_one_byte(gm, n: fx.Node, form: str) -> None:
    """A float linear or gated layer -> its call of `form` (_ONE_BYTE): weight-only int8
    (Int8Config.weights_only), weight-only fp8 (Fp8Config), or fp8 weights and activations
    (Fp8Config(weights_only=False): linear layers, their input's rows quantized to e4m3 at run time)."""
    quantize, linear_op, gated_op, op_name, suffix, constant, note = _ONE_BYTE[form]
    rw = meta.rewrite_of(n)
    weight = _weight_tensor(gm, n.args[1]).detach()
    prefix = _prefix(rw) + "_" + constant
    w_q, w_scale = quantize(weight)     # (a gated layer's: per row of its interleaved weight)
    aux = [add_constant(gm, prefix, w_q, before=n), add_constant(gm, prefix + "_scale", w_scale, before=n)]
    sizes = (weight.numel() * weight.element_size(), w_q.numel() + w_scale.numel() * 4)
    if n.target is GATED:
        x, _, bias, width = n.args[:4]
        restack(gm, n, gated_op, (x, aux[0], aux[1], bias, width), dict(activation=n.kwargs.get("activation", "silu")),
                kind=f"gated_linear_{suffix}",
                kernel=rw.kernel.replace("accelc::gated_linear", f"accelc::gated_linear_{op_name}"),
                aux=aux, note=note, weight_bytes=sizes)
        return
    x, _, bias, residual = n.args[:4]
    kwargs = dict(activation=n.kwargs.get("activation", "none"), residual_first=n.kwargs.get("residual_first", False))
    restack(gm, n, linear_op, (x, aux[0], aux[1], bias, residual), kwargs, kind=f"linear_{suffix}",
            kernel=rw.kernel.replace("accelc::linear", f"accelc::linear_{op_name}"), aux=aux, note=note,
            weight_bytes=sizes)


def _quantized_attention(gm, n: fx.Node, flag: str, kind: str) -> None:
    """An attention layer moved to the same op with `flag` (qk_int8, fp8) set, its kind `attention_<kind>`."""
    rw = meta.rewrite_of(n)
    restack(gm, n, FLASH, n.args, {**n.kwargs, flag: True}, kind=f"attention_{kind}",
            kernel=rw.kernel.replace("accelc::flash_attention", f"accelc::flash_attention[{flag}]"))


def _to_fp8_attention(gm) -> int:
    """Fp8Config(attention=True): each attention layer's products on e4m3 operands (accelc::flash_attention's
    fp8), where its inputs take them (else said in the layer's note); how many moved."""
    moved = 0
    for n in [n for n in layers(gm) if n.target is FLASH]:
        q = meta.tensor_meta(n.args[0])
        why = fp8_problem(q, n.kwargs.get("qk_int8", False)) if q is not None else "its query's shape is unknown"
        if why:
            meta.explain(n, f"{why}; attention stays in float")
            continue
        _quantized_attention(gm, n, "fp8", "fp8")
        moved += 1
    return moved


def _transform(gm, ctx) -> int:
    cfg = ctx.config.quantized
    if cfg is None:
        return 0
    attention = _to_fp8_attention(gm) if ctx.config.fp8 is not None and cfg.attention else 0
    # (W8A8 int8 has no gated form: a gated MLP stays in float there)
    linears = [n for n in layers(gm)
               if n.target is LINEAR or (n.target is GATED and (cfg.weights_only or ctx.config.fp8 is not None))]
    chosen = []
    for i, n in enumerate(linears):
        reason = _why_not(gm, n, i, len(linears), cfg)
        if reason:
            meta.explain(n, reason)
        else:
            chosen.append(n)
    if cfg.weights_only:
        for n in chosen:
            _to_one_byte(gm, n, "int8 weights" if ctx.config.int8 is not None else "fp8 weights")
        return len(chosen) + attention
    if ctx.config.fp8 is not None:
        for n in chosen:
            k = _weight_tensor(gm, n.args[1]).shape[1]
            if k % 16:
                meta.explain(n, f"K={k}: the fp8 product takes K in multiples of 16; stays in float")
            else:
                _to_one_byte(gm, n, "fp8")
        return sum(n.target in (FP8, GATED_FP8) for n in layers(gm)) + attention
    needs_stats = chosen and (cfg.static or cfg.smoothing is not None)
    stats = _calibrate(gm, chosen, ctx.calibration) if needs_stats else {}
    for n in chosen:
        _to_w8a8(gm, n, stats.get(n), cfg)
    count = len(chosen)
    if cfg.attention:
        for n in [n for n in layers(gm) if n.target is FLASH]:
            _quantized_attention(gm, n, "qk_int8", "int8")
            count += 1
    return count


# Not a table of rules: the layers moved to int8 are the float layers the rules before made, chosen
# as a set (the first and last linear layers, the filters) and calibrated together.
PASS = Pass("int8", transform=_transform)
