"""norms: LayerNorm over the last dim -> torch.ops.accelc.layer_norm (kernels/layernorm.py), with
the residual add before it fused where nothing else reads the sum (a post-norm block,
`LayerNorm(x + sublayer(x))`: BERT, the original Transformer). A pre-norm stream's add, whose sum
is also the next residual, stays PyTorch and the LayerNorm alone is rewritten.

Runs after linear_act: an add that a GEMM's epilogue already took (`linear[residual]`) is not
taken again. Only where the glue is eager: Inductor fuses a LayerNorm with the ops around it (a
pre-norm stream's add and its norm become one kernel writing both), and with that glue the
whole models measured no faster with accelc's kernel (bench/results/e2e-runs/run14: BERT-base
2.28 ms with it, 2.19 without; GPT-2 2.48 / 2.47, H100), though the kernel alone is 1.2x-2.3x
eager's LayerNorm (bench/results/norms-*.md).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from accelc import meta
from accelc.kernels.layernorm import why_unsupported
from accelc.rewrite import Pass, Pattern, Replacement, Rule

LAYER_NORM = torch.ops.accelc.layer_norm.default


def _add_layer_norm(x, residual, shape, weight, bias, eps):
    return F.layer_norm(x + residual, shape, weight, bias, eps)


def _layer_norm(x, shape, weight, bias, eps):
    return F.layer_norm(x, shape, weight, bias, eps)


def _sum_read_once(m) -> bool:
    """The add's sum feeds only the LayerNorm (else it is needed as it is: not fused)."""
    add = next(n for n in m.nodes if n.target is operator.add)
    return len(add.users) == 1 and all(isinstance(m.input(k), torch.fx.Node) for k in ("x", "residual"))


def _operands(m):
    return [meta.meta_tensor(m.input(k)) if m.input(k) is not None else None for k in ("weight", "bias")]


INDUCTOR_GLUE = ("left to the Inductor glue, which fuses it with its neighbours: accelc's kernel, faster than "
                 "eager's LayerNorm alone, made whole models no faster there (BERT-base 2.28 vs 2.19 ms on an H100); "
                 "glue='eager' rewrites it")


def inductor_glue(ctx) -> bool:
    """Whether what accelc leaves runs compiled by Inductor (OptimizeConfig.glue, as accelc.runner
    resolves it for the model's device)."""
    from accelc.runner import resolve_glue   # on use: the runner imports the kernels the passes feed

    return resolve_glue(ctx.config.glue, ctx.device.type == "cuda") == "inductor"


def _check(m, ctx) -> str | None:
    if inductor_glue(ctx):
        return INDUCTOR_GLUE
    x = meta.meta_tensor(m.input("x"))
    res = meta.meta_tensor(m.input("residual")) if m.has("residual") else None
    if x is None or (m.has("residual") and res is None):
        return "input shapes unknown"
    w, b = _operands(m)
    if (m.input("weight") is not None and w is None) or (m.input("bias") is not None and b is None):
        return "weight shapes unknown"
    if not isinstance(m.input("eps"), (int, float)):
        return "eps is not a constant"
    shape = _static_shape(m.input("shape"), m.anchor.args[0])
    if shape is None:
        return "normalized_shape is neither constant nor the input's last dim"
    return why_unsupported(x, w, b, res, shape)


def _static_shape(shape, inp):
    """normalized_shape as ints, where it is constants or read off the norm's own input
    (`x.shape[-1:]`, `(x.shape[-1],)`, `(x.size(-1),)`: its last dim, whatever the call's shape);
    None otherwise."""
    def last_dim(n) -> bool:
        if not isinstance(n, torch.fx.Node):
            return False
        if n.op == "call_method" and n.target == "size" and n.args[:1] == (inp,):
            return tuple(n.args[1:]) == (-1,)
        return (n.target is operator.getitem and n.args[1] == -1 and isinstance(n.args[0], torch.fx.Node)
                and _shape_of(n.args[0]) is inp)
    x = meta.tensor_meta(inp)
    if x is None or not x.shape:
        return None
    if isinstance(shape, torch.fx.Node):     # x.shape[-1:]
        if shape.target is operator.getitem and shape.args[1] == slice(-1, None) and _shape_of(shape.args[0]) is inp:
            return (x.shape[-1],)
        return None
    if not isinstance(shape, (tuple, list)):
        return None
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        elif last_dim(d) and len(shape) == 1:
            out.append(x.shape[-1])
        else:
            return None
    return tuple(out)


def _shape_of(n):
    """X for a node reading X.shape (getattr) or X.size() (no argument), else None."""
    if not isinstance(n, torch.fx.Node):
        return None
    if n.op == "call_function" and n.target is getattr and n.args[1] == "shape":
        return n.args[0]
    if n.op == "call_method" and n.target == "size" and len(n.args) == 1:
        return n.args[0]
    return None


def _build(m, ctx) -> Replacement:
    residual = m.input("residual") if m.has("residual") else None
    args = (m.input("x"), m.input("weight"), m.input("bias"), residual, float(m.input("eps")))
    return Replacement(LAYER_NORM, args, kind="layer_norm",
                       kernel="accelc::layer_norm" + ("[residual]" if residual is not None else ""))


RULES = (
    Rule(Pattern("add+layer_norm", _add_layer_norm), build=_build, check=_check, applies=_sum_read_once),
    Rule(Pattern("layer_norm", _layer_norm), build=_build, check=_check),
)
PASS = Pass("norms", RULES)
