"""Cases that once gave wrong numbers without a word (#57's third round): one tensor given as two
inputs, a branch on a size the capture never traced. Each optimized model must match eager on
later calls with other tensors, or refuse the call in one line."""
import pickle

import pytest
import torch
from torch import nn

import accelc
from accelc.capture.shapes import InputShapes
from accelc.errors import InputError
from conftest import DEVICE, rel_l2


class TwoInputs(nn.Module):
    """Two inputs, each through its own layer; `branch`: a branch on the batch (torch.export captures it)."""

    def __init__(self, branch=False):
        super().__init__()
        self.a, self.b, self.branch = nn.Linear(32, 32), nn.Linear(32, 32), branch

    def forward(self, x, y):
        out = self.a(x) + torch.relu(self.b(y))
        return out if not self.branch or x.shape[0] > 0 else out * 2


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, *xs):
        return self.a(xs[0]) * self.b(xs[1]).sigmoid()


@pytest.mark.parametrize("model,example", [
    (TwoInputs(branch=True), "same"),          # torch.export: it merged the two inputs into one
    (TwoInputs(), "same"),                      # symbolic_trace
    (VarArgs(), "same"),
    (TwoInputs(branch=True), "view"),          # the second input a view of the first's memory
])
def test_one_tensor_given_as_two_inputs_stays_two_inputs(model, example):
    model = model.to(DEVICE).eval()
    x = torch.randn(4, 32, device=DEVICE)
    y = x if example == "same" else x.view(4, 32)
    opt = accelc.optimize(model, (x, y))
    for b in (4, 3):
        x2, y2 = torch.randn(b, 32, device=DEVICE), torch.randn(b, 32, device=DEVICE)
        with torch.no_grad():
            assert rel_l2(opt(x2, y2), model(x2, y2)) < 1e-5
    assert opt(x, x).shape == (4, 32)      # the example's own call, aliased, still right
    with torch.no_grad():
        assert rel_l2(opt(x, x), model(x, x)) < 1e-5


def test_a_dict_example_with_one_tensor_under_two_names():
    """A training-style batch: {"input_ids": ids, "labels": ids} (labels shift inside the model)."""
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(50, 32), nn.Linear(32, 50)

        def forward(self, input_ids, labels=None):
            logits = self.head(self.emb(input_ids))
            if labels is None or input_ids.shape[0] == 0:    # (a branch on a size: torch.export captures it, as HF's)
                return logits
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1))
            return logits, loss

    model = LM().to(DEVICE).eval()
    ids = torch.randint(0, 50, (2, 12), device=DEVICE)
    opt = accelc.optimize(model, {"input_ids": ids, "labels": ids})
    ids2, labels2 = torch.randint(0, 50, (2, 12), device=DEVICE), torch.randint(0, 50, (2, 12), device=DEVICE)
    with torch.no_grad():
        (logits, loss), (ref_logits, ref_loss) = opt(input_ids=ids2, labels=labels2), model(ids2, labels2)
    assert rel_l2(logits, ref_logits) < 1e-5 and rel_l2(loss, ref_loss) < 1e-5


class SizeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(32, 32)

    def forward(self, x):
        return self.l(x) if x.shape[0] > 1 else 2 * self.l(x)


def test_a_branch_on_the_batch_size_keeps_the_range_where_the_model_runs_the_traced_way(tmp_path):
    """Optimized at batch 2, a model that runs another way at batch 1: batch 1 is refused in one line
    naming why (not run on the batch>1 branch), by the module, its saved program and that one pickled;
    the summary does not claim a check at batch 1."""
    model = SizeBranch().to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(2, 32, device=DEVICE),))
    assert "x 2..any x 32" in opt.info.shapes and "1x32" not in opt.info.shapes, opt.info.shapes
    accelc.save(opt, tmp_path / "m.pt2")
    loaded = accelc.load(tmp_path / "m.pt2")
    for module in (opt, loaded, pickle.loads(pickle.dumps(loaded))):
        with pytest.raises(InputError, match=r"x dim 0 is 1: at least 2: the model computes another way at 1"):
            module(torch.randn(1, 32, device=DEVICE))
        x = torch.randn(5, 32, device=DEVICE)
        with torch.no_grad():
            assert rel_l2(module(x), model(x)) < 1e-5


class HalvesBranch(SizeBranch):
    """The fuzzer's seed 566 (2026-11-27, H200): a view that halves the last dim, whose program holds a
    guard relating every dim (`x.size()[1] * x.size()[2] * x.size()[0] == 2 * ...`); its term
    `x.size()[0] == 2` was read as the batch's own bound, fixed the batch at 2 and dropped the kept lower
    end: batch 1 ran the batch>1 branch, silently wrong."""

    def forward(self, x):
        B, L, D = x.shape
        h = x.view(B, L, 2, D // 2).transpose(-1, -2).reshape(B, L, D)
        return self.l(h) if x.shape[0] > 1 else 2 * self.l(h)


def test_a_branch_on_the_batch_behind_a_halving_view_still_refuses_batch_one():
    model = HalvesBranch().to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(4, 8, 32, device=DEVICE),))
    with pytest.raises(InputError, match=r"x dim 0 is 1: at least 2: the model computes another way at 1"):
        opt(torch.randn(1, 8, 32, device=DEVICE))
    x = torch.randn(3, 6, 32, device=DEVICE)
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


def test_a_term_of_a_guard_relating_dims_is_no_bound_of_one_dim():
    from accelc.capture.shapes import DimRange

    s = InputShapes(("x",), ((DimRange(2, None, "s0"), DimRange(1, None, "s1")),))
    assert s.narrowed("Guard failed: x.size()[1] * x.size()[0] == 2 * x.size()[1] * (x.size()[0] // 2)") is None
    assert s.narrowed("Guard failed: 2 * x.size()[0] <= 64") is None
    assert s.narrowed("Guard failed: x.size()[0] <= 64\nfrom user code: ...").dims[0][0] == DimRange(2, 64, "s0")


def test_a_model_the_same_at_every_size_still_takes_batch_one():
    class NoBranch(SizeBranch):
        def forward(self, x):
            return self.l(x) if x.shape[-1] == 32 else x     # export's path; the same at every batch
    model = NoBranch().to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(2, 32, device=DEVICE),))
    assert opt.info.capture_method == "torch.export" and "x 1..any x 32" in opt.info.shapes, opt.info.shapes
    x = torch.randn(1, 32, device=DEVICE)
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


def test_a_branch_on_the_batch_optimized_at_batch_one_is_captured_at_its_own_shapes():
    """torch.export traces a batch of one as two; where the model runs another way at one, the example's
    own shapes are traced instead (it was a capture failure): batch 1 right, another batch refused."""
    model = SizeBranch().to(DEVICE).eval()
    x = torch.randn(1, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5
    with pytest.raises(InputError, match="x dim 0 is 3"):
        opt(torch.randn(3, 32, device=DEVICE))


def test_batch_one_refused_by_the_programs_own_guard_names_the_program_not_the_model():
    """HF's Swin traced at batch 2: torch.export's program guards a size computed from the batch (its windows) as
    never 1, and refuses batch 1, where the model runs. The refusal had said the model computes another way at 1
    (#88.6); it names the program's trace now. Batch 3 is served with eager's numbers."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = T.SwinModel(T.SwinConfig(image_size=16, patch_size=4, embed_dim=8, depths=[1], num_heads=[1],
                                     window_size=2)).to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(2, 3, 16, 16, device=DEVICE),))
    one = torch.randn(1, 3, 16, 16, device=DEVICE)
    with torch.no_grad():
        model(one)                                  # (the model runs at 1)
    with pytest.raises(InputError, match=r"dim 0 is 1: at least 2: torch.export's program, traced at 2, takes no 1 "
                                         r"there .* where the model itself runs"):
        opt(one)
    three = torch.randn(3, 3, 16, 16, device=DEVICE)
    with torch.no_grad():
        assert rel_l2(opt(three)[0].double(), model(three)[0].double()) < 1e-4
