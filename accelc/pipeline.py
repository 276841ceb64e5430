"""The pass pipeline: an ordered list of passes, each a table of rules (accelc.rewrite)."""
from __future__ import annotations

from torch import fx

from accelc import meta, runtime
from accelc.config import PASS_NAMES
from accelc.errors import PassError
from accelc.passes import (attention, conv_gemm, fold_bn, fold_weights, gated_mlp, int8, linear_act, norm_linear,
                           norms, qkv_rotary, rotary, sibling_linears)
from accelc.rewrite import PassContext, run_pass

PASSES = (
    fold_weights.PASS,  # first: a weight computed from the weights alone (weight norm) is a weight the rules can take
    fold_bn.PASS,
    conv_gemm.PASS,
    rotary.PASS,        # before attention: q and k reach the attention rules as the rotation's outputs
    attention.PASS,     # before linear_act: it lowers nn.MultiheadAttention to linears + SDPA
    gated_mlp.PASS,     # before linear_act: it would take the gate projection and its activation alone
    sibling_linears.PASS,   # after gated_mlp (gate / up are siblings too), before linear_act: q, k, v as one GEMM
    linear_act.PASS,
    norms.PASS,         # after linear_act: a residual add a GEMM epilogue took is not taken again
    int8.PASS,          # only with OptimizeConfig.int8: float accelc layers -> int8 kernels
    norm_linear.PASS,   # an RMSNorm read by one float projection taken into it
    qkv_rotary.PASS,    # last: a step's q / k / v projection, rotations and cache write as one call
)
if tuple(p.name for p in PASSES) != PASS_NAMES:
    raise ImportError(f"accelc.config.PASS_NAMES {PASS_NAMES} must name PASSES in order: "
                      f"{tuple(p.name for p in PASSES)}")


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    """Run the passes ctx.config.passes names, in pipeline order; lint after each, recompile once after the
    last (the passes read and rewrite the graph, never its generated code: a recompile of a whole model's graph
    after each of ten passes was half their time). Returns {pass name: rewrites made}. On a device accelc's
    kernels cannot use, nothing runs and every node says why."""
    reason = runtime.device_reason(ctx.device)
    if reason:
        for n in gm.graph.nodes:
            meta.explain(n, reason)
        return {}
    counts: dict[str, int] = {}
    for p in PASSES:
        if p.name not in ctx.config.passes:
            continue
        try:
            counts[p.name] = run_pass(gm, p, ctx)
            gm.graph.lint()
        except Exception as e:
            before = ", ".join(counts) or "none"
            raise PassError(f"pass {p.name!r} failed (passes run before it: {before}): "
                            f"{type(e).__name__}: {e}") from e
    gm.recompile()
    return counts
