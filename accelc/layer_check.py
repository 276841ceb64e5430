"""One layer's output judged (the guard's and the report's check): against eager PyTorch's output and its original
subgraph in higher precision, on the same inputs; float layers by relative L2 error, quantized ones by SQNR
(accelc.guard's docstring has the rule)."""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import fx
from torch.utils import _pytree as pytree

from accelc.numerics import error_stats, higher_precision, sqnr_db, upcast_run
from accelc.records import LayerCheck


def reference(original: fx.GraphModule, ins: list):
    """A layer's original subgraph evaluated in higher precision (fp32 for half inputs, fp64 for
    fp32 ones): what the guard and the report measure every side against. Its floating weights and buffers
    taken in that precision for the call (torch.func.functional_call, as original.to(dtype) would hold them),
    the module itself neither copied nor changed: a deep copy generated the subgraph's code again at every
    check (1.65 of a cold Qwen2-0.5B LM optimize's 54 s main thread under py-spy, H200)."""
    leaves = [t for t in ins if isinstance(t, torch.Tensor) and t.is_floating_point()]
    low = leaves[0].dtype if leaves else torch.float32
    ref_dtype = higher_precision(low)
    held = {name: t.to(ref_dtype) for name, t in (*original.named_parameters(), *original.named_buffers())
            if t.is_floating_point() or t.is_complex()}
    up = [t.to(ref_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ins]
    try:
        return torch.func.functional_call(original, held, tuple(up))
    except RuntimeError as e:
        # a cast inside the layer to the model's own precision (Gemma's `x.float()` and `.type_as(x)` in an fp32
        # model) met a weight held in the higher one: its ops run as the whole-model reference runs them, every
        # `low` tensor and dtype taken in the higher precision, its float casts none
        if "dtype" not in str(e):
            raise
        return upcast_run(torch.func.functional_call, original, held, tuple(up), low=low, keep=_CASTS)


_CASTS = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)


def verdict(rel: float, eager_rel: float, tol: float, config, quantized: bool) -> str:
    """Why a layer with this error fails the guard ("" if it passes): int8 layers against the
    SQNR floor, float layers against max(tol, eager_error_factor x eager's error)."""
    if quantized:
        sqnr, floor = sqnr_db(rel), config.quantized.sqnr_floor
        return "" if sqnr >= floor else f"{quantized_format(config)} SQNR {sqnr:.1f} dB under the floor {floor:g} dB"
    limit = max(tol, config.eager_error_factor * eager_rel)
    return "" if rel <= limit else (f"error {rel:.2e} over tolerance {limit:.2e} (floor {tol:.1e}, "
                                    f"eager's own error {eager_rel:.2e})")


# an fp8 kernel's error at most this multiple of the format's own (#92): what its kernels may add to e4m3's rounding
FORMAT_FACTOR = 1.1
FP8_OPS = {torch.ops.accelc.linear_fp8w.default, torch.ops.accelc.gated_linear_fp8w.default,
           torch.ops.accelc.linear_fp8.default, torch.ops.accelc.gated_linear_fp8.default}


def within_the_format(check: LayerCheck, floor_out, ref) -> LayerCheck:
    """An fp8 layer's check against the format's own error: the same layer from the same quantized operands and
    scales computed in fp64 (the kernel's reference, rounded to the output's dtype as the kernel's output is) against
    the higher-precision float reference. The kernel's error passes within FORMAT_FACTOR times it (or the dtype's
    floor above it, where the format's error is ~0); past it the kernel adds error of its own, and fails."""
    floor = error_stats(floor_out, ref)[0]
    limit = max(FORMAT_FACTOR * floor, floor + check.tolerance)
    check = dataclasses.replace(check, format_rel_error=floor)
    if not check.passed or check.rel_error <= limit:
        return check
    return dataclasses.replace(check, passed=False, reason=(
        f"fp8 error {check.rel_error:.2e} over {FORMAT_FACTOR:g}x the format's own {floor:.2e} (the same quantized "
        "operands and scales in fp64): the kernel adds error of its own"))


def probed(op, reference_of, a, kw, check: LayerCheck, config) -> LayerCheck:
    """A blind layer (its output 0 everywhere in higher precision too: zero weights, as a zero-initialised norm's or
    a last BN's in a residual block) checked on non-zero probes: each of its kernel's float operands that is 0
    everywhere drawn at random (its strides kept), the kernel against its own PyTorch reference (`reference_of`,
    kernels.REFERENCES's) on them, that reference computed in fp64 the higher-precision one. The layer fails where
    the kernel is off; a reference that cannot run in fp64 leaves the check as it was."""
    gen = torch.Generator().manual_seed(0)

    def probe(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not bool(t.any()):
            drawn = torch.empty_like(t)
            drawn.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.1)
            return drawn
        return t

    def up(t):
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    pa, pkw = pytree.tree_map(probe, (tuple(a), dict(kw)))
    try:
        ref = reference_of(*pytree.tree_map(up, pa), **pytree.tree_map(up, pkw))
    except Exception:        # (a reference that takes no fp64 operand)
        return check
    out, eager = op(*pa, **pkw), reference_of(*pa, **pkw)
    seen = compare(out, eager, ref, pa, config)
    if seen.passed:
        return dataclasses.replace(check, probe_rel_error=seen.rel_error)
    return dataclasses.replace(check, passed=False, probe_rel_error=seen.rel_error, reason=(
        f"its weights are 0, so the layer was checked on non-zero probe weights, where the kernel is off its "
        f"reference: {seen.reason}"))


def quantized_format(config) -> str:
    return "int8" if config.int8 is not None else "fp8"


def compare(out, eager, ref, ins, config, quantized=False) -> LayerCheck:
    """The check of one layer's output `out` (eager's `eager`, the reference `ref`, both on the
    inputs `ins`)."""
    outs, eagers, refs = pytree.tree_leaves(out), pytree.tree_leaves(eager), pytree.tree_leaves(ref)
    dtype = eagers[0].dtype
    tol = config.tolerance_for(dtype)
    for o, e in zip(outs, eagers):
        if o.shape != e.shape or o.dtype != e.dtype:
            return LayerCheck(False, math.nan, math.nan, math.nan, tol, _shapes(ins), dtype,
                              f"output {tuple(o.shape)} {o.dtype} != eager {tuple(e.shape)} {e.dtype}")
    finite_ok = all(bool((torch.isfinite(o) | ~torch.isfinite(r)).all()) for o, r in zip(outs, refs))
    rel, max_abs = error_stats(out, ref)
    eager_rel = error_stats(eager, ref)[0]
    reason = ("non-finite output where the reference is finite" if not finite_ok
              else verdict(rel, eager_rel, tol, config, quantized))
    blind = not any(bool(r.any()) for r in refs if isinstance(r, torch.Tensor))     # (a zero-initialised norm's)
    return LayerCheck(not reason, rel, eager_rel, max_abs, tol, _shapes(ins), dtype, reason, sqnr_db(rel), blind)


def _shapes(ins):
    return tuple(tuple(t.shape) for t in ins if isinstance(t, torch.Tensor))


def failed(ins, eager, config, reason) -> LayerCheck:
    """The check of a layer whose kernel did not run (`reason`)."""
    dtype = eager.dtype if isinstance(eager, torch.Tensor) else None
    return LayerCheck(False, math.nan, math.nan, math.nan,
                      config.tolerance_for(dtype) if dtype else math.nan, _shapes(ins), dtype, reason)
