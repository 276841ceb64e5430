"""The warp-specialized Gluon conv (kernels/conv_hopper.py) against the fp32 reference, every candidate forced:
maps whose sides are not multiples of the pixel rectangle (the copy engine clips the stores and zero-fills the
padding), 3x3 and 1-padded and dilated taps, stride 2 (the 5-D phase view) as well as 1, bias + ReLU, residual
before and after it, fp16 and bf16, NaN as eager, the same bits on every run. Runs on an sm90 GPU only (Gluon
kernels do not run in Triton's interpreter). Here, the launcher's choice, the phase view's addressing and the
kernel's build for sm90 are checked."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import forced_outputs

from accelc.kernels import conv
from accelc.numerics import REL_L2_FLOOR, rel_l2

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not SM90, reason="Gluon kernels need an sm90 GPU (not the interpreter)")


def _nhwc(*shape, dtype=torch.float16, device="cpu"):
    return torch.randn(*shape, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)


def test_the_gluon_conv_is_offered_only_where_it_applies():
    x = _nhwc(2, 64, 8, 8)
    nhwc = conv.nhwc_view(x)
    if not SM90:
        assert "GPU" in conv.gluon_problem(nhwc, None, nhwc)                  # the interpreter: tl kernels only
    w = torch.randn(64, 64, 3, 3, dtype=torch.float16)
    assert conv.gluon_geometry_ok(nhwc, w, (1, 1)) and conv.gluon_geometry_ok(nhwc, w, (2, 2))
    assert not conv.gluon_geometry_ok(conv.nhwc_view(_nhwc(2, 64, 9, 8)), w, (2, 2))    # odd H: no phase view
    assert not conv.gluon_geometry_ok(nhwc, w, (2, 1)) and not conv.gluon_geometry_ok(nhwc, w, (3, 3))
    cropped = conv.nhwc_view(_nhwc(2, 64, 8, 10)[:, :, :, :8])                # a cropped map: the view holds
    assert conv.gluon_geometry_ok(cropped, w, (2, 2))
    half = conv.nhwc_view(_nhwc(2, 128, 8, 8)[:, :64])                        # half the channels: W's stride is not C
    assert conv.rect_ok(half, w, (1, 1)) and not conv.gluon_geometry_ok(half, w, (2, 2))
    sizes = dict(N=32, C=64, H=56, W=56, K=64, R=3, S=3, OH=56, OW=56, M=32 * 56 * 56, stride=1, rect=True,
                 rows=False, groups=1, gluon=False)
    assert not any(c.kwargs.get("GLUON") for c in conv.prune_configs(conv.CONFIGS, sizes))
    sizes["gluon"] = True
    offered = [c for c in conv.prune_configs(conv.CONFIGS, sizes) if c.kwargs.get("GLUON")]
    assert offered and all(c.kwargs["BLOCK_N"] == 64 for c in offered)    # 64 output channels: the narrow tile
    sizes["K"] = 256
    assert len([c for c in conv.prune_configs(conv.CONFIGS, sizes) if c.kwargs.get("GLUON")]) == len(conv.GLUON_CONFIGS)
    sizes["C"] = 72                                         # a channel block would reach the next tap's weights
    assert not any(c.kwargs.get("GLUON") for c in conv.prune_configs(conv.CONFIGS, sizes))
    sizes.update(C=64, stride=2, rect=False)                # stride 2: the Gluon conv, not the tl RECT configs
    kept = conv.prune_configs(conv.CONFIGS, sizes)
    assert {c.kwargs.get("GLUON", False) for c in kept if c.kwargs["RECT"]} == {True}
    broadcast = conv.nhwc_view(_nhwc(1, 64, 8, 8).expand(2, 64, 8, 8))
    assert not conv._tma_nhwc_ok(broadcast) and conv._tma_nhwc_ok(nhwc)
    nchw = conv.nhwc_view(torch.randn(2, 64, 8, 8, dtype=torch.float16))    # a residual the tl kernel reads instead
    assert not conv._tma_nhwc_ok(nchw)


def test_the_phase_view_addresses_every_input_pixel():
    """conv_hopper.phase_view: element (n, h2, hp, w2, wp * C + c) is input pixel (2 * h2 + hp, 2 * w2 + wp)."""
    module, _ = conv._hopper_import()
    if module is None:
        pytest.skip("this Triton cannot build the Gluon conv")
    x = conv.nhwc_view(_nhwc(2, 24, 6, 10))
    view = module.phase_view(x)
    assert view.shape == (2, 3, 2, 5, 48)
    for h in range(6):
        for w in range(10):
            assert torch.equal(view[:, h // 2, h % 2, w // 2, (w % 2) * 24:(w % 2 + 1) * 24], x[:, h, w])


def test_every_gluon_conv_candidate_fits_shared_memory():
    module, _ = conv._hopper_import()
    if module is None:
        pytest.skip("this Triton cannot build the Gluon conv")
    for c in conv.GLUON_CONFIGS:
        kw = c.kwargs
        used = module.smem_bytes(kw["BLOCK_H"], kw["BLOCK_W"], kw["BLOCK_N"], kw["BLOCK_K"], kw["STAGES"],
                                 kw["CONSUMERS"])
        assert used <= 227 * 1024, kw


def test_the_gluon_conv_builds_for_sm90_with_this_triton():
    """Here, without a GPU: every candidate compiles for sm90 through ptxas, with wgmma in its SASS, within
    shared memory and without spills (the 4-D input box read as the (pixels, channels) operand)."""
    if conv._hopper_import()[0] is None:
        pytest.skip(conv._hopper_import()[1])
    script = Path(__file__).parents[1] / "bench" / "gluon_compile.py"
    done = subprocess.run([sys.executable, str(script), "--kernel", "conv", "--json"],
                          capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(rows) == 3 * len(conv.GLUON_CONFIGS), done.stdout[-2000:] + done.stderr[-2000:]
    for row in rows:
        assert row["hgmma"] > 0 and row["shared_bytes"] <= 227 * 1024 and row["spill_stores"] == 0, row


def _call(x, w, b, res, pad, dil, act, first, stride=1):
    return torch.ops.accelc.conv2d(x, conv.pack_weight(w), b, res, [stride] * 2, [pad] * 4, [dil, dil], act, first)


def _ref(x, w, b, res, pad, dil, act, first, stride=1):
    return conv.conv2d_ref(x.float(), conv.pack_weight(w).float(), None if b is None else b.float(),
                           None if res is None else res.float(), [stride] * 2, [pad] * 4, [dil, dil], act, first)


def _cfg_id(c) -> str:
    return "x".join(str(c.kwargs[k]) for k in ("BLOCK_H", "BLOCK_W", "BLOCK_N", "STAGES", "CONSUMERS"))


# (N, C, H, W, K, kernel, padding, dilation, stride): ResNet-50's stage shapes, sides that leave partial
# rectangles (56 = 3.5 x 16, 28, 14, 7 < 8), more output channels than one tile, a dilated 3x3; stride 2: its
# first blocks' 3x3 and 1x1 downsample convs (outputs 28 / 14 / 7 on a side), a dilated one, a 2-padded 1x1 (taps
# entirely in the padding at the edges), a map of 2 x 2
CASES = [(4, 64, 56, 56, 64, 3, 1, 1, 1), (2, 128, 28, 28, 128, 3, 1, 1, 1), (3, 256, 14, 14, 320, 3, 1, 1, 1),
         (2, 512, 7, 7, 512, 3, 1, 1, 1), (2, 64, 20, 30, 192, 3, 2, 2, 1), (2, 64, 9, 17, 64, 3, 0, 1, 1),
         (3, 128, 56, 56, 128, 3, 1, 1, 2), (2, 256, 28, 28, 256, 3, 1, 1, 2), (2, 512, 14, 14, 512, 3, 1, 1, 2),
         (2, 256, 56, 56, 512, 1, 0, 1, 2), (2, 64, 22, 34, 128, 3, 2, 2, 2), (2, 64, 10, 12, 64, 1, 2, 1, 2),
         (1, 64, 2, 2, 64, 3, 1, 1, 2)]


@gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", conv.GLUON_CONFIGS, ids=_cfg_id)
def test_gluon_conv_candidates_match_reference(case, dtype, cfg):
    N, C, H, W, K, r, pad, dil, stride = case
    x = _nhwc(N, C, H, W, dtype=dtype, device="cuda")
    w = (torch.randn(K, C, r, r, device="cuda") / (C * r * r) ** 0.5).to(dtype)
    b = torch.randn(K, device="cuda", dtype=dtype)
    ref = _ref(x, w, b, None, pad, dil, "relu", False, stride)
    outs = forced_outputs(conv.TUNER, cfg, lambda: _call(x, w, b, None, pad, dil, "relu", False, stride))
    if outs is None:
        pytest.skip("not a candidate for this shape")
    assert rel_l2(outs[0].float(), ref.float()) < REL_L2_FLOOR[dtype]
    assert torch.equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("cfg", conv.GLUON_CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("stride", [1, 2])
def test_gluon_conv_residual(first, cfg, stride):
    x = _nhwc(2, 64, 28, 20, device="cuda")
    w = (torch.randn(256, 64, 3, 3, device="cuda") / 24).half()
    res = _nhwc(2, 256, 28 // stride, 20 // stride, device="cuda")   # channels-last, as rewritten convs hand it on
    ref = _ref(x, w, None, res, 1, 1, "relu", first, stride)
    outs = forced_outputs(conv.TUNER, cfg, lambda: _call(x, w, None, res, 1, 1, "relu", first, stride))
    assert outs is not None
    assert rel_l2(outs[0].float(), ref.float()) < REL_L2_FLOOR[torch.float16]
    assert torch.equal(outs[0], outs[1])


@gpu
def test_gluon_conv_nan_stays_in_its_pixels():
    x = _nhwc(2, 64, 16, 16, device="cuda")
    x[0, 3, 5, 5] = float("nan")
    w = (torch.randn(64, 64, 3, 3, device="cuda") / 24).half()
    ref = _ref(x.double(), w.double(), None, None, 1, 1, "none", False)
    for cfg in conv.GLUON_CONFIGS:
        outs = forced_outputs(conv.TUNER, cfg, lambda: _call(x, w, None, None, 1, 1, "none", False), repeats=1)
        if outs is not None:
            assert torch.equal(outs[0].isnan(), ref.isnan())
