"""accelc::quantize_per_token (kernels/quantize.py): bit for bit against its PyTorch reference."""
import pytest
import torch

from accelc.kernels.quantize import quantize_launch, quantize_ref
from conftest import DEVICE

FLOATS = [torch.float16, torch.bfloat16, torch.float32]


# ---------------------------------------------------------------------------------------------
# quantize: bit for bit

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("m,k", [(37, 70), (1, 16), (5, 123), (3, 5000)])
def test_quantize_exact(m, k, dtype):
    x = (torch.randn(m, k, device=DEVICE) * torch.rand(m, 1, device=DEVICE) * 10).to(dtype)
    q, s = quantize_launch(x)
    q_ref, s_ref = quantize_ref(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert q.abs().amax(1).eq(127).all()          # each row's absmax maps to 127
    # dequantized rows are within half a step of x
    assert ((q.float() * s[:, None] - x.float()).abs() <= s[:, None] * 0.5001).all()


def test_quantize_strided_rows_smooth_static_and_zero_rows():
    base = torch.randn(9, 200, device=DEVICE, dtype=torch.float16)
    x = base[::2, 10:150]                         # strided rows, offset start
    x[1] = 0                                      # a row of zeros: scale 0, q 0
    smooth = torch.rand(140, device=DEVICE) + 0.5
    for kw in ({}, {"smooth": smooth}, {"static_scale": torch.tensor([0.01], device=DEVICE)},
               {"smooth": smooth, "static_scale": torch.tensor([0.02], device=DEVICE)}):
        q, s = quantize_launch(x, **kw)
        q_ref, s_ref = quantize_ref(x, **kw)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), kw
    q, s = quantize_launch(x)
    assert s[1] == 0 and q[1].eq(0).all()
    # a static scale saturates values past it
    q, _ = quantize_launch(x, static_scale=torch.tensor([1e-3], device=DEVICE))
    assert q.abs().max() == 127


def test_quantize_op_and_bad_input():
    x = torch.randn(4, 3, 32, device=DEVICE, dtype=torch.float16)
    q, s = torch.ops.accelc.quantize_per_token(x)
    assert q.shape == x.shape and s.shape == (4, 3)
    with pytest.raises(ValueError, match="dtype"):
        quantize_launch(x.to(torch.int32))
    with pytest.raises(ValueError, match="smooth must be"):
        quantize_launch(x, smooth=torch.ones(31, device=DEVICE))
