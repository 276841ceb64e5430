"""int8 (W8A8): kernels/quantize.py and kernels/int8_gemm.py against integer references (exact),
int8 layers against float by SQNR, and the int8 pass, guard and revert on models."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc.config import Int8Config
from accelc.guard import sqnr_db
from accelc.kernels.flash_attention import flash_attention_launch, flash_attention_ref
from accelc.kernels.int8_gemm import (int8_gemm_launch, int8_gemm_ref, linear_w8a8_launch, linear_w8a8_ref,
                                      quantize_weight)
from accelc.kernels.quantize import quantize_launch, quantize_ref
from conftest import DEVICE, rel_l2

FLOATS = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(37, 70, 45), (1, 16, 16), (5, 123, 123), (64, 96, 128)]  # (M, K, N)


def _sqnr(out, ref) -> float:
    return sqnr_db(rel_l2(out, ref))


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
    assert _sqnr(out, ref) > 30


# ---------------------------------------------------------------------------------------------
# the pass, guard and revert on models

def _int8_opt(model, x, **kw):
    """int8 on every layer the filters allow: these tests are about the int8 path, not about
    whether it is faster than float on their small shapes (test_only_if_faster)."""
    kw.setdefault("only_if_faster", False)
    return accelc.optimize(model, x, accelc.OptimizeConfig(dtype="fp16", int8=Int8Config(**kw)))


@pytest.mark.parametrize("name", ["mlp", "transformer_mlp", "vit", "gpt", "bert"])
def test_models_int8(name):
    model = accelc.models.get(name).to(DEVICE)
    x = model.example_inputs(2)
    float_opt = accelc.optimize(model, x, accelc.OptimizeConfig(dtype="fp16"))
    opt = _int8_opt(model, x, attention=True)
    int8 = [r for r in opt.layers if r.kind in ("linear_int8", "attention_int8")]
    assert int8, opt.summary()
    assert all(r.status == "rewritten" and r.sqnr_db >= 20 for r in int8), opt.summary()
    assert opt.info.end_to_end_sqnr_db >= 20
    # the layers that stay float are exactly what the float path makes
    float_kernels = {r.name: r.kernel for r in float_opt.layers}
    for r in opt.layers:
        if r.kind not in ("linear_int8", "attention_int8"):
            assert r.kernel == float_kernels[r.name], r
        else:
            assert r.kernel.startswith(float_kernels[r.name].split("[")[0].replace("linear", "linear_w8a8")
                                       if r.kind == "linear_int8" else "accelc::flash_attention")
    # first and last linear stay float by default, with the reason
    linears = [r for r in opt.layers if r.kind in ("linear", "linear_int8")]
    assert linears[0].kind == linears[-1].kind == "linear" and "skip_first_last" in linears[0].reason
    assert "SQNR" in opt.summary() and "int8:" in opt.summary()
    assert opt.info.int8_weight_bytes < 0.6 * opt.info.float_weight_bytes


def test_int8_off_is_the_float_path():
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    x = model.example_inputs(2)
    a = accelc.optimize(model, x, accelc.OptimizeConfig(dtype="fp16"))
    b = accelc.optimize(model, x, accelc.OptimizeConfig(dtype="fp16", int8=False))
    assert [(r.name, r.kernel) for r in a.layers] == [(r.name, r.kernel) for r in b.layers]
    assert not any("w8a8" in str(n.target) for n in b.graph_module.graph.nodes)


def test_layer_filters():
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    x = model.example_inputs(2)
    opt = _int8_opt(model, x, layers=("blocks.*.fc1*",), exclude=("blocks.0.*",), skip_first_last=False)
    int8 = {r.name for r in opt.layers if r.kind == "linear_int8"}
    assert int8 == {f"blocks.{i}.fc1+gelu" for i in (1, 2, 3)}, opt.summary()
    opt = _int8_opt(model, x, types=("Conv2d",))
    assert not any(r.kind == "linear_int8" for r in opt.layers)


class _Outliers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x)


def _outlier_input(n=64):
    x = torch.randn(n, 64, device=DEVICE)
    x[:, 5] *= 80                    # one channel carries outliers (as in LLM activations)
    x[:, 17] *= 40
    return x.half()


def test_smoothing_improves_sqnr_on_outliers():
    model = _Outliers().to(DEVICE)
    x = _outlier_input()
    common = dict(skip_first_last=False, sqnr_floor=1.0)
    plain = _int8_opt(model, x, **common)
    smooth = _int8_opt(model, x, smoothing=0.5, **common)
    s_plain, s_smooth = plain.layers[0].sqnr_db, smooth.layers[0].sqnr_db
    assert smooth.layers[0].kind == "linear_int8" and "SmoothQuant" in smooth.layers[0].reason
    assert s_smooth > s_plain + 3, (s_plain, s_smooth)
    # the smoothed module computes the same function on new data (calibrated on x)
    x2 = _outlier_input(32)
    ref = model.double()(x2.double())
    assert _sqnr(smooth(x2), ref) > s_plain


def test_static_scales_from_calibration():
    model = _Outliers().to(DEVICE)
    x = torch.randn(16, 64, device=DEVICE).half()
    calib = [torch.randn(16, 64, device=DEVICE).half() * 1.2 for _ in range(3)]
    opt = accelc.optimize(model, x, accelc.OptimizeConfig(dtype="fp16", int8=Int8Config(
        static=True, skip_first_last=False, only_if_faster=False)), calibration=calib)
    (rec,) = opt.layers
    assert rec.kind == "linear_int8" and "static" in rec.reason and rec.sqnr_db > 20
    assert any(n.kwargs.get("static_scale") is not None for n in opt.graph_module.graph.nodes
               if n.op == "call_function")


def test_under_the_floor_goes_back_to_float():
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    x = model.example_inputs(2)
    (x,) = x
    opt = _int8_opt(model, x, sqnr_floor=80.0)    # int8 cannot reach 80 dB: every layer demoted
    assert not any(r.kind == "linear_int8" for r in opt.layers)
    demoted = [r for r in opt.layers if "under the floor" in r.reason]
    assert len(demoted) == 6, opt.summary()
    for r in demoted:
        assert r.status == "rewritten" and r.kernel.startswith("accelc::linear") and "w8a8" not in r.kernel
        assert r.rel_error <= 2e-3                  # and the float kernel was checked
    assert not any(t.dtype == torch.int8 for t in opt.graph_module.buffers())  # int8 weights dropped
    ref = model.half()(x.half())
    assert rel_l2(opt(x.half()), ref) < 2e-3


def test_min_rows_keeps_small_layers_float():
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    (x,) = model.example_inputs(1)
    rows = math.prod(x.shape[:-1])
    opt = _int8_opt(model, x, min_rows=rows + 1)
    assert not any(r.kind == "linear_int8" for r in opt.layers)
    assert any("min_rows" in r.reason for r in opt.layers)


def test_only_if_faster():
    """On a GPU each int8 layer is timed against its float kernel and the slower one goes; in
    the interpreter nothing is timed (its timings mean nothing) and int8 stays."""
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    (x,) = model.example_inputs(2)
    x = x.half()
    opt = _int8_opt(model, x, only_if_faster=True)
    candidates = [r for r in opt.layers if r.kind in ("linear", "linear_int8") and "skip_first_last" not in r.reason]
    assert len(candidates) == 6
    kept_float = [r for r in candidates if r.kind == "linear"]
    for r in kept_float:
        assert "float kernel kept (Int8Config.only_if_faster)" in r.reason and r.rel_error <= 2e-3, r
    if DEVICE.type == "cpu":
        assert not kept_float
    assert rel_l2(opt(x), model.half()(x)) < 2e-2


def test_config_validation():
    with pytest.raises(ValueError, match="smoothing"):
        Int8Config(smoothing=1.5)
    with pytest.raises(TypeError, match="int8 must be"):
        accelc.OptimizeConfig(int8="yes")
    assert accelc.OptimizeConfig(int8=True).int8 == Int8Config()
    assert accelc.OptimizeConfig().int8 is None


def test_save_keeps_only_int8_weights(tmp_path):
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    (x,) = model.example_inputs(2)
    x = x.half()
    opt = _int8_opt(model, x)
    path = tmp_path / "m.pt2"
    accelc.save(opt, path)
    loaded = accelc.load(path)
    assert rel_l2(loaded(x), opt(x)) == 0
    ep = torch.export.load(path)
    int8_paths = [r.name.split("+")[0] for r in opt.layers if r.kind == "linear_int8"]
    saved = set(ep.state_dict) | set(ep.constants)
    for p in int8_paths:   # the float weights of int8 layers are not in the file
        assert f"{p}.weight" not in saved, p
    assert any(t.dtype == torch.int8 for t in list(ep.state_dict.values()) + list(ep.constants.values()))


def test_cli_int8(capsys):
    from accelc.cli import main

    assert main(["optimize", "transformer_mlp", "--int8", "--int8-keep-slower", "--batch-size", "2",
                 "--device", str(DEVICE.type)]) == 0
    out = capsys.readouterr().out
    assert "accelc::linear_w8a8" in out and "SQNR" in out
    # without --int8-keep-slower, on a GPU, each int8 layer is either kept or said to be slower
    assert main(["optimize", "transformer_mlp", "--int8", "--batch-size", "2", "--device", str(DEVICE.type)]) == 0
    out = capsys.readouterr().out
    assert out.count("accelc::linear_w8a8") + out.count("only_if_faster") == 6
    assert main(["optimize", "mlp", "--int8-attention"]) == 1
    assert "need --int8" in capsys.readouterr().err
