"""One module used twice in a forward (a Linear applied to two inputs, a conv before two batch norms, a gate
projection beside two up projections, a Linear after two norms): every pass that packs, stacks or folds weights
names its new tensor after a source weight or layer, and one source used twice must not give two different
tensors one name (the second overwrote the first: the output 0.93 off with every layer "rewritten", or a crash
inside the guard where the widths differed). And the whole model's check as the last line of defense: an output
far beyond eager's error is never handed back as if fine."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from conftest import DEVICE, rel_l2


def _check(model, args, **config):
    opt = accelc.optimize(model, args, accelc.OptimizeConfig(**config) if config else None)
    with torch.no_grad():
        got, want = opt(*args), model(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert rel_l2(g, w) < 1e-4, (rel_l2(g, w), opt.summary())
    return opt


class SharedProjection(nn.Module):
    """`shared` applied to x beside `a` and to y beside `b`: two groups of sibling projections, one weight in both
    (DeBERTa-v2/v3's share_att_key: the key projection on the hidden states and on the position embeddings)."""

    def __init__(self, d=32, width=48):
        super().__init__()
        self.shared, self.a, self.b = nn.Linear(d, 48), nn.Linear(d, 48), nn.Linear(d, width)

    def forward(self, x, y):
        s1, a = self.shared(x).view(x.shape[0], -1, 8), self.a(x).view(x.shape[0], -1, 8)
        s2, b = self.shared(y).view(y.shape[0], -1, 8), self.b(y).view(y.shape[0], -1, 8)
        return (s1 * a).sum(-1), s2.sum(1) + b.sum(1)


@pytest.mark.parametrize("width", [48, 64])   # 48: both stacks as wide (was silent); 64: they differ (was a crash)
def test_one_linear_on_two_inputs(width):
    model = SharedProjection(width=width).to(DEVICE).eval()
    x, y = torch.randn(4, 32, device=DEVICE), torch.randn(3, 32, device=DEVICE)
    opt = _check(model, (x, y))
    assert opt.info.pass_counts["sibling_linears"] == 2, opt.summary()


class SharedConv(nn.Module):
    """One conv before two batch norms: fold_bn folds each pair into weights named after the conv's."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.BatchNorm2d(8)
        for bn in (self.bn1, self.bn2):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.normal_()

    def forward(self, x, y):
        return self.bn1(self.conv(x)) + self.bn2(self.conv(y))


def test_one_conv_before_two_batch_norms():
    model = SharedConv().to(DEVICE).eval()
    x, y = torch.randn(2, 4, 6, 6, device=DEVICE), torch.randn(2, 4, 6, 6, device=DEVICE)
    opt = _check(model, (x, y))
    assert opt.info.pass_counts["fold_bn"] == 2, opt.summary()


class SharedGate(nn.Module):
    """One gate projection in two gated MLPs, each with its own up projection: the packed gate / up weights were
    named after the gate's."""

    def __init__(self, d=32, hidden=48):
        super().__init__()
        self.gate, self.up1, self.up2 = (nn.Linear(d, hidden, bias=False) for _ in range(3))
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x, y):
        return self.down(F.silu(self.gate(x)) * self.up1(x)) + self.down(F.silu(self.gate(y)) * self.up2(y))


def test_one_gate_in_two_gated_mlps():
    model = SharedGate().to(DEVICE).eval()
    x, y = torch.randn(4, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    opt = _check(model, (x, y))
    assert sum(r.kind == "gated_linear" for r in opt.layers if r.status == "rewritten") == 2, opt.summary()


class SharedAfterNorms(nn.Module):
    """One Linear after two RMSNorms of different weights: norm_linear folds each norm's weight into a tensor
    named after the linear's layer."""

    def __init__(self, d=32):
        super().__init__()
        self.n1, self.n2, self.proj = nn.RMSNorm(d), nn.RMSNorm(d), nn.Linear(d, 48, bias=False)
        self.n1.weight.data.normal_()
        self.n2.weight.data.normal_()

    def forward(self, x, y):
        return self.proj(self.n1(x)) * self.proj(self.n2(y))


def test_one_linear_after_two_norms():
    model = SharedAfterNorms().to(DEVICE).eval()
    _check(model, (torch.randn(4, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE)))


def _overwriting_add_constant(gm, name, value, before, path="", derived=None):
    """rewrite.add_constant as it was: a name already held is overwritten (the fault the check must catch)."""
    from accelc.rewrite import meta as m
    gm.register_buffer(name, value)
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    m.set_tensor_meta(node, value)
    node.meta[m.PATH] = path
    return node


def test_a_fault_outside_every_layer_is_refused(monkeypatch):
    """Stacked weights overwritten under one name: each layer agrees with its own original (both read the
    overwritten tensor), so only the whole output shows it, and reverting layers cannot mend it: refused."""
    from accelc.passes import sibling_linears
    monkeypatch.setattr(sibling_linears, "add_constant", _overwriting_add_constant)
    model = SharedProjection().to(DEVICE).eval()
    x, y = torch.randn(4, 32, device=DEVICE), torch.randn(3, 32, device=DEVICE)
    with pytest.raises(accelc.WrongOutputError, match="a graph rewrite changed the model"):
        accelc.optimize(model, (x, y))


def test_a_wrong_layer_past_its_check_goes_back(monkeypatch):
    """A layer whose kernel reads a weight its check never saw (the weight changed after the check): the whole
    output is far off, the layers go back to PyTorch in graph order until it is within, and the notes say why."""
    from accelc import guard
    real = guard.check_layers

    def check_then_spoil(gm, ctx, only=None):
        checks = real(gm, ctx, only)
        first = guard.layers(gm)[0]       # its kernel reads a tensor of its own, its original the model's weight
        gm.register_buffer("spoiled", accelc.meta.attr_value(gm, first.args[1]).detach() * 3)
        with gm.graph.inserting_before(first):
            spoiled = gm.graph.get_attr("spoiled")
        accelc.meta.set_tensor_meta(spoiled, gm.spoiled)
        first.args = (first.args[0], spoiled, *first.args[2:])
        return checks
    monkeypatch.setattr(guard, "check_layers", check_then_spoil)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            return self.b(torch.relu(self.a(x) + x))
    model = Two().to(DEVICE).eval()
    x = torch.randn(4, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(passes=[p for p in accelc.pipeline.PASS_NAMES
                                                                     if p != "sibling_linears"]))
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5, opt.summary()
    back = [r for r in opt.layers if r.status == "reverted"]
    assert back and all("the whole output was" in r.reason for r in back), opt.summary()
    assert opt.info.end_to_end_rel_error < 1e-5
