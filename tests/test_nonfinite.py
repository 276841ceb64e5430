"""NaN and inf behave as in eager: a diverged model's NaN is never turned into plausible numbers by
a fused epilogue or by int8 quantization."""
import pytest
import torch
from torch import nn

import accelc
from accelc.kernels import conv, gemm, int8_gemm
from accelc.kernels.epilogue import ACTIVATION_NAMES, activation_ref
from conftest import DEVICE


def _special_rows(M, K, dtype):
    x = torch.randn(M, K, device=DEVICE, dtype=dtype)
    x[0, 1] = float("nan")
    x[1] = float("inf")                 # the all-inf row
    x[2, 3] = float("-inf")
    x[3, 0], x[3, 2] = float("inf"), float("-inf")
    return x


def _same_nonfinite(out, ref):
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isposinf(out), torch.isposinf(ref)) and torch.equal(torch.isneginf(out), torch.isneginf(ref))


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_linear_epilogue_keeps_nan_and_inf_as_eager(activation):
    x = _special_rows(6, 32, torch.float32)
    w, b = torch.randn(24, 32, device=DEVICE), torch.randn(24, device=DEVICE)
    out = gemm.linear_launch(x, w, b, None, activation)
    # The reference is eager in float64: the exact value, which eager gives at every dtype on CUDA.
    # Eager CPU float32 / bfloat16 GELU alone differs: its vectorized path gives NaN at +inf (float64
    # and float16 give +inf); the kernels follow the exact value on every device (next test).
    ref = activation_ref(activation, torch.nn.functional.linear(x.double(), w.double(), b.double()))
    _same_nonfinite(out, ref)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[4:]).all()


def test_gelu_epilogue_at_infinity_is_the_exact_value():
    """GELU(+inf) = +inf, GELU(-inf) = -inf * 0 = NaN, as eager CUDA and eager float64 give them,
    under every Triton the project accepts (the interpreter's GELU is a fit, the GPU's libdevice erf)."""
    x = torch.randn(4, 16, device=DEVICE)
    w = torch.eye(16, device=DEVICE)    # the pre-activation's diagonal is x's (inf * 0 = NaN elsewhere)
    x[0, 0], x[1, 1], x[2, 2] = float("inf"), float("-inf"), float("nan")
    out = gemm.linear_launch(x, w, None, None, "gelu")
    assert torch.isposinf(out[0, 0]) and torch.isnan(out[1, 1]) and torch.isnan(out[2, 2])
    exact = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), w.double()))
    assert torch.equal(torch.isposinf(out), torch.isposinf(exact)) and torch.equal(torch.isnan(out), torch.isnan(exact))


def test_conv_relu_keeps_nan():
    x = torch.randn(2, 16, 6, 6, device=DEVICE)
    x[0, 3, 2, 2] = float("nan")
    x[1, :, 4, 4] = float("inf")
    w = torch.randn(8, 16, 3, 3, device=DEVICE)
    out = conv.conv2d_launch(x, conv.pack_weight(w), None, None, (1, 1), (1, 1, 1, 1), (1, 1), "relu")
    ref = torch.relu(torch.nn.functional.conv2d(x, w, None, 1, 1))
    _same_nonfinite(out, ref)
    assert torch.isnan(out).any()


def test_int8_row_with_nan_or_inf_is_nan_not_numbers():
    x = _special_rows(6, 64, torch.float32)
    w_q, w_scale = int8_gemm.quantize_weight(torch.randn(16, 64, device=DEVICE))
    out = int8_gemm.linear_w8a8_launch(x, w_q, w_scale, None, None, "relu")
    assert torch.isnan(out[:4]).all() and torch.isfinite(out[4:]).all()
    ref = int8_gemm.linear_w8a8_ref(x, w_q, w_scale, None, None, "relu")
    assert torch.isnan(ref[:4]).all()


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


@pytest.mark.parametrize("build,shape", [(_Mlp, (4, 32)), (_ConvNet, (2, 16, 5, 5))])
def test_optimized_model_gives_nan_where_eager_does(build, shape):
    model = build().to(DEVICE).eval()
    # only_if_faster off: on a GPU these tiny layers would be kept in PyTorch as faster there
    opt = accelc.optimize(model, torch.randn(*shape, device=DEVICE), accelc.OptimizeConfig(only_if_faster=False))
    assert any(r.status == "rewritten" for r in opt.layers)
    x = torch.randn(*shape, device=DEVICE)
    x[0].view(-1)[3] = float("nan")
    with torch.no_grad():
        out, ref = opt(x), model(x)
    _same_nonfinite(out, ref)
    assert torch.isnan(out[0]).any() and torch.isfinite(out[1:]).all()
