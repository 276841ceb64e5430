"""The warp-specialized Gluon conv (kernels/conv_hopper.py) against the fp32 reference, every candidate forced:
maps whose sides are not multiples of the pixel rectangle (the copy engine clips the stores and zero-fills the
padding), 3x3 and 1-padded and dilated taps, bias + ReLU, residual before and after it, fp16 and bf16, NaN as
eager, the same bits on every run. Runs on an sm90 GPU only (Gluon kernels do not run in Triton's
interpreter), with ACCELC_GLUON_CONV=1: until its first GPU run the launcher offers it only then. Here, the
launcher's choice and the kernel's build for sm90 are checked."""
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


@pytest.fixture
def gluon_conv(monkeypatch):
    monkeypatch.setenv("ACCELC_GLUON_CONV", "1")


def _nhwc(*shape, dtype=torch.float16, device="cpu"):
    return torch.randn(*shape, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)


def test_the_gluon_conv_is_offered_only_where_it_applies(monkeypatch):
    x = _nhwc(2, 64, 8, 8)
    nhwc = conv.nhwc_view(x)
    assert "ACCELC_GLUON_CONV=1" in conv.gluon_problem(nhwc, None, nhwc)       # off by default
    monkeypatch.setenv("ACCELC_GLUON_CONV", "1")
    assert conv.gluon_problem(nhwc, None, nhwc) is not None                   # no sm90 GPU here
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
    broadcast = conv.nhwc_view(_nhwc(1, 64, 8, 8).expand(2, 64, 8, 8))
    assert not conv._tma_nhwc_ok(broadcast) and conv._tma_nhwc_ok(nhwc)


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
    assert done.returncode == 0 and len(rows) == 2 * len(conv.GLUON_CONFIGS), done.stdout[-2000:] + done.stderr[-2000:]
    for row in rows:
        assert row["hgmma"] > 0 and row["shared_bytes"] <= 227 * 1024 and row["spill_stores"] == 0, row


def _call(x, w, b, res, pad, dil, act, first):
    return torch.ops.accelc.conv2d(x, conv.pack_weight(w), b, res, [1, 1], [pad] * 4, [dil, dil], act, first)


def _ref(x, w, b, res, pad, dil, act, first):
    return conv.conv2d_ref(x.float(), conv.pack_weight(w).float(), None if b is None else b.float(),
                           None if res is None else res.float(), [1, 1], [pad] * 4, [dil, dil], act, first)


def _cfg_id(c) -> str:
    return "x".join(str(c.kwargs[k]) for k in ("BLOCK_H", "BLOCK_W", "BLOCK_N", "STAGES", "CONSUMERS"))


# (N, C, H, W, K, kernel, padding, dilation): ResNet-50's stage shapes, sides that leave partial rectangles
# (56 = 3.5 x 16, 28, 14, 7 < 8), more output channels than one tile, a dilated 3x3
CASES = [(4, 64, 56, 56, 64, 3, 1, 1), (2, 128, 28, 28, 128, 3, 1, 1), (3, 256, 14, 14, 320, 3, 1, 1),
         (2, 512, 7, 7, 512, 3, 1, 1), (2, 64, 20, 30, 192, 3, 2, 2), (2, 64, 9, 17, 64, 3, 0, 1)]


@gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", conv.GLUON_CONFIGS, ids=_cfg_id)
def test_gluon_conv_candidates_match_reference(gluon_conv, case, dtype, cfg):
    N, C, H, W, K, r, pad, dil = case
    x = _nhwc(N, C, H, W, dtype=dtype, device="cuda")
    w = (torch.randn(K, C, r, r, device="cuda") / (C * r * r) ** 0.5).to(dtype)
    b = torch.randn(K, device="cuda", dtype=dtype)
    ref = _ref(x, w, b, None, pad, dil, "relu", False)
    outs = forced_outputs(conv.TUNER, cfg, lambda: _call(x, w, b, None, pad, dil, "relu", False))
    if outs is None:
        pytest.skip("not a candidate for this shape")
    assert rel_l2(outs[0].float(), ref.float()) < REL_L2_FLOOR[dtype]
    assert torch.equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("cfg", conv.GLUON_CONFIGS, ids=_cfg_id)
def test_gluon_conv_residual(gluon_conv, first, cfg):
    x = _nhwc(2, 64, 28, 20, device="cuda")
    w = (torch.randn(128, 64, 3, 3, device="cuda") / 24).half()
    res = torch.randn(2, 128, 28, 20, device="cuda", dtype=torch.float16)      # NCHW: converted for the copy engine
    ref = _ref(x, w, None, res, 1, 1, "relu", first)
    outs = forced_outputs(conv.TUNER, cfg, lambda: _call(x, w, None, res, 1, 1, "relu", first))
    assert outs is not None
    assert rel_l2(outs[0].float(), ref.float()) < REL_L2_FLOOR[torch.float16]
    assert torch.equal(outs[0], outs[1])


@gpu
def test_gluon_conv_nan_stays_in_its_pixels(gluon_conv):
    x = _nhwc(2, 64, 16, 16, device="cuda")
    x[0, 3, 5, 5] = float("nan")
    w = (torch.randn(64, 64, 3, 3, device="cuda") / 24).half()
    ref = _ref(x.double(), w.double(), None, None, 1, 1, "none", False)
    for cfg in conv.GLUON_CONFIGS:
        outs = forced_outputs(conv.TUNER, cfg, lambda: _call(x, w, None, None, 1, 1, "none", False), repeats=1)
        if outs is not None:
            assert torch.equal(outs[0].isnan(), ref.isnan())
