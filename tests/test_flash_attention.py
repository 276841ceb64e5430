"""accelc::flash_attention (kernels/flash_attention.py) against an fp64 reference and eager SDPA."""
import pytest
import torch
import torch.nn.functional as F

from accelc.numerics import sqnr_db
from accelc.kernels import flash_attention as fa, primitives
from accelc.kernels.flash_attention import flash_attention_launch, flash_attention_ref
from conftest import DEVICE, assert_close_to_ref, rel_l2

DTYPES = [(torch.float16, 2e-3, 1e-2), (torch.bfloat16, 1.6e-2, 5e-2)]  # (dtype, atol, rtol) vs fp64


def _qkv(b, h, lq, lk, d, dtype):
    return (torch.randn(b, h, lq, d, device=DEVICE, dtype=dtype),
            torch.randn(b, h, lk, d, device=DEVICE, dtype=dtype),
            torch.randn(b, h, lk, d, device=DEVICE, dtype=dtype))


def _check(q, k, v, mask=None, causal=False, scale=None, atol=2e-3, rtol=1e-2):
    out = torch.ops.accelc.flash_attention(q, k, v, mask, causal, scale)
    d = lambda t: None if t is None else (t if t.dtype == torch.bool else t.double())
    ref = fa.flash_attention_ref(d(q), d(k), d(v), d(mask), causal, scale)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    assert_close_to_ref(out, ref, eager, q.dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("d", [16, 32, 40, 64, 80, 96, 128, 160, 256])
def test_every_head_dim(dtype, atol, rtol, d):
    _check(*_qkv(2, 3, 37, 37, d, dtype), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("lq,lk", [(1, 1), (17, 17), (33, 70), (70, 33), (5, 129)])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_lengths_and_causal(dtype, atol, rtol, lq, lk, causal):
    _check(*_qkv(1, 2, lq, lk, 64, dtype), causal=causal, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_key_padding_bool_mask_broadcast_over_heads(dtype, atol, rtol):
    q, k, v = _qkv(3, 2, 29, 29, 32, dtype)
    keep = torch.ones(3, 1, 1, 29, dtype=torch.bool, device=DEVICE)
    keep[1, ..., 20:] = False
    keep[2, ..., 7:] = False
    _check(q, k, v, keep, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_additive_float_mask(dtype, atol, rtol):
    q, k, v = _qkv(2, 2, 24, 40, 64, dtype)
    mask = torch.randn(2, 1, 24, 40, device=DEVICE).to(dtype)
    mask[0, :, :, 30:] = torch.finfo(dtype).min  # BERT-style padding
    _check(q, k, v, mask, atol=atol, rtol=rtol)


def test_explicit_scale_and_strided_inputs():
    # (B, L, H, D) tensors viewed as (B, H, L, D): the kernel reads the strides, no copy
    base = torch.randn(2, 3, 33, 3, 64, device=DEVICE, dtype=torch.float16)
    q, k, v = (base[:, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    _check(q, k, v, scale=0.3)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("mask_kind", [None, "bias", "bool"])
def test_three_dim_batch_times_heads(dtype, atol, rtol, mask_kind):
    """(batch * heads, length, head_dim), as attention written with bmm / baddbmm has it: the
    result is contiguous, as bmm's (a later view that merges dims must work)."""
    q, k, v = (t[0] for t in _qkv(1, 6, 19, 23, 64, dtype))
    mask = None
    if mask_kind == "bias":                     # ALiBi-like: one bias row per (batch * head)
        mask = (torch.randn(6, 1, 23, device=DEVICE) * 2).to(dtype)
    elif mask_kind == "bool":
        mask = torch.rand(6, 19, 23, device=DEVICE) > 0.3
        mask[..., 0] = True
    out = torch.ops.accelc.flash_attention(q, k, v, mask)
    assert out.shape == (6, 19, 64) and out.is_contiguous()
    d = lambda t: None if t is None else (t if t.dtype == torch.bool else t.double())
    ref = fa.flash_attention_ref(d(q), d(k), d(v), d(mask))
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close_to_ref(out, ref, eager, dtype, atol, rtol)
    assert out.view(6 * 19, 64).shape == (114, 64)


def test_output_memory_is_batch_length_heads():
    q, k, v = _qkv(2, 3, 9, 9, 32, torch.float16)
    out = torch.ops.accelc.flash_attention(q, k, v)
    assert out.shape == (2, 3, 9, 32) and out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_row_is_zero_like_sdpa(kind):
    """A row with no visible key (a left-padded row under a causal mask, as HF's masks make them)
    gives 0, as F.scaled_dot_product_attention does; NaN in q still gives NaN."""
    q, k, v = _qkv(1, 1, 4, 8, 32, torch.float16)
    keep = torch.ones(1, 1, 4, 8, dtype=torch.bool, device=DEVICE)
    keep[0, 0, 2] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=q.dtype, device=DEVICE).masked_fill(~keep, float("-inf"))
    out = torch.ops.accelc.flash_attention(q, k, v, mask)
    eager = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask if kind == "bool" else mask.float())
    assert torch.equal(out[0, 0, 2], torch.zeros_like(out[0, 0, 2]))
    assert torch.equal(eager[0, 0, 2], torch.zeros_like(eager[0, 0, 2]))
    assert rel_l2(out, eager) < 2e-3
    q[0, 0, 1, 0] = float("nan")
    out = torch.ops.accelc.flash_attention(q, k, v, mask)
    assert torch.isnan(out[0, 0, 1]).all() and torch.isfinite(out[0, 0, [0, 3]]).all()


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_row_is_nan_with_empty_nan_like_a_written_softmax(kind):
    """empty_nan=True (the decomposed softmax(...) @ v form): a row with no visible key is NaN, as
    eager's softmax of an all -inf row; the other rows are unchanged."""
    q, k, v = _qkv(1, 1, 4, 8, 32, torch.float16)
    keep = torch.ones(1, 1, 4, 8, dtype=torch.bool, device=DEVICE)
    keep[0, 0, 2] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=q.dtype, device=DEVICE).masked_fill(~keep, float("-inf"))
    out = torch.ops.accelc.flash_attention(q, k, v, mask, empty_nan=True)
    zero = torch.ops.accelc.flash_attention(q, k, v, mask)
    assert torch.isnan(out[0, 0, 2]).all() and not torch.isnan(zero).any()
    assert torch.equal(out[0, 0, [0, 1, 3]], zero[0, 0, [0, 1, 3]])
    ref = fa.flash_attention_ref(q.double(), k.double(), v.double(), mask if kind == "bool" else mask.double(),
                                 empty_nan=True)
    assert torch.isnan(ref[0, 0, 2]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("row", [True, False])
@pytest.mark.parametrize("empty_nan", [False, True])
def test_row_masked_with_the_dtypes_minimum_averages_like_eager(dtype, row, empty_nan):
    """A row whose keys are all masked with finfo(dtype).min (HF's padding value: a one-token
    request whose only token is padding) is no empty row: eager's softmax sees finite scores and
    averages the values. bf16's minimum times log2(e) overflows fp32: the kernel saturates it
    instead of making it -inf (which gave 0, or NaN with empty_nan)."""
    q, k, v = _qkv(2, 2, 3, 8, 32, dtype)
    shape = (2, 1, 1, 8) if row else (2, 1, 3, 8)
    mask = torch.zeros(shape, dtype=dtype, device=DEVICE)
    mask[1] = torch.finfo(dtype).min          # batch 1: every key masked, every row
    mask[0, ..., 5:] = torch.finfo(dtype).min  # batch 0: a padded tail
    out = torch.ops.accelc.flash_attention(q, k, v, mask, empty_nan=empty_nan)
    assert torch.isfinite(out).all()
    ref = fa.flash_attention_ref(q.double(), k.double(), v.double(), mask.double(), empty_nan=empty_nan)
    eager = torch.softmax(q.float() @ k.float().transpose(-1, -2) / 32 ** 0.5 + mask.float(), -1) @ v.float()
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert rel_l2(out, ref) < tol and rel_l2(out, eager) < tol
    if dtype == torch.bfloat16:   # -3.4e38 + a score is -3.4e38 even in fp64: every key weighs the same
        torch.testing.assert_close(out[1].float(), v[1].double().mean(-2, keepdim=True).expand(2, 3, 32).float(),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("args,message", [
    (lambda q, k, v: (q.double(), k.double(), v.double()), "dtype torch.float64"),
    (lambda q, k, v: (q[..., :44], k[..., :44], v[..., :44]), "head dim 44"),
    (lambda q, k, v: (torch.cat([q, q[:, :1]], 1), k, v), "query heads a multiple of key/value heads"),
    (lambda q, k, v: (q, k, v[..., :32]), "head dims differ"),
    (lambda q, k, v: (q[0], k, v), "must be 4-D"),
    (lambda q, k, v: (q[0, 0], k[0, 0], v[0, 0]), "must be 4-D"),
])
def test_unsupported_inputs_explained(args, message):
    q, k, v = _qkv(2, 2, 8, 8, 64, torch.float16)
    assert message in fa.why_unsupported(*args(q, k, v))
    with pytest.raises(ValueError, match=message):
        fa.flash_attention_launch(*args(q, k, v))


# ---------------------------------------------------------------------------------------------
# int8 attention

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attention_qk_int8(causal, dtype):
    B, H, L, S, D = 2, 2, 33, 47 if not causal else 33, 64
    q, k, v = (torch.randn(B, H, n, D, device=DEVICE, dtype=dtype) for n in (L, S, S))
    out = flash_attention_launch(q, k, v, None, causal, None, qk_int8=True)
    ref8 = flash_attention_ref(q.float(), k.float(), v.float(), None, causal, None, qk_int8=True)
    ref = flash_attention_ref(q.double(), k.double(), v.double(), None, causal, None)
    assert rel_l2(out, ref8) < (4e-3 if dtype == torch.float16 else 2e-2)  # the kernel does what ref8 does
    assert sqnr_db(rel_l2(out, ref)) > 30


def test_repeated_calls_launch_the_compiled_kernel():
    """Fresh data each call through the cached compiled call (a GPU's direct launch)."""
    for _ in range(3):
        q, k, v = (torch.randn(2, 3, 37, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
        out = fa.flash_attention_launch(q, k, v, None, True)
        ref = fa.flash_attention_ref(q.double(), k.double(), v.double(), None, True)
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=1e-2)
    assert any(c.direct for c, kw in fa.TUNER.calls.values()) or DEVICE.type == "cpu"


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_without_repeating_kv(causal):
    """8 query heads over 2 K/V heads, as F.scaled_dot_product_attention(enable_gqa=True)."""
    q = torch.randn(2, 8, 10, 32, device=DEVICE, dtype=torch.float16)
    k, v = (torch.randn(2, 2, 13, 32, device=DEVICE, dtype=torch.float16) for _ in range(2))
    out = torch.ops.accelc.flash_attention(q, k, v, None, causal)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True)
    assert_close_to_ref(out, ref, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                        torch.float16, 2e-3, 1e-2)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask_read_only_at_real_query_rows(kind):
    """The last query block's rows past L must not read the mask: a (B, 1, L, S) mask ending at the
    end of its allocation was read past it (an illegal address on the GPU, found by the fuzzer with
    compute-sanitizer at L = 197)."""
    B, L, S = 2, 37 if DEVICE == "cpu" else 197, 53
    n = B * L * S
    if kind == "bool":
        buf = torch.ones(2 * 1024 * 1024, dtype=torch.bool, device=DEVICE)    # its own 2 MiB segment
        mask = buf[-n:].view(B, 1, L, S)
        mask[:, :, :, ::3] = False
    else:
        buf = torch.zeros(1024 * 1024, dtype=torch.float16, device=DEVICE)
        mask = buf[-n:].view(B, 1, L, S)
        mask[:, :, :, ::3] = -3.0
    q = torch.randn(B, 2, L, 64, device=DEVICE, dtype=torch.float16)
    k, v = (torch.randn(B, 2, S, 64, device=DEVICE, dtype=torch.float16) for _ in range(2))
    _check(q, k, v, mask)
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# TMA boxes (1, 1, rows, BLOCK_D) of q, k, v, forced: the interpreter runs the one config it is given
_TMA_CFG = fa.config(64, 64, 4, 4, tma=True) if DEVICE.type == "cuda" else fa.config(16, 16, 1, 4, tma=True)


@pytest.mark.parametrize("d", [16, 40, 64, 80, 128])
@pytest.mark.parametrize("lq,lk,causal", [(37, 37, False), (33, 70, True), (70, 33, False), (1, 19, False)])
def test_tma_boxes_every_head_dim_and_ragged_lengths(d, lq, lk, causal):
    """Rows past L and S and columns past D come back zero-filled from the copy engine: no masks on
    the loads, the bounds mask on the scores only."""
    q, k, v = _qkv(2, 3, lq, lk, d, torch.float16)
    assert fa.qkv_tma_ok(q, k, v)
    with fa.TUNER.force(_TMA_CFG):
        _check(q, k, v, causal=causal)
        assert all(kw["TMA"] for _, kw in fa.TUNER.calls.values())


def test_tma_boxes_strided_inputs_grouped_heads_and_masks():
    """(B, L, H, D) memory read as (B, H, L, D), grouped K/V heads, a key padding mask and a
    per-row mask: the boxes follow the real strides."""
    base = torch.randn(2, 21, 3, 4, 32, device=DEVICE, dtype=torch.float16)
    q = base[:, :, 0].transpose(1, 2)                                   # (2, 4, 21, 32), heads interleaved
    kv = torch.randn(2, 25, 2, 2, 32, device=DEVICE, dtype=torch.float16)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)     # (2, 2, 25, 32)
    assert fa.qkv_tma_ok(q, k, v) and not q.is_contiguous()
    keep = torch.rand(2, 1, 21, 25, device=DEVICE) > 0.3
    keep[..., 0] = True
    pad = torch.zeros(2, 1, 1, 25, device=DEVICE, dtype=torch.float16)
    pad[1, ..., 17:] = torch.finfo(torch.float16).min
    with fa.TUNER.force(_TMA_CFG):
        for mask in (None, keep, pad):
            out = torch.ops.accelc.flash_attention(q, k, v, mask)
            d = lambda t: None if t is None else (t if t.dtype == torch.bool else t.double())  # noqa: E731
            ref = fa.flash_attention_ref(q.double(), k.double(), v.double(), d(mask))
            eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            assert_close_to_ref(out, ref, eager, torch.float16, 2e-3, 1e-2)


def test_tma_boxes_size_one_dims_with_odd_strides():
    """One head sliced out of a (B, L, 3 * D) projection has a size-1 head dim whose stride PyTorch
    leaves at any value (here 97 elements, not a 16-byte multiple); the descriptor gets an aligned
    stride there and the result is unchanged."""
    base = torch.randn(2, 19, 3 * 32, device=DEVICE, dtype=torch.float16)
    q, k, v = (base[:, :, i * 32:(i + 1) * 32].unsqueeze(1) for i in range(3))   # (2, 1, 19, 32)
    q = q.as_strided(q.shape, (q.stride(0), 97, q.stride(2), 1))
    view = primitives.tma_view(q)
    assert view.stride(1) % 8 == 0 and view.stride(1) >= q.stride(0) and view.stride()[::2] == q.stride()[::2]
    assert fa.qkv_tma_ok(q, k, v)
    with fa.TUNER.force(_TMA_CFG):
        _check(q, k, v)


def test_tma_boxes_int8_scores():
    q, k, v = _qkv(1, 2, 40, 40, 64, torch.float16)
    ref = fa.flash_attention_ref(q.double(), k.double(), v.double(), None, False, None, True)
    with fa.TUNER.force(_TMA_CFG):
        out = fa.flash_attention_launch(q, k, v, None, False, None, True)
    assert sqnr_db(rel_l2(out.double(), ref)) > 40


def test_tma_refused_where_strides_do_not_allow_it():
    q, k, v = _qkv(1, 2, 8, 8, 64, torch.float16)
    assert fa.qkv_tma_ok(q, k, v)
    assert fa.qkv_tma_ok(q[:1, :1], k[:1, :1], v[:1, :1])                   # size-1 dims: any stride
    assert not fa.qkv_tma_ok(q, k[:, :1].expand(1, 2, 8, 64), v)            # an expanded head: stride 0
    assert not fa.qkv_tma_ok(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)   # head dim not contiguous
    odd = torch.randn(1, 2, 8, 68, device=DEVICE, dtype=torch.float16)[..., :60]  # rows of 136 bytes
    assert not fa.qkv_tma_ok(q[..., :60], odd, odd)
    sizes = dict(B=1, H=2, L=8, S=8, D=64, tma=False)
    assert fa._prune(fa.CONFIGS, sizes) and not any(c.kwargs["TMA"] for c in fa._prune(fa.CONFIGS, sizes))
    assert any(c.kwargs["TMA"] for c in fa._prune(fa.CONFIGS, dict(sizes, tma=True)))
    assert not any(c.kwargs["TMA"] for c in fa._prune(fa.CONFIGS, dict(sizes, D=256, tma=True)))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask_read_as_one_row(kind, causal):
    """A mask broadcast over query rows (B, 1, 1, S) is read as one row of S per block; a
    (B, 1, L, S) one as a tile. Both against the reference, with a fully padded tail."""
    q, k, v = _qkv(2, 3, 45, 45, 64, torch.float16)
    if kind == "bool":
        row = torch.rand(2, 1, 1, 45, device=DEVICE) > 0.3
        row[..., 0] = True
    else:
        row = torch.randn(2, 1, 1, 45, device=DEVICE, dtype=torch.float16)
        row[1, ..., 30:] = torch.finfo(torch.float16).min
    _check(q, k, v, row, causal)
    _check(q, k, v, row.expand(2, 1, 45, 45).contiguous(), causal)


@pytest.mark.parametrize("scale", [0.125, 0.0, -0.2])
def test_scale_of_any_sign(scale):
    """The folded softmax (row max times the scale) holds for scales >= 0; a negative scale takes
    the plain path (there the row max of the scores times a negative scale is no max: with scores
    in the thousands exp2 would overflow). Both match the fp64 reference. (Not compared with eager
    SDPA: on a GPU its flash backend gives NaN at these scales.)"""
    q, k, v = _qkv(1, 2, 33, 50, 64, torch.float16)
    q, k = q * 8, k * 8
    out = torch.ops.accelc.flash_attention(q, k, v, None, False, scale)
    ref = fa.flash_attention_ref(q.double(), k.double(), v.double(), None, False, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "gqa"])
def test_fp32_true_products_against_fp64(d, case):
    """fp32 attention (it stayed SDPA): true fp32 products (ieee), as eager's fp32 SDPA."""
    torch.manual_seed(0)
    q, k, v = _qkv(2, 4, 21, 37, d, torch.float32)
    mask, causal = None, case == "causal"
    if case == "bool_mask":
        mask = torch.rand(2, 1, 21, 37, device=DEVICE) > 0.3
    elif case == "float_mask":
        mask = torch.randn(2, 4, 21, 37, device=DEVICE)
    elif case == "gqa":
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    out = torch.ops.accelc.flash_attention(q, k, v, mask, causal, None)
    d64 = lambda t: None if t is None else (t if t.dtype == torch.bool else t.double())
    ref = fa.flash_attention_ref(d64(q), d64(k), d64(v), d64(mask), causal)
    assert out.dtype == torch.float32 and rel_l2(out, ref) < 1e-5, rel_l2(out, ref)


def test_fp32_tf32_when_asked():
    """allow_tf32: TF32 tensor cores (the config's fp32_precision='tf32'): within TF32's error
    (10 mantissa bits) on the GPU; the interpreter's dot is exact fp32 either way."""
    torch.manual_seed(0)
    q, k, v = _qkv(2, 4, 64, 64, 64, torch.float32)
    out = torch.ops.accelc.flash_attention(q, k, v, None, False, None, False, False, True)
    ref = fa.flash_attention_ref(q.double(), k.double(), v.double())
    assert rel_l2(out, ref) < 2e-3


@pytest.mark.parametrize("case", ["batch", "heads_3d", "grouped_heads", "decode"])
def test_batch_times_heads_past_the_grids_second_dimension_runs_in_slices(monkeypatch, case):
    """batch x heads beyond the grid's second dimension (65535 on CUDA: the launch fails there, and the
    interpreter does not check it) runs as slices, here with the limit lowered to 5: whole batches, or
    whole query groups where the heads alone exceed it (attention written with bmm), or a decode step."""
    monkeypatch.setattr(fa, "MAX_GRID_Y", 5)
    launched, launch = [], fa._launch

    def spy(q, k, *rest):
        launched.append(q.shape[0] * q.shape[1])
        return launch(q, k, *rest)
    monkeypatch.setattr(fa, "_launch", spy)
    mask = None
    if case == "batch":          # 3 x 4 heads: slices of one sequence, a key padding mask sliced with them
        q, k, v = (torch.randn(3, 4, 20, 16, device=DEVICE) for _ in range(3))
        mask = torch.rand(3, 1, 1, 20, device=DEVICE) > 0.2
        mask[..., 0] = True
    elif case == "heads_3d":     # (batch * heads, L, D): 7 heads in one batch
        q, k, v = (torch.randn(7, 20, 16, device=DEVICE) for _ in range(3))
    elif case == "grouped_heads":  # 8 query heads over 2 K/V heads: slices of whole groups of 4
        q = torch.randn(1, 8, 20, 16, device=DEVICE)
        k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(2))
    else:                        # one query row against many keys: the split-KV path
        q = torch.randn(2, 4, 1, 16, device=DEVICE)
        k, v = (torch.randn(2, 4, 300, 16, device=DEVICE) for _ in range(2))
    out = flash_attention_launch(q, k, v, mask, is_causal=case == "batch")
    ref = flash_attention_ref(q.double(), k.double(), v.double(), mask, is_causal=case == "batch")
    assert out.shape == ref.shape
    assert rel_l2(out, ref) < 1e-5
    assert launched[0] > 5 and len(launched) > 1 and all(n <= 5 for n in launched[1:])
