"""Guard: every rewritten layer checked on the example inputs before the user gets it.

The rewritten graph runs once; at each accelc node three things are computed from the same
inputs (the values eager PyTorch would give that layer):
  - the accelc kernel's output,
  - the original subgraph's output (eager PyTorch, in the model's dtype),
  - the original subgraph in higher precision (fp32 for half models, fp64 for fp32 ones).
The layer passes when ||accelc - ref|| / ||ref|| is within the dtype's floor or within
`eager_error_factor` x eager's own error against the same reference, and is finite where the
reference is. An int8 layer (Rewrite.quantized) is judged by its SQNR against the same reference
instead, 10 log10(||ref||^2 / ||accelc - ref||^2) dB, which must reach Int8Config.sqnr_floor.
The eager output is what flows on, so each layer is judged on its real inputs and one layer's
error does not leak into the next one's verdict.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from accelc.capture import flat_inputs


@dataclass
class LayerCheck:
    passed: bool
    rel_error: float          # accelc vs higher-precision reference, relative L2
    eager_rel_error: float    # eager PyTorch vs the same reference
    max_abs_error: float
    tolerance: float
    input_shapes: tuple
    dtype: torch.dtype | None
    reason: str = ""
    sqnr_db: float = math.nan       # vs the same reference


def sqnr_db(rel_error: float) -> float:
    """Signal-to-quantization-noise ratio in dB from a relative L2 error."""
    if math.isnan(rel_error):
        return math.nan
    return math.inf if rel_error == 0 else -20.0 * math.log10(rel_error)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.double()
    denom = ref64.norm().item()
    num = (out.double() - ref64).norm().item()
    return num / denom if denom > 0 else num


def check_layers(gm: fx.GraphModule, args: tuple, config, only=None) -> dict[fx.Node, LayerCheck]:
    """Check every rewritten node (or those in `only`) on `args`."""
    checks: dict[fx.Node, LayerCheck] = {}

    class _Guard(fx.Interpreter):
        def run_node(self, n):
            rw = n.meta.get("accelc")
            if rw is None or (only is not None and n not in only):
                if rw is not None:
                    return rw.original(*[self.env[i] for i in rw.inputs])
                return super().run_node(n)
            ins = [self.env[i] for i in rw.inputs]
            eager = rw.original(*ins)
            a, kw = self.fetch_args_kwargs_from_env(n)
            try:
                out = n.target(*a, **kw)
            except Exception as e:  # a kernel that fails to compile or launch is reverted, not fatal
                checks[n] = _failed(ins, eager, config, f"kernel failed: {type(e).__name__}: {e}")
                return eager
            checks[n] = _compare(out, eager, _reference(rw.original, ins), ins, config, rw.quantized)
            return eager

    with torch.no_grad():
        _Guard(gm).run(*flat_inputs(gm, args))
    return checks


def _reference(original: fx.GraphModule, ins: list):
    """The original layer evaluated in higher precision."""
    leaves = [t for t in ins if isinstance(t, torch.Tensor) and t.is_floating_point()]
    low = leaves[0].dtype if leaves else torch.float32
    ref_dtype = torch.float64 if low in (torch.float32, torch.float64) else torch.float32
    module = copy.deepcopy(original).to(ref_dtype)
    up = [t.to(ref_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ins]
    return module(*up)


def _shapes(ins):
    return tuple(tuple(t.shape) for t in ins if isinstance(t, torch.Tensor))


def _failed(ins, eager, config, reason):
    dtype = eager.dtype if isinstance(eager, torch.Tensor) else None
    return LayerCheck(False, math.nan, math.nan, math.nan,
                      config.tolerance_for(dtype) if dtype else math.nan, _shapes(ins), dtype, reason)


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


def verdict(rel: float, eager_rel: float, tol: float, config, quantized: bool) -> str:
    """Why a layer with this error fails the guard ("" if it passes): int8 layers against the
    SQNR floor, float layers against max(tol, eager_error_factor x eager's error)."""
    if quantized:
        sqnr, floor = sqnr_db(rel), config.int8.sqnr_floor
        return "" if sqnr >= floor else f"int8 SQNR {sqnr:.1f} dB under the floor {floor:g} dB"
    limit = max(tol, config.eager_error_factor * eager_rel)
    return "" if rel <= limit else (f"error {rel:.2e} over tolerance {limit:.2e} (floor {tol:.1e}, "
                                    f"eager's own error {eager_rel:.2e})")


def _compare(out, eager, ref, ins, config, quantized=False) -> LayerCheck:
    outs, eagers, refs = pytree.tree_leaves(out), pytree.tree_leaves(eager), pytree.tree_leaves(ref)
    dtype = eagers[0].dtype
    tol = config.tolerance_for(dtype)
    for o, e, r in zip(outs, eagers, refs):
        if o.shape != e.shape or o.dtype != e.dtype:
            return LayerCheck(False, math.nan, math.nan, math.nan, tol, _shapes(ins), dtype,
                              f"output {tuple(o.shape)} {o.dtype} != eager {tuple(e.shape)} {e.dtype}")
    finite_ok = all(torch.isfinite(o[torch.isfinite(r)]).all() for o, r in zip(outs, refs))
    rel, max_abs = error_stats(out, ref)
    eager_rel = error_stats(eager, ref)[0]
    reason = ("non-finite output where the reference is finite" if not finite_ok
              else verdict(rel, eager_rel, tol, config, quantized))
    return LayerCheck(not reason, rel, eager_rel, max_abs, tol, _shapes(ins), dtype, reason, sqnr_db(rel))


def layer_inputs(gm: fx.GraphModule, args: tuple, wanted=None) -> dict:
    """{rewritten node: (its original subgraph's inputs, (op args, op kwargs))} as one forward
    pass on `args` computes them (all rewritten nodes, or those in `wanted`)."""
    seen = {}

    class _Record(fx.Interpreter):
        def run_node(self, n):
            rw = n.meta.get("accelc")
            if rw is not None and (wanted is None or n in wanted):
                a, kw = self.fetch_args_kwargs_from_env(n)
                seen[n] = ([self.env[i] for i in rw.inputs], (a, kw))
            return super().run_node(n)

    with torch.no_grad():
        _Record(gm).run(*flat_inputs(gm, args))
    return seen
