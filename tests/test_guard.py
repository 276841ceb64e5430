"""accelc/guard.py: wrong or failing kernels put back, with the numbers; what the guard keeps alive."""
import pytest
import torch
from torch import nn

import accelc
from accelc.kernels import gemm
from conftest import DEVICE, rel_l2


def _model(name, dtype=torch.float32):
    return accelc.models.get(name).to(DEVICE, dtype)


def _broken_launch(*args, **kwargs):
    return gemm.linear_ref(*args[:6]) + 1.0  # right shape and dtype, wrong numbers


def test_guard_reverts_a_wrong_kernel(monkeypatch):
    monkeypatch.setattr(gemm, "linear_launch", _broken_launch)
    model = _model("mlp")
    (x,) = model.example_inputs()
    opt = accelc.optimize(model, (x,))
    assert opt.rewritten == []
    reverted = [r for r in opt.layers if r.status == "reverted"]
    assert len(reverted) == 4 and all("over tolerance" in r.reason for r in reverted)
    assert reverted[0].rel_error > 1e-2
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))  # the original layers are back, exactly
    assert not any(n.target == torch.ops.accelc.linear.default for n in opt.graph_module.graph.nodes)


def test_guard_reverts_a_kernel_that_raises(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("out of resources")
    monkeypatch.setattr(gemm, "linear_launch", boom)
    model = _model("transformer_mlp")
    opt = accelc.optimize(model, model.example_inputs())
    rows = [r for r in opt.layers if r.status == "reverted"]
    assert len(rows) == 8 and "kernel failed: RuntimeError: out of resources" in rows[0].reason


class TransposedWeight(nn.Module):
    """A weight read through a transposed view: the original layer reads W.T, the rewritten one
    t(W.T). The guard must keep W.T alive until the layer has run (it used to free it after
    t(W.T) and fail with the node's name as the whole message)."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.W = nn.Parameter(torch.randn(12, 20) / 20 ** 0.5)
        self.emb = nn.Embedding(12, 20)

    def forward(self, x, w=None):
        if self.style == "W.T":
            return x @ self.W.T
        if self.style == "W.t()":
            return torch.relu(x @ self.W.t())
        if self.style == "transpose":
            return torch.matmul(x, self.W.transpose(0, 1)) + 1.0
        if self.style == "input":
            return x @ w
        return x @ self.emb.weight.T          # a tied LM head


@pytest.mark.parametrize("style", ["W.T", "W.t()", "transpose", "input", "tied"])
def test_weight_views_and_inputs_are_kept_alive_for_the_check(style):
    model = TransposedWeight(style).to(DEVICE).eval()
    args = (torch.randn(3, 7, 20, device=DEVICE),) + ((torch.randn(20, 12, device=DEVICE),) if style == "input" else ())
    opt = accelc.optimize(model, args)
    assert [r.kind for r in opt.rewritten] == ["linear"], opt.summary()
    assert not [r for r in opt.layers if r.status == "reverted"]
    with torch.no_grad():
        assert rel_l2(opt(*args), model(*args)) < 1e-5
