"""accelc::layer_norm (kernels/layernorm.py) and the norms pass (passes/norms.py): LayerNorm over
the last dim, the residual add before it fused where nothing else reads the sum."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc.kernels.layernorm import MAX_N, layer_norm_launch, layer_norm_ref, why_unsupported
from conftest import DEVICE, assert_close_to_ref

FLOATS = [torch.float16, torch.bfloat16, torch.float32]
# the norms pass rewrites where the glue is eager (under Inductor's it leaves LayerNorms to it)
# (the norms pass's own rewrites: without norm_linear, which takes an RMSNorm into the projection after it,
# tests/test_norm_linear.py)
EAGER_GLUE = accelc.OptimizeConfig(only_if_faster=False, glue="eager",
                                   passes=tuple(p for p in accelc.config.PASS_NAMES if p != "norm_linear"))
ATOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}


def _ref64(x, w, b, r, eps):
    h = x if r is None else x + r            # eager's add in the input dtype, then fp64
    return F.layer_norm(h.double(), (x.shape[-1],), None if w is None else w.double(),
                        None if b is None else b.double(), eps)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 100), (2, 1), (1, 768)])
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_against_fp64(shape, dtype, residual):
    N = shape[-1]
    x = (torch.randn(shape, device=DEVICE) * 3 + 1).to(dtype)
    r = torch.randn(shape, device=DEVICE).to(dtype) if residual else None
    w = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    b = torch.randn(N, device=DEVICE).to(dtype)
    out = layer_norm_launch(x, w, b, r, 1e-5)
    ref = _ref64(x, w, b, r, 1e-5)
    eager = F.layer_norm(x if r is None else x + r, (N,), w, b, 1e-5)
    if N == 1:   # a one-wide row normalizes to exactly the bias
        assert torch.equal(out, b.expand_as(out).to(dtype))
        return
    assert_close_to_ref(out, ref, eager, dtype, atol=ATOL[dtype], rtol=ATOL[dtype])
    assert torch.allclose(out.double(), layer_norm_ref(x, w, b, r, 1e-5).double(), atol=ATOL[dtype], rtol=ATOL[dtype])


def test_without_affine_eps_and_strided_rows():
    base = torch.randn(6, 40, 50, device=DEVICE, dtype=torch.float16)
    x = base[::2, :, 3:35]                   # strided rows, offset start
    xt = torch.randn(16, 6, device=DEVICE).t()   # the last dim not contiguous
    for inp, w, b, eps in ((x, None, None, 1e-6), (x, torch.randn(32, device=DEVICE).half(), None, 1e-3),
                           (xt, None, torch.randn(16, device=DEVICE), 1e-5)):
        out = layer_norm_launch(inp, w, b, None, eps)
        ref = _ref64(inp, w, b, None, eps)
        eager = F.layer_norm(inp, (inp.shape[-1],), w, b, eps)
        assert out.shape == inp.shape
        assert_close_to_ref(out, ref, eager, inp.dtype, atol=ATOL[inp.dtype], rtol=ATOL[inp.dtype])


def test_nan_and_inf_rows_as_eager():
    x = torch.randn(4, 32, device=DEVICE, dtype=torch.float16)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    w, b = torch.randn(32, device=DEVICE).half(), torch.randn(32, device=DEVICE).half()
    out = layer_norm_launch(x, w, b, None, 1e-5)
    eager = F.layer_norm(x.float(), (32,), w.float(), b.float(), 1e-5).half()
    assert torch.equal(out.isnan(), eager.isnan()) and out[1].isnan().all() and out[2].isnan().all()
    assert torch.isfinite(out[[0, 3]]).all()


def test_why_unsupported_says_why():
    x = torch.empty(4, 8, 64, device="meta", dtype=torch.float16)
    assert why_unsupported(x) is None
    assert "last dim" in why_unsupported(x, normalized_shape=(8, 64))
    assert "wider than" in why_unsupported(torch.empty(2, MAX_N + 1, device="meta", dtype=torch.float16))
    assert "broadcast" in why_unsupported(x, residual=torch.empty(64, device="meta", dtype=torch.float16))
    assert "dtype" in why_unsupported(x.to(torch.int32))
    assert "weight" in why_unsupported(x, weight=torch.empty(32, device="meta"))
    with pytest.raises(ValueError, match="accelc::layer_norm: .*broadcast"):
        torch.ops.accelc.layer_norm(torch.randn(2, 8), residual=torch.randn(8))


# ---------------------------------------------------------------------------------------------
# the pass

class PostNorm(nn.Module):
    """BERT's output block: LayerNorm(dropout(dense(h)) + input), then a pre-norm-style stream."""

    def __init__(self, d=32):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d, eps=1e-12)
        self.pre = nn.LayerNorm(d, bias=False)
        self.fc = nn.Linear(d, d)

    def forward(self, x, skip):
        h = self.ln(F.leaky_relu(self.dense(x)) + skip)       # post-norm: the sum read once
        s = h + skip                                          # a residual stream: the sum read twice
        y = s + self.fc(self.pre(s))
        return (F.layer_norm(y, (y.shape[-1],), eps=1e-6) + torch.layer_norm(y, [32])
                + F.layer_norm(y, y.shape[-1:]) + F.layer_norm(y, (y.size(-1),)))


def _kernels(opt):
    return {r.name: r.kernel for r in opt.layers if r.status == "rewritten"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_post_norm_fuses_the_add_pre_norm_keeps_it(dtype):
    model = PostNorm().to(DEVICE).to(dtype).eval()
    x, skip = (torch.randn(2, 8, 32, device=DEVICE, dtype=dtype) for _ in range(2))
    opt = accelc.optimize(model, (x, skip), EAGER_GLUE)
    kernels = _kernels(opt)
    assert kernels["add+ln"] == "accelc::layer_norm[residual]"      # leaky_relu ends the GEMM's epilogue: the add is the norm's
    assert kernels["pre"] == "accelc::layer_norm"                   # its input is a sum read twice
    norms = [r for r in opt.layers if r.kind == "layer_norm" or "layer_norm" in r.kernel]
    assert len(norms) == 6 and all(r.status == "rewritten" for r in norms), opt.summary()   # every spelling
    assert not [r for r in opt.layers if r.status == "reverted"]
    with torch.no_grad():
        ref = model.double()(x.double(), skip.double())
        out, eager = opt(x, skip), model.to(dtype)(x, skip)
    assert_close_to_ref(out, ref, eager, dtype, atol=5e-2 if dtype == torch.float16 else 1e-5,
                        rtol=5e-2 if dtype == torch.float16 else 1e-5)


def test_gemm_epilogue_keeps_its_residual():
    """dense(x) + skip then LayerNorm: linear_act's epilogue takes the add (one kernel less),
    the norm is rewritten alone."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense, self.ln = nn.Linear(32, 32), nn.LayerNorm(32)

        def forward(self, x, skip):
            return self.ln(self.dense(x) + skip)
    model = Block().to(DEVICE).eval()
    x, skip = torch.randn(4, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    opt = accelc.optimize(model, (x, skip), EAGER_GLUE)
    assert _kernels(opt) == {"dense+add": "accelc::linear[residual]", "ln": "accelc::layer_norm"}
    assert torch.allclose(opt(x, skip), model(x, skip), atol=1e-5)


def test_layer_norms_left_as_pytorch_say_why():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln2d = nn.LayerNorm((4, 8))

        def forward(self, x):
            return self.ln2d(x)
    model = Odd().to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(2, 4, 8, device=DEVICE),), EAGER_GLUE)
    (row,) = [r for r in opt.layers if r.name == "ln2d"]
    assert row.status == "kept" and "last dim" in row.reason


def test_hf_bert_layer_norms_rewritten():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=1,
                                  vocab_size=50, max_position_embeddings=16)
    model = transformers.BertModel(cfg).to(DEVICE).eval()
    ids = torch.randint(0, 50, (2, 8), device=DEVICE)
    opt = accelc.optimize(model, (ids,), EAGER_GLUE)
    norms = {n: k for n, k in _kernels(opt).items() if "layer_norm" in k}
    assert len(norms) == 3, _kernels(opt)          # embeddings, attention output, layer output
    assert not [r for r in opt.layers if r.status == "reverted"]
    with torch.no_grad():
        assert torch.allclose(opt(ids).last_hidden_state, model(ids).last_hidden_state, atol=1e-4)


def test_left_to_the_inductor_glue_with_the_reason():
    """Under Inductor glue (the GPU default) a LayerNorm stays for Inductor to fuse with its
    neighbours, and the summary says why; eager glue rewrites it."""
    from accelc.passes import norms
    from accelc.rewrite import PassContext

    for glue, device, expect in (("auto", "cuda", True), ("inductor", "cpu", True), ("auto", "cpu", False),
                                 ("eager", "cuda", False)):
        ctx = PassContext(accelc.OptimizeConfig(glue=glue), (), [], torch.device(device))
        assert ctx.inductor_glue is expect, (glue, device)
    ctx = PassContext(accelc.OptimizeConfig(glue="inductor"), (), [], torch.device("cpu"))
    assert "Inductor glue" in norms._check(None, ctx)


# ---------------------------------------------------------------------------------------------
# RMSNorm: accelc::rms_norm and the written-out forms the norms pass folds

def _rms64(x, w, r, eps):
    h = (x if r is None else x + r).double()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 100), (1, 2048)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_against_fp64(shape, dtype, residual):
    N = shape[-1]
    x = (torch.randn(shape, device=DEVICE) * 3 + 1).to(dtype)
    r = torch.randn(shape, device=DEVICE).to(dtype) if residual else None
    w = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    out = torch.ops.accelc.rms_norm(x, w, r, 1e-6)
    ref = _rms64(x, w, r, 1e-6)
    h = (x if r is None else x + r)
    eager = F.rms_norm(h.float(), (N,), w.float(), 1e-6).to(dtype)
    assert_close_to_ref(out, ref, eager, dtype, atol=ATOL[dtype], rtol=ATOL[dtype])


def test_rms_norm_nan_and_inf_as_eager():
    x = torch.randn(4, 32, device=DEVICE)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    out = torch.ops.accelc.rms_norm(x, None, None, 1e-6)
    eager = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(out.isnan(), eager.isnan()) and out[1].isnan().all()
    assert torch.isfinite(out[[0, 3]]).all()
    with pytest.raises(ValueError, match="accelc::rms_norm: .*weight"):
        torch.ops.accelc.rms_norm(torch.randn(2, 8), torch.randn(4))


class LlamaStyle(nn.Module):
    """RMSNorm as HF's Llama (and T5, Mistral, Qwen) writes it, and the other spellings."""

    def __init__(self, d=32, form="llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.form = form
        self.rms = nn.RMSNorm(d, eps=1e-5)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        if self.form == "llama":      # LlamaRMSNorm
            h = x.to(torch.float32)
            variance = h.pow(2).mean(-1, keepdim=True)
            h = h * torch.rsqrt(variance + 1e-6)
            y = self.weight * h.to(x.dtype)
        elif self.form == "t5":       # T5LayerNorm: the half input times an fp32 rsqrt
            variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
            h = x * torch.rsqrt(variance + 1e-6)
            y = self.weight * h.to(self.weight.dtype)
        elif self.form == "square":   # x * x, .float(), dim= keyword, weight on the right
            h = x.float()
            y = (h * torch.rsqrt((h * h).mean(dim=-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight
        elif self.form == "gemma":    # GemmaRMSNorm: (h * (1 + w)) in fp32, then .type_as(x)
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            y = (h * (1.0 + self.weight.float())).type_as(x)
        elif self.form == "module":
            y = self.rms(x)
        elif self.form == "functional":   # eps=None: the dtype's machine epsilon
            y = F.rms_norm(x, (x.shape[-1],), self.weight)
        return self.fc(y)


@pytest.mark.parametrize("form", ["llama", "t5", "square", "gemma", "module", "functional"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rms_norm_forms_rewritten(form, dtype):
    model = LlamaStyle(form=form).to(DEVICE).to(dtype).eval()
    x = torch.randn(2, 8, 32, device=DEVICE, dtype=dtype) * 2
    opt = accelc.optimize(model, (x,), EAGER_GLUE)
    norms = [r for r in opt.layers if r.kernel == "accelc::rms_norm"]
    assert len(norms) == 1 and norms[0].status == "rewritten", opt.summary()
    assert not [r for r in opt.layers if r.status == "kept" and r.op in ("pow", "mean", "rsqrt")], opt.summary()
    with torch.no_grad():
        ref = model.double()(x.double())
        out, eager = opt(x), model.to(dtype)(x)
    tol = 5e-2 if dtype == torch.float16 else 1e-5
    assert_close_to_ref(out, ref, eager, dtype, atol=tol, rtol=tol)


def test_rms_norm_near_misses_stay_with_pytorch():
    """A square taken in half precision (eager may overflow it), a mean over another dim, a
    reduction without keepdim: not an RMSNorm the kernel computes as eager does."""
    class Near(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.rand(32) + 0.5)

        def forward(self, x):
            half = self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
            h = x.float()
            other_dim = h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6)
            cubed = h * torch.rsqrt(h.pow(3).mean(-1, keepdim=True).abs() + 1e-6)
            return half.float() + other_dim + cubed
    model = Near().to(DEVICE).half().eval()
    x = torch.randn(2, 8, 32, device=DEVICE, dtype=torch.float16)
    opt = accelc.optimize(model, (x,), EAGER_GLUE)
    assert not [r for r in opt.layers if "rms_norm" in r.kernel], opt.summary()
    with torch.no_grad():
        assert torch.allclose(opt(x), model(x), atol=1e-3)


def test_rms_norm_under_inductor_glue_says_why():
    from accelc.passes import norms
    from accelc.rewrite import PassContext

    model = LlamaStyle(form="llama").to(DEVICE).half().eval()
    x = torch.randn(2, 8, 32, device=DEVICE, dtype=torch.float16)
    gm, _, _ = accelc.capture.capture(model, (x,))
    accelc.capture.make_canonical(gm, (x,))
    norms.fold_written_rms_norms(gm, PassContext(accelc.OptimizeConfig(glue="inductor"), (), [], torch.device("cpu")))
    rsqrt = [n for n in gm.graph.nodes if n.op != "placeholder" and "rsqrt" in str(n.target)]
    assert len(rsqrt) == 1 and "RMSNorm written out" in rsqrt[0].meta[accelc.meta.SKIP]
    assert "Inductor" in rsqrt[0].meta[accelc.meta.SKIP]


def test_hf_llama_rms_norms_rewritten():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                   num_hidden_layers=1, vocab_size=50)
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg).to(DEVICE).eval()
    ids = torch.randint(0, 50, (2, 8), device=DEVICE)
    opt = accelc.optimize(model, (ids,), EAGER_GLUE)
    assert sorted(n for n, k in _kernels(opt).items() if k == "accelc::rms_norm") == [
        "layers.0.input_layernorm", "layers.0.post_attention_layernorm", "norm"], opt.summary()
    with torch.no_grad():
        assert torch.allclose(opt(ids).last_hidden_state, model(ids).last_hidden_state, atol=1e-4)
