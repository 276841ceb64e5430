"""passes/fold_bn.py: BatchNorm folded into the conv before it."""
import torch
import torch.nn.functional as F
from torch import nn

from accelc.passes.fold_bn import fold
from conftest import rel_l2


def test_bn_folding_is_exact_up_to_rounding():
    torch.manual_seed(1)
    cv, bn = nn.Conv2d(6, 10, 3, bias=True).double(), nn.BatchNorm2d(10).double().eval()
    bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.2, 2), bn.weight.data.uniform_(0.5, 2)
    w, b = fold(cv.weight, cv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
    x = torch.randn(2, 6, 9, 9, dtype=torch.float64)
    assert rel_l2(F.conv2d(x, w, b), bn(cv(x))) < 1e-14
    w16, b16 = fold(cv.weight.half(), None, bn.running_mean.half(), bn.running_var.half(), bn.weight.half(),
                    bn.bias.half(), bn.eps)  # folded in fp32, stored once in fp16
    ref16, _ = fold(cv.weight.half().double(), None, bn.running_mean.half().double(),
                    bn.running_var.half().double(), bn.weight.half().double(), bn.bias.half().double(), bn.eps)
    assert w16.dtype == torch.float16 and rel_l2(w16, ref16) < 1e-3


class _BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d: BN and its activation in one module, asserting its input's rank first
    (an extra reader of the conv's output)."""

    def __init__(self, c):
        super().__init__(c)
        self.act = nn.SiLU()

    def forward(self, x):
        torch._assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.1, self.eps)
        return self.act(x)


def test_a_bn_act_module_that_asserts_its_inputs_rank_still_folds_into_the_conv():
    import warnings

    import accelc
    from conftest import DEVICE

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn = _BatchNormAct2d(8)

        def forward(self, x):
            return self.bn(self.conv(x))
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2)
    model = model.to(DEVICE)
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(model, (x,))
    rows = [(r.name, r.kernel, r.status) for r in opt.layers]
    assert rows == [("conv+bn+bn.act", "accelc::conv2d[silu]", "rewritten")], rows    # the assert: glue, not a layer
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


def test_a_shape_read_that_the_chain_itself_uses_stays_where_it_is():
    """x.shape read off the conv's output and fed to a reshape inside the conv -> BN -> relu chain:
    the read cannot move past the node it feeds (the graph would read a value before it exists)."""
    import warnings

    import accelc
    from conftest import DEVICE

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x):
            x = self.conv(x)
            b, c, h, w = x.shape
            return F.relu(self.bn(x).reshape(b, c, h, w)).flatten(1)
    model = Net().eval().to(DEVICE)
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(model, (x,))
    assert opt.layers[0].kernel.startswith("accelc::conv2d")
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5
