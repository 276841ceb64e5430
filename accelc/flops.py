"""FLOPs per graph node, for the summary's coverage figure: the share of a model's work that runs
in accelc kernels.

FLOPs are counted as torch.utils.flop_counter counts them (matrix products, convolutions,
attention: 2 per multiply-add; elementwise ops, norms and data movement count 0), on meta
tensors shaped like each node's inputs on the example inputs, so counting runs no kernel. The
accelc ops get the formulas of the PyTorch ops they replace; attention counts every (query, key)
pair, causal or not, as PyTorch's formula for scaled_dot_product_attention does.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from accelc import meta
from accelc.layer_signature import value
from accelc.meta import attr_value

accelc_ops = torch.ops.accelc


def _linear_flops(x, weight, *args, out_val=None, **kwargs) -> int:
    # x (..., K), weight (N, K); int8 layers: the same product on int8 operands
    return 2 * math.prod(x.shape[:-1]) * weight.shape[0] * x.shape[-1]


def _gated_linear_flops(x, weight, bias, n, *args, out_val=None, **kwargs) -> int:
    # packed weight (2 Np, K): the two products of n columns each
    return 2 * 2 * math.prod(x.shape[:-1]) * n * x.shape[-1]


def _gated_w8a16_flops(x, w_q, w_scale, bias, n, *args, out_val=None, **kwargs) -> int:
    return _gated_linear_flops(x, w_q, bias, n)


def _conv_flops(x, weight, *args, out_val=None, **kwargs) -> int:
    # weight packed (K, R, S, C); out (N, K, OH, OW)
    K, R, S, C = weight.shape
    return 2 * out_val.numel() * R * S * C


def _depthwise_flops(x, weight, *args, out_val=None, **kwargs) -> int:
    # weight packed (R, S, C): one multiply-add per tap and output value
    R, S, C = weight.shape
    return 2 * out_val.numel() * R * S


def _conv1d_flops(x, weight, bias, residual, stride, padding, dilation, activation="none", residual_first=False,
                  allow_tf32=False, depthwise=False, out_val=None, **kwargs) -> int:
    # the height-1 conv's weight is the 2-D kernels' (packed (1, S, C) depthwise, else (K, 1, S, C))
    return (_depthwise_flops if depthwise else _conv_flops)(x, weight, out_val=out_val)


def _attention_flops(q, k, v, *args, out_val=None, **kwargs) -> int:
    B, H, L, D = q.shape
    return 4 * B * H * L * k.shape[2] * D


@functools.cache
def _register() -> None:
    from accelc import kernels  # noqa: F401  (registers the ops)
    formulas = {"linear": _linear_flops, "linear_w8a8": _linear_flops, "linear_w8a16": _linear_flops,
                "gated_linear_w8a16": _gated_w8a16_flops, "linear_fp8w": _linear_flops, "linear_fp8": _linear_flops,
                "gated_linear_fp8w": _gated_w8a16_flops, "gated_linear_fp8": _gated_w8a16_flops, "conv2d": _conv_flops,
                "flash_attention": _attention_flops, "gated_linear": _gated_linear_flops,
                "conv2d_depthwise": _depthwise_flops, "conv1d": _conv1d_flops, "qkv_rotary": _linear_flops}
    for name, fn in formulas.items():
        register_flop_formula(getattr(accelc_ops, name), get_raw=True)(fn)


class _Unknown(Exception):
    pass


def node_flops(gm: fx.GraphModule) -> dict:
    """{node: FLOPs} for the graph's call_function / call_method / call_module nodes (a module
    called with its weights on the meta device; nodes whose input shapes are unknown count 0)."""
    _register()
    out = {}
    counted: dict = {}     # the same op on the same sizes (a model's repeated blocks): counted once
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        try:
            args = fx.node.map_arg((n.args, n.kwargs), lambda a: _meta_value(gm, a))
        except _Unknown:
            continue
        key = (n.op, n.target, value(args)) if n.op != "call_module" else n     # (a module: its own)
        if key in counted:
            if counted[key] is not None:
                out[n] = counted[key]
            continue
        counted[key] = None        # (None: no FLOPs known)
        counter = FlopCounterMode(display=False)
        try:
            with counter, torch.no_grad():
                if n.op == "call_method":
                    getattr(args[0][0], n.target)(*args[0][1:], **args[1])
                elif n.op == "call_module":
                    module = gm.get_submodule(n.target)
                    state = {k: v.to("meta") for k, v in [*module.named_parameters(), *module.named_buffers()]}
                    torch.func.functional_call(module, state, tuple(args[0]), dict(args[1]))
                else:
                    n.target(*args[0], **args[1])
        except Exception:   # an op without a meta kernel: no FLOPs known
            continue
        out[n] = counted[key] = counter.get_total_flops()
    return out


def _meta_value(gm, node: fx.Node):
    if node.op == "get_attr":
        value = attr_value(gm, node)
        return value.to("meta") if isinstance(value, torch.Tensor) else value
    if node.meta.get(meta.IS_NONE):
        return None
    m = meta.tensor_meta(node)
    if m is None:
        raise _Unknown(node.name)
    return m.empty()
