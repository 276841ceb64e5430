"""accelc::conv2d (kernels/conv.py), fold_bn and conv_gemm passes, resnet and cnn_small."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc.kernels import conv
from accelc.passes.fold_bn import fold
from conftest import DEVICE, REL_FLOOR, assert_close_to_ref, rel_l2

DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 1e-2, 1e-2), (torch.bfloat16, 6e-2, 4e-2)]
# (C, K, kernel, stride, padding, dilation): odd channel counts, every stride / padding / dilation
GEOMETRY = [
    (3, 16, 7, 2, 3, 1),   # RGB stem: the flattened-reduction path (C < 16)
    (17, 33, 3, 1, 1, 1), (16, 20, 3, 2, 1, 1), (24, 8, 3, 1, 2, 2), (5, 7, 5, 1, 2, 1),
    (32, 8, 1, 1, 0, 1),   # 1x1 stride 1: the GEMM path
    (24, 16, 1, 2, 0, 1), (16, 16, 3, 1, 0, 1), (20, 12, 7, 1, 3, 1),
]


def _case(c, k, r, dtype, n=2, h=13, w=11):
    x = torch.randn(n, c, h, w, device=DEVICE, dtype=dtype)
    wt = (torch.randn(k, c, r, r, device=DEVICE) / (c * r * r) ** 0.5).to(dtype)
    b = torch.randn(k, device=DEVICE, dtype=dtype)
    return x, wt, b


def _run(x, wt, b, res, st, pad, dil, act, res_first):
    return torch.ops.accelc.conv2d(x, conv.pack_weight(wt), b, res, [st, st], [pad] * 4, [dil, dil], act, res_first)


def _eager(x, wt, b, res, st, pad, dil, act, res_first):
    y = F.conv2d(x, wt, b, st, pad, dil)
    if res is not None and res_first:
        return {"relu": F.relu, "silu": F.silu, "none": lambda t: t}[act](y + res)
    y = {"relu": F.relu, "silu": F.silu, "none": lambda t: t}[act](y)
    return y + res if res is not None else y


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("c,k,r,st,pad,dil", GEOMETRY)
def test_geometry_and_dtypes(dtype, atol, rtol, c, k, r, st, pad, dil):
    x, wt, b = _case(c, k, r, dtype)
    out = _run(x, wt, b, None, st, pad, dil, "relu", False)
    d = torch.float64
    ref = _eager(x.to(d), wt.to(d), b.to(d), None, st, pad, dil, "relu", False)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close_to_ref(out, ref, _eager(x, wt, b, None, st, pad, dil, "relu", False), dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("res_first,act", [(True, "relu"), (False, "silu"), (False, "none")])
@pytest.mark.parametrize("r", [3, 1])
def test_fused_residual_either_order(dtype, atol, rtol, res_first, act, r):
    x, wt, b = _case(16, 24, r, dtype)
    res = torch.randn(2, 24, 13, 11, device=DEVICE, dtype=dtype)  # NCHW residual: read via strides
    out = _run(x, wt, b, res, 1, r // 2, 1, act, res_first)
    d = torch.float64
    ref = _eager(x.to(d), wt.to(d), b.to(d), res.to(d), 1, r // 2, 1, act, res_first)
    assert_close_to_ref(out, ref, _eager(x, wt, b, res, 1, r // 2, 1, act, res_first), dtype, atol, rtol)


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "strided"])
def test_input_layouts(layout):
    x, wt, b = _case(16, 8, 3, torch.float16, h=20)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = x[:, :, ::2, :]  # every other row: a non-contiguous view
    out = _run(x, wt, b, None, 1, 1, 1, "none", False)
    ref = F.conv2d(x.double(), wt.double(), b.double(), 1, 1)
    assert_close_to_ref(out, ref, F.conv2d(x, wt, b, 1, 1), torch.float16, 1e-2, 1e-2)


def test_same_padding_even_kernel_is_asymmetric():
    x, wt, _ = _case(8, 8, 4, torch.float32)
    from accelc.passes.conv_gemm import explicit_padding
    pad = explicit_padding("same", (4, 4), 1, 1)
    assert pad == (1, 2, 1, 2)
    out = torch.ops.accelc.conv2d(x, conv.pack_weight(wt), None, None, [1, 1], list(pad), [1, 1])
    ref = F.conv2d(x.double(), wt.double(), None, 1, "same")
    assert out.shape == ref.shape and rel_l2(out, ref) < 1e-6


def test_bad_inputs_say_what_is_wrong():
    x, wt, b = _case(8, 4, 3, torch.float32)
    with pytest.raises(ValueError, match="x has 8 channels but the packed weight"):
        conv.conv2d_launch(x, conv.pack_weight(wt)[..., :5], b, None, [1, 1], [1] * 4, [1, 1])
    with pytest.raises(ValueError, match="dtype torch.float64"):
        conv.conv2d_launch(x.double(), conv.pack_weight(wt).double(), b.double(), None, [1, 1], [1] * 4, [1, 1])


def test_bn_folding_is_exact_up_to_rounding():
    torch.manual_seed(1)
    cv, bn = nn.Conv2d(6, 10, 3, bias=True).double(), nn.BatchNorm2d(10).double().eval()
    bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.2, 2), bn.weight.data.uniform_(0.5, 2)
    w, b = fold(cv.weight, cv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
    x = torch.randn(2, 6, 9, 9, dtype=torch.float64)
    assert rel_l2(F.conv2d(x, w, b), bn(cv(x))) < 1e-14
    w16, b16 = fold(cv.weight.half(), None, bn.running_mean.half(), bn.running_var.half(), bn.weight.half(),
                    bn.bias.half(), bn.eps)  # folded in fp32, stored once in fp16
    ref16, _ = fold(cv.weight.half().double(), None, bn.running_mean.half().double(),
                    bn.running_var.half().double(), bn.weight.half().double(), bn.bias.half().double(), bn.eps)
    assert w16.dtype == torch.float16 and rel_l2(w16, ref16) < 1e-3


class ConvBlock(nn.Module):
    def __init__(self, groups=1, transposed=False):
        super().__init__()
        self.conv = (nn.ConvTranspose2d(8, 8, 3, padding=1) if transposed
                     else nn.Conv2d(8, 8, 3, padding=1, groups=groups, bias=False))
        self.bn = nn.BatchNorm2d(8)
        self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)) + x)


def test_conv_bn_relu_residual_one_op():
    model = ConvBlock().to(DEVICE).eval()
    x = torch.randn(2, 8, 10, 10, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    assert [(r.name, r.kernel) for r in opt.rewritten] == [("conv+bn+add+relu", "accelc::conv2d[residual+relu]")]
    assert opt.info.pass_counts["fold_bn"] == 1 and opt.info.pass_counts["conv_gemm"] == 1
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


@pytest.mark.parametrize("kwargs,reason", [(dict(groups=2), "groups=2"), (dict(groups=8), "groups=8")])
def test_grouped_and_depthwise_kept_with_reason(kwargs, reason):
    model = ConvBlock(**kwargs).to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(2, 8, 10, 10, device=DEVICE),))
    assert not any(r.kind == "conv2d" for r in opt.rewritten)
    assert any(reason in r.reason for r in opt.layers)


def test_transposed_conv_stays_pytorch():
    model = ConvBlock(transposed=True).to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(2, 8, 10, 10, device=DEVICE),))
    assert not any(r.kind == "conv2d" for r in opt.rewritten)
    assert any(r.kind == "ConvTranspose2d" and r.status == "kept" for r in opt.layers)


@pytest.mark.parametrize("name,kwargs", [("resnet", {}), ("resnet", {"block": "basic"}), ("cnn_small", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_models_every_conv_rewritten_and_matching(name, kwargs, dtype):
    model = accelc.models.get(name, **kwargs).to(DEVICE, dtype)
    (x,) = model.example_inputs()
    opt = accelc.optimize(model, (x,))
    n_conv = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert sum(r.kind == "conv2d" for r in opt.rewritten) == n_conv
    assert not any(r.kind in ("BatchNorm2d", "ReLU") for r in opt.layers)  # all folded or fused
    ref_model = accelc.models.get(name, **kwargs).to(DEVICE, torch.float64)
    (x2,) = model.example_inputs(batch_size=3)
    with torch.no_grad():
        out, eager, ref = opt(x2), model(x2), ref_model(x2.double())
    assert rel_l2(out, ref) <= max(2 * rel_l2(eager, ref), REL_FLOOR[dtype])


@pytest.mark.parametrize("c,stride,hw,rect", [(16, 1, 9, True), (64, 1, 7, True), (16, 2, 9, False),
                                             (12, 1, 9, False), (16, 1, 1, True)])
def test_rectangle_path_choice(c, stride, hw, rect):
    # stride-1, aligned NHWC inputs take the TMA-rectangle path (a 1x1 map too: its NCHW
    # strides on size-1 dims are normalised); the rest gather with pointers; both match
    x = torch.randn(2, c, hw, hw, device=DEVICE, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    wt = (torch.randn(8, c, 3, 3, device=DEVICE) / (9 * c) ** 0.5).half()
    assert conv._rect_ok(conv.nhwc_view(x), conv.pack_weight(wt), (stride, stride)) == rect
    out = _run(x, wt, None, None, stride, 1, 1, "none", False)
    ref = F.conv2d(x.double(), wt.double(), None, stride, 1)
    assert_close_to_ref(out, ref, F.conv2d(x, wt, None, stride, 1), torch.float16, 1e-2, 1e-2)


def test_reverted_conv_leaves_no_packed_weight(monkeypatch):
    def wrong(*args, **kwargs):
        return conv.conv2d_ref(*args, **kwargs) + 1.0
    monkeypatch.setattr(conv, "conv2d_launch", wrong)
    model = accelc.models.get("cnn_small").to(DEVICE)
    opt = accelc.optimize(model, model.example_inputs())
    assert sum(r.status == "reverted" and r.kind == "conv2d" for r in opt.layers) == 3
    assert not [name for name, _ in opt.graph_module.named_buffers() if "accelc_packed" in name]
    assert "accelc_replaced" not in opt.graph_module.meta
    with torch.no_grad():
        (x,) = model.example_inputs()
        assert rel_l2(opt(x), model(x)) < 1e-6
