"""fold_bn: eval-mode Conv2d -> BatchNorm2d becomes one Conv2d with folded weights.

    w' = w * g,  b' = (b - running_mean) * g + beta,  g = gamma / sqrt(running_var + eps)

computed in fp32 (fp64 for fp32 models) whatever the model's dtype, then stored in it: exact up
to one rounding of w' and b'. The folded tensors are new buffers on the graph module. This is a
simplification, not a layer: the new conv stands for the old one and records the batch norm's
module path (meta.ABSORBED), so the layer conv_gemm makes of it is still named
layer1.0.conv1+bn1 in summaries.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import fx

from accelc import meta
from accelc.meta import attr_value
from accelc.rewrite import Pass, Pattern, Replacement, Rule, add_constant

_PARAMS = ("w", "b", "mean", "var", "gamma", "beta")


def _conv_bn(x, w, b, stride, padding, dilation, groups, mean, var, gamma, beta, momentum, eps):
    return F.batch_norm(F.conv2d(x, w, b, stride, padding, dilation, groups), mean, var, gamma, beta,
                        False, momentum, eps)


def fold(w, b, mean, var, gamma, beta, eps):
    """The folded (w', b') in w's dtype, computed in fp32 (fp64 for fp32 weights)."""
    acc = torch.float64 if w.dtype in (torch.float32, torch.float64) else torch.float32
    g = torch.rsqrt(var.to(acc) + eps)
    if gamma is not None:
        g = g * gamma.to(acc)
    shift = -mean.to(acc) * g
    if b is not None:
        shift = shift + b.to(acc) * g
    if beta is not None:
        shift = shift + beta.to(acc)
    return (w.to(acc) * g.reshape(-1, 1, 1, 1)).to(w.dtype), shift.to(w.dtype)


def _folded(which, eps, w, b, mean, var, gamma, beta):
    """fold's w' (which=0) or b' (1), for meta.DERIVED: picklable, unlike a lambda."""
    return fold(w, b, mean, var, gamma, beta, eps)[which]


def _check(m, ctx) -> str | None:
    ins = [m.input(k) for k in _PARAMS]
    if any(v is not None and not (isinstance(v, fx.Node) and v.op == "get_attr") for v in ins) \
            or m.input("w") is None or m.input("mean") is None:
        return "conv or batch-norm parameters computed at run time"
    return None


def _build(m, ctx) -> Replacement:
    ts = {k: None if m.input(k) is None else attr_value(m.gm, m.input(k)) for k in _PARAMS}
    w, b = fold(ts["w"], ts["b"], ts["mean"], ts["var"], ts["gamma"], ts["beta"], m.input("eps"))
    base, conv_path = m.input("w").target.replace(".", "_"), meta.path(m.nodes[0])
    sources = [m.input(k) for k in _PARAMS]
    w_node = add_constant(m.gm, f"{base}_accelc_folded_w", w.detach(), before=m.anchor, path=conv_path,
                          derived=(functools.partial(_folded, 0, m.input("eps")), sources))
    b_node = add_constant(m.gm, f"{base}_accelc_folded_b", b.detach(), before=m.anchor, path=conv_path,
                          derived=(functools.partial(_folded, 1, m.input("eps")), sources))
    args = (m.input("x"), w_node, b_node, m.input("stride"), m.input("padding"), m.input("dilation"),
            m.input("groups"))
    return Replacement(F.conv2d, args)   # kind "": a simplification, not a layer


RULES = (Rule(Pattern("batch_norm(conv2d(x))", _conv_bn), build=_build, check=_check),)
PASS = Pass("fold_bn", RULES)
