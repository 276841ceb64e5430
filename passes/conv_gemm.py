"""conv_gemm: F.conv2d (+ bias, folded BN included) (+ activation) (+ residual add, before or
after the activation) -> one torch.ops.accelc.conv2d call (kernels/conv.py).

Taken: groups=1, any stride, padding (ints, 'same', 'valid'), dilation, kernel sizes 1x1 to 7x7,
any channel counts. The weight is packed once here, (K, C, R, S) -> (K, R, S, C), as a buffer of
the graph module. Kept as PyTorch, with the reason: grouped and depthwise convs, kernels over 7x7,
weights computed at run time, unsupported dtypes. (Transposed convs and other layouts are other
ops and never match.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from accelc import runtime
from accelc.capture import TensorMeta, tensor_meta
from accelc.kernels.conv import SUPPORTED_DTYPES, pack_weight
from accelc.rewrite import Pattern, absorb_epilogue, attr_value, find, kernel_label, replace_group


def _conv(x, w, b, stride, padding, dilation, groups):
    return F.conv2d(x, w, b, stride, padding, dilation, groups)


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def explicit_padding(padding, kernel, dilation, stride):
    """(top, bottom, left, right) for int / tuple / 'valid' / 'same' padding."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        if _pair(stride) != (1, 1):
            return None  # PyTorch refuses it too
        pads = []
        for k, d in zip(kernel, _pair(dilation)):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)
    ph, pw = _pair(padding)
    return (ph, ph, pw, pw)


def _why_not(x, w, b, groups) -> str | None:
    mx, mw = tensor_meta(x), tensor_meta(w)
    if mx is None or mw is None:
        return "input shapes unknown"
    if groups != 1:
        return f"groups={groups} (grouped / depthwise convs stay PyTorch)"
    if len(mx.shape) != 4 or len(mw.shape) != 4:
        return "not a batched 2-D conv"
    if mw.shape[2] > 7 or mw.shape[3] > 7:
        return f"kernel {mw.shape[2]}x{mw.shape[3]} over 7x7"
    if mx.dtype not in SUPPORTED_DTYPES or mw.dtype != mx.dtype:
        return f"dtype {mx.dtype} / weight {mw.dtype} (accelc::conv2d takes fp16, bf16, fp32)"
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        return "weight computed at run time (cannot be packed ahead)"
    if b is not None and not (tensor_meta(b) and tensor_meta(b).dtype == mx.dtype):
        return "bias dtype differs"
    if not runtime.can_run_on(mx.device):
        return f"tensors on {mx.device}: accelc kernels need a CUDA device"
    return None


def run(gm, config) -> int:
    g = gm.graph
    count = 0
    # last conv first: where a residual add joins two convs (ResNet's main path and downsample),
    # the later one, the block's main path, takes the add: layer1.0.conv3+bn3+add+relu
    for m in reversed(find(gm, PATTERN)):
        if not m.is_live():
            continue
        x, w, b = m.input("x"), m.input("w"), m.input("b")
        reason = _why_not(x, w, b, m.input("groups"))
        mw = tensor_meta(w)
        pad = None if reason else explicit_padding(m.input("padding"), mw.shape[2:], m.input("dilation"),
                                                    m.input("stride"))
        if reason is None and pad is None:
            reason = "padding='same' with stride > 1"
        if reason:
            m.anchor.meta.setdefault("accelc_skip", reason)
            continue
        packed = pack_weight(attr_value(gm, w).detach())
        name = w.target.replace(".", "_") + "_accelc_packed"
        gm.register_buffer(name, packed)
        with g.inserting_before(m.anchor):
            w_node = g.get_attr(name)
        w_node.meta["accelc_meta"] = TensorMeta(tuple(packed.shape), packed.dtype, packed.device)
        ep = absorb_epilogue(m.anchor)
        kwargs = dict(activation=ep.activation, residual_first=ep.residual_first,
                      allow_tf32=config.fp32_precision == "tf32")
        args = (x, w_node, b, ep.residual, list(_pair(m.input("stride"))), list(pad),
                list(_pair(m.input("dilation"))))
        replace_group(gm, m.nodes + ep.nodes, torch.ops.accelc.conv2d.default, args, kwargs,
                      kind="conv2d", kernel=kernel_label("conv2d", ep), aux=(w_node,))
        count += 1
    return count


PATTERN = Pattern("conv2d", _conv)
