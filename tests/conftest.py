import math
import os

import pytest
import torch

# on a GPU the guard would keep these tests' tiny layers in PyTorch (faster there): tests that are
# about that choice set OptimizeConfig(only_if_faster=True) themselves
os.environ.setdefault("ACCELC_ONLY_IF_FASTER", "0")

import accelc  # noqa: F401  (sets TRITON_INTERPRET=1 when there is no GPU, registers the ops)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# LayerNorms are rewritten where the glue is eager: the default glue on a GPU is Inductor's, which
# keeps them to fuse with their neighbours (passes/norms.py)
NORMS_REWRITTEN = DEVICE.type != "cuda"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


# Floors for the relative L2 error against an fp64 reference: a few roundings of each dtype
# (fp32 2^-24, fp16 2^-11, bf16 2^-8).
REL_FLOOR = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close_to_ref(out, ref, eager, dtype, atol, rtol):
    """out / eager: the kernel's and eager PyTorch's results in `dtype`; ref: the same math in
    fp64. The kernel must be within (atol, rtol) of ref elementwise, and its relative L2 error
    at most 2x eager's own (or the dtype's floor)."""
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)
    err, eager_err = rel_l2(out, ref), rel_l2(eager, ref)
    assert err <= max(2 * eager_err, REL_FLOOR[dtype]), (err, eager_err)
    assert not math.isnan(err)
