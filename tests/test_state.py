"""Whose weights and state: the optimized module owns a snapshot of the model's weights, the
caller's model is never run or changed by optimize(), and buffers updated in forward are updated
by the optimized module exactly as eager updates them."""
import pytest
import torch
from torch import nn

import accelc
from accelc.errors import InputError
from conftest import DEVICE, rel_l2


class _ConvLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


def _randomize_bn(model):
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model


def test_later_changes_to_the_model_never_reach_the_optimized_module():
    """One rule for every layer (convs are packed and BN-folded, linears are not): a snapshot."""
    model = _randomize_bn(_ConvLinear()).to(DEVICE).eval()
    x = torch.randn(2, 16, 6, 6, device=DEVICE)
    opt = accelc.optimize(model, x, accelc.OptimizeConfig(only_if_faster=False))
    assert {r.kind for r in opt.rewritten} >= {"conv2d", "linear"}, opt.summary()
    with torch.no_grad():
        before = opt(x).clone()
        model.load_state_dict(_randomize_bn(_ConvLinear()).state_dict())       # new weights
        model.fc.weight.mul_(3.0)                                              # an in-place update
        changed = model(x)
        after = opt(x)
    assert rel_l2(changed, before) > 0.1           # the model did change ...
    assert torch.equal(after, before)              # ... and the optimized module did not


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", torch.zeros(8))

    def forward(self, x):
        self.calls.add_(1)
        self.total += x.detach().sum(0)
        return torch.relu(self.fc(x))


def test_buffers_updated_in_forward_are_updated_once_a_call():
    model = _Counting().to(DEVICE).eval()
    x = torch.randn(3, 8, device=DEVICE)
    opt = accelc.optimize(model, x, accelc.OptimizeConfig(only_if_faster=False))
    assert model.calls.item() == 0 and not model.total.any()     # optimize() never ran the caller's model
    assert [r.kind for r in opt.rewritten] == ["linear"], opt.summary()
    gm = opt.graph_module
    assert gm.calls.item() == 0 and not gm.total.any()           # the optimized copy starts from the model's state
    with torch.no_grad():
        for i in range(1, 4):
            out = opt(x)
            model(x)
            assert gm.calls.item() == i == model.calls.item()
            assert torch.allclose(gm.total, model.total)
        assert rel_l2(out, model(x)) < 1e-5
    assert "updates module state in place: calls, total" in opt.info.runtime


class _SetThenAdvance(nn.Module):
    """A buffer set from an input, read, and advanced in place through the set's result (what a
    static KV cache's length does each step)."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("length", torch.zeros((), dtype=torch.int64))

    def forward(self, x, start):
        n = self.length.copy_(start)
        y = self.fc(x) * (n + 1)
        n.add_(x.shape[0])       # the written tensor's alias, read by nothing after: still the buffer
        m = self.length.copy_(start).to(torch.int64)    # a conversion to its own dtype: the buffer too
        m.add_(2 * x.shape[0])
        return torch.relu(y)


def test_an_update_through_an_in_place_ops_result_stays_in_place():
    """add_ on copy_'s result writes the buffer copy_ wrote: canonical form must not make it an
    out-of-place add that nothing reads (the buffer would silently keep its old value)."""
    model = _SetThenAdvance().to(DEVICE).eval()
    x, start = torch.randn(3, 8, device=DEVICE), torch.tensor(5, device=DEVICE)
    opt = accelc.optimize(model, (x, start), accelc.OptimizeConfig(only_if_faster=False))
    with torch.no_grad():
        for s in (2, 7):
            start = torch.tensor(s, device=DEVICE)
            out, want = opt(x, start), model(x, start)
            assert opt.graph_module.length.item() == s + 6 == model.length.item()
            assert rel_l2(out, want) < 1e-5


class _Holder:
    """Not a module: a tensor held here is one the capture reaches as an object's attribute."""

    def __init__(self, t):
        self.t = t


class _WrittenAsBufferReadAsAttribute(nn.Module):
    replayable_state = True      # set from the input each call: a replay writes the same value

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("start", torch.zeros((), dtype=torch.int64))
        self.holder = _Holder(self.start)

    def forward(self, x, start):
        self.start.copy_(start)                        # written as the module's buffer ...
        return self.fc(x) * (self.holder.t + 1)        # ... read as the object's attribute


def test_a_tensor_captured_twice_and_written_keeps_its_order_with_eager_glue():
    """torch.export holds a tensor reached by two paths as two constants over one memory. Inductor
    would take them for independent and may read the one before the write of the other (silently a
    step behind): the glue runs eager, in the graph's order, and the runtime line says why. torch 2.11's export holds
    it once: there only the numbers are checked."""
    from accelc.capture import aliased_state

    model = _WrittenAsBufferReadAsAttribute().to(DEVICE).eval()
    x = torch.randn(3, 8, device=DEVICE)
    opt = accelc.optimize(model, (x, torch.tensor(2, device=DEVICE)), accelc.OptimizeConfig(glue="inductor"))
    aliased = aliased_state(opt.graph_module)
    with torch.no_grad():
        for s in (4, 9):
            start = torch.tensor(s, device=DEVICE)
            assert rel_l2(opt(x, start), model(x, start)) < 1e-5
    if aliased:
        assert "eager glue: the forward writes" in opt.info.runtime, opt.info.runtime
    else:  # torch 2.11's export holds the tensor once (the device's image): nothing to order, the glue may compile
        assert "eager glue: the forward writes" not in opt.info.runtime, opt.info.runtime
        assert torch.__version__ < "2.13", "torch 2.13 (CI's) holds the tensor twice: the case is tested there"


def test_in_place_update_of_a_caller_input_is_refused_naming_it():
    """x.add_(1) on an input changes the caller's tensor in eager, which a CUDA graph's static
    input copy would not do: refused, in one sentence that names the input."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            x.add_(1.0)
            return self.fc(x)

    with pytest.raises(accelc.CaptureError, match="changes its input 0 in place"):
        accelc.optimize(M().to(DEVICE).eval(), torch.randn(2, 8, device=DEVICE))


@pytest.mark.parametrize("make,match", [
    (lambda: torch.randn(0, 16), "is empty"),
    (lambda: torch.full((4, 16), float("nan")), "NaN or inf"),
    (lambda: torch.tensor([[1.0, float("inf")] * 8] * 4), "NaN or inf"),
])
def test_example_inputs_without_numbers_to_check_on_are_refused(make, match):
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).to(DEVICE).eval()
    with pytest.raises(InputError, match=match):
        accelc.optimize(model, make().to(DEVICE))


def test_a_shape_the_program_does_not_take_is_one_clear_error():
    """A torch.export program fixed at batch 4, optimized, called at batch 3: accelc's error, not
    torch's bare shape guard (and never a wrong number)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU()).to(DEVICE).eval()
    ep = torch.export.export(model, (torch.randn(4, 16, device=DEVICE),), strict=False)
    opt = accelc.optimize(ep.module(), torch.randn(4, 16, device=DEVICE))
    # (the input, the dim, what it is and the size the program fixes: the any-shape issue's wording)
    with pytest.raises(InputError, match=r"^input dim 0 is 3: the model fixes it at 4$"):
        opt(torch.randn(3, 16, device=DEVICE))


class _Slots(nn.Module):
    """Writes its input at given slots of a buffer: run again on the same inputs, the same state."""
    replayable_state = True

    def __init__(self):
        super().__init__()
        self.register_buffer("slots", torch.zeros(8, 4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x, at):
        self.slots.index_copy_(0, at, x)
        return self.fc(self.slots).sum(0)


def test_replayable_state_may_run_in_cuda_graphs_and_an_accumulating_one_may_not(monkeypatch):
    """plan() on a GPU (stood in): a graph whose in-place updates accumulate runs as plain calls;
    one whose model declares them replayable (a static KV cache) keeps CUDA graphs and the glue,
    and still updates its state as eager does."""
    from accelc import runner, runtime

    counting = accelc.optimize(_Counting().to(DEVICE).eval(), torch.randn(3, 8, device=DEVICE))
    slots = _Slots().to(DEVICE).eval()
    x, at = torch.randn(2, 4, device=DEVICE), torch.tensor([1, 5], device=DEVICE)
    opt = accelc.optimize(slots, (x, at))
    assert opt.graph_module.meta.get(runner.REPLAYABLE_STATE) is True
    assert not counting.graph_module.meta.get(runner.REPLAYABLE_STATE)
    monkeypatch.setattr(runtime, "can_time", lambda device: True)
    cfg = accelc.OptimizeConfig(glue="inductor")
    assert runner.plan(cfg, DEVICE, counting.graph_module)[:2] == ("eager", False)
    assert runner.plan(cfg, DEVICE, opt.graph_module)[:2] == ("inductor", True)
    monkeypatch.undo()
    with torch.no_grad():
        for _ in range(2):
            y = torch.randn(2, 4, device=DEVICE)
            out, ref = opt(y, at), slots(y, at)
            assert torch.equal(opt.graph_module.slots, slots.slots) and rel_l2(out, ref) < 1e-5
