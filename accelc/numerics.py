"""How far apart two outputs are: the measures the capture check, the guard and the report share."""
from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (the plain norm of out - ref where ref is all zeros)."""
    ref64 = ref.double()
    denom = ref64.norm().item()
    num = (out.double() - ref64).norm().item()
    return num / denom if denom > 0 else num


def sqnr_db(rel_error: float) -> float:
    """Signal-to-quantization-noise ratio in dB from a relative L2 error."""
    if math.isnan(rel_error):
        return math.nan
    return math.inf if rel_error == 0 else -20.0 * math.log10(rel_error)


def error_stats(out, ref) -> tuple[float, float]:
    """(relative L2, max abs error) of `out` against `ref` where `ref` is finite; the worst over
    the outputs' tensors."""
    rel = max_abs = 0.0
    for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        finite = torch.isfinite(r)
        o = o.to(r.device)
        rel = max(rel, rel_l2(o[finite], r[finite]))
        if finite.any():
            max_abs = max(max_abs, (o[finite].double() - r[finite].double()).abs().max().item())
    return rel, max_abs


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise the same values, NaN equal to NaN (two runs of a deterministic kernel, a buffer
    before and after a forward)."""
    if a.shape != b.shape:
        return False
    return torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))
