"""rotary: rotary position embeddings written out -> torch.ops.accelc.rotary_embedding
(kernels/rotary.py), one kernel for what eager runs as seven.

Models write RoPE as HF's `apply_rotary_pos_emb` does: `x * cos + rotate_half(x) * sin`, with
rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]) (Llama, Mistral, Qwen, Gemma, GPT-NeoX, Phi-3),
the slices as getitem or aten.slice, the halves' bounds literal or computed from x.shape, the
products either way round. The step before the rule finds the candidates by their shape (an add of
two products, one of them of a cat computed from the other product's operand) and keeps only those
that compute RoPE: the expression is evaluated, in float64, on random tensors of the example shapes
and compared with kernels/rotary.rotary_embedding_ref. Each one becomes a call of that reference
(the same arithmetic), which the rule then rewrites. The interleaved form of GPT-J / CodeGen
(rotate_every_two) computes another function and stays as written.

As with the norms, the rule rewrites only where the glue is eager: under Inductor glue, Inductor
fuses the rotation with the head split around it, and the summary says so.

Before either, the angles: HF computes them as a matrix product of the inverse frequencies and the
positions with an inner dim of 1 (inv_freq[:, None] @ positions[None, :]), which ran as a cuBLAS
SGEMM of its own (3.3 us of an H100 decode step, besides its operands' copies). Any product with an
inner dim of 1 is an outer product: it becomes the broadcast multiply it is (one product an
element, the same bits), which the glue fuses with the cos and sin after it.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from accelc import meta
from accelc.graph_order import in_graph_order
from accelc.capture import erase_dead
from accelc.capture.written import matches_reference
from accelc.kernels.rotary import rotary_embedding_ref, why_unsupported
from accelc.rewrite import Pass, Pattern, Replacement, Rule, replace_uses

ROTARY = torch.ops.accelc.rotary_embedding.default
INDUCTOR_GLUE = ("left to the Inductor glue, which fuses the rotation with the head split around it; "
                 "glue='eager' rewrites it")

torch.fx.wrap("rotary_embedding_ref")     # a pattern call of its own, not traced through
_MAX_OPS = 24                             # a written RoPE takes 7 ops (12 with shape arithmetic)


def _is_mul(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.mul and len(n.args) == 2


def _depends_on(n: fx.Node, x: fx.Node, limit: int = _MAX_OPS) -> bool:
    seen, todo = set(), [n]
    while todo and len(seen) <= limit:
        m = todo.pop()
        if m is x:
            return True
        if m in seen:
            continue
        seen.add(m)
        todo.extend(m.all_input_nodes)
    return False


def _candidate(root: fx.Node):
    """(x, cos, sin) where root is structurally `x * cos + r * sin` with r = cat(...) computed
    from x; None otherwise."""
    if not (root.op == "call_function" and root.target is operator.add and len(root.args) == 2
            and all(_is_mul(a) for a in root.args)):
        return None
    for direct, rotated in (root.args, root.args[::-1]):
        cats = [a for a in rotated.args if isinstance(a, fx.Node) and meta.op_name(a) == "cat"]
        if len(cats) != 1:
            continue
        cat = cats[0]
        sin = rotated.args[1] if rotated.args[0] is cat else rotated.args[0]
        for x, cos in (direct.args, direct.args[::-1]):
            if isinstance(x, fx.Node) and isinstance(cos, fx.Node) and isinstance(sin, fx.Node) \
                    and x is not cos and _depends_on(cat, x):
                return x, cos, sin
    return None


def _interior(root: fx.Node, leaves: tuple) -> list | None:
    """The nodes root computes from `leaves` alone (in graph order), or None where it reads
    anything else (another tensor, a module attribute) or is too large to be a RoPE."""
    found, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n in leaves or n in found:
            continue
        if n.op not in ("call_function", "call_method") or len(found) >= _MAX_OPS:
            return None
        found.add(n)
        todo.extend(n.all_input_nodes)
    return in_graph_order(found)


def fold_written_rotary(gm: fx.GraphModule, ctx) -> None:
    """The rotary pass's step before its rule: each written-out RoPE becomes
    rotary_embedding_ref(x, cos, sin)."""
    g = gm.graph
    for root in list(g.nodes):
        if root.graph is not g:
            continue
        found = _candidate(root)
        if found is None:
            continue
        x, cos, sin = found
        nodes = _interior(root, (x, cos, sin))
        if nodes is None or not matches_reference(nodes, (x, cos, sin), rotary_embedding_ref):
            continue
        with g.inserting_before(root):
            new = g.call_function(rotary_embedding_ref, (x, cos, sin))
        new.meta.update(root.meta)
        replace_uses(gm, root, new)
        erase_dead(nodes)


_PRODUCTS = {torch.matmul, operator.matmul, torch.bmm, torch.mm, torch.ops.aten.matmul.default,
             torch.ops.aten.bmm.default, torch.ops.aten.mm.default}


def outer_products(gm: fx.GraphModule) -> int:
    """Matrix products with an inner dim of 1, (..., M, 1) @ (..., 1, N), as broadcast multiplies
    (see the module docstring); returns how many."""
    g, count = gm.graph, 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in _PRODUCTS or len(n.args) != 2 or n.kwargs:
            continue
        a, b = (meta.tensor_meta(x) for x in n.args)
        if a is None or b is None or len(a.shape) < 2 or len(b.shape) < 2 or a.shape[-1] != 1 or b.shape[-2] != 1 \
                or a.dtype != b.dtype or not a.dtype.is_floating_point:
            continue
        with g.inserting_before(n):
            new = g.call_function(torch.mul, tuple(n.args))
        new.meta.update(n.meta)
        replace_uses(gm, n, new)
        g.erase_node(n)
        count += 1
    return count


def _before_rules(gm: fx.GraphModule, ctx) -> None:
    outer_products(gm)
    fold_written_rotary(gm, ctx)


def _rope(x, cos, sin):
    return rotary_embedding_ref(x, cos, sin)


def _check(m, ctx) -> str | None:
    if ctx.inductor_glue:
        return INDUCTOR_GLUE
    ts = [meta.meta_tensor(m.input(k)) for k in ("x", "cos", "sin")]
    if any(t is None for t in ts):
        return "input shapes unknown"
    return why_unsupported(*ts)


def _build(m, ctx) -> Replacement:
    return Replacement(ROTARY, (m.input("x"), m.input("cos"), m.input("sin")), kind="rotary",
                       kernel="accelc::rotary_embedding")


RULES = (Rule(Pattern("rotary_embedding", _rope), build=_build, check=_check),)
PASS = Pass("rotary", RULES, before_rules=_before_rules)
