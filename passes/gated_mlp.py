"""gated_mlp: a gated MLP's input side, `act(gate(x)) * up(x)` with both projections Linear layers
of the same input, -> torch.ops.accelc.gated_linear (kernels/gated_linear.py): SwiGLU (Llama,
Mistral, Qwen: silu), GeGLU (T5 v1.1, Gemma: gelu, exact or tanh, however capture found it
written), ReGLU (relu), in either operand order of the product; and the fused form, one
`gate_up` projection chunked in two along its output (`gate, up = gate_up(x).chunk(2, -1)`, Phi-3),
whose weight's halves are the gate and up weights.

Runs before linear_act, which would otherwise take the gate projection with its activation and
leave the product and the second GEMM. The two weights (parameters of the model) are packed once,
here, into the kernel's interleaved layout (kernels/gated_linear.pack) as a buffer of the graph. A projection whose output is read elsewhere too is no
gated MLP here (the matcher keeps such matches out). The down projection stays linear_act's.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from accelc import meta
from accelc.meta import attr_value
from accelc.kernels.epilogue import ACTIVATIONS
from accelc.kernels.gated_linear import pack, why_unsupported
from accelc.rewrite import Pass, Pattern, Replacement, Rule, add_constant

GATED_LINEAR = torch.ops.accelc.gated_linear.default


def _pattern(act: str, gate_first: bool) -> Pattern:
    fn, kw = ACTIVATIONS[act]

    if gate_first:
        def gated(x, w_gate, b_gate, w_up, b_up):
            return fn(F.linear(x, w_gate, b_gate), **kw) * F.linear(x, w_up, b_up)
    else:
        def gated(x, w_gate, b_gate, w_up, b_up):
            return F.linear(x, w_up, b_up) * fn(F.linear(x, w_gate, b_gate), **kw)
    return Pattern(f"{act}(gate)*up" if gate_first else f"up*{act}(gate)", gated)


def _fused_pattern(act: str, gate_first: bool) -> Pattern:
    fn, kw = ACTIVATIONS[act]

    if gate_first:
        def fused(x, w, b):
            halves = torch.chunk(F.linear(x, w, b), 2, -1)
            return fn(halves[0], **kw) * halves[1]
    else:
        def fused(x, w, b):
            halves = torch.chunk(F.linear(x, w, b), 2, -1)
            return halves[1] * fn(halves[0], **kw)
    return Pattern(f"chunk(gate_up) {act}(gate)*up" if gate_first else f"chunk(gate_up) up*{act}(gate)", fused)


def _halves(gm, m) -> tuple:
    """A fused gate_up layer's (w_gate, w_up, b_gate, b_up) values: the first and second halves of its
    output rows."""
    w = attr_value(gm, m.input("w")).detach()
    b = attr_value(gm, m.input("b")).detach() if m.input("b") is not None else None
    n = w.shape[0] // 2
    return w[:n], w[n:], (b[:n] if b is not None else None), (b[n:] if b is not None else None)


def _check_fused(m, ctx, act: str) -> str | None:
    x = meta.meta_tensor(m.input("x"))
    w, b = m.input("w"), m.input("b")
    if not _is_param(w) or (b is not None and not _is_param(b)):
        return "weights computed at run time (the packed weight is made once, ahead)"
    wm = meta.meta_tensor(w)
    if x is None or wm is None:
        return "input shapes unknown"
    if wm.dim() != 2 or wm.shape[0] % 2:
        return f"the fused gate_up weight {tuple(wm.shape)} does not split in two halves of rows"
    n = wm.shape[0] // 2
    bm = meta.meta_tensor(b) if b is not None else None
    return why_unsupported(x, wm[:n], wm[n:], bm[:n] if bm is not None else None, bm[n:] if bm is not None else None,
                           activation=act)


def _build_fused(m, ctx, act: str) -> Replacement:
    return _gated_call(m, ctx, act, _halves(m.gm, m), m.input("w"))


def _check(m, ctx, act: str) -> str | None:
    x = meta.meta_tensor(m.input("x"))
    params = [m.input(k) for k in ("w_gate", "w_up", "b_gate", "b_up")]
    if not all(p is None or _is_param(p) for p in params) or params[0] is None or params[1] is None:
        return "weights computed at run time (the packed weight is made once, ahead)"
    wg, wu = meta.meta_tensor(m.input("w_gate")), meta.meta_tensor(m.input("w_up"))
    if x is None or wg is None or wu is None:
        return "input shapes unknown"
    biases = []
    for k in ("b_gate", "b_up"):
        b = m.input(k)
        if b is not None and not isinstance(b, torch.fx.Node):
            return f"{k} is not a tensor"
        biases.append(meta.meta_tensor(b) if b is not None else None)
        if b is not None and biases[-1] is None:
            return "bias shapes unknown"
    return why_unsupported(x, wg, wu, *biases, activation=act)


def _is_param(n) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "get_attr"


def _build(m, ctx, act: str) -> Replacement:
    nodes = [m.input(k) for k in ("w_gate", "w_up", "b_gate", "b_up")]
    return _gated_call(m, ctx, act, [attr_value(m.gm, n).detach() if n is not None else None for n in nodes],
                       nodes[0])


def _gated_call(m, ctx, act: str, values: list, named: torch.fx.Node) -> Replacement:
    """The gated_linear call over (w_gate, w_up, b_gate, b_up) packed once into a buffer named after
    `named` (the gate's or the fused projection's weight)."""
    gm = m.gm
    weight, bias = pack(*values)
    stem = named.target.replace(".", "_") + "_accelc_gated"
    aux = [add_constant(gm, stem, weight, before=m.anchor, path=meta.path(named))]
    if bias is not None:
        aux.append(add_constant(gm, stem + "_bias", bias, before=m.anchor, path=meta.path(named)))
    args = (m.input("x"), aux[0], aux[1] if bias is not None else None, values[0].shape[0])
    return Replacement(GATED_LINEAR, args, dict(activation=act, allow_tf32=ctx.config.fp32_precision == "tf32"),
                       kind="gated_linear", kernel=f"accelc::gated_linear[{act}]", aux=tuple(aux))


RULES = tuple(Rule(_pattern(act, first), build=functools.partial(_build, act=act),
                   check=functools.partial(_check, act=act))
              for act in ACTIVATIONS if act != "none" for first in (True, False)) + tuple(
    Rule(_fused_pattern(act, first), build=functools.partial(_build_fused, act=act),
         check=functools.partial(_check_fused, act=act))
    for act in ACTIVATIONS if act != "none" for first in (True, False))
PASS = Pass("gated_mlp", RULES)
