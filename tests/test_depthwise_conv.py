"""accelc::conv2d_depthwise (kernels/depthwise_conv.py) and its rule in the conv_gemm pass:
depthwise convs (groups = in = out channels) with BN folded and the epilogue fused."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc import runtime
from accelc.kernels.depthwise_conv import (CONFIGS, TUNER, _prune, config, conv2d_depthwise_launch,
                                           conv2d_depthwise_ref, pack_weight, why_unsupported)
from accelc.kernels.epilogue import activation_ref
from conftest import DEVICE, assert_close_to_ref, rel_l2

ATOL = {torch.float16: 5e-3, torch.bfloat16: 4e-2, torch.float32: 1e-5}


@pytest.fixture
def small_blocks():
    """In the interpreter, blocks of 32 pixels x 16 channels: the kernel tests' shapes span several
    programs, with tails (a whole model's layers, these tests' models too, get one or a few large ones)."""
    if not runtime.interpreted():
        yield
        return
    with TUNER.force(config(32, 16, 4)):
        yield


# (N, C, H, W, kernel, stride, padding, dilation)
SHAPES = [(2, 24, 9, 7, 3, 1, 1, 1), (1, 40, 10, 10, 7, 1, 3, 1), (2, 8, 11, 11, 5, 2, 2, 1),
          (1, 16, 8, 8, 3, 1, 2, 2), (1, 3, 6, 6, 3, 2, 0, 1)]


def _eager(x, w, b, r, stride, pad, dil, act, residual_first=False):
    y = F.conv2d(x, w, b, stride, pad, dil, x.shape[1])
    if r is not None and residual_first:
        return activation_ref(act, y + r)
    y = activation_ref(act, y)
    return y if r is None else y + r


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("dtype, channels_last", [(torch.float16, False), (torch.float16, True),
                                                   (torch.bfloat16, True), (torch.float32, False)])
@pytest.mark.parametrize("shape", SHAPES)
def test_depthwise_against_fp64(shape, dtype, channels_last):
    N, C, H, W, R, st, pad, dil = shape
    x = torch.randn(N, C, H, W, device=DEVICE).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(C, 1, R, R, device=DEVICE) / R).to(dtype)
    b = torch.randn(C, device=DEVICE).to(dtype)
    OH, OW = F.conv2d(x[:, :, :, :].float(), w.float(), None, st, pad, dil, C).shape[2:]
    r = torch.randn(N, C, OH, OW, device=DEVICE).to(dtype)
    for bias, res, act, first in ((None, None, "none", False), (b, None, "relu", False), (b, r, "silu", False),
                                  (b, r, "relu", True)):
        out = conv2d_depthwise_launch(x, pack_weight(w), bias, res, [st, st], [pad] * 4, [dil, dil], act, first)
        d = torch.float64
        ref = _eager(x.to(d), w.to(d), None if bias is None else bias.to(d), None if res is None else res.to(d),
                     st, pad, dil, act, first)
        eager = _eager(x.float(), w.float(), None if bias is None else bias.float(),
                       None if res is None else res.float(), st, pad, dil, act, first).to(dtype)
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert_close_to_ref(out, ref, eager, dtype, atol=ATOL[dtype], rtol=ATOL[dtype])
    ref_fn = conv2d_depthwise_ref(x.double(), pack_weight(w).double(), b.double(), None, [st, st], [pad] * 4,
                                  [dil, dil], "relu")
    assert torch.allclose(ref_fn, _eager(x.double(), w.double(), b.double(), None, st, pad, dil, "relu"))


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("padding,stride,r", [((0, 1, 0, 1), 2, 3), ((1, 2, 1, 2), 1, 4), ((3, 0, 0, 2), 2, 5)])
def test_asymmetric_padding_against_fp64(padding, stride, r):
    """TF-style 'same' padding (more at the bottom / right), and any other split."""
    x = torch.randn(2, 12, 9, 10, device=DEVICE, dtype=torch.float16)
    w = (torch.randn(12, 1, r, r, device=DEVICE) / r).to(torch.float16)
    b = torch.randn(12, device=DEVICE, dtype=torch.float16)
    top, bottom, left, right = padding

    def eager(d):
        y = F.conv2d(F.pad(x.to(d), (left, right, top, bottom)), w.to(d), b.to(d), stride, 0, 1, 12)
        return F.hardswish(y)
    out = conv2d_depthwise_launch(x, pack_weight(w), b, None, [stride] * 2, list(padding), [1, 1], "hardswish")
    assert_close_to_ref(out, eager(torch.float64), eager(torch.float32).half(), torch.float16,
                        atol=ATOL[torch.float16], rtol=ATOL[torch.float16])


@pytest.mark.usefixtures("small_blocks")
def test_nan_and_inf_as_eager():
    x = torch.randn(1, 8, 6, 6, device=DEVICE)
    x[0, 2, 3, 3] = float("nan")
    x[0, 5, 1, 1] = float("inf")
    w = torch.randn(8, 1, 3, 3, device=DEVICE)
    out = conv2d_depthwise_launch(x, pack_weight(w), None, None, [1, 1], [1] * 4, [1, 1])
    eager = F.conv2d(x, w, None, 1, 1, 1, 8)
    assert torch.equal(out.isnan(), eager.isnan())
    assert torch.equal(out.isinf(), eager.isinf())


def test_why_unsupported_says_why():
    x = torch.empty(2, 16, 8, 8, device="meta", dtype=torch.float16)
    w = torch.empty(3, 3, 16, device="meta", dtype=torch.float16)
    assert why_unsupported(x, w, padding=(1, 1, 1, 1)) is None
    assert "channels" in why_unsupported(x, torch.empty(3, 3, 8, device="meta", dtype=torch.float16))
    assert "9x9" in why_unsupported(x, torch.empty(9, 9, 16, device="meta", dtype=torch.float16))
    assert why_unsupported(x, w, padding=(0, 1, 2, 0)) is None            # asymmetric: taken
    assert "bias" in why_unsupported(x, w, torch.empty(8, device="meta", dtype=torch.float16))
    with pytest.raises(ValueError, match="accelc::conv2d_depthwise: .*channels"):
        torch.ops.accelc.conv2d_depthwise(torch.randn(1, 4, 5, 5), torch.randn(3, 3, 2), None, None, [1, 1],
                                          [1, 1, 1, 1], [1, 1])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the tuned configs need a GPU (the interpreter runs one)")
def test_every_candidate_config_is_correct():
    x = torch.randn(4, 96, 28, 28, device=DEVICE, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(96, 1, 7, 7, device=DEVICE, dtype=torch.float16) / 7
    ref = F.conv2d(x.double(), w.double(), None, 1, 3, 1, 96)
    for cfg in _prune(CONFIGS, dict(C=96)):
        with TUNER.force(cfg):
            out = conv2d_depthwise_launch(x, pack_weight(w), None, None, [1, 1], [3] * 4, [1, 1])
        torch.testing.assert_close(out.double(), ref, atol=5e-3, rtol=5e-3, msg=str(cfg))


# ---------------------------------------------------------------------------------------------
# the rule

class MobileBlock(nn.Module):
    """MobileNet / EfficientNet: expand 1x1, depthwise 3x3 + BN + activation, project 1x1 + BN,
    the residual; ConvNeXt's 7x7 depthwise with a bias."""

    def __init__(self, c=16, e=32):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.SiLU())
        self.dw = nn.Sequential(nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False), nn.BatchNorm2d(e), nn.SiLU())
        self.dw_s2 = nn.Conv2d(e, e, 5, stride=2, padding=2, groups=e)
        self.project = nn.Sequential(nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))
        self.dw7 = nn.Conv2d(c, c, 7, padding=3, groups=c)

    def forward(self, x):
        h = self.dw(self.expand(x))
        y = self.project(h) + x
        return self.dw7(y), self.dw_s2(h)


def _kernels(opt):
    return {r.name: r.kernel for r in opt.layers if r.status == "rewritten"}


def _randomize_bn(model):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_depthwise_convs_rewritten_with_bn_and_activation(dtype):
    model = _randomize_bn(MobileBlock()).to(DEVICE).to(dtype).eval()
    x = torch.randn(2, 16, 12, 12, device=DEVICE, dtype=dtype)
    opt = accelc.optimize(model, (x,))
    kernels = _kernels(opt)
    assert kernels["dw.0+1+2"] == "accelc::conv2d_depthwise[silu]", opt.summary()
    assert kernels["dw_s2"] == "accelc::conv2d_depthwise" and kernels["dw7"] == "accelc::conv2d_depthwise"
    assert not [r for r in opt.layers if r.status != "rewritten" and r.kind.startswith("conv")], opt.summary()
    assert opt.info.accelc_flops == opt.info.flops
    with torch.no_grad():
        ref = model.double()(x.double())
        out, eager = opt(x), model.to(dtype)(x)
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    for o, r, e in zip(out, ref, eager):
        assert_close_to_ref(o.contiguous(), r, e, dtype, atol=tol, rtol=tol)


def test_grouped_and_multiplier_convs_take_the_grouped_gemm():
    """Other grouped convs and depthwise ones with a channel multiplier (they stayed PyTorch) are
    accelc::conv2d with a group per program slice; a true depthwise conv stays the depthwise kernel's."""
    class Grouped(nn.Module):
        def __init__(self):
            super().__init__()
            self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
            self.multiplier = nn.Conv2d(8, 16, 3, padding=1, groups=8)
            self.same_even = nn.Conv2d(16, 16, 4, padding="same", groups=16)   # asymmetric: taken

        def forward(self, x):
            return self.same_even(self.multiplier(self.grouped(x)))
    model = Grouped().to(DEVICE).eval()
    x = torch.randn(1, 8, 6, 6, device=DEVICE)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=False))
    rows = {r.name: r for r in opt.layers}
    assert rows["grouped"].kernel == rows["multiplier"].kernel == "accelc::conv2d", opt.summary()
    assert rows["same_even"].kernel == "accelc::conv2d_depthwise", opt.summary()
    with torch.no_grad():
        assert torch.allclose(opt(x), model(x), atol=1e-5)


class PaddedConvs(nn.Module):
    """TF-style 'same' padding as HF's MobileNet / EfficientNet ports and timm's Conv2dSame write
    it: an explicit zero F.pad, then the conv with padding 0; look-alikes that must stay."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.dw = nn.Conv2d(8, 8, 3, stride=2, groups=8)
        self.pw = nn.Conv2d(8, 16, 3, stride=2)
        self.bn = nn.BatchNorm2d(8)
        self.zero_pad = nn.ZeroPad2d((1, 2, 1, 2))

    def forward(self, x):
        if self.style == "export" and x.shape[0] > 1:     # a shape branch: captured by torch.export
            x = x * 0.5
        value, mode = {"reflect": (0.0, "reflect"), "fill": (1.0, "constant")}.get(self.style, (0.0, "constant"))
        pad = {"negative": (0, 1, -1, 1), "batch": (0, 1, 0, 1, 0, 0, 0, 1)}.get(self.style, (0, 1, 0, 1))
        h = F.relu6(self.bn(self.dw(F.pad(x, pad, mode, value))))
        return self.pw(self.zero_pad(h))


@pytest.mark.parametrize("style", ["trace", "export"])
def test_zero_pad_before_a_conv_is_folded_into_its_padding(style):
    model = _randomize_bn(PaddedConvs(style)).to(DEVICE).eval()
    x = torch.randn(2, 8, 11, 12, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    assert opt.info.capture_method == ("torch.export" if style == "export" else "symbolic_trace")
    kernels = sorted(r.kernel for r in opt.rewritten)
    assert kernels == ["accelc::conv2d", "accelc::conv2d_depthwise[relu6]"], opt.summary()
    assert not [r for r in opt.layers if r.status != "rewritten"], opt.summary()   # no pad left
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


@pytest.mark.parametrize("style", ["reflect", "fill", "negative", "batch"])
def test_pads_that_are_not_zero_padding_stay(style):
    model = _randomize_bn(PaddedConvs(style)).to(DEVICE).eval()
    x = torch.randn(2, 8, 11, 12, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    rows = [r for r in opt.layers if r.kind == "pad" or r.name.endswith("pad")]
    assert rows and all(r.status == "kept" for r in rows), opt.summary()
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5
