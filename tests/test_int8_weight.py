"""Weight-only int8 (kernels/int8_weight.py): accelc::linear_w8a16 and accelc::gated_linear_w8a16
against their references (the dequantized weight in fp32 / fp64), at a decode step's rows
(gemv_kernel) and at a prompt's (the tensor-core tiles), and the weight's own quantization error."""
import pytest
import torch
import torch.nn.functional as F

from accelc.kernels import gated_linear, gemm, int8_weight
from accelc.kernels.int8_gemm import quantize_weight
from accelc.numerics import rel_l2
from conftest import DEVICE
from test_gemm import gemv_id

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}   # rel. L2 vs the fp64 reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 37])      # gemv_kernel's rows (1-8), then tiles
def test_linear_w8a16_matches_its_reference_with_the_whole_epilogue(dtype, m):
    torch.manual_seed(m)
    k, n = 72, 40
    x = torch.randn(2, m, k, device=DEVICE, dtype=dtype)
    w = torch.randn(n, k, device=DEVICE) / k ** 0.5
    w_q, w_scale = quantize_weight(w)
    b = torch.randn(n, device=DEVICE, dtype=dtype)
    r = torch.randn(2, m, n, device=DEVICE, dtype=dtype)
    out = int8_weight.linear_w8a16_launch(x, w_q, w_scale, b, r, "gelu")
    ref = int8_weight.linear_w8a16_ref(x.double(), w_q, w_scale, b.double(), r.double(), "gelu")
    assert out.dtype == dtype and out.shape == (2, m, n)
    assert rel_l2(out, ref) <= TOL[dtype], rel_l2(out, ref)
    # against the float layer: the weight's rounding alone (per channel, 8 bits: ~40 dB and up)
    float_out = (F.gelu(x.double() @ w.double().t() + b.double()) + r.double())
    assert rel_l2(out, float_out) < 2e-2


@pytest.mark.parametrize("m", [1, 5, 24])
def test_gated_linear_w8a16_matches_its_reference(m):
    torch.manual_seed(m)
    k, n = 64, 40                # n not a multiple of the gating group: padded rows
    x = torch.randn(m, k, device=DEVICE)
    wg, wu = (torch.randn(n, k, device=DEVICE) / k ** 0.5 for _ in range(2))
    bg = torch.randn(n, device=DEVICE)
    packed, bias = gated_linear.pack(wg, wu, bg, None)
    w_q, w_scale = quantize_weight(packed)
    out = int8_weight.gated_linear_w8a16_launch(x, w_q, w_scale, bias, n, "silu")
    ref = int8_weight.gated_linear_w8a16_ref(x.double(), w_q, w_scale, bias, n, "silu")
    assert out.shape == (m, n) and rel_l2(out, ref) <= 1e-5
    float_out = F.silu(x.double() @ wg.double().t() + bg.double()) * (x.double() @ wu.double().t())
    assert rel_l2(out, float_out) < 2e-2


def test_bad_operands_say_what_is_wrong():
    x = torch.randn(2, 8, device=DEVICE)
    w_q, w_scale = quantize_weight(torch.randn(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="w_q must be int8"):
        int8_weight.linear_w8a16_launch(x, w_q.float(), w_scale)
    with pytest.raises(ValueError, match="x has K=6 features but w_q is \\(4, 8\\)"):
        int8_weight.linear_w8a16_launch(torch.randn(2, 6, device=DEVICE), w_q, w_scale)


def test_weights_only_moves_every_linear_and_gated_layer_and_generates(tmp_path):
    """OptimizeConfig(int8=Int8Config(weights_only=True)) on a tiny Llama: its linear layers and its
    gated MLP run with int8 weights (the guard judges them by SQNR), the module holds the int8
    weights instead of the float ones, and generate() works over them; W8A8-only options are refused
    in one line."""
    import warnings

    import accelc
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              num_key_value_heads=1, intermediate_size=64, vocab_size=100,
                                              max_position_embeddings=64)).to(DEVICE).eval()
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    config = accelc.OptimizeConfig(int8=accelc.Int8Config(weights_only=True, skip_first_last=False,
                                                          only_if_faster=False),
                                   only_if_faster=False, max_cache_len=24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, config=config)
    # (a projection with its RMSNorm taken in: accelc::rms_norm+<kernel>, passes/norm_linear.py)
    kernels = [r.kernel.replace("rms_norm+", "") for r in opt.layers if r.status == "rewritten"]
    assert any(k.startswith("accelc::gated_linear_w8a16") for k in kernels), kernels
    assert sum(k.startswith("accelc::linear_w8a16") for k in kernels) >= 3, kernels     # qkv, o, down, lm_head
    assert all(r.sqnr_db is None or r.sqnr_db > 30 for r in opt.layers if "w8a16" in r.kernel)
    assert opt.info.int8_weight_bytes and opt.info.int8_weight_bytes < opt.info.float_weight_bytes / 1.9
    with torch.no_grad():
        mask = torch.ones_like(ids)
        want = lm(input_ids=ids, attention_mask=mask).logits.double()
        got = opt(input_ids=ids, attention_mask=mask).logits.double()
        assert rel_l2(got, want) < 5e-2
        out = opt.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert out.shape == (2, 14)
    step = [r.kernel.replace("rms_norm+", "") for r in opt.step.layers if r.status == "rewritten"]      # the decode step's too
    assert any(k.startswith("accelc::gated_linear_w8a16") for k in step), step
    with pytest.raises(ValueError, match="weights_only keeps the activations in float: static"):
        accelc.Int8Config(weights_only=True, static=True)


@pytest.mark.parametrize("cfg", gemm.GEMV_INT8_CONFIGS, ids=gemv_id)
def test_every_int8_weight_gemv_candidate_with_tails_and_gating(cfg):
    """gemv_kernel's deeper candidates for int8 weights, each forced: rows below BLOCK_M, N and K
    tails, the epilogue with a residual, and a gated weight where the candidate is wide enough."""
    bm, bn, bk = (cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    k, n = bk + 28, bn + 24
    torch.manual_seed(bn)
    for m in sorted({bm, bm // 2 + 1}):
        x = torch.randn(m, k, device=DEVICE)
        w_q, w_scale = quantize_weight(torch.randn(n, k, device=DEVICE) / k ** 0.5)
        b, r = torch.randn(n, device=DEVICE), torch.randn(m, n, device=DEVICE)
        with int8_weight.TUNER.force(cfg):
            out = int8_weight.linear_w8a16_launch(x, w_q, w_scale, b, r, "gelu")
        ref = int8_weight.linear_w8a16_ref(x.double(), w_q, w_scale, b.double(), r.double(), "gelu")
        assert rel_l2(out, ref) <= TOL[torch.float32], (m, rel_l2(out, ref))
        if bn >= 2 * gemm.GATE_GROUP:
            wg, wu = (torch.randn(n, k, device=DEVICE) / k ** 0.5 for _ in range(2))
            packed, bias = gated_linear.pack(wg, wu, b, None)
            g_q, g_scale = quantize_weight(packed)
            with int8_weight.GATED_TUNER.force(cfg):
                y = int8_weight.gated_linear_w8a16_launch(x, g_q, g_scale, bias, n, "silu")
            ref = int8_weight.gated_linear_w8a16_ref(x.double(), g_q, g_scale, bias, n, "silu")
            assert rel_l2(y, ref) <= TOL[torch.float32], (m, rel_l2(y, ref))
