"""conv_gemm: F.conv2d (+ bias, folded BN included) (+ activation) (+ residual add, before or
after the activation) -> one torch.ops.accelc.conv2d call (kernels/conv.py).

Taken: any stride, padding (ints, 'same', 'valid', and a zero F.pad just before the conv, folded
in: TF-style asymmetric 'same' padding), dilation, groups, what the kernel's why_unsupported
accepts (kernel sizes up to 7x7, any channel counts, fp16 / bf16 / fp32). The weight is packed once
here, (K, C / groups, R, S) -> (K, R, S, C / groups), as a buffer of the graph module; a grouped
conv (ResNeXt / RegNet) is the same op, its groups read from the packed weight's channels.
Depthwise convs (groups = in channels = out channels) -> torch.ops.accelc.conv2d_depthwise
(kernels/depthwise_conv.py), weight packed (C, 1, R, S) -> (R, S, C), with the same epilogue. Kept
as PyTorch, with the reason: weights computed at run time, what the kernels refuse. (Transposed
convs and other layouts are other ops and never match.)

F.conv1d (nn.Conv1d: audio and speech stems, 1-D convs), any groups, with the same
padding forms and epilogue -> torch.ops.accelc.conv1d (kernels/conv1d.py): the height-1 conv on the
same two kernels, its output channels-last (made contiguous where a reader needs it, as below).

Matches are taken from the end of the graph: where a residual add joins two convs (ResNet's main
path and its downsample), the later one, the block's main path, takes the add:
layer1.0.conv3+bn3+add+relu.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from accelc import meta
from accelc.meta import attr_value
from accelc.kernels import conv1d, depthwise_conv
from accelc.kernels.conv import pack_weight, why_unsupported
from accelc.passes import epilogue
from accelc.rewrite import Pass, Pattern, Replacement, Rule, add_constant

CONV = torch.ops.accelc.conv2d.default
DEPTHWISE = torch.ops.accelc.conv2d_depthwise.default
CONV1D = torch.ops.accelc.conv1d.default


def _conv(x, w, b, stride, padding, dilation, groups):
    return F.conv2d(x, w, b, stride, padding, dilation, groups)


def _padded_conv(x, pad, w, b, stride, padding, dilation, groups):
    # an explicit zero pad first (TF-style 'same' padding: HF's MobileNet / EfficientNet ports, timm's
    # Conv2dSame): folded into the conv's own, possibly asymmetric, padding
    return F.conv2d(F.pad(x, pad), w, b, stride, padding, dilation, groups)


def _conv1d(x, w, b, stride, padding, dilation, groups):
    return F.conv1d(x, w, b, stride, padding, dilation, groups)


def _padded_conv1d(x, pad, w, b, stride, padding, dilation, groups):
    return F.conv1d(F.pad(x, pad), w, b, stride, padding, dilation, groups)


def _one(v):
    return v if isinstance(v, (int, str)) else v[0]


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


def pad_widths(pad) -> tuple | None:
    """F.pad's widths over the last two dims as (top, bottom, left, right); None where they are
    not constants >= 0 or pad another dim too."""
    if not isinstance(pad, (list, tuple)) or len(pad) not in (2, 4, 6, 8) \
            or any(isinstance(p, bool) or not isinstance(p, int) for p in pad):
        return None
    if any(p < 0 for p in pad) or any(pad[4:]):
        return None
    left, right, top, bottom = (tuple(pad) + (0, 0))[:4]
    return (top, bottom, left, right)


def _is_1d(m) -> bool:
    return m.anchor.target is F.conv1d


def _geometry(m):
    """(stride, dilation) as (h, w) pairs; a conv1d's as the height-1 conv2d's."""
    if _is_1d(m):
        return (1, _one(m.input("stride"))), (1, _one(m.input("dilation")))
    return _pair(m.input("stride")), _pair(m.input("dilation"))


def _padding(m):
    mw = meta.tensor_meta(m.input("w"))
    stride, dilation = _geometry(m)
    if _is_1d(m):
        p = _one(m.input("padding"))
        own = explicit_padding(p if isinstance(p, str) else (0, p), (1, *mw.shape[2:]), dilation, stride)
    else:
        own = explicit_padding(m.input("padding"), mw.shape[2:], dilation, stride)
    if own is None or not m.has("pad"):
        return own
    extra = pad_widths(m.input("pad"))
    return None if extra is None else tuple(a + b for a, b in zip(own, extra))


def _check(m, ctx) -> str | None:
    x, w, b = (meta.meta_tensor(m.input(k)) for k in ("x", "w", "b"))
    if x is None or w is None or (m.input("b") is not None and b is None):
        return "input shapes unknown"
    if not isinstance(m.input("groups"), int):
        return f"groups={m.input('groups')!r} is not a number known at capture"
    stride, dilation = _geometry(m)
    return _common_reason(m, x, w) or why_unsupported(x, w.permute(0, 2, 3, 1), b, None, stride, _padding(m),
                                                      dilation)


def _check_1d(m, ctx) -> str | None:
    x, w, b = (meta.meta_tensor(m.input(k)) for k in ("x", "w", "b"))
    if x is None or w is None or (m.input("b") is not None and b is None):
        return "input shapes unknown"
    if x.dim() != 3 or w.dim() != 3:
        return "not a batched 1-D conv (the input has no batch dim)"
    g = m.input("groups")
    if not isinstance(g, int):
        return f"groups={g!r} is not a number known at capture"
    depthwise = _is_depthwise(m)
    packed = conv1d.pack_weight(w, depthwise)
    (_, stride), (_, dilation) = _geometry(m)
    pads = _padding(m)
    return _common_reason(m, x, w) or conv1d.why_unsupported(x, packed, b, None, stride, pads and pads[2:],
                                                             dilation, depthwise=depthwise)


def _common_reason(m, x, w) -> str | None:
    if x.dim() != w.dim() or x.dim() != (3 if _is_1d(m) else 4):
        return f"not a batched {1 if _is_1d(m) else 2}-D conv"
    w_node = m.input("w")
    if not (isinstance(w_node, fx.Node) and w_node.op == "get_attr"):
        return "weight computed at run time (cannot be packed ahead)"
    if m.has("pad") and pad_widths(m.input("pad")) is None:
        return f"a pad before the conv the kernel cannot fold: widths {m.input('pad')}"
    if _padding(m) is None:
        return "padding='same' with stride > 1"
    return None


def _is_depthwise(m) -> bool:
    """groups = in channels = out channels (weight (C, 1, R, S), a conv1d's (C, 1, S)); other grouped
    convs are the implicit GEMM's."""
    x, w = meta.tensor_meta(m.input("x")), meta.tensor_meta(m.input("w"))
    g = m.input("groups")
    return (x is not None and w is not None and len(x.shape) == len(w.shape) == (3 if _is_1d(m) else 4)
            and isinstance(g, int) and g > 1 and x.shape[1] == g == w.shape[0] and w.shape[1] == 1)


def _check_depthwise(m, ctx) -> str | None:
    x, w, b = (meta.meta_tensor(m.input(k)) for k in ("x", "w", "b"))
    if m.input("b") is not None and b is None:
        return "input shapes unknown"
    stride, dilation = _geometry(m)
    return _common_reason(m, x, w) or depthwise_conv.why_unsupported(
        x, w[:, 0].permute(1, 2, 0), b, None, stride, _padding(m), dilation)


def _build(m, ctx) -> Replacement:
    """The conv's op (conv2d, conv2d_depthwise or conv1d) on its weight packed once, the epilogue absorbed."""
    w = m.input("w")
    one_d, depthwise = _is_1d(m), _is_depthwise(m)
    value = attr_value(m.gm, w).detach()
    packed = (conv1d.pack_weight(value, depthwise) if one_d
              else (depthwise_conv.pack_weight if depthwise else pack_weight)(value))
    w_node = add_constant(m.gm, w.target.replace(".", "_") + "_accelc_packed", packed, before=m.anchor,
                          path=meta.path(w))
    ep = epilogue.absorb(m.anchor)
    kwargs = dict(activation=ep.activation, residual_first=ep.residual_first)
    if one_d or not depthwise:
        kwargs["allow_tf32"] = ctx.config.fp32_precision == "tf32"
    stride, dilation = _geometry(m)
    if one_d:    # the height-1 conv's width: ints, (left, right)
        geometry, kwargs["depthwise"] = (stride[1], list(_padding(m)[2:]), dilation[1]), depthwise
        op, kind = CONV1D, "conv1d"
    else:
        geometry = (list(stride), list(_padding(m)), list(dilation))
        op, kind = (DEPTHWISE, "conv2d_depthwise") if depthwise else (CONV, "conv2d")
    return Replacement(op, (m.input("x"), w_node, m.input("b"), ep.residual, *geometry), kwargs, kind=kind,
                       kernel=ep.label(kind), absorbed=ep.nodes, aux=(w_node,))


_VIEWS = {"view", "view_as"}


def _eager_layout_where_needed(gm: fx.GraphModule, ctx) -> int:
    """accelc::conv2d returns channels-last memory, and the ops after it (elementwise, pooling,
    BN) keep that layout. Where eager's value was row-major and the consumer depends on the layout,
    `.view()` (LeNet / VGG flatten: it fails on channels-last) and the graph's outputs (the caller
    may view them), the value is made contiguous first: a no-op where it already is."""
    g = gm.graph
    ops = (CONV, DEPTHWISE, CONV1D)
    downstream, todo = set(), [n for n in g.nodes if n.target in ops]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in downstream:
                downstream.add(u)
                todo.append(u)
    sources = {n for n in g.nodes if n.target in ops} | downstream
    for u in list(downstream):
        if u.op == "output" or (u.op in ("call_method", "call_function") and meta.op_name(u) in _VIEWS):
            for arg in {a for a in u.all_input_nodes if a in sources}:
                value = meta.tensor_meta(arg)
                if value is None or not value.contiguous or len(value.shape) < 3:
                    continue
                with g.inserting_before(u):
                    c = g.call_method("contiguous", (arg,))
                c.meta.update(arg.meta)
                c.meta.pop(meta.REWRITE, None)
                u.replace_input_with(arg, c)
    return 0


RULES = (Rule(Pattern("pad+conv2d_depthwise", _padded_conv), build=_build, check=_check_depthwise,
              applies=_is_depthwise, last_first=True),
         Rule(Pattern("conv2d_depthwise", _conv), build=_build, check=_check_depthwise, applies=_is_depthwise,
              last_first=True),
         Rule(Pattern("pad+conv2d", _padded_conv), build=_build, check=_check, last_first=True),
         Rule(Pattern("conv2d", _conv), build=_build, check=_check, last_first=True),
         Rule(Pattern("pad+conv1d", _padded_conv1d), build=_build, check=_check_1d, last_first=True),
         Rule(Pattern("conv1d", _conv1d), build=_build, check=_check_1d, last_first=True))
PASS = Pass("conv_gemm", RULES, transform=_eager_layout_where_needed)
