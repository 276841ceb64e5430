"""passes/fold_weights.py: what the graph computes from the weights alone (a weight-norm parametrization), computed
once at optimize and read as a constant, so that the layer passes take the layer (a weight-normed conv was left to
PyTorch, its weight "computed at run time"); views, casts, state and anything reading an input left as they are."""
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import accelc
from accelc import meta, records
from accelc.numerics import rel_l2
from conftest import DEVICE


class Normed(nn.Module):
    """Weight-normed convs and a linear (as audio models and vocoders use them); `branch`: a branch on a size,
    which symbolic_trace cannot take (the capture is torch.export's)."""

    def __init__(self, branch: bool):
        super().__init__()
        self.branch = branch
        self.conv = weight_norm(nn.Conv1d(8, 16, 3, padding=1))
        self.conv2 = weight_norm(nn.Conv2d(16, 16, 3, padding=1), dim=0)
        self.lin = weight_norm(nn.Linear(16, 12))

    def forward(self, x):
        if self.branch and x.shape[-1] > 10_000:
            x = x * 2
        y = torch.relu(self.conv(x))
        y = self.conv2(y.unsqueeze(-1)).squeeze(-1)
        return self.lin(y.transpose(1, 2))


def _optimize(model, inputs, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelc.optimize(model, inputs, accelc.OptimizeConfig(only_if_faster=False, **config))


@pytest.mark.parametrize("branch", [False, True])
def test_weight_normed_layers_are_rewritten_on_weights_computed_once(branch):
    """Both captures (symbolic_trace reads the parametrized weight as the module's attribute, torch.export writes
    `_weight_norm(v, g)`): each weight computed once, the convs and the linear rewritten, no weight norm left in the
    graph, the model's numbers at the example and other shapes; without the pass export's convs stay PyTorch, said."""
    torch.manual_seed(0)
    model = Normed(branch).to(DEVICE).eval()
    x = torch.randn(2, 8, 20, device=DEVICE)
    opt = _optimize(model, (x,))
    assert opt.info.capture_method == ("torch.export" if branch else "symbolic_trace")
    assert opt.info.pass_counts["fold_weights"] == 3
    kernels = {r.name: r.kernel for r in opt.layers if r.status == "rewritten"}
    assert any(k.startswith("accelc::conv1d") for k in kernels.values()), [(r.name, r.kernel, r.reason)
                                                                            for r in opt.layers]
    assert any(k.startswith("accelc::conv2d") for k in kernels.values()) and "lin" in kernels, kernels
    assert not [n for n in opt.graph_module.graph.nodes if "weight_norm" in meta.op_name(n)]
    with torch.no_grad():
        for shape in ((2, 8, 20), (1, 8, 7), (3, 8, 33)):
            xx = torch.randn(*shape, device=DEVICE)
            assert rel_l2(opt(xx), model(xx)) < 1e-5, shape
    if branch:      # (symbolic_trace's graph reads the parametrized weight as an attribute: packed from it anyway)
        plain = _optimize(model, (x,), passes=tuple(p for p in accelc.config.PASS_NAMES if p != "fold_weights"))
        conv = [r for r in plain.layers if r.name.startswith("conv") and r.status != "rewritten"]
        convs = [r for r in conv if r.name.endswith(("conv1d", "conv2d"))]
        assert convs and all("computed at run time" in r.reason for r in convs), \
            [(r.name, r.status, r.reason) for r in plain.layers]


def test_a_folded_weight_is_recomputed_from_the_model_where_a_layer_needs_it_again():
    """meta.DERIVED on each folded constant: a released layer rebuilds it from the model's own parameters."""
    torch.manual_seed(0)
    model = Normed(True).to(DEVICE).eval()
    opt = _optimize(model, (torch.randn(2, 8, 20, device=DEVICE),), passes=("fold_weights",))
    gm = opt.graph_module
    folded = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("accelc_folded_")]
    assert len(folded) == 3
    for n in folded:
        again = records._model_tensor(model, n.target, n.meta[meta.DERIVED], "test")
        assert torch.allclose(again, meta.attr_value(gm, n), rtol=1e-6, atol=1e-7), n.target


class Unfoldable(nn.Module):
    """What must stay as it is: a transposed weight (a view), a cast alone, a buffer the forward writes (state), an
    op reading the input, a tensor made from nothing."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 12))
        self.register_buffer("count", torch.zeros(12))
        self.register_buffer("scale", torch.full((12,), 2.0, dtype=torch.float64))

    def forward(self, x):
        self.count.add_(1)
        y = x @ self.w.t() * self.scale.float()
        y = y + (self.count * 0.5) + (x.sum() * self.w).sum(0)
        return y + torch.arange(12, device=x.device, dtype=x.dtype)


def test_views_casts_state_and_inputs_are_not_folded(monkeypatch):
    """... nor run at optimize: a cast of a large weight read as it is made no copy of it there."""
    from accelc.passes import fold_weights

    ran = []
    monkeypatch.setattr(fold_weights, "_replay", lambda graph, *sources: ran.append(graph))
    torch.manual_seed(0)
    model = Unfoldable().to(DEVICE).eval()
    x = torch.randn(3, 12, device=DEVICE)
    opt = _optimize(model, (x,), passes=("fold_weights",))
    assert not ran
    assert opt.info.pass_counts["fold_weights"] == 0, opt.graph_module.code
    assert not [n for n in opt.graph_module.graph.nodes if n.op == "get_attr"
                and n.target.startswith("accelc_folded_")]
    with torch.no_grad():
        model.count.zero_()
        want = model(x)
        model.count.zero_()
        assert rel_l2(opt(x), want) < 1e-6


class Sharded(torch.Tensor):
    """A tensor subclass, as a tensor-parallel program's DTensor weights are."""


def test_a_tensor_subclass_is_left_as_it_is():
    """A tensor-parallel program's weights are DTensors: what is computed from them stays in the graph (the same
    computation on a plain buffer is folded)."""
    import operator

    from torch import fx
    from accelc.passes import fold_weights

    def graph(w):
        root = nn.Module()
        root.register_buffer("w", w)
        g = fx.Graph()
        x, wn = g.placeholder("x"), g.get_attr("w")
        doubled = g.call_function(operator.mul, (wn, 2.0))
        g.output(g.call_function(operator.mul, (x, doubled)))
        for n, value in ((wn, w), (doubled, w * 2.0)):      # (the values capture records)
            meta.set_tensor_meta(n, value)
        return fx.GraphModule(root, g)

    w = torch.rand(12)
    assert fold_weights.PASS.transform(graph(w), None) == 1
    assert fold_weights.PASS.transform(graph(torch.Tensor._make_subclass(Sharded, w)), None) == 0
