"""The RMSNorm before a projection taken into it (passes/norm_linear.py, accelc::linear / gated_linear's
norm_weight and norm_eps): the kernels against their references (gemv_kernel's K loop for a decode step's rows,
both of its forms; the norm kernel then the GEMM for more rows), the pass on a tiny Llama (the norm as accelc's
layer under eager glue, and written out as HF writes it), generation, a wrong fused kernel reverted, and a norm
with another reader left alone."""
import warnings

import pytest
import torch

import accelc
from accelc import meta
from accelc.kernels import gated_linear, gemm
from accelc.numerics import rel_l2
from conftest import DEVICE, CausalLogits

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 13])
def test_the_norm_before_a_projection_matches_its_reference(dtype, m):
    """x's rows RMS-normalized (weight, eps) before act(x @ W^T + b) (+ residual), and before a gated pair: as
    the fp64 reference, K not a multiple of the block; m = 13 past gemv_kernel's rows (the norm kernel first)."""
    torch.manual_seed(m)
    k, n = 200, 72
    x = torch.randn(m, k, device=DEVICE, dtype=dtype) * 3
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    b = torch.randn(n, device=DEVICE, dtype=dtype)
    r = torch.randn(m, n, device=DEVICE, dtype=dtype)
    out = torch.ops.accelc.linear(x, w, b, r, "gelu", norm_weight=nw, norm_eps=1e-5)
    ref = gemm.linear_ref(x.double(), w.double(), b.double(), r.double(), "gelu", norm_weight=nw.double(),
                          norm_eps=1e-5)
    assert rel_l2(out, ref) <= TOL[dtype], rel_l2(out, ref)
    h = x.double()
    by_hand = torch.nn.functional.gelu((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double())
                                       @ w.double().t() + b.double()) + r.double()
    assert rel_l2(ref, by_hand) < 1e-12
    packed, pb = gated_linear.pack(w[:36], w[36:], b[:36], None)
    g = torch.ops.accelc.gated_linear(x, packed, pb, 36, "silu", norm_weight=nw, norm_eps=1e-5)
    gref = gated_linear.gated_linear_ref(x.double(), packed.double(), pb.double(), 36, "silu",
                                         norm_weight=nw.double(), norm_eps=1e-5)
    assert rel_l2(g, gref) <= TOL[dtype], rel_l2(g, gref)


def test_both_gemv_forms_take_the_norm_and_only_they_do():
    """gemv_kernel's one-row form (gemv_row) and its tiled form each take the norm; a tile config is refused
    one; bad norm operands are refused in one line."""
    torch.manual_seed(0)
    x = torch.randn(1, 200, device=DEVICE) * 2
    w = torch.randn(72, 200, device=DEVICE) / 200 ** 0.5
    nw = 1 + 0.1 * torch.randn(200, device=DEVICE)
    ref = gemm.linear_ref(x.double(), w.double(), norm_weight=nw.double(), norm_eps=1e-6)
    flat = [c for c in gemm.GEMV_FLAT_CONFIGS if c.kwargs["BLOCK_M"] == 1][:1]
    tiled = [c for c in gemm.GEMV_CONFIGS if c.kwargs["BLOCK_M"] == 1 and not c.kwargs.get("FLAT")][:1]
    assert flat and tiled
    for cfg in flat + tiled:
        out = torch.empty(1, 72, device=DEVICE)
        gemm.launch(x, w, None, None, out, config=cfg, norm=(nw, 1e-6))
        assert rel_l2(out, ref) < 1e-5, cfg
    with pytest.raises(ValueError, match="the norm before the projection runs in gemv_kernel only"):
        gemm.launch(x, w, None, None, torch.empty(1, 72, device=DEVICE), config=gemm.default_config(
            dict(M=64, N=72, K=200, dtype=torch.float32, tma=False)), norm=(nw, 1e-6))
    with pytest.raises(ValueError, match=r"norm_weight must be \(200,\) torch.float32"):
        gemm.linear_launch(x, w, norm_weight=nw[:10], norm_eps=1e-6)
    with pytest.raises(ValueError, match="norm_weight given without norm_eps"):
        gemm.linear_launch(x, w, norm_weight=nw)


@pytest.mark.parametrize("k", [96, 100])
@pytest.mark.parametrize("wdtype", ["float", "int8", "fp8"])
def test_the_one_row_gemv_takes_the_norm_over_several_k_blocks(k, wdtype):
    """gemv_row's K loop with the norm: three and four K blocks of 32, K a multiple of the block (its unmasked
    loads) and not; the row's squares from their own read of x, the norm weight on the block's copy; float,
    int8 and fp8 weights (their scales) against the fp64 reference."""
    import triton
    from accelc.kernels import fp8_weight, int8_gemm

    if wdtype == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8_e4m3fn in this PyTorch")
    torch.manual_seed(k)
    x = torch.randn(1, k, device=DEVICE) * 3
    w = torch.randn(40, k, device=DEVICE) / k ** 0.5
    nw = 1 + 0.3 * torch.randn(k, device=DEVICE)
    b = torch.randn(40, device=DEVICE)
    cfg = triton.Config(dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=32, GROUP_M=8, USE_TMA=False, PROGRAMS_PER_SM=1,
                             GEMV=True, FLAT=True), num_warps=1, num_stages=1)
    scales, wq, w_ref = None, w, w.double()
    if wdtype == "int8":
        wq, ws = int8_gemm.quantize_weight(w)
        scales, w_ref = (None, ws), wq.double() * ws.double()[:, None]
    elif wdtype == "fp8":
        wq, ws = fp8_weight.quantize_weight(w)
        scales, w_ref = (None, ws), wq.double() * ws.double()[:, None]
    out = torch.empty(1, 40, device=DEVICE)
    gemm.launch(x, wq, b, None, out, config=cfg, scales=scales, norm=(nw, 1e-5))
    ref = gemm.linear_ref(x.double(), w_ref, b.double(), norm_weight=nw.double(), norm_eps=1e-5)
    assert rel_l2(out, ref) < 1e-5, rel_l2(out, ref)


def _tiny_llama(layers=2):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                                num_key_value_heads=1, intermediate_size=64, vocab_size=100,
                                                max_position_embeddings=64)).to(DEVICE).eval()


def _optimize(model, inputs, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelc.optimize(model, inputs, config=accelc.OptimizeConfig(**config))


@pytest.mark.parametrize("norms_pass", [True, False])
def test_a_llama_blocks_norms_go_into_their_projections(norms_pass):
    """Each block's two RMSNorms taken into q / k / v and the gated MLP (the norm as accelc's layer under eager
    glue, or written out as HF writes it where the norms pass is off); the logits as the model's; the final
    norm, which the head reads through a slice, left as it was; passes without norm_linear: none taken."""
    lm = _tiny_llama()
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    passes = tuple(p for p in accelc.config.PASS_NAMES if norms_pass or p != "norms")
    opt = _optimize(CausalLogits(lm), (ids,), passes=passes)
    fused = [r for r in opt.layers if r.kernel.startswith("accelc::rms_norm+")]
    assert [r.kernel for r in fused] == ["accelc::rms_norm+linear", "accelc::rms_norm+gated_linear[silu]"] * 2, \
        [(r.name, r.kernel) for r in opt.layers]
    assert all(r.status == "rewritten" for r in fused)
    assert fused[0].name == "lm.model.layers.0.input_layernorm+self_attn.q_proj+k_proj+v_proj", fused[0].name
    with torch.no_grad():
        assert rel_l2(opt(ids), CausalLogits(lm)(ids)) < 1e-5
        for shape in ((3, 5), (1, 1), (1, 12)):      # other batches and lengths: a row count gemv_kernel takes too
            other = torch.randint(1, 100, shape, device=DEVICE)
            assert rel_l2(opt(other), CausalLogits(lm)(other)) < 1e-5, shape
    plain = _optimize(CausalLogits(lm), (ids,), passes=tuple(p for p in passes if p != "norm_linear"))
    assert not any(r.kernel.startswith("accelc::rms_norm+") for r in plain.layers)


def _tiny_gemma(layers=2):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = T.GemmaForCausalLM(T.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                              num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                              vocab_size=100, max_position_embeddings=64)).to(DEVICE).eval()
    with torch.no_grad():        # (Gemma's norm weights start at zero: 1 + w all ones)
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return lm


def _passes(norms_pass: bool) -> tuple:
    return tuple(p for p in accelc.config.PASS_NAMES if norms_pass or p != "norms")


@pytest.mark.parametrize("dtype, norms_pass", [(torch.float32, True), (torch.float32, False), (torch.float16, True)])
def test_a_gemma_blocks_norms_computed_weight_is_taken_into_their_projections(dtype, norms_pass):
    """Gemma's RMSNorm applies `1 + w.float()` in fp32: that weight computed once at optimize, in x's dtype, and
    both of each block's norms taken into q / k / v and the gated MLP (the norm as accelc's layer, or written out
    where the norms pass is off); the logits as the model's, at the example and other shapes, within the dtype's
    tolerance; the graph computes the weight no more."""
    lm = _tiny_gemma().to(dtype)
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    opt = _optimize(CausalLogits(lm), (ids,), passes=_passes(norms_pass))
    fused = [r for r in opt.layers if r.kernel.startswith("accelc::rms_norm+")]
    assert [r.kernel for r in fused] == ["accelc::rms_norm+linear", "accelc::rms_norm+gated_linear[gelu_tanh]"] * 2, \
        [(r.name, r.kernel, r.reason) for r in opt.layers]
    assert all(r.status == "rewritten" for r in fused), [(r.name, r.status, r.reason) for r in fused]
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    with torch.no_grad():
        for shape in ((2, 8), (3, 5), (1, 1)):
            other = torch.randint(1, 100, shape, device=DEVICE)
            want = CausalLogits(lm.float())(other)
            lm.to(dtype)
            assert rel_l2(opt(other).float(), want) < tol, shape
    gm = opt.graph_module
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and n.kwargs.get("norm_eps") is not None]
    norms = [p for name, p in lm.named_parameters() if "layernorm" in name]
    assert len(fused) == len(norms) == 4
    for n, w in zip(fused, norms):      # (in graph order, as the blocks' norms)
        held = meta.attr_value(gm, n.kwargs["norm_weight"])
        assert held.dtype == dtype and torch.equal(held, (1 + w.float()).to(dtype))
    blocks = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("layernorm.weight")]
    assert not [n for n in blocks if n.users], gm.code        # (the final norm's, read through a slice, stays)


@pytest.mark.parametrize("norms_pass", [True, False])
def test_a_wrong_kernel_for_a_computed_norm_weight_is_reverted_to_the_weights_own_computation(monkeypatch, norms_pass):
    """A kernel that skips the norm is caught, and the reverted layers compute Gemma's `1 + w` from the
    parameter again, as the model does: the model's numbers."""
    monkeypatch.setenv("ACCELC_REUSE", "0")
    monkeypatch.setattr(gemm, "normed_rows", lambda x2, w, eps: (x2, None))
    lm = _tiny_gemma(layers=1)
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    opt = _optimize(CausalLogits(lm), (ids,), passes=_passes(norms_pass))
    fused = [r for r in opt.layers if r.kernel.startswith("accelc::rms_norm+")]
    assert len(fused) == 2 and all(r.status == "reverted" for r in fused), [(r.name, r.status) for r in opt.layers]
    with torch.no_grad():
        assert rel_l2(opt(ids), CausalLogits(lm)(ids)) < 1e-5


def test_a_computed_norm_weight_is_read_as_casts_and_numbers_or_not_at_all():
    """weight_steps follows one parameter through casts and arithmetic with numbers, either side of them;
    apply_steps gives what the graph computes; a second tensor, a node read twice or a kwarg like add's
    alpha is not taken."""
    from accelc.passes.norm_linear import apply_steps, weight_steps
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8).half())
            self.v = torch.nn.Parameter(torch.randn(8))

        def forward(self, x):
            a = (2.0 - (1 + self.w.float()) * 3) / 4
            b = 1 / (self.w.float() + 5)
            c = self.v * self.w.float()
            d = torch.add(self.w.float(), 1, alpha=2)
            return x * a, x * b, x * c, x * d

    m = M()
    gm = torch.fx.symbolic_trace(m)
    values = {}

    class Values(torch.fx.Interpreter):     # (each node's tensor metadata, as capture leaves it)
        def run_node(self, n):
            values[n] = out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                meta.set_tensor_meta(n, out)
            return out
    Values(gm).run(torch.randn(8))
    a, b, c, d = (n.args[1] for n in gm.graph.nodes
                  if n.op == "call_function" and meta.op_name(n) == "mul" and n.args[0].op == "placeholder")
    for node, want in ((a, (2.0 - (1 + m.w.float()) * 3) / 4), (b, 1 / (m.w.float() + 5))):
        source, steps, nodes = weight_steps(node)
        assert source.target == "w" and nodes[0] is node
        assert torch.allclose(apply_steps(steps, torch.float32, m.w.detach()), want.detach())
    assert weight_steps(c) is None and weight_steps(d) is None


def test_generation_runs_the_norms_inside_its_gemvs():
    """The decode step's projections take their norms (gemv_kernel's rows; q / k / v's in accelc::qkv_rotary's,
    with their rotations and cache write); greedy tokens as HF's."""
    lm = _tiny_llama()
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    mask = torch.ones_like(ids)
    opt = _optimize(lm, {"input_ids": ids, "attention_mask": mask}, max_cache_len=24)
    step = [r.kernel for r in opt.step.layers if r.status == "rewritten"]
    assert step.count("accelc::rms_norm+qkv_rotary") == 2 and step.count("accelc::rms_norm+gated_linear[silu]") == 2, step
    with torch.no_grad():
        got = opt.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        want = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_a_wrong_fused_kernel_is_reverted_to_the_norm_and_projection(monkeypatch):
    """The guard checks the fused layer against the norm and the projection together: a kernel that skips the
    norm is caught, and the reverted layer (both back as PyTorch) gives the model's numbers."""
    monkeypatch.setenv("ACCELC_REUSE", "0")
    monkeypatch.setattr(gemm, "normed_rows", lambda x2, w, eps: (x2, None))
    lm = _tiny_llama(layers=1)
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    opt = _optimize(CausalLogits(lm), (ids,))
    fused = [r for r in opt.layers if r.kernel.startswith("accelc::rms_norm+")]
    assert len(fused) == 2 and all(r.status == "reverted" and "over tolerance" in r.reason for r in fused), \
        [(r.name, r.status, r.reason) for r in opt.layers]
    with torch.no_grad():
        assert rel_l2(opt(ids), CausalLogits(lm)(ids)) < 1e-5


class _NormReadTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(32, eps=1e-6)
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        y = self.norm(x)
        return self.proj(y) + y


def test_a_norm_with_another_reader_stays_apart():
    torch.manual_seed(0)
    model = _NormReadTwice().to(DEVICE).eval()
    x = torch.randn(4, 32, device=DEVICE)
    opt = _optimize(model, (x,))
    assert not any(r.kernel.startswith("accelc::rms_norm+") for r in opt.layers), [r.kernel for r in opt.layers]
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


@pytest.mark.parametrize("form", ["int8", "fp8"])
def test_one_byte_weights_take_the_norm_too(form):
    """Weight-only int8 / fp8 layers (the same gemv_kernel) take their norms: the kernels as their references at a
    decode row and past gemv_kernel's rows; on a tiny Llama the fused layers judged by SQNR, and a layer under the
    floor demoted to its float call with the norm still inside."""
    from accelc.kernels import fp8_weight, int8_weight
    from accelc.kernels.int8_gemm import quantize_weight

    torch.manual_seed(0)
    quantize = quantize_weight if form == "int8" else fp8_weight.quantize_weight
    op = torch.ops.accelc.linear_w8a16 if form == "int8" else torch.ops.accelc.linear_fp8w
    w_q, w_s = quantize(torch.randn(72, 200, device=DEVICE) / 200 ** 0.5)
    nw = 1 + 0.1 * torch.randn(200, device=DEVICE)
    for m in (1, 13):
        x = torch.randn(m, 200, device=DEVICE) * 2
        out = op(x, w_q, w_s, norm_weight=nw, norm_eps=1e-6)
        ref = int8_weight.linear_w8a16_ref(x.double(), w_q, w_s, norm_weight=nw.double(), norm_eps=1e-6)
        assert rel_l2(out, ref) < 1e-5, (m, rel_l2(out, ref))
    lm = _tiny_llama(layers=1)
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    cfg = (dict(int8=accelc.Int8Config(weights_only=True, skip_first_last=False, only_if_faster=False))
           if form == "int8" else dict(fp8=accelc.Fp8Config(skip_first_last=False, only_if_faster=False)))
    opt = _optimize(CausalLogits(lm), (ids,), **cfg)
    suffix = "w8a16" if form == "int8" else "fp8w"
    kernels = [r.kernel for r in opt.layers if r.status == "rewritten"]
    assert f"accelc::rms_norm+linear_{suffix}" in kernels and f"accelc::rms_norm+gated_linear_{suffix}[silu]" in \
        kernels, kernels
    with torch.no_grad():
        assert rel_l2(opt(ids), CausalLogits(lm)(ids)) < 1e-1
        other = torch.randint(1, 100, (1, 3), device=DEVICE)          # a batch and length of gemv_kernel's rows
        assert rel_l2(opt(other), CausalLogits(lm)(other)) < 1e-1
    floor = dict(int8=accelc.Int8Config(weights_only=True, skip_first_last=False, sqnr_floor=90)) if form == "int8" \
        else dict(fp8=accelc.Fp8Config(skip_first_last=False, sqnr_floor=90))
    demoted = _optimize(CausalLogits(lm), (ids,), **floor)
    fused = [r for r in demoted.layers if r.kernel.startswith("accelc::rms_norm+")]
    assert fused and all(r.status == "rewritten" and suffix not in r.kernel for r in fused), \
        [(r.name, r.status, r.kernel) for r in demoted.layers]      # back on the float kernel, the norm inside
    with torch.no_grad():
        assert rel_l2(demoted(ids), CausalLogits(lm)(ids)) < 1e-5


@pytest.mark.parametrize("one_pass_max_k", [16384, 64])
def test_fp8_activations_take_the_norm_in_their_quantization(one_pass_max_k, monkeypatch):
    """fp8 weights and activations: the rows RMS-normalized in the quantization's own read (a row held in
    registers; a longer one through the norm kernel first), the scales and fp8 values as the reference's (a
    value on a rounding tie may land one e4m3 step apart: rsqrt's last bit), the linear and gated layers as their
    references; on a tiny Llama both layers take their norms."""
    from accelc.kernels import fp8_gemm, fp8_weight

    monkeypatch.setattr(fp8_gemm, "ONE_PASS_MAX_K", one_pass_max_k)
    torch.manual_seed(0)
    x = torch.randn(13, 96, device=DEVICE) * 3
    nw = 1 + 0.1 * torch.randn(96, device=DEVICE)
    q, s = fp8_gemm.quantize_rows(x, (nw, 1e-6))
    qr, sr = fp8_gemm.quantize_rows_ref(x, (nw, 1e-6))
    assert rel_l2(s, sr) < 1e-6 and rel_l2(q.float() * s[:, None], qr.float() * sr[:, None]) < 1e-3
    w_q, w_s = fp8_weight.quantize_weight(torch.randn(80, 96, device=DEVICE) / 96 ** 0.5)
    out = torch.ops.accelc.linear_fp8(x, w_q, w_s, norm_weight=nw, norm_eps=1e-6)
    ref = fp8_gemm.linear_fp8_ref(x, w_q, w_s, norm_weight=nw, norm_eps=1e-6)
    assert rel_l2(out, ref) < 1e-3, rel_l2(out, ref)
    g = torch.ops.accelc.gated_linear_fp8(x, w_q[:64], w_s[:64], None, 32, "silu", norm_weight=nw, norm_eps=1e-6)
    gref = fp8_gemm.gated_linear_fp8_ref(x, w_q[:64], w_s[:64], None, 32, "silu", norm_weight=nw, norm_eps=1e-6)
    assert rel_l2(g, gref) < 1e-3, rel_l2(g, gref)
    if one_pass_max_k == 64:
        return
    lm = _tiny_llama(layers=1)
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    opt = _optimize(CausalLogits(lm), (ids,), only_if_faster=False, fp8=accelc.Fp8Config(
        weights_only=False, skip_first_last=False, only_if_faster=False))
    kernels = [r.kernel for r in opt.layers if r.status == "rewritten"]
    assert "accelc::rms_norm+linear_fp8" in kernels and "accelc::rms_norm+gated_linear_fp8[silu]" in kernels, kernels
    with torch.no_grad():
        assert rel_l2(opt(ids), CausalLogits(lm)(ids)) < 1e-1
        other = torch.randint(1, 100, (3, 5), device=DEVICE)          # another batch and length
        assert rel_l2(opt(other), CausalLogits(lm)(other)) < 1e-1


def test_a_large_weight_keeps_its_norm_apart(monkeypatch):
    """Above NORM_IN_MOST_WEIGHTS weight elements the norm stays a kernel of its own (its work at every weight
    element of the GEMV costs more than its launch), said in the layer's note; smaller layers still take it. Here
    the limit sits between the tiny Llama's q / k / v (64 x 32) and its packed gate / up (128 x 32)."""
    from accelc.passes import norm_linear

    monkeypatch.setattr(norm_linear, "NORM_IN_MOST_WEIGHTS", 3000)
    lm = _tiny_llama(layers=1)
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    opt = _optimize(CausalLogits(lm), (ids,))
    kernels = [r.kernel for r in opt.layers if r.status == "rewritten"]
    assert "accelc::rms_norm+linear" in kernels and "accelc::gated_linear[silu]" in kernels, kernels
    assert not any(k.startswith("accelc::rms_norm+gated") for k in kernels), kernels
    gated = next(r for r in opt.layers if r.kernel == "accelc::gated_linear[silu]")
    assert "norm not taken in: a weight of 4,096 elements" in gated.reason, gated.reason
    with torch.no_grad():
        assert rel_l2(opt(ids), CausalLogits(lm)(ids)) < 1e-5
        for shape in ((3, 5), (1, 1)):     # other batches and lengths: the norm apart and the one taken in alike
            other = torch.randint(1, 100, shape, device=DEVICE)
            assert rel_l2(opt(other), CausalLogits(lm)(other)) < 1e-5, shape


def test_a_large_one_byte_weight_takes_its_norm(monkeypatch):
    """The size rule is the float layers' alone: a weight-only fp8 layer above NORM_IN_MOST_WEIGHTS takes its norm
    in (one-byte weights read half the bytes a weight element for the norm's same work there: it paid at every
    width timed), and where the guard sends it back to its float kernel (under the SQNR floor) the norm stays in."""
    from accelc.passes import norm_linear

    monkeypatch.setattr(norm_linear, "NORM_IN_MOST_WEIGHTS", 3000)
    lm = _tiny_llama(layers=1)
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    opt = _optimize(CausalLogits(lm), (ids,), fp8=accelc.Fp8Config(skip_first_last=False, only_if_faster=False))
    kernels = [r.kernel for r in opt.layers if r.status == "rewritten"]
    assert "accelc::rms_norm+linear_fp8w" in kernels and "accelc::rms_norm+gated_linear_fp8w[silu]" in kernels, \
        kernels
    assert not any("norm not taken in" in r.reason for r in opt.layers), [r.reason for r in opt.layers]
    demoted = _optimize(CausalLogits(lm), (ids,), fp8=accelc.Fp8Config(skip_first_last=False, sqnr_floor=90))
    assert "accelc::rms_norm+gated_linear[silu]" in [r.kernel for r in demoted.layers if r.status == "rewritten"]
    with torch.no_grad():
        assert rel_l2(opt(ids), CausalLogits(lm)(ids)) < 1e-1
        assert rel_l2(demoted(ids), CausalLogits(lm)(ids)) < 1e-5

