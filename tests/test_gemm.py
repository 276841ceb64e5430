"""accelc::linear (kernels/gemm.py) against its fp64 reference and eager PyTorch."""
import pytest
import torch
import torch.nn.functional as F

from accelc.kernels import gemm
from accelc.kernels.epilogue import ACTIVATIONS, activation_ref
from conftest import DEVICE, assert_close_to_ref

DTYPES = [  # (dtype, atol, rtol) vs the fp64 reference
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-2, 1e-2),
    (torch.bfloat16, 6e-2, 4e-2),
]
SHAPES = [(37, 70, 45), (1, 16, 16), (5, 123, 123), (64, 96, 128)]  # (M, K, N)


def _inputs(m, k, n, dtype, lead=()):
    x = torch.randn(*lead, m, k, device=DEVICE, dtype=dtype)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEVICE, dtype=dtype)
    r = torch.randn(*lead, m, n, device=DEVICE, dtype=dtype)
    return x, w, b, r


def _eager(x, w, b, r, act, residual_first=False):
    """What a PyTorch model computes, rounding to x.dtype after every op."""
    y = F.linear(x, w, b)
    if r is not None and residual_first:
        return activation_ref(act, y + r)
    y = activation_ref(act, y)
    return y + r if r is not None else y


def _ref(x, w, b, r, act, residual_first=False):
    d = lambda t: None if t is None else t.double()
    return gemm.linear_ref(d(x), d(w), d(b), d(r), act, residual_first)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_every_dtype(dtype, atol, rtol, activation):
    x, w, b, _ = _inputs(37, 70, 45, dtype)
    out = torch.ops.accelc.linear(x, w, b, activation=activation)
    assert_close_to_ref(out, _ref(x, w, b, None, activation), _eager(x, w, b, None, activation),
                        dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_odd_shapes_with_residual(dtype, atol, rtol, m, k, n):
    x, w, b, r = _inputs(m, k, n, dtype)
    out = torch.ops.accelc.linear(x, w, b, r, activation="gelu")
    assert_close_to_ref(out, _ref(x, w, b, r, "gelu"), _eager(x, w, b, r, "gelu"), dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_residual_before_activation(dtype, atol, rtol):
    x, w, b, r = _inputs(29, 48, 40, dtype)
    out = torch.ops.accelc.linear(x, w, b, r, activation="relu", residual_first=True)
    assert_close_to_ref(out, _ref(x, w, b, r, "relu", True), _eager(x, w, b, r, "relu", True),
                        dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_leading_batch_dims_and_no_bias(dtype, atol, rtol):
    x, w, _, r = _inputs(7, 33, 20, dtype, lead=(2, 3))
    out = torch.ops.accelc.linear(x, w, None, r, activation="silu")
    assert out.shape == (2, 3, 7, 20)
    assert_close_to_ref(out, _ref(x, w, None, r, "silu"), _eager(x, w, None, r, "silu"), dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_non_contiguous_inputs(dtype, atol, rtol):
    # x: a transposed slice; weight: the transpose of a (K, N) matrix, as matmul(x, W) has it
    big = torch.randn(64, 50, device=DEVICE, dtype=dtype)
    x = big[::2, :].t()                                   # (50, 32), strides (1, 100)
    w_t = (torch.randn(32, 24, device=DEVICE) / 32 ** 0.5).to(dtype)
    w = w_t.t()                                           # (24, 32), strides (1, 24)
    r = torch.randn(24, 50, device=DEVICE, dtype=dtype).t()
    b = torch.randn(24, device=DEVICE, dtype=dtype)
    assert not x.is_contiguous() and not w.is_contiguous() and not r.is_contiguous()
    out = torch.ops.accelc.linear(x, w, b, r, activation="tanh")
    assert_close_to_ref(out, _ref(x, w, b, r, "tanh"), _eager(x, w, b, r, "tanh"), dtype, atol, rtol)


def test_fp32_tf32_option_runs():
    x, w, b, _ = _inputs(37, 70, 45, torch.float32)
    out = torch.ops.accelc.linear(x, w, b, activation="relu", allow_tf32=True)
    ref = _ref(x, w, b, None, "relu")
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)  # tf32: 10-bit mantissa


def test_empty_rows():
    x, w, b, _ = _inputs(0, 16, 8, torch.float32)
    out = torch.ops.accelc.linear(x, w, b)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("bad,message", [
    (lambda x, w, b: (x, w[:, :10], b), "x has K=16 features but weight is"),
    (lambda x, w, b: (x, w.half(), b), "weight is torch.float16 but x is torch.float32"),
    (lambda x, w, b: (x, w, b[:3]), "bias must be (8,)"),
    (lambda x, w, b: (x.double(), w.double(), b.double()), "dtype torch.float64 is not supported"),
    (lambda x, w, b: (x, w[None], b), "weight must be 2-D"),
])
def test_bad_inputs_say_what_is_wrong(bad, message):
    x, w, b, _ = _inputs(4, 16, 8, torch.float32)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gemm.linear_launch(*bad(x, w, b))


def test_op_is_one_node_under_export():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 16))

        def forward(self, x):
            return torch.ops.accelc.linear(x, self.w, None, activation="relu")

    ep = torch.export.export(M().to(DEVICE), (torch.randn(4, 16, device=DEVICE),))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.accelc.linear.default]


@pytest.mark.parametrize("k,tma", [(64, True), (70, False)])
def test_tma_and_pointer_paths(k, tma):
    # K=64 rows are 16-byte aligned: the copy-engine (TMA) path; K=70 fp16 rows are not: pointers
    x, w, b, r = _inputs(45, k, 33, torch.float16)
    assert gemm.tma_ok(x) == tma and gemm.tma_ok(w) == tma
    out = torch.ops.accelc.linear(x, w, b, r, activation="gelu_tanh")
    assert_close_to_ref(out, _ref(x, w, b, r, "gelu_tanh"), _eager(x, w, b, r, "gelu_tanh"),
                        torch.float16, 1e-2, 1e-2)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the autotuner times configs on a GPU")
@pytest.mark.parametrize("k", [256, 250])  # TMA configs allowed / pruned
def test_autotuned_launch(monkeypatch, k):
    monkeypatch.setenv("ACCELC_AUTOTUNE", "1")
    x, w, b, r = _inputs(300, k, 192, torch.float16)
    out = torch.ops.accelc.linear(x, w, b, r, activation="gelu")
    assert_close_to_ref(out, _ref(x, w, b, r, "gelu"), _eager(x, w, b, r, "gelu"), torch.float16, 1e-2, 1e-2)


@pytest.mark.parametrize("m,k,n", [(7, 40, 24), (300, 64, 96)])
def test_repeated_calls_launch_the_compiled_kernel(m, k, n):
    """A call signature seen before launches its compiled kernel directly (on a GPU; the
    interpreter goes through Triton every time): fresh data each call, each result right."""
    w = torch.randn(n, k, device=DEVICE, dtype=torch.float16)
    b = torch.randn(n, device=DEVICE, dtype=torch.float16)
    for _ in range(3):
        x = torch.randn(m, k, device=DEVICE, dtype=torch.float16)
        r = torch.randn(m, n, device=DEVICE, dtype=torch.float16)
        out = gemm.linear_launch(x, w, b, r, "gelu")
        ref = gemm.linear_ref(x.float(), w.float(), b.float(), r.float(), "gelu")
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    calls = [c for sig, (c, kw) in gemm.TUNER.calls.items() if sig[0] == (m, k) and sig[2] == (n, k)]
    assert calls and (DEVICE.type == "cpu" or calls[0].direct)
