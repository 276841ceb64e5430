"""Whether a captured graph reproduces the model it came from: the check every tracer's graph
passes before accelc takes it (accelc.capture.trace)."""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from accelc.numerics import EAGER_ERROR_FACTOR, OWN_ERROR_CAP, REL_L2_FLOOR, rel_l2, whole_model_limit

# How far a correct captured graph may differ from the model (the same ops, possibly regrouped,
# decomposed, or given another kernel by the tracer: an SDPA with an all-zero mask where eager took
# none), relative L2 per output tensor: a few roundings of its dtype (REL_L2_FLOOR; 1e-5 for fp32
# and fp64), or, past the floor, numerics.whole_model_limit (a Llama-3-8B shape's 32 layers in fp16
# compound those roundings past the floor).


def check_same(expected, got, reference=None):
    """Raises RuntimeError where `got` (the captured graph's output) is not `expected` (the model's):
    structure, shape, dtype, integers exact, NaN and inf where eager has them, and finite values
    within the floor, or within numerics.whole_model_limit of eager's own error against
    `reference()` (the model's output in higher precision, flat like `expected`, asked for only where
    the floor is passed; None: the floor alone)."""
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
    for i, err in over:
        e, floor = exp_leaves[i], REL_L2_FLOOR.get(exp_leaves[i].dtype, 1e-5)
        if refs is None:
            why = f"relative L2 error {err:.1e} over the floor {floor:.0e} for {str(e.dtype)[6:]}"
        else:
            r = refs[i].to(e.device)
            finite = torch.isfinite(e) & torch.isfinite(r)
            own = rel_l2(e[finite], r[finite])
            limit = whole_model_limit(floor, own)
            if rel_l2(got_leaves[i][finite], r[finite]) <= limit:
                continue
            why = (f"relative L2 error {err:.1e} from the model's, {rel_l2(got_leaves[i][finite], r[finite]):.1e} "
                   f"from the model in {str(r.dtype)[6:]}, over the limit {limit:.1e} (the model's own error "
                   f"{own:.1e} x {EAGER_ERROR_FACTOR:g}, floor {floor:.0e}, at most {OWN_ERROR_CAP:g} x the floor)")
        raise RuntimeError(f"the captured graph's output differs from the model's on the example inputs "
                           f"(output {i}: {why})")
