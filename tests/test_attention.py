"""passes/attention.py: attention found however it is written; vit / bert / gpt end to end."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc import meta
from conftest import DEVICE, REL_FLOOR, rel_l2

FLASH = torch.ops.accelc.flash_attention.default


def _optimize(model, *args, dtype=torch.float16):
    model = model.to(DEVICE, dtype).eval()
    args = tuple(a.to(DEVICE, dtype) if a.is_floating_point() else a.to(DEVICE) for a in args)
    opt = accelc.optimize(model, args)
    with torch.no_grad():
        assert rel_l2(opt(*args), model(*args)) < 5e-3
    return opt


def _attention_rows(opt):
    return [r for r in opt.layers if r.kind == "attention"]


class Decomposed(nn.Module):
    def __init__(self, style, d=32):
        super().__init__()
        self.style, self.d = style, d

    def forward(self, q, k, v, mask):
        d, s = self.d, self.style
        if s == "mul":
            scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d))
        elif s == "div_sqrt":
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
        elif s == "div_mask":
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d) + mask
        elif s == "mul_mask":
            scores = q @ k.transpose(-2, -1) * 0.125 + mask
        elif s == "q_scaled":
            scores = (q * d ** -0.5) @ k.transpose(-2, -1)
        else:  # "none": unscaled
            scores = q @ k.transpose(-2, -1)
        probs = F.dropout(scores.softmax(dim=-1), p=0.1, training=self.training)
        return probs @ v


@pytest.mark.parametrize("style,scale", [("mul", 32 ** -0.5), ("div_sqrt", 32 ** -0.5), ("div_mask", 32 ** -0.5),
                                         ("mul_mask", 0.125), ("q_scaled", 32 ** -0.5), ("none", 1.0)])
def test_decomposed_forms_found(style, scale):
    q, k, v = (torch.randn(2, 2, 19, 32) for _ in range(3))
    mask = torch.randn(2, 1, 1, 19)
    opt = _optimize(Decomposed(style), q, k, v, mask)
    nodes = [n for n in opt.graph_module.graph.nodes if n.target is FLASH]
    assert len(nodes) == 1 and len(_attention_rows(opt)) == 1
    assert nodes[0].args[5] == pytest.approx(scale)
    assert (nodes[0].args[3] is not None) == style.endswith("mask")


class Sdpa(nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)


@pytest.mark.parametrize("causal,with_mask,label", [
    (False, False, "accelc::flash_attention"), (True, False, "accelc::flash_attention[causal]"),
    (False, True, "accelc::flash_attention[mask]"),
])
def test_sdpa_calls(causal, with_mask, label):
    q, k, v = (torch.randn(1, 4, 33, 64) for _ in range(3))
    args = (q, k, v) + ((torch.rand(1, 1, 33, 33) > 0.2,) if with_mask else ())
    if with_mask:
        args[3][..., 0] = True
    opt = _optimize(Sdpa(causal), *args)
    assert [r.kernel for r in _attention_rows(opt)] == [label]


class Mha(nn.Module):
    def __init__(self, batch_first, cross=False):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 2, batch_first=batch_first)
        self.cross = cross

    def forward(self, x, mem, pad):
        kv = mem if self.cross else x
        return self.attn(x, kv, kv, key_padding_mask=pad)[0]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cross", [False, True])
def test_multihead_attention_lowered_and_rewritten(batch_first, cross):
    x, mem = torch.randn(3, 11, 64), torch.randn(3, 11, 64)
    if not batch_first:
        x, mem = x.transpose(0, 1).contiguous(), mem.transpose(0, 1).contiguous()
    pad = torch.zeros(3, 11, dtype=torch.bool)
    pad[1, 8:] = True  # padding at the end of the second sequence
    opt = _optimize(Mha(batch_first, cross), x, mem, pad)
    kernels = sorted(r.kernel for r in opt.rewritten)
    assert "accelc::flash_attention[mask]" in kernels
    assert kernels.count("accelc::linear") == (3 if cross else 1) + 1  # in-projection(s) + out_proj


class MhaWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 2, batch_first=True)

    def forward(self, x):
        out, weights = self.attn(x, x, x)
        return out + weights.sum()


def test_attention_weights_used_stays_pytorch():
    opt = _optimize(MhaWeights(), torch.randn(2, 5, 64))
    row = next(r for r in opt.layers if r.name == "attn")
    assert row.status == "kept" and "attention weights are used" in row.reason


def test_fp32_attention_rewritten_and_odd_head_dim_kept_with_reason():
    """fp32 attention stayed SDPA (1.7-20% of fp32 transformers' FLOPs): now the flash kernel with
    true fp32 products, or TF32 where the config's fp32_precision asks, as for fp32 linears."""
    q, k, v = (torch.randn(1, 2, 9, 64) for _ in range(3))
    opt = _optimize(Sdpa(False), q, k, v, dtype=torch.float32)
    (row,) = _attention_rows(opt)
    assert row.status == "rewritten", opt.summary()
    (node,) = [n for n in opt.graph_module.graph.nodes if n.target is torch.ops.accelc.flash_attention.default]
    assert not node.kwargs.get("allow_tf32")
    model = Sdpa(False).to(DEVICE).eval()
    args = tuple(t.to(DEVICE) for t in (q, k, v))
    opt = accelc.optimize(model, args, accelc.OptimizeConfig(fp32_precision="tf32", only_if_faster=False))
    (node,) = [n for n in opt.graph_module.graph.nodes if n.target is torch.ops.accelc.flash_attention.default]
    assert node.kwargs.get("allow_tf32") is True
    q, k, v = (torch.randn(1, 2, 9, 44) for _ in range(3))
    opt = _optimize(Sdpa(False), q, k, v)
    assert any("head dim 44" in r.reason for r in opt.layers)


@pytest.mark.parametrize("name,n_attention", [("vit", 2), ("bert", 2), ("gpt", 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_models_every_attention_rewritten_and_matching(name, n_attention, dtype):
    model = accelc.models.get(name).to(DEVICE, dtype)
    args = model.example_inputs()
    # (every layer kept whatever its speed: on the GPU the race may hand the stacked q / k / v of
    # these tiny shapes back as three linears, a timing verdict, not this test's business)
    opt = accelc.optimize(model, args, accelc.OptimizeConfig(only_if_faster=False))
    assert len(_attention_rows(opt)) == n_attention
    assert all(r.status == "rewritten" for r in opt.layers if r.kind in ("attention", "linear"))
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    n_mha = sum(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    # each nn.MultiheadAttention holds one nn.Linear (out_proj) and one packed in-projection; a
    # block's q, k and v projections (bert) are one GEMM (passes/sibling_linears.py)
    stacked = opt.info.pass_counts.get("sibling_linears", 0)
    assert stacked == (n_attention if name == "bert" else 0), opt.summary()
    assert sum(r.kind == "linear" for r in opt.rewritten) == n_linear + n_mha - 2 * stacked
    ref_model = accelc.models.get(name).to(DEVICE, torch.float64)
    args2 = model.example_inputs(batch_size=3)  # a fresh input, against fp64
    ref_args = tuple(a.double() if a.is_floating_point() else a for a in args2)
    with torch.no_grad():
        out, eager, ref = opt(*args2), model(*args2), ref_model(*ref_args)
    assert rel_l2(out, ref) <= max(2 * rel_l2(eager, ref), REL_FLOOR[dtype])


class SdpaSpellings(nn.Module):
    """SDPA with its arguments given by keyword, positionally, or left to their defaults: capture
    writes one canonical call, so one rule takes them all."""

    def forward(self, q, k, v):
        a = F.scaled_dot_product_attention(q, k, v, scale=0.3)
        b = F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True)
        c = F.scaled_dot_product_attention(q, k, v, None, 0.0, False)
        return a + b + c


def test_sdpa_argument_spellings():
    q, k, v = (torch.randn(1, 2, 17, 32) for _ in range(3))
    opt = _optimize(SdpaSpellings(), q, k, v)
    nodes = [n for n in opt.graph_module.graph.nodes if n.target is FLASH]
    assert [(n.args[4], n.args[5]) for n in nodes] == [(False, 0.3), (True, None), (False, None)]


class _MaskedSoftmax(nn.Module):
    """A written-out attention whose additive mask is built from a boolean one: -inf where masked."""

    def forward(self, q, k, v, keep):
        mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
        return torch.softmax(q @ k.transpose(-2, -1) * 0.125 + mask, dim=-1) @ v


def test_written_softmax_keeps_eagers_nan_on_a_row_with_no_visible_key():
    """softmax over an all -inf row is NaN in eager; the decomposed form's kernel call says
    empty_nan so it gives NaN there too (an SDPA call's gives 0, as SDPA does)."""
    q, k, v = (torch.randn(1, 2, 8, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
    keep = torch.rand(1, 1, 8, 8, device=DEVICE) > 0.3
    keep[..., 0] = True
    model = _MaskedSoftmax().eval()
    opt = accelc.optimize(model, (q, k, v, keep), accelc.OptimizeConfig(only_if_faster=False))
    [node] = [n for n in opt.graph_module.graph.nodes if n.target is FLASH]
    assert node.kwargs.get("empty_nan") is True
    keep[0, 0, 3] = False
    with torch.no_grad():
        out, eager = opt(q, k, v, keep), model(q, k, v, keep)
    assert torch.isnan(eager[0, :, 3]).all() and torch.isnan(out[0, :, 3]).all()
    rows = [0, 1, 2, 4, 5, 6, 7]
    assert rel_l2(out[:, :, rows], eager[:, :, rows]) < 5e-3


class BmmAttention(nn.Module):
    """Attention over (batch * heads, length, head_dim) tensors written with bmm, the scores
    either a scaled bmm or one baddbmm with a bias (ALiBi-style, beta / alpha as given)."""

    def __init__(self, style, heads=2, d=32):
        super().__init__()
        self.style, self.heads, self.d = style, heads, d

    def forward(self, x, bias):
        B, L, _ = x.shape
        q = x.view(B, L, self.heads, self.d).transpose(1, 2).reshape(B * self.heads, L, self.d)
        k, v = q * 0.5, q.flip(1)
        if self.style == "bmm":
            p = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(self.d), dim=-1)
        else:
            beta = {"baddbmm": 1.0, "baddbmm_beta0": 0.0, "baddbmm_beta2": 2.0}[self.style]
            p = F.softmax(torch.baddbmm(bias, q, k.transpose(-1, -2), beta=beta, alpha=self.d ** -0.5), dim=-1)
        out = torch.bmm(p, v)                                      # (B * heads, L, d)
        return out.view(B, self.heads, L, self.d).transpose(1, 2).reshape(B, L, -1)


@pytest.mark.parametrize("style,kernel", [("bmm", "accelc::flash_attention"),
                                          ("baddbmm", "accelc::flash_attention[mask]"),
                                          ("baddbmm_beta0", "accelc::flash_attention"),
                                          ("baddbmm_beta2", None)])
def test_bmm_and_baddbmm_attention(style, kernel):
    x = torch.randn(2, 9, 64)
    bias = torch.randn(4, 1, 9) * 2                                # (batch * heads, 1, keys)
    opt = _optimize(BmmAttention(style), x, bias)
    rows = _attention_rows(opt)
    if kernel is None:
        assert not rows and "beta=2.0" in opt.summary(), opt.summary()
    else:
        assert [r.kernel for r in rows] == [kernel], opt.summary()


def test_baddbmm_that_is_no_attention_stays_and_keeps_beta_and_alpha():
    class M(nn.Module):
        def forward(self, c, a, b):
            return torch.baddbmm(c, a, b, beta=0.5, alpha=2.0).relu() + a.bmm(b)
    c, a, b = torch.randn(3, 4, 5), torch.randn(3, 4, 6), torch.randn(3, 6, 5)
    opt = _optimize(M(), c, a, b, dtype=torch.float32)
    assert not opt.rewritten
    with torch.no_grad():
        torch.testing.assert_close(opt(c, a, b), M()(c, a, b))


class _ModuleSoftmax(nn.Module):
    """Written-out attention whose softmax is an nn.Softmax module (as several vision and audio
    models write it)."""

    def __init__(self):
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q, k, v, mask):
        return self.softmax(q @ k.transpose(-2, -1) * 0.125 + mask) @ v


def test_written_attention_with_an_nn_softmax_module_is_found():
    q, k, v = (torch.randn(2, 2, 19, 32) for _ in range(3))
    mask = torch.randn(2, 1, 1, 19)
    opt = _optimize(_ModuleSoftmax(), q, k, v, mask)
    nodes = [n for n in opt.graph_module.graph.nodes if n.target is FLASH]
    assert len(nodes) == 1 and len(_attention_rows(opt)) == 1 and nodes[0].args[5] == pytest.approx(0.125)


class RepeatedKV(nn.Module):
    """Grouped-query attention with K/V repeated to the query's heads before the attention, as HF
    writes it (repeat_kv), or with repeat_interleave, or as a tile (another head order: query head
    j reads K/V head j % Hkv, not a group's); `keep` returns the repeated K as well."""

    def __init__(self, style, n_rep=2, keep=False):
        super().__init__()
        self.style, self.n_rep, self.keep = style, n_rep, keep

    def repeat(self, x):
        b, hkv, s, d = x.shape
        if self.style == "interleave":
            return x.repeat_interleave(self.n_rep, dim=1)
        if self.style == "uneven":     # head 0 once, head 1 three times: no grouping
            return x.repeat_interleave(torch.tensor([1, 3], device=x.device), dim=1)
        if self.style == "tile":
            return x.repeat(1, self.n_rep, 1, 1)
        return x[:, :, None, :, :].expand(b, hkv, self.n_rep, s, d).reshape(b, hkv * self.n_rep, s, d)

    def forward(self, q, k, v, mask):
        k, v = self.repeat(k), self.repeat(v)
        if self.style == "written":
            out = torch.softmax(q @ k.transpose(-2, -1) * 32 ** -0.5 + mask, dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return (out, k * 2) if self.keep else out


@pytest.mark.parametrize("style", ["repeat_kv", "interleave", "written"])
def test_repeated_kv_read_once_per_group(style):
    # the kernel is given the K/V of Hkv heads and maps each query group to its head: no copy of
    # the K/V (a decode step's whole cache) made per query head before it
    q, (k, v) = torch.randn(2, 8, 5, 32), (torch.randn(2, 2, 13, 32) for _ in range(2))
    mask = torch.randn(2, 1, 5, 13)
    opt = _optimize(RepeatedKV(style, n_rep=4), q, k, v, mask)
    (node,) = [n for n in opt.graph_module.graph.nodes if n.target is FLASH]
    assert [tuple(meta.tensor_meta(a).shape) for a in node.args[1:3]] == [(2, 2, 13, 32)] * 2
    assert all(n.target not in (torch.ops.aten.expand.default, torch.ops.aten.repeat_interleave.self_int)
               for n in opt.graph_module.graph.nodes)
    assert len(_attention_rows(opt)) == 1 and _attention_rows(opt)[0].status == "rewritten"


@pytest.mark.parametrize("style,keep", [("tile", False), ("repeat_kv", True), ("uneven", False)])
def test_repeats_that_are_no_query_grouping_stay(style, keep):
    # a tile maps query head j to K/V head j % Hkv (not the kernel's j // group), a repeats tensor may
    # repeat heads unevenly; a repeated K read elsewhere too must still be made: all keep the
    # repeated K/V as the kernel's inputs
    q, (k, v) = torch.randn(1, 4, 5, 32), (torch.randn(1, 2, 7, 32) for _ in range(2))
    mask = torch.randn(1, 1, 5, 7)
    model = RepeatedKV(style, keep=keep).to(DEVICE, torch.float16).eval()
    args = tuple(a.to(DEVICE, torch.float16) for a in (q, k, v, mask))
    opt = accelc.optimize(model, args)
    (node,) = [n for n in opt.graph_module.graph.nodes if n.target is FLASH]
    assert tuple(meta.tensor_meta(node.args[1]).shape)[1] == 4
    with torch.no_grad():
        got, want = opt(*args), model(*args)
    for g, w in zip(got if keep else (got,), want if keep else (want,)):
        assert rel_l2(g, w) < 5e-3
