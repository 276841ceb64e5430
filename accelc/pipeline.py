"""The pass pipeline: an ordered list of rewrites, each (gm, config) -> matches made."""
from __future__ import annotations

from torch import fx

from accelc.errors import PassError
from accelc.passes import attention, conv_gemm, fold_bn, int8, linear_act
from accelc.rewrite import forget_replacements

PASSES = [
    ("fold_bn", fold_bn.run),
    ("conv_gemm", conv_gemm.run),
    ("attention", attention.run),   # first: it lowers nn.MultiheadAttention to linears + SDPA
    ("linear_act", linear_act.run),
    ("int8", int8.run),             # only with OptimizeConfig.int8: float accelc layers -> int8 kernels
]


def run_passes(gm: fx.GraphModule, config) -> dict[str, int]:
    """Run the passes `config.passes` names, in pipeline order; lint and recompile after each.
    Returns {pass name: matches made}."""
    counts: dict[str, int] = {}
    for name, fn in PASSES:
        if name not in config.passes:
            continue
        try:
            counts[name] = fn(gm, config)
            forget_replacements(gm)
            gm.graph.lint()
            gm.recompile()
        except Exception as e:
            before = ", ".join(counts) or "none"
            raise PassError(f"pass {name!r} failed (passes run before it: {before}): "
                            f"{type(e).__name__}: {e}") from e
    return counts
