"""Operations models write out in elementary ops, told by what they compute: activations here (the
erf / tanh GELUs, quick_gelu, SiLU, hardswish, hardsigmoid), RoPE (passes/rotary.py) and RMSNorm
(passes/norms.py) beside their rules. A candidate is found by its shape in the graph, then confirmed
by running its nodes on probe values with `evaluate` (the one evaluator all three use) and comparing
with the operation's reference (`matches_reference` for tensors of the example shapes)."""
from __future__ import annotations

import functools
import operator

import torch
import torch.nn.functional as F
from torch import fx

from accelc import meta
from accelc.graph_order import in_graph_order
from accelc.capture.nodes import erase_dead, swap
from accelc.kernels.epilogue import ACTIVATIONS
from accelc.numerics import same_values

aten = torch.ops.aten


def evaluate(nodes: list, env: dict, resolve=None):
    """Run `nodes` (call_function / call_method nodes, in graph order) on the values `env` holds for
    their inputs (node -> value), filling env as it goes; returns the last node's value. resolve(n):
    the callable to run n with (None: its target, or its method on its first argument)."""
    for n in nodes:
        args = fx.node.map_arg(n.args, env.__getitem__)
        kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
        fn = resolve(n) if resolve is not None else None
        if fn is not None:
            env[n] = fn(*args, **kwargs)
        elif n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        else:
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
    return env[nodes[-1]]


PROBE_ROWS = 3      # a probe's size in every dim but the last (see matches_reference)


def matches_reference(nodes: list, inputs: tuple, reference, dtypes: tuple | None = None, rtol: float = 1e-12,
                      atol: float = 1e-12, trials: int = 2) -> bool:
    """Whether `nodes` (ending in the candidate's output) compute reference(*inputs): run on `trials`
    sets of random values (float64, or `dtypes` per input), seeded, on the CPU. The probes are small:
    the inputs' last dims (what a norm reduces, what a rotation pairs) as in the example, every other
    dim at most PROBE_ROWS (a size of 1 stays 1, so what broadcasts still does): a written-out norm or
    rotary is told by a few rows, not a full activation. Where the nodes cannot run at those sizes (a
    reshape to the example's numbers), the example's shapes are probed. False where a shape is unknown
    or the nodes fail on the probe."""
    metas = [meta.tensor_meta(t) for t in inputs]
    if any(m is None for m in metas):
        return False
    dtypes = tuple(dtypes or (torch.float64,) * len(metas))
    full = tuple(tuple(m.shape) for m in metas)
    small = tuple(tuple(min(n, PROBE_ROWS) for n in s[:-1]) + s[-1:] for s in full)
    outcome = _matches_at(nodes, inputs, reference, small, dtypes, rtol, atol, trials)
    if outcome is None and small != full:
        outcome = _matches_at(nodes, inputs, reference, full, dtypes, rtol, atol, trials)
    return bool(outcome)


def _matches_at(nodes, inputs, reference, shapes, dtypes, rtol, atol, trials) -> bool | None:
    """matches_reference at these probe shapes: None where the nodes or the reference raise."""
    for trial in range(trials):
        probe = [t.to(d) for t, d in zip(_probes(shapes, trial), dtypes)]
        try:
            got = evaluate(nodes, dict(zip(inputs, probe)))
            want = reference(*probe)
        except Exception:
            return None
        if not isinstance(got, torch.Tensor) or got.shape != want.shape \
                or not torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol):
            return False
    return True


@functools.lru_cache(maxsize=256)
def _probes(shapes: tuple, trial: int) -> tuple:
    """Random float64 values of these shapes, seeded by the shapes and the trial: drawn once for every
    candidate of one case (a 28-layer model's 57 norms share two draws)."""
    gen = torch.Generator().manual_seed(trial)
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)


# ---------------------------------------------------------------------------------------------
# activations written out

_POINTWISE_FUNCTIONS = {
    operator.mul: operator.mul, operator.add: operator.add, operator.sub: operator.sub,
    operator.truediv: operator.truediv, operator.neg: operator.neg, operator.pow: operator.pow,
    torch.sub: torch.sub, aten.sub.Tensor: torch.sub, aten.mul.Scalar: operator.mul, aten.add.Scalar: operator.add,
    aten.neg.default: operator.neg, torch.neg: operator.neg,
    torch.pow: torch.pow, aten.pow.Tensor_Scalar: torch.pow, aten.pow.Tensor_Tensor: torch.pow,
    torch.tanh: torch.tanh, torch.sigmoid: torch.sigmoid, torch.erf: torch.erf, aten.erf.default: torch.erf,
    torch.special.erf: torch.erf, torch.sqrt: torch.sqrt, F.relu6: F.relu6,
}
_POINTWISE_METHODS = {"pow": torch.pow, "erf": torch.erf, "neg": operator.neg, "sub": torch.sub}
# the activations a written-out form may compute: (the fewest ops its written form takes, the
# ACTIVATIONS entry of the canonical call that replaces it)
_WRITTEN_ACTIVATIONS = (
    (4, "gelu_tanh"),      # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3))): gelu_new, gelu_fast
    (4, "gelu"),           # x * 0.5 * (1 + erf(x / sqrt(2)))
    (3, "quick_gelu"),     # x * sigmoid(1.702 * x)
    (3, "hardswish"),      # x * relu6(x + 3) / 6
    (3, "hardsigmoid"),    # relu6(x + 3) / 6
    (2, "silu"),           # x * sigmoid(x)
)
_PROBE = torch.cat([torch.linspace(-9, 9, 361, dtype=torch.float64),
                    torch.tensor([-40.0, -15.0, 15.0, 40.0, 1e-3, -1e-3, 0.0], dtype=torch.float64)])


def _pointwise_fn(n: fx.Node):
    if n.op == "call_function":
        return _POINTWISE_FUNCTIONS.get(n.target)
    if n.op == "call_method":
        return _POINTWISE_METHODS.get(n.target)   # (mul / add / tanh ... methods: canonical functions by now)
    return None


_MAX_WRITTEN_OPS = 16        # a written GELU takes 8 to 10


def _written_expression(root: fx.Node, x: fx.Node | None = None):
    """(the single tensor the pointwise expression at `root` is a function of, its interior
    nodes) where `root` computes f(x) from x and number constants only; None otherwise. With x
    given, the walk stops there (x may itself be pointwise: silu(h + 1) is silu of h + 1)."""
    leaves, interior, todo = set(), [], [root]
    while todo:
        n = todo.pop()
        if n in interior:
            continue
        if _pointwise_fn(n) is None or n.kwargs or len(interior) >= _MAX_WRITTEN_OPS:
            return None
        interior.append(n)
        for a in n.args:
            if isinstance(a, fx.Node):
                (todo.append(a) if a is not x and _pointwise_fn(a) is not None and not a.kwargs else leaves.add(a))
            elif not isinstance(a, (int, float)) or isinstance(a, bool):
                return None
    return (leaves.pop(), interior) if len(leaves) == 1 else None


def _written_candidates(root: fx.Node) -> list:
    """Each (x, interior) for which root is a pointwise function of x alone: x the expression's
    one leaf, or one of its own pointwise nodes (nearest the root first)."""
    whole = _written_expression(root)
    found = [] if whole is None else [whole]
    pointwise, todo = [], [root]
    while todo and len(pointwise) < _MAX_WRITTEN_OPS:
        n = todo.pop(0)
        for a in n.all_input_nodes:
            if a not in pointwise and _pointwise_fn(a) is not None and not a.kwargs:
                pointwise.append(a)
                todo.append(a)
    for x in pointwise:
        sub = _written_expression(root, x)
        if sub is not None and sub[0] is x:
            found.append(sub)
    return found


def fold_written_activations(g: fx.Graph) -> None:
    """An activation written out in pointwise ops (_WRITTEN_ACTIVATIONS: HF's gelu_new /
    gelu_fast, the erf GELU, CLIP's quick_gelu, hardswish and hardsigmoid through relu6, SiLU), in any
    order of its commutative operands, becomes its canonical call (F.gelu(x, approximate=...),
    quick_gelu(x), F.hardswish(x) ...), so that the epilogue rules see it. Told by evaluating the
    expression, in float64, on probe values (NaN and inf included) against each form: an
    expression is replaced only where it computes that function to 1e-9."""
    gone: set = set()
    special = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)
    for root in reversed(list(g.nodes)):
        if root in gone or _pointwise_fn(root) is None:
            continue
        for x, interior in _written_candidates(root):     # (one op alone is a call already)
            if len(interior) >= 2 and _fold_as_activation(g, root, x, interior, special, gone):
                break


def _fold_as_activation(g, root, x, interior, special, gone) -> bool:
    """Replace root by the canonical call of the activation it computes of x, if any."""
    nodes = in_graph_order(interior)        # root last: every other node feeds it
    try:
        got = evaluate(nodes, {x: _PROBE}, resolve=_pointwise_fn)
        got_special = evaluate(nodes, {x: special}, resolve=_pointwise_fn)
    except Exception:
        return False
    if not isinstance(got, torch.Tensor) or got.shape != _PROBE.shape:
        return False
    for fewest_ops, name in _WRITTEN_ACTIVATIONS:
        fn, kwargs = ACTIVATIONS[name]
        if len(interior) < fewest_ops:
            continue
        want, want_special = fn(_PROBE, **kwargs), fn(special, **kwargs)
        if torch.allclose(got, want, rtol=1e-9, atol=1e-9) and same_values(got_special, want_special):
            with g.inserting_before(root):
                call = g.call_function(fn, (x,), dict(kwargs))
            swap(root, call)
            gone.add(root)
            gone.update(erase_dead([n for n in interior if n is not root]))
            return True
    return False
