"""How far apart two outputs are, and how far apart they may be: the measures and the one table of
dtype tolerances that the capture check, the guard, the report, the benches and the tests share."""
from __future__ import annotations

import math

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

# A few roundings of each dtype, as a relative L2 error against a higher-precision reference: fp16
# rounds at 2^-11 ~ 4.9e-4 and bf16 at 2^-8 ~ 3.9e-3 per element, and an output is a few roundings
# away. What may differ by purpose is the fp32 entry (the guard allows 1e-4 for reassociated sums
# over long reductions: accelc.config.DEFAULT_TOLERANCES; a kernel tested alone 1e-6).
REL_L2_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}

# A whole model's output (not one layer's) compounds a few roundings per layer: a deep half-precision
# model passes its dtype's floor where only rounding separates two correct computations of it (the
# graph a tracer took against eager, a padded call against an unpadded one). Such a comparison also
# passes within EAGER_ERROR_FACTOR x the model's own error against the model computed in higher
# precision (upcast_run), as the guard judges a layer, up to OWN_ERROR_CAP x the floor: an "own
# error" past that may be no rounding (a model drawing random numbers differs from any rerun), unless
# a rerun shows the model deterministic: then it is rounding however far many layers compound it (a
# Llama-3-70B shape's 80 layers in fp16 on four GPUs: 2.9e-2), and the cap is lifted.
EAGER_ERROR_FACTOR = 2.0
OWN_ERROR_CAP = 10.0


def whole_model_limit(floor: float, own_error: float, deterministic: bool = False) -> float:
    """The largest relative L2 difference two correct computations of a whole model may show, given
    its dtype's floor and the model's own error against higher precision (see above); deterministic:
    a rerun of the model gave its output again (within the floor), and the cap does not apply."""
    cap = math.inf if deterministic else OWN_ERROR_CAP * floor
    return max(floor, min(EAGER_ERROR_FACTOR * own_error, cap))


def rel_l2(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp64 (the plain norm of out - ref where ref is all zeros). out and
    ref may be tensors, or tuples / lists of tensors taken together."""
    outs, refs = (out, ref) if isinstance(ref, (tuple, list)) else ((out,), (ref,))
    num = math.sqrt(sum(((o.double() - r.double()).norm() ** 2).item() for o, r in zip(outs, refs, strict=True)))
    denom = math.sqrt(sum((r.double().norm() ** 2).item() for r in refs))
    return num / denom if denom > 0 else num


def output_error(got, expected) -> float:
    """The worst relative L2 error over the floating-point tensors of an output."""
    errs = [rel_l2(g, e) for g, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected))
            if isinstance(e, torch.Tensor) and e.is_floating_point()]
    return max(errs) if errs else 0.0


def sqnr_db(rel_error: float) -> float:
    """Signal-to-quantization-noise ratio in dB from a relative L2 error."""
    if math.isnan(rel_error):
        return math.nan
    return math.inf if rel_error == 0 else -20.0 * math.log10(rel_error)


def error_stats(out, ref) -> tuple[float, float]:
    """(relative L2, max abs error) of `out` against `ref` where `ref` is finite; the worst over
    the outputs' tensors. Each tensor's sums are read back from the device once (the guard checks every layer at
    every size: a boolean index and a read-back each were eight waits for the GPU a check)."""
    rel = max_abs = 0.0
    for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        if o.shape != r.shape:     # (never broadcast one onto the other)
            raise ValueError(f"error of a {tuple(o.shape)} output against a {tuple(r.shape)} reference")
        finite = torch.isfinite(r)
        outside = ~finite
        diff = o.to(r.device, torch.float64, copy=True).sub_(r).masked_fill_(outside, 0.0)   # (in place: a
        kept = r.to(torch.float64, copy=True).masked_fill_(outside, 0.0)                      # logits' size twice)
        worst = diff.abs().amax() if diff.numel() else diff.new_zeros(())
        num2, den2, top, any_finite = torch.stack(
            [diff.norm() ** 2, kept.norm() ** 2, worst, finite.any().double()]).tolist()
        num, den = math.sqrt(num2), math.sqrt(den2)
        rel = max(rel, num / den if den > 0 else num)
        if any_finite:
            max_abs = max(max_abs, top)
    return rel, max_abs


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise the same values, NaN equal to NaN (two runs of a deterministic kernel, a buffer
    before and after a forward)."""
    if a.shape != b.shape:
        return False
    return torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))


class _Upcast(TorchFunctionMode):
    """Every op sees `low` tensors as `high` ones and a `low` dtype argument as `high` (x.to(fp16),
    torch.zeros(..., dtype=fp16)); results and dtypes read off tensors (a parameter's .dtype) come
    back as `high`, and x.half() (for low fp16; .bfloat16() for bf16) keeps x as it is. Parameters
    are converted op by op, so the model is never copied whole."""

    _KEEP = {torch.float16: torch.Tensor.half, torch.bfloat16: torch.Tensor.bfloat16}

    def __init__(self, low: torch.dtype, high: torch.dtype, keep: tuple = ()):
        super().__init__()
        self.low, self.high = low, high
        self.keep = {self._KEEP.get(low), *keep} - {None}     # casts that keep x as it is

    def _up(self, x):
        if isinstance(x, torch.Tensor) and x.dtype == self.low:
            return x.to(self.high)
        return self.high if x is self.low else x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map(self._up, (tuple(args), dict(kwargs or {})))
        if func in self.keep and args:
            return args[0]
        return pytree.tree_map(self._up, func(*args, **kwargs))


def higher_precision(low: torch.dtype) -> torch.dtype:
    """The dtype a reference computes in: fp32 for half precisions, fp64 for fp32."""
    return torch.float64 if low in (torch.float32, torch.float64) else torch.float32


def upcast_run(fn, *args, low: torch.dtype = torch.float16, keep: tuple = (), **kwargs):
    """fn(*args, **kwargs) computed in higher precision: every `low` tensor and dtype in the ops it
    runs taken as fp32 (fp64 for low fp32). The whole-model reference the capture check measures
    eager's own error against (the guard's per-layer reference, for a model run through Python).
    keep: more casts that leave x as it is (x.float() in an fp32 layer's reference)."""
    with torch.no_grad(), _Upcast(low, higher_precision(low), keep):
        return fn(*args, **kwargs)
