"""linear_act: Linear / F.linear / matmul (+ bias) (+ activation) (+ residual add), in one
torch.ops.accelc.linear call (kernels/gemm.py).

The patterns below find the GEMM and its bias; accelc.rewrite.absorb_epilogue then takes the
activation (relu, gelu exact or tanh, silu, sigmoid, tanh) and a residual add that follow, in
either order. An activation the kernel lacks (leaky_relu, ...) stays a PyTorch op after the
fused GEMM + bias.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from accelc import runtime
from accelc.capture import tensor_meta
from accelc.kernels.gemm import SUPPORTED_DTYPES
from accelc.rewrite import Pattern, absorb_epilogue, find, kernel_label, replace_group


def _linear(x, weight, bias):
    return F.linear(x, weight, bias)            # nn.Linear, F.linear, with or without bias


def _matmul_bias(x, weight_t, bias):
    return torch.matmul(x, weight_t) + bias


def _bias_matmul(x, weight_t, bias):
    return bias + torch.matmul(x, weight_t)


def _matmul(x, weight_t):
    return torch.matmul(x, weight_t)


def _why_not(x, weight, bias, transposed: bool) -> str | None:
    """Why this GEMM cannot become accelc::linear, or None if it can."""
    mx, mw = tensor_meta(x), tensor_meta(weight)
    if mx is None or mw is None:
        return "input shapes unknown"
    if len(mw.shape) != 2 or len(mx.shape) < 1:
        return ""  # a batched matmul of two activations: not a linear layer at all
    k, n = (mw.shape[0], mw.shape[1]) if transposed else (mw.shape[1], mw.shape[0])
    if mx.shape[-1] != k:
        return f"x {mx.shape} does not match weight {mw.shape}"
    if mx.dtype not in SUPPORTED_DTYPES:
        return f"dtype {mx.dtype} (accelc::linear takes fp16, bf16, fp32)"
    if mw.dtype != mx.dtype:
        return f"x is {mx.dtype} but weight is {mw.dtype}"
    if bias is not None:
        mb = tensor_meta(bias)
        if mb is None or mb.shape != (n,) or mb.dtype != mx.dtype:
            return f"bias {None if mb is None else (mb.shape, mb.dtype)} is not a ({n},) {mx.dtype} vector"
    if not runtime.can_run_on(mx.device):
        return f"tensors on {mx.device}: accelc kernels need a CUDA device (or Triton's interpreter)"
    return None


def run(gm, config) -> int:
    g = gm.graph
    count = 0
    for pattern, transposed in PATTERNS:
        for m in find(gm, pattern):
            if not m.is_live():
                continue  # taken by an earlier match's epilogue
            x = m.input("x")
            weight = m.input("weight_t" if transposed else "weight")
            bias = m.input("bias")
            reason = _why_not(x, weight, bias, transposed)
            if reason is not None:
                if reason:  # an earlier pass's reason for this node stays
                    m.anchor.meta.setdefault("accelc_skip", reason)
                continue
            ep = absorb_epilogue(m.anchor)
            aux = ()
            if transposed:
                with g.inserting_before(m.anchor):
                    weight = g.call_function(torch.t, (weight,))
                aux = (weight,)
            kwargs = dict(activation=ep.activation, residual_first=ep.residual_first,
                          allow_tf32=config.fp32_precision == "tf32")
            replace_group(gm, m.nodes + ep.nodes, torch.ops.accelc.linear.default,
                          (x, weight, bias, ep.residual), kwargs,
                          kind="linear", kernel=kernel_label("linear", ep), aux=aux)
            count += 1
    return count


# pattern                                      weight given transposed (K, N)?
PATTERNS = [
    (Pattern("linear", _linear),               False),
    (Pattern("matmul+bias", _matmul_bias),     True),
    (Pattern("bias+matmul", _bias_matmul),     True),
    (Pattern("matmul", _matmul),               True),
]
