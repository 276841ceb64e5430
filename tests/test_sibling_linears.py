"""The sibling_linears pass (passes/sibling_linears.py): projections of one input whose outputs are
only reshaped (q, k, v) become one GEMM over their stacked weights, each output a slice."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc.pipeline import PASS_NAMES
from conftest import DEVICE, assert_close_to_ref


class Projections(nn.Module):
    """Attention's input side as HF writes it: three projections of x, each viewed into heads
    (grouped K / V: narrower k and v), then SDPA."""

    def __init__(self, d=64, heads=4, kv_heads=2, bias=True):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, heads * self.hd, bias=bias)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=bias)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=bias)
        self.o = nn.Linear(d, d, bias=bias)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(B, L, self.kvh, self.hd).transpose(1, 2)
        v = self.v(x).view(B, L, self.kvh, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(B, L, -1))


def _kernels(opt):
    return {r.name: r.kernel for r in opt.layers if r.status == "rewritten"}


@pytest.mark.parametrize("bias", [True, False])
def test_q_k_v_become_one_gemm(bias):
    model = Projections(bias=bias).to(DEVICE).half().eval()
    x = torch.randn(2, 16, 64, device=DEVICE, dtype=torch.float16)
    opt = accelc.optimize(model, (x,))
    kernels = _kernels(opt)
    assert kernels.get("q+k+v") == "accelc::linear", opt.summary()
    assert opt.info.pass_counts["sibling_linears"] == 1
    assert not [r for r in opt.layers if r.kind in ("narrow", "Linear")], opt.summary()
    # the projections' own weights left the graph: the stacked one replaces them
    held = {n for n, _ in opt.graph_module.named_buffers()} | {n for n, _ in opt.graph_module.named_parameters()}
    assert not any(n.startswith(("q.", "k.", "v.")) for n in held), sorted(held)
    with torch.no_grad():
        ref = model.double()(x.double())
        out, eager = opt(x), model.half()(x)
    assert_close_to_ref(out, ref, eager, torch.float16, atol=1e-2, rtol=1e-2)


class Flattened(nn.Module):
    """Projections whose outputs are viewed in ways a slice of the stacked output cannot be viewed:
    (B, L, E) -> (B, L * E) merges a dim whose stride the slice changed."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, 2 * d)

    def forward(self, x):
        B, L, _ = x.shape
        return self.a(x).view(B, -1).sum(-1) + self.b(x).view(B, L * 2, -1).transpose(1, 2).mean((1, 2))


def test_views_of_the_slices_become_reshapes():
    model = Flattened().to(DEVICE).eval()
    x = torch.randn(3, 5, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    assert opt.info.pass_counts["sibling_linears"] == 1 and "a+b" in _kernels(opt), opt.summary()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), atol=1e-4, rtol=1e-4)


class NotSiblings(nn.Module):
    """Projections this pass leaves: an activation after one (linear_act's epilogue), a residual
    add after another, two inputs, a weight computed at run time."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(d, d) for _ in range(5))

    def forward(self, x, y):
        act = F.gelu(self.a(x)).view(-1)                  # a GELU after it: its epilogue
        res = (self.b(x) + x).view(-1)                    # a residual after it
        other = self.c(y).view(-1)                        # another input than d's
        scaled = F.linear(x, self.e.weight * y.mean()).view(-1)  # a weight computed at run time (from an input)
        return act + res + other + self.d(x).view(-1) + scaled


def test_look_alikes_stay_separate():
    model = NotSiblings().to(DEVICE).eval()
    x, y = torch.randn(4, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    opt = accelc.optimize(model, (x, y))
    assert opt.info.pass_counts["sibling_linears"] == 0, opt.summary()
    assert "a+gelu" in _kernels(opt) and "b+add" in _kernels(opt), opt.summary()
    with torch.no_grad():
        torch.testing.assert_close(opt(x, y), model(x, y), atol=1e-4, rtol=1e-4)


def test_one_weight_twice_and_the_pass_off():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Linear(32, 48, bias=False)

        def forward(self, x):
            return self.p(x).view(-1, 6, 8).sum(1) * F.linear(x, self.p.weight).view(-1, 6, 8).amax(1)
    model = Tied().to(DEVICE).eval()
    x = torch.randn(4, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    assert opt.info.pass_counts["sibling_linears"] == 1, opt.summary()
    off = accelc.optimize(model, (x,), accelc.OptimizeConfig(passes=[p for p in PASS_NAMES if p != "sibling_linears"]))
    assert "sibling_linears" not in off.info.pass_counts and len(_kernels(off)) == 2, off.summary()
    with torch.no_grad():
        for o in (opt, off):
            torch.testing.assert_close(o(x), model(x), atol=1e-4, rtol=1e-4)
