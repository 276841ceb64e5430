"""accelc/near_miss.py: a layer that nearly matched a rule says which rule and what did not fit
(it said only "no accelc rewrite for softmax"), and look-alikes that do match say nothing of it."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from conftest import DEVICE, rel_l2

CFG = accelc.OptimizeConfig(only_if_faster=False)


class _Attention(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.form = form

    def forward(self, x):
        q, k, v = (t.view(2, 8, 2, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        s = q @ k.transpose(-1, -2) / 4.0
        if self.form == "weights_returned":
            p = F.softmax(s, dim=-1)
            return p @ v, p
        if self.form == "other_dim":
            return F.softmax(s, dim=-2) @ v
        return F.softmax(s, dim=-1) @ v


def _kept(opt):
    return {r.name: r.reason for r in opt.layers if r.status == "kept"}


@pytest.mark.parametrize("form, said", [
    ("weights_returned", "attention (softmax(q @ k^T) @ v as one flash kernel) not taken: the probabilities are "
                         "also read by"),
    ("other_dim", "attention (softmax(q @ k^T) @ v as one flash kernel) not taken: the softmax is over dim -2, "
                  "not the keys"),
])
def test_an_attention_not_taken_says_which_part_did_not_fit(form, said):
    model = _Attention(form).to(DEVICE).eval()
    x = torch.randn(2, 8, 32, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    kept = _kept(opt)
    assert kept["softmax"].startswith(said), kept
    assert kept["matmul"].startswith("part of an attention the attention rule did not take"), kept
    with torch.no_grad():
        for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (opt(x), model(x)))):
            assert rel_l2(a, b) < 1e-5


def test_a_taken_attention_and_a_product_of_activations():
    model = _Attention("plain").to(DEVICE).eval()
    opt = accelc.optimize(model, torch.randn(2, 8, 32, device=DEVICE), CFG)
    assert any(r.kind == "attention" for r in opt.rewritten) and "softmax" not in _kept(opt)

    class Gram(nn.Module):
        def forward(self, x):
            return x @ x.transpose(1, 2)
    opt = accelc.optimize(Gram(), torch.randn(2, 8, 32, device=DEVICE), CFG)
    assert _kept(opt)["matmul"].startswith("linear (x @ W + b) not taken: both operands are computed at run time")


class _Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.pool_bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y), y * 2, self.pool_bn(F.avg_pool2d(x, 2))


def test_a_batch_norm_not_folded_says_why():
    model = _Norms().to(DEVICE).eval()
    for bn in (model.bn, model.pool_bn):
        bn.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 4, 6, 6, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    kept = _kept(opt)
    assert kept["bn"].startswith("fold_bn not taken: the conv's output is also read by mul"), kept
    assert kept["pool_bn"].startswith("fold_bn not taken: it follows avg_pool2d, not a conv"), kept


def test_hf_attention_weights_returned_are_named_as_the_cause():
    """output_attentions=True (a user who wants the attention maps): the attention stays eager's,
    and the summary says it is because the probabilities are returned."""
    T = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, vocab_size=100, max_position_embeddings=64,
                                        attn_implementation="eager"))
    bert = bert.to(DEVICE).eval()
    ids = torch.randint(0, 100, (2, 16), device=DEVICE)
    opt = accelc.optimize(bert, {"input_ids": ids, "output_attentions": True}, CFG)
    reasons = [r.reason for r in opt.layers if r.status == "kept" and r.kind == "softmax"]
    assert reasons and all("the probabilities are also read by" in r for r in reasons), opt.summary()


class _ShiftedWindows(nn.Module):
    """timm's WindowAttention without fused attention: the relative position bias added, then the
    per-window mask through a 5-D view of the scores."""

    def __init__(self, windows=4, heads=2, n=16, d=16):
        super().__init__()
        self.qkv = nn.Linear(heads * d, 3 * heads * d)
        self.bias = nn.Parameter(torch.randn(heads, n, n))
        self.register_buffer("mask", torch.where(torch.rand(windows, n, n) > 0.3, 0.0, -100.0))
        self.heads, self.d = heads, d

    def forward(self, x):
        B_, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B_, N, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        attn = (q * self.d ** -0.5) @ k.transpose(-2, -1) + self.bias.unsqueeze(0)
        nw = self.mask.shape[0]
        attn = attn.view(-1, nw, self.heads, N, N) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.heads, N, N).softmax(dim=-1)
        return (attn @ v).transpose(1, 2).reshape(B_, N, C)


def test_a_shifted_window_mask_through_a_5d_view_is_named():
    model = _ShiftedWindows().to(DEVICE).eval()
    x = torch.randn(8, 16, 32, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert _kept(opt)["softmax"].startswith("attention (softmax(q @ k^T) @ v as one flash kernel) not taken: a mask "
                                            "is added through a 5-D view of the scores"), _kept(opt)
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5
