"""accelc::linear_w8a8 (kernels/int8_gemm.py): int32 accumulators bit for bit against an integer
reference, the dequantizing epilogue against the same math in fp32, the layer against float by SQNR."""
import pytest
import torch
import torch.nn.functional as F

from accelc.numerics import sqnr_db
from accelc.kernels.int8_gemm import (int8_gemm_launch, int8_gemm_ref, linear_w8a8_launch, linear_w8a8_ref,
                                      quantize_weight)
from conftest import DEVICE, rel_l2

SHAPES = [(37, 70, 45), (1, 16, 16), (5, 123, 123), (64, 96, 128)]  # (M, K, N)


def _sqnr(out, ref) -> float:
    return sqnr_db(rel_l2(out, ref))


# ---------------------------------------------------------------------------------------------
# int8 GEMM: int32 accumulators bit for bit; dequantized epilogue vs the same math in fp32

@pytest.mark.parametrize("m,k,n", SHAPES + [(33, 1000, 70)])
def test_int8_gemm_int32_exact(m, k, n):
    q = torch.randint(-127, 128, (m, k), device=DEVICE, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8)
    ones_m, ones_n = torch.ones(m, device=DEVICE), torch.ones(n, device=DEVICE)
    acc = int8_gemm_launch(q, ones_m, w, ones_n, raw=True)
    assert acc.dtype == torch.int32
    assert torch.equal(acc, int8_gemm_ref(q, ones_m, w, ones_n, raw=True))
    # extremes: every product 127 * 127 (or -127 * 127) summed over k
    full = torch.full((m, k), 127, device=DEVICE, dtype=torch.int8)
    assert torch.equal(int8_gemm_launch(full, ones_m, -w.abs().clamp_min(127), ones_n, raw=True),
                       torch.full((m, n), -127 * 127 * k, device=DEVICE, dtype=torch.int32))


@pytest.mark.parametrize("activation,residual,residual_first", [
    ("none", False, False), ("gelu", False, False), ("relu", True, True), ("silu", True, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_gemm_epilogue(activation, residual, residual_first, dtype):
    m, k, n = 37, 70, 45
    q = torch.randint(-127, 128, (m, k), device=DEVICE, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8)
    a_s, w_s = torch.rand(m, device=DEVICE) / 100, torch.rand(n, device=DEVICE) / 100
    b = torch.randn(n, device=DEVICE, dtype=dtype)
    r = torch.randn(m, n, device=DEVICE, dtype=dtype) if residual else None
    out = int8_gemm_launch(q, a_s, w, w_s, b, r, activation, residual_first, out_dtype=dtype)
    ref = int8_gemm_ref(q.cpu(), a_s.cpu(), w.cpu(), w_s.cpu(), b.cpu(), None if r is None else r.cpu(),
                        activation, residual_first, out_dtype=torch.float32)
    assert out.dtype == dtype
    # the same fp32 math: within one rounding to the output dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float().cpu(), ref, atol=2 * eps, rtol=eps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear_w8a8_sqnr_vs_float(m, k, n, dtype):
    """Random data: int8 layer vs the float layer in fp64, well above the 20 dB floor."""
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    w = torch.randn(n, k, device=DEVICE) / k ** 0.5
    b = torch.randn(n, device=DEVICE, dtype=dtype)
    w_q, w_s = quantize_weight(w)
    out = torch.ops.accelc.linear_w8a8(x, w_q, w_s, b, None, "gelu")
    ref = F.gelu(F.linear(x.double(), w.double(), b.double()))
    assert out.dtype == dtype and out.shape == (m, n)
    assert _sqnr(out, ref) > 30
    # and the kernel is its own integer reference, up to the output rounding
    ref8 = linear_w8a8_ref(x, w_q, w_s, b, None, "gelu")
    assert rel_l2(out, ref8) <= 2 * torch.finfo(dtype).eps


def test_linear_w8a8_batch_dims_and_bad_input():
    x = torch.randn(2, 3, 64, device=DEVICE, dtype=torch.float16)
    w_q, w_s = quantize_weight(torch.randn(32, 64, device=DEVICE))
    out = linear_w8a8_launch(x, w_q, w_s)
    assert out.shape == (2, 3, 32)
    with pytest.raises(ValueError, match="expected"):
        linear_w8a8_launch(x, w_q[:, :63].contiguous(), w_s)
    with pytest.raises(ValueError, match="int8"):
        int8_gemm_launch(x.reshape(6, 64), torch.ones(6, device=DEVICE), w_q, w_s)


def test_quantize_weight_per_channel():
    w = torch.randn(16, 40, device=DEVICE) * torch.logspace(-3, 2, 16, device=DEVICE)[:, None]
    w_q, w_s = quantize_weight(w)
    assert w_q.dtype == torch.int8 and w_s.shape == (16,)
    assert w_q.abs().amax(1).eq(127).all()
    assert _sqnr(w_q.float() * w_s[:, None], w) > 38   # each row keeps its own range
