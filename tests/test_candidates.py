"""Every autotune candidate of every kernel, forced in turn, on shapes with tails and odd sizes,
three runs each: each run within the dtype's tolerance of the fp32 reference, and the three runs
bitwise equal (the kernels have no atomics, so any difference between runs is a race).

GPU only (the interpreter runs one config); run on the device in every session that touches a
kernel: `python -m pytest -q tests/test_candidates.py`. The autotuner may pick any of these
candidates on another day (timings are noisy), so a failing one is a bug to fix, not a config to drop.
"""
import pytest
import torch

from accelc.kernels import conv, flash_attention, gemm, int8_gemm, quantize
from accelc.numerics import REL_L2_FLOOR, rel_l2
from accelc.tuning import NotACandidate, config_dict, out_of_resources

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="forces compiled configs: GPU only")

# relative L2 against the fp32 reference: a few roundings of the output dtype
TOL = REL_L2_FLOOR
REPEATS = 3


def _sweep(tuner, run, ref, tol):
    """Forces each of tuner's candidates; run() -> output. Returns how many candidates applied."""
    applied, failures = 0, []
    for i, cfg in enumerate(tuner.configs):
        outs = []
        try:
            with tuner.force(cfg):
                for _ in range(REPEATS):
                    outs.append(run())
                    torch.cuda.synchronize()
                used = bool(tuner.chosen)
        except NotACandidate:
            continue
        except Exception as e:   # out of shared memory for this dtype: the tuner skips it too
            if out_of_resources(e):
                continue
            raise
        assert used, f"candidate {i} was not consulted by the launcher"
        applied += 1
        errs = [rel_l2(o.float(), ref) for o in outs]
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        if max(errs) > tol or not same:
            failures.append(f"candidate {i} {cfg}: rel L2 {[f'{e:.1e}' for e in errs]}, runs identical: {same}")
    assert not failures, "\n".join(failures)
    return applied


LINEAR_SHAPES = [(1, 768, 768), (2, 200, 136), (3, 520, 72), (7, 64, 96), (16, 4096, 4096), (33, 77, 50), (130, 200, 136), (394, 768, 3072),
                 (1024, 768, 768), (2048, 1024, 4096), (4000, 3072, 768),
                 (3000, 16, 96), (2500, 144, 24), (1100, 40, 56)]   # narrow / shallow tiles (FIT_CONFIGS)


def _dtypes(shapes, bf16_every=3):
    """fp16 on every shape, bf16 on every third (compiling each candidate per dtype is the cost)."""
    return [(*s, torch.float16) for s in shapes] + [(*s, torch.bfloat16) for s in shapes[::bf16_every]]


@pytest.mark.parametrize("M,K,N,dtype", _dtypes(LINEAR_SHAPES))
def test_linear_candidates(M, K, N, dtype):
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=dtype)
    r = torch.randn(M, N, device="cuda", dtype=dtype)
    ref = gemm.linear_ref(x.float(), w.float(), b.float(), r.float(), "gelu_tanh")
    assert _sweep(gemm.TUNER, lambda: gemm.linear_launch(x, w, b, r, "gelu_tanh"), ref, TOL[dtype]) >= 1


@pytest.mark.parametrize("M,K,N", [(1, 768, 2304), (45, 64, 96), (1030, 768, 2304), (3000, 24, 144)])
def test_linear_candidates_weight_by_columns(M, K, N):
    # x @ W with W (K, N) row-major (GPT-2's Conv1D): the TMA configs load W's (K, N) boxes
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    W = torch.randn(K, N, device="cuda", dtype=torch.float16) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=torch.float16)
    ref = gemm.linear_ref(x.float(), W.t().float(), b.float(), None, "gelu")
    assert gemm.weight_by_columns(W.t())
    assert _sweep(gemm.TUNER, lambda: gemm.linear_launch(x, W.t(), b, None, "gelu"), ref, TOL[torch.float16]) >= 1


@pytest.mark.parametrize("M,K,N", [(1, 768, 768), (130, 200, 136), (1024, 768, 768)])
def test_linear_candidates_fp32(M, K, N):
    x, w = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda") / K ** 0.5
    ref = gemm.linear_ref(x.double(), w.double(), None, None, "relu")
    assert _sweep(gemm.TUNER, lambda: gemm.linear_launch(x, w, None, None, "relu"), ref, TOL[torch.float32]) >= 1


CONV_SHAPES = [  # N, C, H, W, K, R, S, stride, pad, dilation
    (32, 128, 28, 28, 128, 3, 3, 1, 1, 1), (32, 128, 27, 29, 128, 3, 3, 1, 1, 1), (32, 64, 56, 56, 64, 3, 3, 1, 1, 1),
    (32, 256, 14, 14, 256, 3, 3, 1, 1, 1), (32, 512, 7, 7, 512, 3, 3, 1, 1, 1), (8, 128, 28, 28, 128, 3, 3, 1, 1, 1),
    (1, 192, 28, 28, 192, 3, 3, 1, 1, 1), (2, 3, 64, 64, 64, 7, 7, 2, 3, 1), (3, 48, 17, 19, 40, 3, 3, 2, 1, 1),
    (2, 32, 15, 15, 24, 5, 5, 1, 4, 2), (4, 96, 9, 11, 80, 1, 1, 2, 0, 1), (2, 40, 13, 13, 72, 3, 3, 1, 0, 1),
    (1, 512, 7, 7, 512, 3, 3, 1, 1, 1), (2, 256, 14, 14, 256, 3, 3, 2, 1, 1),   # split reductions (SPLIT_CONFIGS)
]


@pytest.mark.parametrize("residual", [False, True], ids=["bias_relu", "bias_residual_relu"])
@pytest.mark.parametrize("shape", _dtypes(CONV_SHAPES), ids=lambda s: "x".join(map(str, s)))
def test_conv_candidates(shape, residual):
    N, C, H, W, K, R, S, st, p, d, dtype = shape
    x = torch.randn(N, C, H, W, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = conv.pack_weight(torch.randn(K, C, R, S, device="cuda", dtype=dtype) / (C * R * S) ** 0.5)
    b = torch.randn(K, device="cuda", dtype=dtype)
    OH, OW = conv.output_size(H, W, R, S, (st, st), (p, p, p, p), (d, d))
    res = torch.randn(N, K, OH, OW, device="cuda", dtype=dtype) if residual else None
    args = ((st, st), (p, p, p, p), (d, d), "relu", True)
    ref = conv.conv2d_ref(x.float(), w.float(), b.float(), res.float() if residual else None, *args)
    assert _sweep(conv.TUNER, lambda: conv.conv2d_launch(x, w, b, res, *args), ref, TOL[dtype]) >= 1


ATTN_SHAPES = [  # B, H, L, S, D, mask, causal
    (2, 12, 197, 197, 64, None, False), (4, 12, 128, 128, 64, "bool", False), (2, 8, 300, 300, 128, None, True),
    (3, 4, 77, 77, 32, "float", False), (1, 16, 1024, 1024, 128, None, False), (2, 4, 100, 333, 80, None, False),
    (2, 2, 1, 50, 96, None, False), (2, 3, 65, 65, 64, "bool", True),
]


@pytest.mark.parametrize("shape", _dtypes(ATTN_SHAPES), ids=lambda s: "x".join(map(str, s)))
def test_flash_attention_candidates(shape):
    B, H, L, S, D, kind, causal, dtype = shape
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=dtype) for n in (L, S, S))
    mask = None
    if kind == "bool":
        mask = torch.rand(B, 1, L, S, device="cuda") > 0.2
        mask[..., 0] = True                       # no fully masked row
    elif kind == "float":
        mask = torch.randn(B, 1, 1, S, device="cuda", dtype=dtype)
    ref = flash_attention.flash_attention_ref(q.float(), k.float(), v.float(),
                                              None if mask is None else (mask if kind == "bool" else mask.float()),
                                              causal)
    run = lambda: flash_attention.flash_attention_launch(q, k, v, mask, causal)  # noqa: E731
    assert _sweep(flash_attention.TUNER, run, ref, TOL[dtype]) >= 1


@pytest.mark.parametrize("shape", [s for s in ATTN_SHAPES if s[4] != 80] + [(2, 4, 64, 90, 256, "bool", False)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tf32", [False, True], ids=["ieee", "tf32"])
def test_flash_attention_fp32_candidates(shape, tf32):
    B, H, L, S, D, kind, causal = shape
    q, k, v = (torch.randn(B, H, n, D, device="cuda") for n in (L, S, S))
    mask = None
    if kind == "bool":
        mask = torch.rand(B, 1, L, S, device="cuda") > 0.2
        mask[..., 0] = True
    elif kind == "float":
        mask = torch.randn(B, 1, 1, S, device="cuda")
    ref = flash_attention.flash_attention_ref(q.double(), k.double(), v.double(),
                                              None if mask is None else (mask if kind == "bool" else mask.double()),
                                              causal)
    run = lambda: flash_attention.flash_attention_launch(q, k, v, mask, causal, None, False, False, tf32)  # noqa: E731
    assert _sweep(flash_attention.TUNER, run, ref, 2e-3 if tf32 else 1e-5) >= 1


@pytest.mark.parametrize("M,K,N", [(1, 768, 768), (7, 64, 96), (16, 4096, 4096), (130, 256, 136), (1024, 768, 3072),
                                   (4000, 3072, 768)])
def test_int8_candidates(M, K, N):
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w_q, w_scale = int8_gemm.quantize_weight(torch.randn(N, K, device="cuda") / K ** 0.5)
    b = torch.randn(N, device="cuda", dtype=torch.float16)
    ref = int8_gemm.linear_w8a8_ref(x, w_q, w_scale, b, None, "gelu").float()
    run = lambda: int8_gemm.linear_w8a8_launch(x, w_q, w_scale, b, None, "gelu")  # noqa: E731
    if K < 128:   # no int8 candidate is that shallow (BLOCK_K 128-512): the prune offers the untuned default
        sizes = {"M": M, "N": N, "K": K, "tma": True, "gluon": True, "dtype": torch.float16}
        offered = [config_dict(c) for c in gemm.prune_configs(int8_gemm.CONFIGS, sizes)]
        assert offered == [config_dict(gemm.default_config(sizes))]
        outs = [run() for _ in range(REPEATS)]
        assert all(torch.equal(outs[0], o) for o in outs) and rel_l2(outs[0].float(), ref) <= TOL[torch.float16]
        return
    assert _sweep(int8_gemm.TUNER, run, ref, TOL[torch.float16]) >= 1


@pytest.mark.parametrize("M,K", [(1, 768), (7, 100), (333, 4096), (64, 11008)])
def test_quantize_one_config_exact_and_repeatable(M, K):
    x = torch.randn(M, K, device="cuda", dtype=torch.float16) * 3
    x[M // 2, K // 3] = float("nan")
    q_ref, s_ref = quantize.quantize_ref(x)
    for _ in range(REPEATS):
        q, s = quantize.quantize_launch(x)
        finite = torch.isfinite(s_ref)
        assert torch.equal(q[finite], q_ref[finite]) and torch.equal(s[finite], s_ref[finite])
        assert torch.isnan(s[M // 2]) and torch.isnan(s_ref[M // 2])


@pytest.mark.parametrize("M,K,N", [(1, 2048, 200), (5, 300, 96), (64, 256, 320)])
def test_gated_linear_candidates(M, K, N):
    # gate and up rows interleaved: gemv_kernel's candidates for a decode step's rows, tl tiles else
    from accelc.kernels import gated_linear
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    wg, wu = (torch.randn(N, K, device="cuda", dtype=torch.float16) / K ** 0.5 for _ in range(2))
    packed, bias = gated_linear.pack(wg, wu)
    ref = torch.nn.functional.silu(x.float() @ wg.float().t()) * (x.float() @ wu.float().t())
    assert _sweep(gated_linear.TUNER, lambda: gated_linear.gated_linear_launch(x, packed, bias, N, "silu"), ref,
                  TOL[torch.float16]) >= 1


@pytest.mark.parametrize("M,K,N", [(1, 2048, 200), (6, 300, 96), (130, 512, 264), (1024, 768, 768)])
def test_linear_w8a16_candidates(M, K, N):
    # int8 weights, fp16 activations (weight-only int8): gemv_kernel and the tiles with QUANT=3
    from accelc.kernels import int8_weight
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w_q, w_scale = int8_gemm.quantize_weight(torch.randn(N, K, device="cuda") / K ** 0.5)
    b = torch.randn(N, device="cuda", dtype=torch.float16)
    ref = int8_weight.linear_w8a16_ref(x.float(), w_q, w_scale, b.float(), None, "silu")
    assert _sweep(int8_weight.TUNER, lambda: int8_weight.linear_w8a16_launch(x, w_q, w_scale, b, None, "silu"), ref,
                  TOL[torch.float16]) >= 1


GROUPED_CONV_SHAPES = [  # N, C, H, W, K, R, S, stride, pad, dilation, groups
    (32, 128, 28, 28, 128, 3, 3, 1, 1, 1, 32),    # ResNeXt-50 32x4d stage 1 (4 channels a group)
    (32, 448, 14, 14, 448, 3, 3, 2, 1, 1, 56),    # RegNet-style stride 2, 8 channels a group
    (8, 256, 14, 14, 256, 3, 3, 1, 1, 1, 8),      # 32 channels a group
    (2, 64, 15, 13, 128, 3, 3, 1, 1, 1, 4),       # twice the channels out, odd sizes
]


@pytest.mark.parametrize("shape", _dtypes(GROUPED_CONV_SHAPES, bf16_every=2), ids=lambda s: "x".join(map(str, s)))
def test_grouped_conv_candidates(shape):
    N, C, H, W, K, R, S, st, p, d, g, dtype = shape
    x = torch.randn(N, C, H, W, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = conv.pack_weight(torch.randn(K, C // g, R, S, device="cuda", dtype=dtype) / (C // g * R * S) ** 0.5)
    b = torch.randn(K, device="cuda", dtype=dtype)
    OH, OW = conv.output_size(H, W, R, S, (st, st), (p, p, p, p), (d, d))
    res = torch.randn(N, K, OH, OW, device="cuda", dtype=dtype)
    args = ((st, st), (p, p, p, p), (d, d), "relu", True)
    ref = conv.conv2d_ref(x.float(), w.float(), b.float(), res.float(), *args)
    # (a group of 4-8 channels in and out has one candidate, the narrowest tile)
    assert _sweep(conv.TUNER, lambda: conv.conv2d_launch(x, w, b, res, *args), ref, TOL[dtype]) >= (1 if C // g < 16 else 2)
