"""passes/conv_gemm.py (with fold_bn before it): which convs become accelc::conv2d with their epilogue,
what stays PyTorch and why, ResNet and cnn_small end to end, a reverted conv's packed weight."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc.kernels import conv
from conftest import DEVICE, REL_FLOOR, rel_l2


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


def test_grouped_conv_bn_relu_residual_one_op():
    """Grouped convs (ResNeXt / RegNet) stayed PyTorch: now the implicit GEMM with a group per
    program slice, BN folded, the epilogue fused."""
    model = ConvBlock(groups=2).to(DEVICE).eval()
    x = torch.randn(2, 8, 10, 10, device=DEVICE)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=False))
    assert [(r.name, r.kernel) for r in opt.rewritten] == [("conv+bn+add+relu", "accelc::conv2d[residual+relu]")]
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5
        y = torch.randn(3, 8, 7, 9, device=DEVICE)          # another batch and image size
        assert rel_l2(opt(y), model(y)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cin, cout, groups, k, stride", [
    (32, 64, 4, 3, 1),      # ResNeXt-style, more channels out than in
    (64, 64, 8, 3, 2),      # RegNet's stride-2 group conv, 8 channels a group
    (48, 48, 3, 1, 1),      # a grouped 1x1
    (16, 32, 16, 3, 1),     # depthwise with a channel multiplier (one channel a group in, two out)
    (24, 24, 2, 5, 1),
])
def test_grouped_conv_kernel_matches_pytorch(dtype, cin, cout, groups, k, stride):
    torch.manual_seed(0)
    x = torch.randn(2, cin, 9, 11, device=DEVICE, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(cout, cin // groups, k, k, device=DEVICE, dtype=dtype) / (cin // groups * k * k) ** 0.5
    b = torch.randn(cout, device=DEVICE, dtype=dtype)
    packed = conv.pack_weight(w)
    assert conv.why_unsupported(x, packed, b, None, (stride, stride), (k // 2,) * 4) is None
    got = torch.ops.accelc.conv2d(x, packed, b, None, [stride] * 2, [k // 2] * 4, [1, 1], "silu")
    want = F.silu(F.conv2d(x.double(), w.double(), b.double(), stride, k // 2, 1, groups))
    with torch.backends.cudnn.flags(allow_tf32=False):      # cuDNN's fp32 convs are TF32 by default
        eager = F.silu(F.conv2d(x, w, b, stride, k // 2, 1, groups)) if dtype == torch.float32 else None
    assert got.shape == want.shape
    assert rel_l2(got, want) < (1e-5 if dtype == torch.float32 else 2e-3), rel_l2(got, want)
    if eager is not None:
        assert rel_l2(got, eager) < 1e-5
    assert "whole number of groups" in conv.why_unsupported(x, conv.pack_weight(torch.randn(cout, 5, k, k, device=DEVICE,
                                                                                      dtype=dtype)), b)


def test_depthwise_block_one_op():
    """groups = channels: accelc::conv2d_depthwise with the BN folded and the residual + ReLU
    (tests/test_depthwise_conv.py has the kernel's own tests)."""
    model = ConvBlock(groups=8).to(DEVICE).eval()
    x = torch.randn(2, 8, 10, 10, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    assert [(r.name, r.kernel) for r in opt.rewritten] == [
        ("conv+bn+add+relu", "accelc::conv2d_depthwise[residual+relu]")], opt.summary()
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


def test_transposed_conv_stays_pytorch():
    model = ConvBlock(transposed=True).to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(2, 8, 10, 10, device=DEVICE),))
    assert not any(r.kind == "conv2d" for r in opt.rewritten)
    assert any(r.kind == "ConvTranspose2d" and r.status == "kept" for r in opt.layers)


# the interpreter runs every program instance in turn: 16x16 images there (every conv shape kind stays)
SMALL_IMAGES = {} if DEVICE.type == "cuda" else {"image_size": 16}


@pytest.mark.parametrize("name,kwargs", [("resnet", {}), ("resnet", {"block": "basic"}), ("cnn_small", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_models_every_conv_rewritten_and_matching(name, kwargs, dtype):
    kwargs = {**kwargs, **SMALL_IMAGES}
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



def test_reverted_conv_leaves_no_packed_weight(monkeypatch):
    def wrong(*args, **kwargs):
        return conv.conv2d_ref(*args, **kwargs) + 1.0
    monkeypatch.setattr(conv, "conv2d_launch", wrong)
    model = accelc.models.get("cnn_small").to(DEVICE)
    # eager glue: the comparison below is exact, and Inductor's fused glue may round differently
    opt = accelc.optimize(model, model.example_inputs(), accelc.OptimizeConfig(glue="eager", cuda_graphs=False))
    assert sum(r.status == "reverted" and r.kind == "conv2d" for r in opt.layers) == 3
    assert not [name for name, _ in opt.graph_module.named_buffers() if "accelc_packed" in name]
    assert "accelc_replaced" not in opt.graph_module.meta
    with torch.no_grad():
        (x,) = model.example_inputs()
        assert rel_l2(opt(x), model(x)) < 1e-6


class _LeNet(nn.Module):
    """conv -> pool -> x.view(x.size(0), -1) -> Linear, and a conv output returned as it is."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        y = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        z = torch.relu(self.conv2(y))
        return self.fc(z.view(z.size(0), -1)), self.conv2(y)


def test_layout_eager_gave_where_a_view_or_the_caller_needs_it():
    """accelc's convs write channels-last; a .view() after them (and the caller viewing a returned
    conv output) worked in eager and must work optimized."""
    model = _LeNet().to(DEVICE).eval()
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    opt = accelc.optimize(model, x, accelc.OptimizeConfig(only_if_faster=False))
    assert sum(r.kind == "conv2d" for r in opt.rewritten) == 3, opt.summary()   # conv2 runs twice
    with torch.no_grad():
        logits, feat = opt(x)
        ref_logits, ref_feat = model(x)
    assert feat.is_contiguous() and feat.view(2, -1).shape == (2, 256)
    assert rel_l2(logits, ref_logits) < 1e-5 and rel_l2(feat, ref_feat) < 1e-5


class _Conv1dStem(nn.Module):
    """An audio / speech stem's 1-D convs, as real encoders write them: GELU after each, a stride-2
    conv, a depthwise conv with 'same' padding and a residual, an explicit F.pad before a conv, then
    transpose(1, 2) into a linear, and a .view of a conv output returned to the caller."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(16, 32, 3, padding=1)
        self.c2 = nn.Conv1d(32, 32, 3, stride=2, padding=1)
        self.dw = nn.Conv1d(32, 32, 5, padding="same", groups=32)
        self.c3 = nn.Conv1d(32, 32, 2, bias=False)
        self.fc = nn.Linear(32, 8)

    def forward(self, x):
        h = F.gelu(self.c1(x))
        h = F.gelu(self.c2(h))
        h = self.dw(h) + h
        h = torch.relu(self.c3(F.pad(h, (1, 0))))     # causal padding, written out
        return self.fc(h.transpose(1, 2)), h.view(h.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv1d_layers_are_accelc_convs_with_their_epilogues(dtype):
    """Conv1d stayed PyTorch (and, not counted, left the FLOP coverage at 100%): each is now
    accelc::conv1d, the height-1 conv on the 2-D kernels, activation / residual / pad fused; every
    FLOP counted; eager's numbers and layout where the caller sees them, at other lengths too."""
    torch.manual_seed(0)
    model = _Conv1dStem().to(DEVICE, dtype).eval()
    x = torch.randn(2, 16, 40, device=DEVICE, dtype=dtype)
    opt = accelc.optimize(model, x, accelc.OptimizeConfig(only_if_faster=False))
    assert [(r.name, r.kernel) for r in opt.rewritten if r.kind == "conv1d"] == [
        ("c1+gelu", "accelc::conv1d[gelu]"), ("c2+gelu", "accelc::conv1d[gelu]"),
        ("dw+add", "accelc::conv1d[residual]"), ("pad+c3+relu", "accelc::conv1d[relu]")], opt.summary()
    assert opt.info.accelc_flops == opt.info.flops > 0
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for length in (40, 23):
        y = torch.randn(3, 16, length, device=DEVICE, dtype=dtype)
        with torch.no_grad():
            (got, flat), (want, want_flat) = opt(y), model(y)
        assert flat.is_contiguous() and rel_l2(got, want) < tol and rel_l2(flat, want_flat) < tol


def test_a_grouped_conv1d_is_taken_and_a_reflect_padded_one_kept_with_the_reason():
    model = nn.Sequential(nn.Conv1d(8, 8, 3, padding=1, groups=2), nn.Conv1d(8, 8, 3, padding=1,
                                                                           padding_mode="reflect")).to(DEVICE).eval()
    x = torch.randn(2, 8, 12, device=DEVICE)
    opt = accelc.optimize(model, x, accelc.OptimizeConfig(only_if_faster=False))
    assert [(r.name, r.kernel) for r in opt.rewritten] == [("0", "accelc::conv1d")], opt.summary()
    reasons = [r.reason for r in opt.layers if r.status == "kept"]
    assert reasons == ["padding_mode='reflect': accelc's conv pads with zeros only"], reasons
    assert 0 < opt.info.accelc_flops < opt.info.flops
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5
