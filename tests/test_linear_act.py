"""passes/linear_act.py: which spellings of linear + epilogue are found, and what stays."""
import math
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from conftest import DEVICE, NORMS_REWRITTEN, rel_l2


def _optimize(model, *shape):
    model = model.to(DEVICE).eval()
    x = torch.randn(*shape, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    x2 = torch.randn(*shape, device=DEVICE)  # fresh input: same function, not just the example
    with torch.no_grad():
        assert rel_l2(opt(x2), model(x2)) < 1e-5
    return opt


def _kernels(opt):
    return [r.kernel for r in opt.rewritten]


class LinearAct(nn.Module):
    def __init__(self, act, bias=True):
        super().__init__()
        self.fc = nn.Linear(20, 12, bias=bias)
        self.act = act

    def forward(self, x):
        return self.act(self.fc(x))


@pytest.mark.parametrize("act,label", [
    (nn.ReLU(), "accelc::linear[relu]"),
    (nn.ReLU(inplace=True), "accelc::linear[relu]"),
    (nn.GELU(), "accelc::linear[gelu]"),
    (nn.GELU(approximate="tanh"), "accelc::linear[gelu_tanh]"),
    (nn.SiLU(), "accelc::linear[silu]"),
    (nn.Sigmoid(), "accelc::linear[sigmoid]"),
    (nn.Tanh(), "accelc::linear[tanh]"),
    (nn.ReLU6(), "accelc::linear[relu6]"),
    (nn.ReLU6(inplace=True), "accelc::linear[relu6]"),
    (nn.Hardtanh(0.0, 6.0), "accelc::linear[relu6]"),
    (nn.Hardtanh(), "accelc::linear"),                 # clamps to [-1, 1]: not an epilogue activation
    (nn.Hardswish(), "accelc::linear[hardswish]"),
    (nn.Hardsigmoid(inplace=True), "accelc::linear[hardsigmoid]"),
    (nn.Identity(), "accelc::linear"),
])
def test_activation_modules_fused(act, label):
    opt = _optimize(LinearAct(act), 9, 20)
    assert _kernels(opt) == [label]
    assert opt.info.pass_counts["linear_act"] == 1


class Relu6Spelled(nn.Module):
    """relu6 written each way models write it; `shape_branch` makes symbolic_trace fail, so the
    graph comes from torch.export (aten.hardtanh / aten.clamp / aten.relu6)."""

    def __init__(self, style, shape_branch=False):
        super().__init__()
        self.fc, self.style, self.shape_branch = nn.Linear(20, 12), style, shape_branch

    def forward(self, x):
        if self.shape_branch and x.shape[0] > 1:
            x = x * 0.5
        y = self.fc(x)
        if self.style == "F.relu6":
            return F.relu6(y, inplace=True)
        if self.style == "F.hardtanh":
            return F.hardtanh(y, min_val=0.0, max_val=6.0)
        if self.style == "torch.clamp":
            return torch.clamp(y, 0, 6)
        if self.style == "clamp_kwargs":
            return y.clamp(min=0.0, max=6.0)
        if self.style == "clip":
            return y.clip(0, 6)
        if self.style == "clamp_other":
            return y.clamp(0, 5)             # not relu6: stays
        if self.style == "clamp_min_only":
            return y.clamp(min=0)            # stays (a relu, but spelled as clamp: left as written)
        return F.hardswish(y)


@pytest.mark.parametrize("shape_branch", [False, True])
@pytest.mark.parametrize("style,label", [
    ("F.relu6", "accelc::linear[relu6]"), ("F.hardtanh", "accelc::linear[relu6]"),
    ("torch.clamp", "accelc::linear[relu6]"), ("clamp_kwargs", "accelc::linear[relu6]"),
    ("clip", "accelc::linear[relu6]"), ("clamp_other", "accelc::linear"), ("clamp_min_only", "accelc::linear"),
    ("F.hardswish", "accelc::linear[hardswish]"),
])
def test_relu6_and_hardswish_spellings_fused(style, label, shape_branch):
    opt = _optimize(Relu6Spelled(style, shape_branch), 9, 20)
    assert opt.info.capture_method == ("torch.export" if shape_branch else "symbolic_trace")
    assert _kernels(opt) == [label], opt.summary()


def test_relu6_in_place_on_a_tensor_read_again_stays():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(20, 12)

        def forward(self, x):
            y = self.fc(x)
            z = F.relu6(y, inplace=True)     # mutates y, which is read again below
            return z + y
    opt = _optimize(M(), 9, 20)
    assert _kernels(opt) == ["accelc::linear"], opt.summary()


class Functional(nn.Module):
    """The same linear+relu written five ways."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.w = nn.Parameter(torch.randn(12, 20) / 20 ** 0.5)   # (N, K) like nn.Linear
        self.w_t = nn.Parameter(torch.randn(20, 12) / 20 ** 0.5)  # (K, N) for matmul
        self.b = nn.Parameter(torch.randn(12))

    def forward(self, x):
        if self.style == "F.linear":
            return torch.relu(F.linear(x, self.w, self.b))
        if self.style == "matmul+bias":
            return (x @ self.w_t + self.b).relu()
        if self.style == "bias+matmul":
            return F.relu(torch.add(self.b, torch.matmul(x, self.w_t)))
        if self.style == "matmul":
            return F.relu(x @ self.w_t, inplace=True)
        return F.linear(x, self.w).relu_()


@pytest.mark.parametrize("style", ["F.linear", "matmul+bias", "bias+matmul", "matmul", "nobias"])
def test_functional_spellings_fused(style):
    opt = _optimize(Functional(style), 2, 7, 20)
    assert _kernels(opt) == ["accelc::linear[relu]"]


class Residual(nn.Module):
    def __init__(self, order):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.order = order

    def forward(self, x):
        if self.order == "act_then_add":
            return x + F.gelu(self.fc(x))
        if self.order == "add_then_act":
            return F.relu(self.fc(x) + x)
        return self.fc(x) + x


@pytest.mark.parametrize("order,label", [
    ("act_then_add", "accelc::linear[gelu+residual]"),
    ("add_then_act", "accelc::linear[residual+relu]"),
    ("add_only", "accelc::linear[residual]"),
])
def test_residual_add_fused_in_either_order(order, label):
    opt = _optimize(Residual(order), 5, 16)
    assert _kernels(opt) == [label]


def test_unsupported_activation_stays_pytorch():
    opt = _optimize(LinearAct(nn.LeakyReLU(0.1)), 9, 20)
    assert _kernels(opt) == ["accelc::linear"]
    kept = [r for r in opt.layers if r.status == "kept"]
    assert [r.kind for r in kept] == ["LeakyReLU"]
    assert kept[0].reason == "no accelc rewrite for LeakyReLU"
    assert "no accelc kernel for (these run as PyTorch, as in eager): LeakyReLU" in opt.summary()


class SharedOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return torch.relu(h) * h  # h read twice: the relu cannot be fused away


def test_intermediate_with_other_readers_not_absorbed():
    opt = _optimize(SharedOutput(), 4, 16)
    assert _kernels(opt) == ["accelc::linear"]
    assert any(r.kind == "relu" and r.status == "kept" for r in opt.layers)


class InplaceShared(nn.Module):
    """relu_ mutates h, which is read again afterwards: canonicalising it to an out-of-place
    relu would change the result, so it must not be absorbed."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        y = h.relu_()
        return y + h


def test_inplace_op_whose_input_is_read_again_is_left_alone():
    opt = _optimize(InplaceShared(), 4, 16)
    assert _kernels(opt) == ["accelc::linear"]


class NoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x, ):
        return torch.relu(self.norm(x)) @ x.transpose(-1, -2)  # matmul of two activations (3-D)


def test_no_pattern_found():
    opt = _optimize(NoLinear(), 2, 4, 16)
    assert {p: n for p, n in opt.info.pass_counts.items() if p != "norms"} == {
        p: 0 for p in opt.info.pass_counts if p != "norms"}
    assert [r.name for r in opt.rewritten] == (["norm"] if NORMS_REWRITTEN else [])   # the LayerNorm alone
    assert {(r.name, r.kind) for r in opt.layers if r.name != "norm"} == {("relu", "relu"), ("matmul", "matmul")}


def test_unsupported_dtype_kept_with_reason():
    model = LinearAct(nn.ReLU()).double().to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(3, 20, device=DEVICE, dtype=torch.float64),))
    assert opt.rewritten == []
    row = next(r for r in opt.layers if r.name == "fc")
    assert row.status == "kept" and "dtype torch.float64" in row.reason


def test_counts_and_names_on_a_sequence():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = _optimize(model, 6, 8)
    assert opt.info.pass_counts["linear_act"] == 3
    assert [r.name for r in opt.rewritten] == ["0+1", "2+3", "4"]


class Conv1D(nn.Module):
    """HF's GPT-2 linear: bias + x @ weight through torch.addmm on x flattened to 2-D, weight stored
    (K, N), the result viewed back to x's leading dims; then GELU (and, with residual, + x)."""

    def __init__(self, k, n, beta=1, style="view", residual=False, shape_branch=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) / k ** 0.5)
        self.bias = nn.Parameter(torch.randn(n))
        self.beta, self.style, self.residual, self.shape_branch = beta, style, residual, shape_branch

    def forward(self, x):
        if self.shape_branch and x.shape[0] > 1:      # symbolic_trace fails: the graph comes from torch.export
            x = x * 0.5
        size_out = x.size()[:-1] + (self.weight.shape[1],)
        if self.style == "reshape":
            y = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).reshape(size_out)
        elif self.style == "other_view":               # viewed to another shape: not x's rows
            y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(-1, x.size(1), 2, size_out[-1] // 2)
        else:
            y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight, beta=self.beta).view(size_out)
        y = F.gelu(y, approximate="tanh")
        return y + x if self.residual else y


@pytest.mark.parametrize("shape_branch", [False, True])
@pytest.mark.parametrize("style", ["view", "reshape"])
def test_addmm_linears(style, shape_branch):
    # the view back to x's leading dims is undone (F.linear on x itself), so the activation and the
    # residual meet the GEMM and fuse into it; the weight is read (K, N) as stored
    opt = _optimize(Conv1D(20, 12, style=style, shape_branch=shape_branch), 2, 5, 20)
    assert opt.info.capture_method == ("torch.export" if shape_branch else "symbolic_trace")
    assert _kernels(opt) == ["accelc::linear[gelu_tanh]"], opt.summary()
    opt = _optimize(Conv1D(20, 20, style=style, residual=True, shape_branch=shape_branch), 2, 5, 20)
    assert _kernels(opt) == ["accelc::linear[gelu_tanh+residual]"], opt.summary()


def test_addmm_look_alikes():
    opt = _optimize(Conv1D(20, 12, beta=2), 2, 5, 20)
    assert _kernels(opt) == []                       # 2 * bias + x @ w: not a linear layer's addmm
    opt = _optimize(Conv1D(20, 12, style="other_view"), 2, 5, 20)
    assert _kernels(opt) == ["accelc::linear"]       # the view is not back to x's rows: the gelu stays after it


_S2 = math.sqrt(2.0 / math.pi)
WRITTEN = {   # HF's gelu_new / gelu_fast, the erf form, operand orders a user may write; CLIP's quick_gelu,
              # hardswish / hardsigmoid through relu6, SiLU written out; look-alikes stay as written
    "gelu_new": (lambda h: 0.5 * h * (1.0 + torch.tanh(_S2 * (h + 0.044715 * torch.pow(h, 3.0)))), "gelu_tanh"),
    "commuted": (lambda h: (torch.tanh((0.044715 * h ** 3 + h) * _S2) + 1.0) * h * 0.5, "gelu_tanh"),
    "gelu_fast": (lambda h: 0.5 * h * (1.0 + torch.tanh(h * 0.7978845608 * (1.0 + 0.044715 * h * h))), "gelu_tanh"),
    "erf": (lambda h: h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0))), "gelu"),
    "near_miss": (lambda h: 0.5 * h * (1.0 + torch.tanh(_S2 * (h + 0.05 * h ** 3))), None),
    "quick_gelu": (lambda h: h * torch.sigmoid(1.702 * h), "quick_gelu"),
    "quick_gelu_commuted": (lambda h: torch.sigmoid(h * 1.702) * h, "quick_gelu"),
    "quick_gelu_near_miss": (lambda h: h * torch.sigmoid(1.7 * h), None),
    "hardswish": (lambda h: h * F.relu6(h + 3.0) / 6.0, "hardswish"),
    "hardswish_clamp": (lambda h: h * torch.clamp(h + 3, 0, 6) / 6, "hardswish"),
    "hardswish_hardtanh": (lambda h: h * F.hardtanh(h + 3.0, 0.0, 6.0) * (1.0 / 6.0), "hardswish"),
    "hardsigmoid": (lambda h: F.relu6(h + 3.0) / 6.0, "hardsigmoid"),
    "silu": (lambda h: h * torch.sigmoid(h), "silu"),
    "sigmoid_squared": (lambda h: torch.sigmoid(h) * torch.sigmoid(h), None),
    "relu6_shifted": (lambda h: F.relu6(h + 2.0) / 6.0, None),
}


class _Written(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.fc, self.f = nn.Linear(16, 32), f

    def forward(self, x):
        return self.f(self.fc(x))


class _WrittenAfterBias(nn.Module):
    """matmul + bias, then an activation written out over that sum: the written form's input is
    itself a pointwise node (the bias add), not the expression's one leaf."""

    def __init__(self, act):
        super().__init__()
        self.w, self.b, self.act = nn.Parameter(torch.randn(16, 32) / 4), nn.Parameter(torch.randn(32)), act

    def forward(self, x):
        h = x @ self.w + self.b
        if self.act == "gelu_tanh":
            return 0.5 * h * (1.0 + torch.tanh(_S2 * (h + 0.044715 * h ** 3)))
        return h * torch.sigmoid(h)


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_written_activation_over_a_bias_add_fuses(act):
    opt = _optimize(_WrittenAfterBias(act), 4, 16)
    assert _kernels(opt) == [f"accelc::linear[{act}]"], opt.summary()


@pytest.mark.parametrize("form", list(WRITTEN))
def test_written_out_activations_fuse(form):
    f, act = WRITTEN[form]
    model = _Written(f).to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, accelc.OptimizeConfig(only_if_faster=False))
    assert [r.kernel for r in opt.rewritten] == ["accelc::linear" + (f"[{act}]" if act else "")], opt.summary()
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5
        y = x.clone()
        y[0, 0] = float("nan")
        assert torch.isnan(opt(y)[0]).all() and torch.isnan(model(y)[0]).all()
