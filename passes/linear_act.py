"""linear_act: Linear / F.linear / matmul / addmm (+ bias) (+ activation) (+ residual add), in one
torch.ops.accelc.linear call (kernels/gemm.py).

The patterns below find the GEMM and its bias; passes/epilogue.py then takes the activation
(relu, gelu exact or tanh, silu, sigmoid, tanh) and a residual add that follow, in either order.
An activation the kernel lacks (leaky_relu, ...) stays a PyTorch op after the fused GEMM + bias.
A pattern input named weight_t is the weight as matmul takes it, (K, N).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from accelc import meta
from accelc.kernels.gemm import why_unsupported
from accelc.passes import epilogue
from accelc.rewrite import Pass, Pattern, Replacement, Rule

LINEAR = torch.ops.accelc.linear.default


def _linear(x, weight, bias):
    return F.linear(x, weight, bias)            # nn.Linear, F.linear, with or without bias


def _matmul_bias(x, weight_t, bias):
    return torch.matmul(x, weight_t) + bias


def _bias_matmul(x, weight_t, bias):
    return bias + torch.matmul(x, weight_t)


def _matmul(x, weight_t):
    return torch.matmul(x, weight_t)


def _addmm(bias, x, weight_t):
    return torch.addmm(bias, x, weight_t)       # HF's Conv1D (GPT-2): bias + x @ weight


def _is_linear(m) -> bool:
    """A GEMM with a 2-D weight and a tensor bias: a batched matmul of two activations is no
    linear layer, and `x @ w + 1.0` adds no bias vector."""
    w = meta.tensor_meta(m.input("weight_t") if m.has("weight_t") else m.input("weight"))
    bias = m.input("bias")
    return (w is None or len(w.shape) == 2) and (bias is None or isinstance(bias, torch.fx.Node))


def _check(m, ctx) -> str | None:
    x, bias = meta.meta_tensor(m.input("x")), m.input("bias")
    w = meta.meta_tensor(m.input("weight_t") if m.has("weight_t") else m.input("weight"))
    if x is None or w is None or (bias is not None and meta.tensor_meta(bias) is None):
        return "input shapes unknown"
    return why_unsupported(x, w.t() if m.has("weight_t") else w, meta.meta_tensor(bias))


def _build(m, ctx) -> Replacement:
    x, bias = m.input("x"), m.input("bias")
    ep = epilogue.absorb(m.anchor)
    aux = ()
    if m.has("weight_t"):
        g = m.gm.graph
        with g.inserting_before(m.anchor):
            weight = g.call_function(torch.t, (m.input("weight_t"),))   # a (N, K) view: no copy
        aux = (weight,)
    else:
        weight = m.input("weight")
    kwargs = dict(activation=ep.activation, residual_first=ep.residual_first,
                  allow_tf32=ctx.config.fp32_precision == "tf32")
    return Replacement(LINEAR, (x, weight, bias, ep.residual), kwargs, kind="linear", kernel=ep.label("linear"),
                       absorbed=ep.nodes, aux=aux)


def _rule(name, fn) -> Rule:
    return Rule(Pattern(name, fn), build=_build, check=_check, applies=_is_linear)


RULES = (
    _rule("linear", _linear),
    _rule("matmul+bias", _matmul_bias),
    _rule("bias+matmul", _bias_matmul),
    _rule("addmm", _addmm),
    _rule("matmul", _matmul),
)
PASS = Pass("linear_act", RULES)
