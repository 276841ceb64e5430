"""fold_bn: eval-mode Conv2d -> BatchNorm2d becomes one Conv2d with folded weights.

    w' = w * g,  b' = (b - running_mean) * g + beta,  g = gamma / sqrt(running_var + eps)

computed in fp32 (fp64 for fp32 models) whatever the model's dtype, then stored in it: exact up
to one rounding of w' and b'. The folded tensors are new buffers on the graph module; the BN node
is gone and the conv node records it (meta["accelc_absorbed"]) so the layer is still named
layer1.0.conv1+bn1 in summaries.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from accelc.capture import TensorMeta
from accelc.rewrite import Pattern, attr_value, find


def _conv_bn(x, w, b, stride, padding, dilation, groups, mean, var, gamma, beta, momentum, eps):
    return F.batch_norm(F.conv2d(x, w, b, stride, padding, dilation, groups), mean, var, gamma, beta,
                        False, momentum, eps)


def _tensor(gm, node):
    if node is None:
        return None
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return False  # computed at run time: cannot be folded ahead of time
    return attr_value(gm, node)


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


def run(gm, config) -> int:
    count = 0
    for m in find(gm, PATTERN):
        if not m.is_live():
            continue
        conv = next(n for n in m.nodes if n.target is F.conv2d)
        bn = m.anchor
        ts = {k: _tensor(gm, m.input(k)) for k in ("w", "b", "mean", "var", "gamma", "beta")}
        if any(t is False for t in ts.values()) or ts["w"] is None or ts["mean"] is None:
            bn.meta["accelc_skip"] = "conv or batch-norm parameters computed at run time"
            continue
        w, b = fold(ts["w"], ts["b"], ts["mean"], ts["var"], ts["gamma"], ts["beta"], m.input("eps"))
        base = m.input("w").target.replace(".", "_")
        names = (f"{base}_accelc_folded_w", f"{base}_accelc_folded_b")
        gm.register_buffer(names[0], w.detach())
        gm.register_buffer(names[1], b.detach())
        g = gm.graph
        with g.inserting_before(conv):
            w_node, b_node = g.get_attr(names[0]), g.get_attr(names[1])
        for node, t in ((w_node, w), (b_node, b)):
            node.meta["accelc_meta"] = TensorMeta(tuple(t.shape), t.dtype, t.device)
            node.meta["accelc_path"] = conv.meta.get("accelc_path", "")
        conv.args = (conv.args[0], w_node, b_node, *conv.args[3:])
        conv.meta["accelc_absorbed"] = conv.meta.get("accelc_absorbed", []) + [bn.meta.get("accelc_path", "")]
        conv.meta["accelc_meta"] = bn.meta["accelc_meta"]
        bn.replace_all_uses_with(conv)
        g.erase_node(bn)
        count += 1
    return count


PATTERN = Pattern("batch_norm(conv2d(x))", _conv_bn)
