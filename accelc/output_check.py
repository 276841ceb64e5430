"""The whole model's output, the guard's last line of defense (guard.settle's and guard.replay's last phase).

Every layer is checked alone on its own inputs, against its own original subgraph; a fault outside any layer (a
graph rewrite that changed the model, not a kernel: two stacked weights once given one name) passes every layer's
check and still changes the output. So before the module is built, its output on the example is compared with
eager's: far past what rounding gives (FAR times the whole-model limit that the padding and capture checks use, the
model's own error against higher precision counted, never under QUANTIZED_FLOOR for an int8 / fp8 model), the
rewritten layers go back to PyTorch in graph order, in doubling steps (1, 1, 2, 4, ... layers: one forward each),
until the output is within it, each layer's note saying why; and where it is still past with every layer back, the
rewrite is refused with the figures (an AccelcError), never returned. The check costs one forward on the example
where the output is within the dtype's limit alone; the model's run in higher precision only past it. A graph that
updates state in place (a call counter, a cache) is not judged so: its output moves from call to call; nor is a
tensor-parallel rank's (ranks decide alone, and one refusing alone would leave the others at their next collective).
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import fx
from torch.utils import _pytree as pytree

from accelc import meta, runtime, tensor_parallel
from accelc.capture.contract import mutated_state
from accelc.errors import WrongOutputError
from accelc.numerics import output_error, whole_model_limit
from accelc.rewrite import layers

log = logging.getLogger("accelc")

FAR = 10.0               # times the whole-model limit: well past rounding, however the layers compound it
QUANTIZED_FLOOR = 0.25   # an int8 / fp8 model's output error never judged a fault below this (SQNR 12 dB)


def _dtype(expected) -> torch.dtype | None:
    for t in pytree.tree_leaves(expected):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return None


def limit(ctx, dtype: torch.dtype, own: float | None) -> float:
    """How far from eager the whole output may be before it is a fault (module docstring); own: the model's own
    error against higher precision, None where not (yet) known."""
    bound = FAR * whole_model_limit(ctx.config.tolerance_for(dtype), own or 0.0, deterministic=True)
    return max(bound, QUANTIZED_FLOOR) if ctx.config.quantized is not None else bound


def defend(gm: fx.GraphModule, ctx, revert, put_back: dict, passed: dict | None = None) -> None:
    """The check (module docstring) on gm before guard._finish; revert(gm, ctx, node, reason) puts a layer back and
    records the decision; put_back / passed: the guard's checks by layer name / by node, moved as layers go back."""
    # not judged: a graph that updates state in place (its output moves call by call); a tensor-parallel rank's (its
    # collectives stand in locally while the guard decides, and a rank that refused alone would leave the others
    # waiting at their next collective)
    if ctx.output_budget is None or mutated_state(gm) or tensor_parallel.group_of(gm) is not None:
        return
    expected, reference = ctx.output_budget
    dtype = _dtype(expected)
    if dtype is None:
        return

    def error() -> float:       # (no state to put back after: a graph that updates any is not judged)
        gm.recompile()
        with torch.no_grad():
            return output_error(gm(*ctx.example_inputs), expected)

    err = error()
    if not err > limit(ctx, dtype, None):       # (NaN: eager's own NaN where the layers' checks allowed it)
        return
    try:
        own = output_error(expected, reference())
    except Exception:      # the model does not run in higher precision: its own error unknown
        own = None
    if own is None or math.isnan(own):
        runtime.warn_once(f"output-far-{id(gm)}", f"accelc: the optimized model's output is {err:.2g} (relative L2) "
                          f"from eager's on the example, past {limit(ctx, dtype, None):.2g}, and the model does not run "
                          "in higher precision to tell rounding from a fault; check its outputs")
        return
    bound = limit(ctx, dtype, own)
    if not err > bound:
        return
    first, order, step, done = err, layers(gm), 1, 0
    while err > bound and order:
        batch, order = order[:step], order[step:]
        for n in batch:
            rw = meta.rewrite_of(n)
            note = (f"the whole output was {first:.2g} from eager's (relative L2), past {bound:.2g} ({FAR:g}x what "
                    f"rounding gives, eager's own error {own:.2g}): layers back to PyTorch in graph order until within")
            check = (passed or {}).pop(n, None) or put_back.get(rw.layer)
            if check is not None:
                put_back[rw.layer] = dataclasses.replace(check, passed=False, reason=note)
            revert(gm, ctx, n, note)
        done += len(batch)
        step = max(1, done)
        err = error()
    if err > bound:
        raise WrongOutputError(
            f"accelc's rewritten graph gives an output {err:.2g} (relative L2) from eager's on the example inputs "
            f"with every layer back in PyTorch, past {bound:.2g} ({FAR:g}x what rounding gives, the model's own error "
            f"{own:.2g}): a graph rewrite changed the model; refused rather than returned (please report it with the "
            "model; OptimizeConfig(passes=...) without the pass that did it is a way around)")
    log.warning("accelc: the whole output was %.2g from eager's, past %.2g; layers put back in PyTorch until within "
                "(%.2g now): the summary's notes name them", first, bound, err)
