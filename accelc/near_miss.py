"""Why a layer that looks like one accelc rewrites was left to PyTorch, where no pass said so.

The passes explain what they refuse (a dtype, a kernel's limit); an op that no rule's pattern
matched at all got only "no accelc rewrite for softmax". Where the op is the piece of a rule's
pattern that stood out, this names the rule and the part that did not fit: an attention whose
probabilities another op also reads (attention weights returned), a softmax over another dim than
the keys, a mask added through a 5-D view of the scores (shifted windows), a product of two
activations outside an attention, a BatchNorm after something that is not a conv or whose conv's
output is read elsewhere.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from accelc import meta

_SCALES = {"mul", "truediv", "div", "add", "sub", "masked_fill", "where", "to", "float", "type_as", "view",
           "reshape"}
_CONVS = {"conv2d", "conv1d"}


def _others(n: fx.Node, but: fx.Node | None = None) -> str:
    names = [u.name for u in n.users if u is not but]
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def _scores_chain(n: fx.Node) -> list[fx.Node]:
    """The nodes from the q @ k^T a softmax's input comes from (first) through its scaling and
    masking (the softmax's input last); [] where the input is no such chain."""
    chain = []
    while isinstance(n, fx.Node) and len(chain) < 8:
        chain.append(n)
        name = meta.op_name(n)
        if name in ("matmul", "bmm", "baddbmm"):
            return chain[::-1]
        if name not in _SCALES or not n.args:
            return []
        n = n.args[0]
    return []


def _softmax(n: fx.Node) -> str | None:
    chain = _scores_chain(n.args[0] if n.args else None)
    if not chain:
        return None
    scores = chain[0]
    rule = "attention (softmax(q @ k^T) @ v as one flash kernel)"
    value = meta.tensor_meta(n)
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if value is not None and isinstance(dim, int) and dim not in (-1, len(value.shape) - 1):
        return f"{rule} not taken: the softmax is over dim {dim}, not the keys (the last dim)"
    readers = list(n.users)
    if len(readers) > 1:
        return (f"{rule} not taken: the probabilities are also read by {_others(n)} (attention weights "
                "returned or reused: the fused kernel never forms them)")
    if readers and meta.op_name(readers[0]) not in ("matmul", "bmm", "dropout"):
        return f"{rule} not taken: the probabilities go to {readers[0].name}, not a product with v"
    if len(scores.users) > 1:
        return f"{rule} not taken: the scores q @ k^T are also read by {_others(scores)}"
    if value is not None and value.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{rule} not taken: dtype {value.dtype}"
    if any(len(getattr(meta.tensor_meta(c), "shape", ())) == 5 for c in chain):
        return (f"{rule} not taken: a mask is added through a 5-D view of the scores (shifted-window attention's "
                "per-window mask); the kernel takes one mask broadcast to (batch, heads, L, S): add it before, or "
                "pass the sum to F.scaled_dot_product_attention")
    return f"{rule} not taken: the ops between q @ k^T and the softmax are not a scale and a mask it knows"


def _in_attention(n: fx.Node) -> bool:
    """n is a product of an attention's form: its scores feed a softmax, or it multiplies one's output."""
    if any(isinstance(a, fx.Node) and meta.op_name(a) == "softmax" for a in n.args[:2]):
        return True
    frontier, seen = list(n.users), 0
    while frontier and seen < 16:
        u = frontier.pop()
        seen += 1
        if meta.op_name(u) == "softmax":
            return True
        if meta.op_name(u) in _SCALES:
            frontier.extend(u.users)
    return False


def _matmul(n: fx.Node) -> str | None:
    if _in_attention(n):
        return "part of an attention the attention rule did not take: its softmax's row says why"
    operands = [a for a in n.args[:2] if isinstance(a, fx.Node)]
    if len(operands) == 2 and all(a.op != "get_attr" for a in operands):
        return ("linear (x @ W + b) not taken: both operands are computed at run time (the rule takes a parameter "
                "as the weight); products of two activations are taken only inside an attention")
    return None


def _batch_norm(n: fx.Node) -> str | None:
    x = n.args[0] if n.args else None
    if not isinstance(x, fx.Node):
        return None
    if meta.op_name(x) in _CONVS or (x.op == "call_function" and "accelc" in str(x.target)):
        if len(x.users) > 1:
            return f"fold_bn not taken: the conv's output is also read by {_others(x, but=n)}"
        return None
    return f"fold_bn not taken: it follows {x.name}, not a conv (a BatchNorm on its own stays PyTorch)"


_DIAGNOSES = {"softmax": _softmax, "matmul": _matmul, "bmm": _matmul, "batch_norm": _batch_norm}


def near_miss(n: fx.Node) -> str | None:
    """The rule a kept node nearly was part of and what did not fit, or None."""
    if n.op not in ("call_function", "call_method") or n.target is operator.getitem:
        return None
    diagnose = _DIAGNOSES.get(meta.op_name(n))
    return diagnose(n) if diagnose is not None else None
