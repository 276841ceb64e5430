"""accelc/rewrite.py: the rule driver every pass shares (matching, liveness, the device check, the
skip-reason policy, counts), and the kernels' why_unsupported that rules ask on meta tensors."""
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

import accelc
from accelc import meta
from accelc.capture import make_canonical
from accelc.config import OptimizeConfig
from accelc.kernels import conv, flash_attention, gemm, int8_gemm, quantize
from accelc.rewrite import Pass, PassContext, Pattern, Replacement, Rule, apply_rules, run_pass
from conftest import DEVICE, rel_l2


class WrittenOutSilu(nn.Module):
    """x * tanh(x), twice: an expression no pass and no canonical form knows (capture folds a
    written-out silu, so it is no example of a new rule any more)."""

    def forward(self, x):
        y = x + 1
        return torch.tanh(x) * x + torch.tanh(y) * y


def _silu(x):
    return torch.tanh(x) * x


def x_tanh(x):
    return x * torch.tanh(x)


def _graph(model, *args):
    gm = fx.symbolic_trace(model)
    make_canonical(gm, args)
    return gm


def _ctx(*args):
    return PassContext(OptimizeConfig(), args, [args], DEVICE)


def test_a_new_rewrite_is_one_rule():
    """A rule declared in four lines (pattern, build) is found, counted and replaced by the driver."""
    rule = Rule(Pattern("written-out x tanh(x)", _silu), build=lambda m, ctx: Replacement(x_tanh, (m.input("x"),)))
    x = torch.randn(3, 5, device=DEVICE)
    gm = _graph(WrittenOutSilu(), x)
    assert run_pass(gm, Pass("silu", (rule,)), _ctx(x)) == 2
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(x_tanh) == 2 and torch.tanh not in targets
    assert rel_l2(gm(x), WrittenOutSilu()(x)) < 1e-6


def test_check_reason_recorded_and_first_reason_stands():
    first = Rule(Pattern("silu", _silu), build=None, check=lambda m, ctx: "first reason")
    second = Rule(Pattern("silu", _silu), build=None, check=lambda m, ctx: "second reason")
    x = torch.randn(3, 5, device=DEVICE)
    gm = _graph(WrittenOutSilu(), x)
    assert apply_rules(gm, (first, second), _ctx(x)) == 0
    muls = [n for n in gm.graph.nodes if n.target is operator.mul]
    assert [meta.reason_kept(n) for n in muls] == ["first reason", "first reason"]


def test_applies_false_is_silent():
    rule = Rule(Pattern("silu", _silu), build=None, check=lambda m, ctx: "refused", applies=lambda m: False)
    x = torch.randn(3, 5, device=DEVICE)
    gm = _graph(WrittenOutSilu(), x)
    assert apply_rules(gm, (rule,), _ctx(x)) == 0
    assert not any(meta.reason_kept(n) for n in gm.graph.nodes)


def test_a_device_kernels_cannot_use_is_refused_with_one_message():
    rule = Rule(Pattern("silu", _silu), build=lambda m, ctx: Replacement(F.silu, (m.input("x"),)))
    x = torch.randn(3, 5, device=DEVICE)
    gm = _graph(WrittenOutSilu(), x)
    for n in gm.graph.nodes:     # as if the values lived on a device Triton cannot reach
        if meta.tensor_meta(n) is not None:
            m = meta.tensor_meta(n)
            n.meta[meta.VALUE] = meta.TensorMeta(m.shape, m.dtype, torch.device("meta"))
    assert apply_rules(gm, (rule,), _ctx(x)) == 0
    reasons = {meta.reason_kept(n) for n in gm.graph.nodes if n.target is operator.mul}
    assert reasons == {"tensors on meta: accelc kernels need a CUDA device (or Triton's interpreter, "
                       "TRITON_INTERPRET=1)"}


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def test_an_absorbed_node_is_not_taken_twice():
    """fc1 absorbs the gelu; fc2's match reads the gelu's replacement, not the erased node."""
    model = Chain().to(DEVICE).eval()
    x = torch.randn(4, 8, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    assert [r.kernel for r in opt.rewritten] == ["accelc::linear[gelu]", "accelc::linear"]
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


def test_kernels_say_why_on_meta_tensors():
    def m(*shape, dtype=torch.float16):
        return torch.empty(shape, device="meta", dtype=dtype)

    assert gemm.why_unsupported(m(4, 16), m(8, 16)) is None
    assert "x has K=16 features" in gemm.why_unsupported(m(4, 16), m(8, 12))
    assert "dtype torch.float64" in gemm.why_unsupported(m(4, 16, dtype=torch.float64), m(8, 16, dtype=torch.float64))
    assert "bias must be (8,)" in gemm.why_unsupported(m(4, 16), m(8, 16), m(3))
    assert conv.why_unsupported(m(1, 4, 9, 9), m(8, 3, 3, 4), stride=(1, 1), padding=(1, 1, 1, 1)) is None
    assert "kernel 9x9 over 7x7" in conv.why_unsupported(m(1, 4, 9, 9), m(8, 9, 9, 4))
    assert "takes 5 a group: not a whole number of groups" in conv.why_unsupported(m(1, 4, 9, 9), m(8, 3, 3, 5))
    assert conv.why_unsupported(m(1, 4, 9, 9), m(8, 3, 3, 2)) is None       # two groups of two channels
    assert flash_attention.why_unsupported(m(1, 2, 8, 64), m(1, 2, 8, 64), m(1, 2, 8, 64)) is None
    assert flash_attention.why_unsupported(m(1, 2, 8, 48), m(1, 2, 8, 48), m(1, 2, 8, 48)) is None
    assert "head dim 12" in flash_attention.why_unsupported(m(1, 2, 8, 12), m(1, 2, 8, 12), m(1, 2, 8, 12))
    assert "head dim 264" in flash_attention.why_unsupported(m(1, 2, 8, 264), m(1, 2, 8, 264), m(1, 2, 8, 264))
    assert quantize.why_unsupported(m(4, 16)) is None
    assert "smooth must be" in quantize.why_unsupported(m(4, 16), m(3, dtype=torch.float32))
    w_q, w_s = m(8, 16, dtype=torch.int8), m(8, dtype=torch.float32)
    assert int8_gemm.why_unsupported(m(4, 16), w_q, w_s) is None
    assert "expected (N, 12)" in int8_gemm.why_unsupported(m(4, 12), w_q, w_s)
