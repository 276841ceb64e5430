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
