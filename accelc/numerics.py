"""How far apart two outputs are, and how far apart they may be: the measures and the one table of
dtype tolerances that the capture check, the guard, the report, the benches and the tests share."""
from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

# A few roundings of each dtype, as a relative L2 error against a higher-precision reference: fp16
# rounds at 2^-11 ~ 4.9e-4 and bf16 at 2^-8 ~ 3.9e-3 per element, and an output is a few roundings
# away. What may differ by purpose is the fp32 entry (the guard allows 1e-4 for reassociated sums
# over long reductions: accelc.config.DEFAULT_TOLERANCES; a kernel tested alone 1e-6).
REL_L2_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def rel_l2(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp64 (the plain norm of out - ref where ref is all zeros). out and
    ref may be tensors, or tuples / lists of tensors taken together."""
    outs, refs = (out, ref) if isinstance(ref, (tuple, list)) else ((out,), (ref,))
    num = math.sqrt(sum(((o.double() - r.double()).norm() ** 2).item() for o, r in zip(outs, refs, strict=True)))
    denom = math.sqrt(sum((r.double().norm() ** 2).item() for r in refs))
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
