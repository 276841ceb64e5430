"""accelc::rotary_embedding (kernels/rotary.py) and the rotary pass: RoPE written out as models
write it, folded into one kernel; look-alikes stay."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc.kernels.rotary import rotary_embedding_launch, rotary_embedding_ref, why_unsupported
from conftest import DEVICE, NORMS_REWRITTEN, assert_close_to_ref, rel_l2

ATOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}
EAGER_GLUE = accelc.OptimizeConfig(only_if_faster=False, glue="eager")


def _tables(L, D, dtype, batch=None):
    """HF's cos / sin: (L, D) from positions and inverse frequencies, duplicated halves."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    freqs = torch.arange(L, device=DEVICE).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    if batch is not None:
        cos, sin = cos.expand(batch, L, D)[:, None], sin.expand(batch, L, D)[:, None]
    return cos, sin


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,H,L,D,layout", [(2, 4, 9, 64, "bhld"), (1, 3, 17, 16, "blhd"), (2, 2, 5, 80, "blhd"),
                                           (1, 2, 3, 128, "bhld")])
def test_against_fp64(dtype, B, H, L, D, layout):
    if layout == "blhd":   # heads split by a transpose: x is a strided view, read through its strides
        x = torch.randn(B, L, H, D, device=DEVICE, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(B, H, L, D, device=DEVICE, dtype=dtype)
    cos, sin = _tables(L, D, dtype, batch=B)                   # (B, 1, L, D): broadcast over heads
    out = rotary_embedding_launch(x, cos, sin)
    d = torch.float64
    ref = rotary_embedding_ref(x.to(d), cos.to(d), sin.to(d))
    assert out.is_contiguous()
    assert_close_to_ref(out, ref, rotary_embedding_ref(x, cos, sin), dtype, ATOL[dtype], ATOL[dtype])


@pytest.mark.parametrize("shape", [(7, 32), (3, 7, 32), (32,)])
def test_lower_ranks_and_plain_tables(shape):
    x = torch.randn(*shape, device=DEVICE)
    cos, sin = _tables(shape[-2] if len(shape) > 1 else 1, shape[-1], torch.float32)
    if len(shape) == 1:
        cos, sin = cos[0], sin[0]
    out = rotary_embedding_launch(x, cos, sin)
    torch.testing.assert_close(out, rotary_embedding_ref(x, cos, sin), atol=1e-6, rtol=1e-6)


def test_mixed_dtypes_promote_as_eager():
    """fp16 x with fp32 tables: eager's expression is fp32, and so is the kernel's result."""
    x = torch.randn(1, 2, 5, 32, device=DEVICE, dtype=torch.float16)
    cos, sin = _tables(5, 32, torch.float32)
    out = rotary_embedding_launch(x, cos, sin)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rotary_embedding_ref(x, cos, sin), atol=1e-6, rtol=1e-6)


def test_nan_and_inf_as_eager():
    x = torch.randn(1, 2, 4, 16, device=DEVICE)
    x[0, 0, 1, 3] = float("nan")
    x[0, 1, 2, 12] = float("inf")
    cos, sin = _tables(4, 16, torch.float32)
    out, eager = rotary_embedding_launch(x, cos, sin), rotary_embedding_ref(x, cos, sin)
    assert torch.equal(out.isnan(), eager.isnan()) and torch.equal(out.isinf(), eager.isinf())
    assert out.isnan().any() and out.isinf().any()


def test_empty():
    x = torch.randn(2, 0, 4, 16, device=DEVICE)
    cos, sin = _tables(4, 16, torch.float32)
    assert rotary_embedding_launch(x, cos, sin).shape == x.shape


def test_why_unsupported_says_why():
    m = lambda *s, dt=torch.float16: torch.empty(*s, device="meta", dtype=dt)
    assert why_unsupported(m(2, 4, 8, 64), m(2, 1, 8, 64), m(8, 64)) is None
    assert "even" in why_unsupported(m(2, 4, 8, 63), m(8, 63), m(8, 63))
    assert "dims" in why_unsupported(m(1, 2, 4, 8, 64), m(8, 64), m(8, 64))
    assert "broadcast" in why_unsupported(m(2, 4, 8, 64), m(3, 8, 64), m(8, 64))
    assert "broadcast" in why_unsupported(m(2, 4, 8, 64), m(2, 4, 16, 64), m(8, 64))
    assert "dtype" in why_unsupported(m(2, 4, 8, 64), m(8, 64, dt=torch.int32), m(8, 64))
    with pytest.raises(ValueError, match="accelc::rotary_embedding: .*even"):
        torch.ops.accelc.rotary_embedding(torch.randn(2, 3, 5), torch.randn(3, 5), torch.randn(3, 5))


# ---------------------------------------------------------------------------------------------
# the rotary pass

def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):          # GPT-J's interleaved form: another function
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


FORMS = {   # name -> (q_embed, k_embed) given q, k, cos, sin; whether it is RoPE
    "hf": (lambda q, k, c, s: (q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s), True),
    "commuted": (lambda q, k, c, s: (_rotate_half(q) * s + c * q, s * _rotate_half(k) + k * c), True),
    "literal": (lambda q, k, c, s: (q * c + torch.cat([q[..., 16:].neg(), q[..., :16]], -1) * s,
                                    k * c + torch.cat([k[..., 16:].neg(), k[..., :16]], -1) * s), True),
    "chunk": (lambda q, k, c, s: tuple(t * c + torch.cat((-t.chunk(2, -1)[1], t.chunk(2, -1)[0]), -1) * s
                                       for t in (q, k)), True),
    "every_two": (lambda q, k, c, s: (q * c + _rotate_every_two(q) * s, k * c + _rotate_every_two(k) * s), False),
    "wrong_sign": (lambda q, k, c, s: tuple(t * c + torch.cat((t[..., 16:], -t[..., :16]), -1) * s
                                            for t in (q, k)), False),
    "wrong_half": (lambda q, k, c, s: tuple(t * c + torch.cat((-t[..., 8:], t[..., :8]), -1) * s
                                            for t in (q, k)), False),
}


class RopeAttention(nn.Module):
    """A Llama-style attention block with RoPE in one of FORMS; `shape_branch` makes it a
    torch.export capture (aten.slice, aten.neg, aten.cat)."""

    def __init__(self, form, shape_branch=False, heads=2, dim=32):
        super().__init__()
        self.form, self.shape_branch, self.heads, self.dim = form, shape_branch, heads, dim
        self.qkv = nn.Linear(heads * dim, 3 * heads * dim)
        self.out = nn.Linear(heads * dim, heads * dim)
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x):
        if self.shape_branch and x.shape[0] > 1:
            x = x * 0.5
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, self.dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(L, device=x.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[None, None], emb.sin().to(x.dtype)[None, None]
        q, k = FORMS[self.form][0](q, k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(B, L, -1))


@pytest.mark.parametrize("shape_branch", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_written_rope_folded_into_one_kernel(form, shape_branch):
    model = RopeAttention(form, shape_branch).to(DEVICE).half().eval()
    x = torch.randn(2, 8, 64, device=DEVICE, dtype=torch.float16)
    opt = accelc.optimize(model, (x,), EAGER_GLUE)
    assert opt.info.capture_method == ("torch.export" if shape_branch else "symbolic_trace")
    rope = [r for r in opt.layers if r.kind == "rotary"]
    if FORMS[form][1]:
        assert [r.status for r in rope] == ["rewritten"] * 2, opt.summary()
        assert all(r.kernel == "accelc::rotary_embedding" for r in rope)
    else:
        assert not rope, opt.summary()
    assert [r.kernel for r in opt.layers if r.kind == "attention"] == ["accelc::flash_attention[causal]"]
    with torch.no_grad():
        x2 = torch.randn_like(x)
        ref = model.float()(x2.float())
        eager = model.half()(x2)
        assert rel_l2(opt(x2), ref) <= max(2e-3, 2 * rel_l2(eager, ref))


def test_rope_left_to_inductor_glue_with_the_reason():
    from accelc.passes import rotary
    from accelc.rewrite import PassContext

    ctx = PassContext(accelc.OptimizeConfig(glue="inductor"), (), [], torch.device("cpu"))
    assert "Inductor glue" in rotary._check(None, ctx)
    model = RopeAttention("hf").to(DEVICE).eval()
    x = torch.randn(2, 8, 64, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    rope = [r for r in opt.layers if r.kind == "rotary"]
    if NORMS_REWRITTEN:      # eager glue (this machine's default)
        assert [r.status for r in rope] == ["rewritten"] * 2, opt.summary()
    else:
        assert not [r for r in opt.layers if r.status == "rewritten" and r.kind == "rotary"], opt.summary()
        assert "fuses the rotation" in opt.summary(), opt.summary()


class Angles(nn.Module):
    """HF's rotary angles: inverse frequencies times positions as a matrix product with an inner
    dim of 1; and a product with an inner dim of 2, which is no outer product."""

    def __init__(self, inner=1):
        super().__init__()
        self.inner = inner
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))

    def forward(self, pos):
        inv = self.inv_freq[None, :, None].expand(pos.shape[0], -1, self.inner)
        freqs = (inv @ pos[:, None, :].float().expand(-1, self.inner, -1)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


@pytest.mark.parametrize("inner", [1, 2])
def test_outer_products_written_as_matmul_become_a_multiply(inner):
    # (8, 1) @ (1, T): one product an element, so a multiply gives the same bits; the glue fuses it
    # with the cos and sin (on a GPU it was a cuBLAS SGEMM of its own in every decode step)
    pos = torch.arange(3, 40, device=DEVICE).reshape(1, -1) * 7
    model = Angles(inner).to(DEVICE).eval()
    opt = accelc.optimize(model, (pos,))
    products = [n for n in opt.graph_module.graph.nodes
                if n.op == "call_function" and ("matmul" in str(n.target) or "bmm" in str(n.target))]
    assert bool(products) == (inner == 2)
    with torch.no_grad():
        for got, want in zip(opt(pos * 3), model(pos * 3)):
            assert torch.equal(got, want)
