"""Whether a captured graph reproduces the model it came from: the check every tracer's graph
passes before accelc takes it (accelc.capture.trace)."""
from __future__ import annotations

import contextlib
import io
import logging

import torch
from torch import fx
from torch.utils import _pytree as pytree

from accelc import tensor_parallel
from accelc.capture.shapes import SHAPES, guard_failure
from accelc.numerics import EAGER_ERROR_FACTOR, OWN_ERROR_CAP, REL_L2_FLOOR, rel_l2, whole_model_limit

log = logging.getLogger("accelc")

# How far a correct captured graph may differ from the model (the same ops, possibly regrouped,
# decomposed, or given another kernel by the tracer: an SDPA with an all-zero mask where eager took
# none), relative L2 per output tensor: a few roundings of its dtype (REL_L2_FLOOR; 1e-5 for fp32
# and fp64), or, past the floor, numerics.whole_model_limit (a Llama-3-8B shape's 32 layers in fp16
# compound those roundings past the floor).


def check_same(expected, got, reference=None, again=None):
    """Raises RuntimeError where `got` (the captured graph's output) is not `expected` (the model's):
    structure, shape, dtype, integers exact, NaN and inf where eager has them, and finite values
    within the floor, or within numerics.whole_model_limit of eager's own error against
    `reference()` (the model's output in higher precision, flat like `expected`, asked for only where
    the floor is passed; None: the floor alone). `again()`: the model's output once more (flat like
    `expected`), asked for only where the limit's cap alone refuses `got`: a model whose rerun gives
    its output again is deterministic, its own error rounding, and the cap lifted."""
    exp_leaves, got_leaves = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    if len(exp_leaves) != len(got_leaves):
        raise RuntimeError("the captured graph returns a different output structure than the model")
    over = []      # (leaf index, relative L2 error) of the floating outputs past the floor
    for i, (e, g) in enumerate(zip(exp_leaves, got_leaves)):
        if not isinstance(e, torch.Tensor):
            continue
        if not (isinstance(g, torch.Tensor) and g.shape == e.shape and g.dtype == e.dtype):
            raise RuntimeError("the captured graph's output has another shape or dtype than the model's")
        if not e.is_floating_point():
            if not torch.equal(e, g):
                raise RuntimeError("the captured graph's output differs from the model's on the example inputs "
                                   f"(output {i}: integer values differ)")
            continue
        nan, inf = torch.isnan(e), torch.isinf(e)
        if not (torch.equal(nan, torch.isnan(g)) and torch.equal(e[inf], g[inf])):
            raise RuntimeError("the captured graph's output differs from the model's on the example inputs "
                               f"(output {i}: NaN or inf where the model has none, or the other way round)")
        finite = ~(nan | inf)
        err = rel_l2(g[finite], e[finite])
        if err > REL_L2_FLOOR.get(e.dtype, 1e-5):
            over.append((i, err))
    if not over:
        return
    refs = pytree.tree_leaves(reference()) if reference is not None else None
    if refs is not None and len(refs) != len(exp_leaves):
        refs = None
    deterministic = None       # whether a rerun gave the model's output again: asked once, where needed
    for i, err in over:
        e, floor = exp_leaves[i], REL_L2_FLOOR.get(exp_leaves[i].dtype, 1e-5)
        if refs is None:
            why = f"relative L2 error {err:.1e} over the floor {floor:.0e} for {str(e.dtype)[6:]}"
        else:
            r = refs[i].to(e.device)
            finite = torch.isfinite(e) & torch.isfinite(r)
            own = rel_l2(e[finite], r[finite])
            limit, off_ref = whole_model_limit(floor, own), rel_l2(got_leaves[i][finite], r[finite])
            if off_ref <= limit:
                continue
            if again is not None and off_ref <= whole_model_limit(floor, own, deterministic=True):
                if deterministic is None:
                    deterministic = _gives_again(expected, again)
                if deterministic:
                    continue
            cap = (f"at most {OWN_ERROR_CAP:g} x the floor where the model's output changes from call to call"
                   if deterministic is not None else f"at most {OWN_ERROR_CAP:g} x the floor")
            why = (f"relative L2 error {err:.1e} from the model's, {off_ref:.1e} from the model in "
                   f"{str(r.dtype)[6:]}, over the limit {limit:.1e} (the model's own error {own:.1e} x "
                   f"{EAGER_ERROR_FACTOR:g}, floor {floor:.0e}, {cap})")
        raise RuntimeError(f"the captured graph's output differs from the model's on the example inputs "
                           f"(output {i}: {why})")


def _gives_again(expected, again) -> bool:
    """Whether `again()` (the model rerun) gives `expected` again by check_same's floor alone (a GPU's reductions
    may reorder between runs; drawn random numbers differ by far more)."""
    try:
        check_same(expected, again())
    except Exception:       # (a rerun that differs, or fails, proves nothing: the cap stands)
        return False
    return True


def checked(gm: fx.GraphModule, expected, got, reference, again) -> None:
    """check_same(expected, got, reference, again), alike on every rank of a tensor-parallel graph: what a rank
    asks for (the model in higher precision, a rerun: both run the collectives) depends on its own outputs, which
    differ between ranks where the output is the rank's shard, and a collective one rank runs alone never pairs.
    So every rank runs both, and a graph any rank refuses is refused on every rank (one rank taking a tracer's
    graph and another the next tracer's would pair their collectives wrongly from then on)."""
    if tensor_parallel.group_of(gm) is None:
        check_same(expected, got, reference, again)
        return
    ref, more = _asked(reference), _asked(again)
    why = None
    try:
        check_same(expected, got, lambda: ref, lambda: more)
    except RuntimeError as e:
        why = str(e)
    refused = [w for w in tensor_parallel.on_every_rank(gm, why) if w is not None]
    if refused:
        raise RuntimeError(why or f"another rank refused the graph: {refused[0]}")


def _asked(fn):
    """fn(), or None where it cannot run (a model holding a kernel that takes no float64 has no higher-precision run):
    check_same then judges by the floor alone, as where nothing is asked."""
    try:
        return fn()
    except Exception:
        return None


def at_other_sizes(gm: fx.GraphModule, flat: tuple, model_at, reference_at, rerun_at, restore) -> None:
    """A graph read back from an earlier process (capture.stored) against the model at the sizes its contract claims
    besides the example's (the ends of its ranges and an odd size between, as the guard checks layers: other_inputs):
    an export made under another limit from outside the model's code (a setting, a global) took a branch on a size
    that the model now takes another way. model_at(inputs): the model's flat output; reference_at(inputs, output),
    rerun_at(inputs): as `checked` asks them; restore(): the model's buffers put back. Raises where the two differ;
    a size where either refuses to run says nothing (the graph's own refusal is no wrong number, and where the
    model fails there is nothing to compare)."""
    from accelc.other_inputs import sized_other_inputs      # (it imports the capture package: not at the top)
    for label, ins, sizes in sized_other_inputs(flat, gm.meta.get(SHAPES)):
        if sizes is None:       # (the second draw at the example's shapes: the branches the example took)
            continue
        try:
            with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
                want = model_at(ins)
                restore()
                got = gm(*ins)
        except Exception:
            continue
        finally:
            restore()
        try:
            checked(gm, want, got, lambda: reference_at(ins, want), lambda: rerun_at(ins))
        except Exception as e:
            raise ValueError(f"{label}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


_ANOTHER_WAY = "the model computes another way at 1 than at 2, where it was captured (a branch on the size?)"
_PROGRAM_AT_ONE = ("torch.export's program, traced at 2, takes no 1 there (its trace assumed a size computed from "
                   "this one is never 1), where the model itself runs")


def settle_lower_ends(gm: fx.GraphModule, flat: tuple, model_at, reference_at, rerun_at, restore) -> None:
    """torch.export states 2 as the lower end of a dim it merely did not specialise to 1, and never
    traced size 1: a branch on the size (`if x.shape[0] > 1`) takes another way there. A dim's range
    goes down to 1 only where the model itself, run at 1, gives what the graph gives; else it stays
    at 2 and the refusal of a call at 1 says why (InputShapes.lower_ends): the model fails there, computes
    another way, or the program's own guard refuses it (HF's Swin: a size computed from the batch traced as never
    1), where the model runs. model_at, reference_at, rerun_at, restore: as at_other_sizes takes them."""
    shapes = gm.meta.get(SHAPES)
    twos = [sym for sym, r in (shapes.varying() if shapes is not None else {}).items() if r.lo == 2]
    for group in ([twos] + ([[sym] for sym in twos] if len(twos) > 1 else [])) if twos else []:
        if not any(sym in twos for sym in group):
            continue
        ins = shapes.inputs_at(flat, {sym: 1 for sym in group})
        why = "the model fails at 1"
        try:
            with torch.no_grad():
                expected = model_at(ins)
                restore()
                why = _ANOTHER_WAY
                got = gm(*ins)
            checked(gm, expected, got, lambda: reference_at(ins, expected), lambda: rerun_at(ins))
        except Exception as e:   # the range keeps its 2
            if why is _ANOTHER_WAY and isinstance(e, AssertionError) and guard_failure(e):   # (the program's guard)
                why = _PROGRAM_AT_ONE
            log.debug("accelc: capture: %s stay at 2 or more: %s (%s)", ", ".join(group), why,
                      str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            shapes = gm.meta[SHAPES] = shapes.with_lower_ends({sym: why for sym in group})
            continue
        finally:
            restore()
        # (a group of several that failed before may have named them in lower_ends: lowered drops them)
        shapes = gm.meta[SHAPES] = shapes.lowered(group)
        twos = [sym for sym in twos if sym not in group]
