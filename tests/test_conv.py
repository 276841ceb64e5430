"""accelc::conv2d (kernels/conv.py) against an fp64 reference and eager PyTorch: every geometry and
dtype, the fused residual, input layouts, the TMA-rectangle path choice, bad inputs."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from accelc.kernels import conv
from conftest import DEVICE, assert_close_to_ref, rel_l2

DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 1e-2, 1e-2), (torch.bfloat16, 6e-2, 4e-2)]
# (C, K, kernel, stride, padding, dilation): odd channel counts, every stride / padding / dilation
GEOMETRY = [
    (3, 16, 7, 2, 3, 1),   # RGB stem: the padded-rows path (C < 16)
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



@pytest.mark.parametrize("c,stride,hw,rect", [(16, 1, 9, True), (64, 1, 7, True), (16, 2, 9, False),
                                             (12, 1, 9, False), (16, 1, 1, True)])
def test_rectangle_path_choice(c, stride, hw, rect):
    # stride-1, aligned NHWC inputs take the TMA-rectangle path (a 1x1 map too: its NCHW
    # strides on size-1 dims are normalised); the rest gather with pointers; both match
    x = torch.randn(2, c, hw, hw, device=DEVICE, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    wt = (torch.randn(8, c, 3, 3, device=DEVICE) / (9 * c) ** 0.5).half()
    assert conv.rect_ok(conv.nhwc_view(x), conv.pack_weight(wt), (stride, stride)) == rect
    out = _run(x, wt, None, None, stride, 1, 1, "none", False)
    ref = F.conv2d(x.double(), wt.double(), None, stride, 1)
    assert_close_to_ref(out, ref, F.conv2d(x, wt, None, stride, 1), torch.float16, 1e-2, 1e-2)


@pytest.mark.parametrize("c,r,st", [(16, 3, 1), (5, 3, 2)])
def test_repeated_calls_launch_the_compiled_kernel(c, r, st):
    """Fresh data each call through the cached compiled call (a GPU's direct launch)."""
    for _ in range(3):
        x, wt, b = _case(c, 8, r, torch.float16)
        out = _run(x, wt, b, None, st, 1, 1, "relu", False)
        ref = _eager(x.double(), wt.double(), b.double(), None, st, 1, 1, "relu", False)
        assert_close_to_ref(out, ref, _eager(x, wt, b, None, st, 1, 1, "relu", False), torch.float16, 1e-2, 1e-2)
    assert any(c.direct for c, kw in conv.TUNER.calls.values()) or DEVICE.type == "cpu"


def test_tma_rectangle_configs_take_one_warpgroup():
    """Two warpgroups raced on the tl kernel's TMA-rectangle path (conv.rect_config); such configs are refused.
    (The Gluon conv's candidates are not the tl kernel's: its warpgroups read the ring's slots in shared
    memory under the mbarrier protocol of kernels/gemm_hopper.py.)"""
    assert all(c.num_warps == 4 for c in conv.CONFIGS if c.kwargs["RECT"] and not c.kwargs.get("GLUON"))
    with pytest.raises(ValueError, match="4 warps"):
        conv.rect_config(16, 8, 128, 64, 3, 8)


def test_rows_configs_take_one_warpgroup():
    """The ROWS path (an RGB stem) zeroes its input run in registers before the dot, the same register-operand wgmma
    from a pipelined stage: its 256 x 64 tile with 8 warps differed run to run in 39 of 40 runs (H200,
    bench/conv_rows_race.py). Such configs are refused, and none is offered."""
    assert conv.ROWS_CONFIGS and all(c.num_warps == 4 for c in conv.ROWS_CONFIGS)
    with pytest.raises(ValueError, match="4 warps"):
        conv.rows_config(256, 64, 3, 8, row_step=2)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("c,k,r,h,w,with_res", [
    (3, 24, 8, 32, 32, False),    # ViT's patch embedding, small: 8x8 stride 8
    (3, 16, 16, 35, 33, True),    # 16x16 over the 7x7 limit, a ragged edge cropped (as PyTorch does)
    (5, 8, 2, 9, 12, False),      # 2x2 stride 2 (ConvNeXt's downsampling)
])
def test_patch_embedding_is_a_gemm(dtype, atol, rtol, c, k, r, h, w, with_res):
    """Kernel == stride, no padding: non-overlapping patches, any kernel size, as one GEMM."""
    x, wt, b = _case(c, k, r, dtype, h=h, w=w)
    res = torch.randn(2, k, h // r, w // r, device=DEVICE, dtype=dtype) if with_res else None
    assert conv.why_unsupported(x, conv.pack_weight(wt), b, res, (r, r), (0, 0, 0, 0), (1, 1)) is None
    out = _run(x, wt, b, res, r, 0, 1, "relu", True)
    d = torch.float64
    ref = _eager(x.to(d), wt.to(d), b.to(d), None if res is None else res.to(d), r, 0, 1, "relu", True)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close_to_ref(out, ref, _eager(x, wt, b, res, r, 0, 1, "relu", True), dtype, atol, rtol)


def test_large_kernel_refused_unless_patches():
    x, wt, b = _case(3, 8, 9, torch.float16, h=20, w=20)
    assert "kernel 9x9 over 7x7" in conv.why_unsupported(x, conv.pack_weight(wt), b, None, (2, 2), (0, 0, 0, 0), (1, 1))
    assert "kernel 9x9 over 7x7" in conv.why_unsupported(x, conv.pack_weight(wt), b, None, (9, 9), (1, 1, 1, 1), (1, 1))


# the reduction split into slices (few output tiles, batch 1-8 at 14x14 / 7x7): forced configs; the
# interpreter runs whatever it is given, a GPU only candidates (its sweep: tests/test_candidates.py)
_SPLITS = ([conv.rect_config(4, 8, 32, 16, 1, 4, split=3), conv.config(32, 32, 16, 1, 4, split=4)]
           if DEVICE.type == "cpu" else [c for c in conv.SPLIT_CONFIGS])


@pytest.mark.parametrize("cfg", range(len(_SPLITS)))
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES[1:])
@pytest.mark.parametrize("res_first,act", [(True, "relu"), (False, "silu")])
def test_split_reduction_matches_and_applies_the_epilogue_once(cfg, dtype, atol, rtol, res_first, act):
    """Slices' fp32 partial sums added in slice order by the reduce kernel, then bias, activation
    and residual there, once: against fp64, with ragged tiles (7x9 maps, 40 or 520 channels)."""
    C, K = (32, 40) if DEVICE.type == "cpu" else (512, 520)    # a GPU: sizes where every split is a candidate
    x, wt, b = _case(C, K, 3, dtype, n=1, h=7, w=9)
    x = x.contiguous(memory_format=torch.channels_last)
    res = torch.randn(1, K, 7, 9, device=DEVICE, dtype=dtype)
    c = _SPLITS[cfg]
    with conv.TUNER.force(c):
        outs = [_run(x, wt, b, res, 1, 1, 1, act, res_first) for _ in range(2)]
        assert all(kw["SPLIT"] > 1 for _, kw in conv.TUNER.calls.values())
    d = torch.float64
    ref = _eager(x.to(d), wt.to(d), b.to(d), res.to(d), 1, 1, 1, act, res_first)
    assert_close_to_ref(outs[0], ref, _eager(x, wt, b, res, 1, 1, 1, act, res_first), dtype, atol, rtol)
    assert torch.equal(outs[0], outs[1])      # the slice order is fixed: the same bits every run


def test_the_split_reduce_keys_the_conv_tuning_cache():
    # a split config is timed with its reduce: the reduce's source and tile are part of the cache's key
    assert conv._splitk_reduce in conv._other_kernels()
    assert str(conv.REDUCE_BLOCK) in conv.TUNER.launch_identity


def test_split_offered_only_where_tiles_are_few_and_the_reduction_long():
    def splits(**kw):
        sizes = dict(N=1, C=512, H=7, W=7, K=512, R=3, S=3, OH=7, OW=7, M=49, stride=1, rect=True, rows=False)
        sizes.update(kw)
        return sorted({c.kwargs["SPLIT"] for c in conv.prune_configs(conv.CONFIGS, sizes)})
    assert splits() == [1, 2, 4, 8]                                # ResNet-50 layer4 3x3 at batch 1
    assert splits(N=32, M=32 * 49) == [1]                          # batch 32: 128+ tiles
    assert splits(C=16, K=16, R=1, S=1) == [1]                     # a short reduction
    assert splits(C=3, K=64, R=7, S=7, rect=False, rows=True) == [1]   # an RGB stem (ROWS: no slices)
    assert splits(C=3, K=64, R=7, S=7, rect=False) == [1]          # FLAT_K (dilated along W): no slices


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_geometry_keeps_every_run_aligned(dtype):
    """The ROWS path's padded input (conv.rows_geometry): each kernel row a run of SP >= S pixels
    x CP >= C channels, at least one tensor-core K step, starting 16 bytes aligned, in rows that
    are multiples of 16 elements; convs with 16+ channels or dilated along W do not take it."""
    x = torch.empty(2, 3, 20, 20, dtype=dtype)
    for c in (1, 3, 4, 8, 15):
        for st in (1, 2, 3, 4):
            for r, s in ((7, 7), (3, 3), (1, 1), (1, 7), (5, 2)):
                w = torch.empty(8, r, s, c, dtype=dtype)
                oh, ow = conv.output_size(20, 20, r, s, (st, st), (1, 1, 1, 1), (1, 1))
                cp, sp, hp, wp, align = conv.rows_geometry(x[:, :1].expand(2, c, 20, 20), w, (st, st), (1, 1), (oh, ow))
                assert align == 16 // x.element_size() and (st * cp) % align == 0
                assert cp >= c and sp >= s and sp * cp >= 16 and wp % 16 == 0
                assert wp >= (ow - 1) * st + sp and hp == (oh - 1) * st + r
    w = torch.empty(8, 3, 3, 16, dtype=dtype)
    assert conv.rows_geometry(torch.empty(2, 16, 9, 9, dtype=dtype), w, (1, 1), (1, 1), (9, 9)) is None
    w = torch.empty(8, 3, 3, 3, dtype=dtype)
    assert conv.rows_geometry(torch.empty(2, 3, 9, 9, dtype=dtype), w, (1, 1), (1, 2), (9, 7)) is None


ROWS_CASES = [  # (C, K, (R, S), (sh, sw), (top, bottom, left, right), (dh, dw))
    (3, 16, (7, 7), (2, 2), (3, 3, 3, 3), (1, 1)),     # ResNet's stem
    (1, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),      # one channel: CP and SP widen to a K step
    (5, 12, (1, 7), (2, 1), (0, 2, 3, 1), (1, 1)),     # rectangular kernel, uneven strides and padding
    (12, 9, (5, 2), (3, 3), (2, 0, 0, 1), (2, 1)),     # dilated along H only
    (4, 16, (4, 4), (4, 4), (0, 0, 0, 0), (1, 1)),     # kernel = stride, no padding: the patch GEMM
    (3, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 2)),      # dilated along W: FLAT_K
]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("c,k,rs,st,pad,dil", ROWS_CASES)
@pytest.mark.parametrize("row_step", [1, 2])
def test_few_channel_convs(dtype, atol, rtol, c, k, rs, st, pad, dil, row_step):
    """Few-channel convs, every geometry; on the ROWS path one and two kernel rows a K step
    (R = 7, 5, 3, 1: the last step of two half past R)."""
    x = torch.randn(2, c, 13, 11, device=DEVICE, dtype=dtype)
    wt = (torch.randn(k, c, *rs, device=DEVICE) / (c * rs[0] * rs[1]) ** 0.5).to(dtype)
    b = torch.randn(k, device=DEVICE, dtype=dtype)
    packed = conv.pack_weight(wt)
    rows = not conv.is_patchify(packed.shape, st, pad, dil) and conv.rows_geometry(x, packed, st, dil, (1, 1))
    if not rows and row_step == 2:
        pytest.skip("not the ROWS path: no K-step choice")
    forced = conv.TUNER.force(conv.config(64, 64, 16, 3, 4, row_step=row_step)) if rows else contextlib.nullcontext()
    with forced:
        out = torch.ops.accelc.conv2d(x, packed, b, None, list(st), list(pad), list(dil), "relu")

    def eager(x, wt, b):
        xp = F.pad(x, (pad[2], pad[3], pad[0], pad[1]))
        return F.relu(F.conv2d(xp, wt, b, st, 0, dil))
    d = torch.float64
    assert_close_to_ref(out, eager(x.to(d), wt.to(d), b.to(d)), eager(x, wt, b), dtype, atol, rtol)


@pytest.mark.parametrize("where", ["inside", "edge", "corner"])
def test_rgb_stem_inf_and_nan_reach_the_pixels_eager_gives(where):
    """The ROWS path reads one pixel past the 7x7 kernel in each run (SP = 8) and multiplies it
    by zero weights: an inf there must not make NaN where eager's output is finite."""
    x = torch.randn(2, 3, 16, 16, device=DEVICE, dtype=torch.float16)
    i, j = {"inside": (6, 9), "edge": (0, 15), "corner": (15, 0)}[where]
    x[0, 1, i, j] = float("inf")
    x[1, 2, j, i] = float("nan")
    wt = (torch.randn(8, 3, 7, 7, device=DEVICE) / 12).half()
    b = torch.randn(8, device=DEVICE, dtype=torch.float16)
    out = torch.ops.accelc.conv2d(x, conv.pack_weight(wt), b, None, [2, 2], [3, 3, 3, 3], [1, 1])
    ref = F.conv2d(x.double(), wt.double(), b.double(), 2, 3)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    fin = ref.isfinite()
    assert rel_l2(out[fin], ref[fin]) < 1e-2


def test_rgb_stem_with_residual_repeated_calls():
    """The ROWS path's pad launch is remembered with the conv's: fresh inputs every call."""
    for _ in range(3):
        x, wt, b = _case(3, 16, 7, torch.float16, h=17, w=15)
        res = torch.randn(2, 16, 9, 8, device=DEVICE, dtype=torch.float16)
        out = _run(x, wt, b, res, 2, 3, 1, "relu", True)
        ref = _eager(x.double(), wt.double(), b.double(), res.double(), 2, 3, 1, "relu", True)
        assert_close_to_ref(out, ref, _eager(x, wt, b, res, 2, 3, 1, "relu", True), torch.float16, 1e-2, 1e-2)


def test_the_conv_plans_tuning_key_is_the_shipped_tables():
    """ConvPlan's tuning key is what accelc/tuning_table.json is keyed by: ResNet-50's stem (7x7 stride 2 over
    RGB, the ROWS path) at batch 32 finds its H200 row (a key format that drifted would leave every shipped
    conv row unread, silently: the race runs instead)."""
    import json

    from accelc import tuning_table

    x = torch.empty(32, 3, 224, 224, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    weight = torch.empty(64, 7, 7, 3, dtype=torch.float16)
    out = torch.empty(32, 64, 112, 112, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    plan = conv.ConvPlan.of(x, weight, torch.empty(64, dtype=torch.float16), None, out, (2, 2), (1, 1), "none",
                            False, False)
    assert plan.rows is not None and not plan.rect and not plan.gluon and plan.M == 32 * 112 * 112
    assert plan.problem() == dict(N=32, C=3, H=224, W=224, K=64, R=7, S=7, OH=112, OW=112, M=32 * 112 * 112,
                                  stride=2, rect=False, rows=True, groups=1, gluon=False)
    own = tuning_table.shipped()["kernels"]["conv2d"]["NVIDIA H200"]["keys"]
    assert json.dumps([str(k) for k in plan.tuning_key()]) in own
