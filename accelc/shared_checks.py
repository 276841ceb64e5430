"""The guard's layer checks shared within one optimize: a causal LM's generation step checks again the layers its
forward checked moments before (its projections, norms and MLPs: the same kernels on the same weights at the same
prompt shapes; only its cache attention is its own), each run twice on the GPU and compared against PyTorch and a
higher-precision reference. Within `sharing()` (accelc.api.optimize_job: a forward and the step optimized inside it)
a float layer's check is kept under what its outcome depends on, and a later check with the same key is the kept one:

    the op and its non-tensor arguments, the PyTorch subgraph it replaced (its structure), every tensor it reads by
    size, dtype, strides and device, the weights it reads (get_attr) by the digest of their values as well, and the
    config the checks judge by.

What is not in the key is the activations' values: the forward's layer was checked on its own inputs, the step's
would be on the step's (the same prompt through the same layers, bitwise apart after the first attention). A layer
that passes or fails on one draw of same-shaped inputs and not on another is what the guard's second draw and other
sizes are for, and the step still runs those of its own sizes. Quantized layers (int8, fp8: their error reads the
inputs' scales) and tensor-parallel ranks (a check runs collectives) share nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import weakref

import torch
from torch import fx
from torch.utils import _pytree as pytree

from accelc.layer_signature import signature, values_digest

log = logging.getLogger("accelc")

_scope: contextvars.ContextVar = contextvars.ContextVar("accelc_shared_checks", default=None)


@dataclasses.dataclass
class _Scope:
    checks: dict = dataclasses.field(default_factory=dict)     # key -> (weakref to the program, LayerCheck)
    digests: dict = dataclasses.field(default_factory=dict)    # id(tensor) -> (weakref, version, digest)
    reused: int = 0


@contextlib.contextmanager
def sharing():
    """Checks shared within the block (the outermost one's scope: a step's optimize inside its forward's shares it)."""
    if _scope.get() is not None:
        yield
        return
    token = _scope.set(_Scope())
    try:
        yield
    finally:
        scope = _scope.get()
        _scope.reset(token)
        if scope.reused:
            log.info("accelc: guard: %d layer check(s) shared with an earlier check of the same kernel, weights and "
                     "shapes in this optimize", scope.reused)


def key(node: fx.Node, args: tuple, kwargs: dict, rw, config) -> tuple | None:
    """The key of node's check on (args, kwargs), its values (module docstring); None where nothing is shared."""
    scope = _scope.get()
    if scope is None or rw.quantized or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        nodes = pytree.tree_leaves((node.args, node.kwargs))
        values = pytree.tree_leaves((args, kwargs))
        if len(nodes) != len(values):
            return None
        weights = tuple(_digest(scope, v) if isinstance(n, fx.Node) and n.op == "get_attr"
                        and isinstance(v, torch.Tensor) else None for n, v in zip(nodes, values))
        judged_by = repr(dataclasses.replace(config, dynamic=True, warmup_shapes=()))   # (what the checks read)
        if " at 0x" in judged_by:
            return None
        original = rw.original if isinstance(rw.original, fx.GraphModule) else None
        return signature(node, args, kwargs, original, (weights, judged_by))
    except Exception as e:    # nothing a key cannot read is worth a failed check: this one is not shared
        log.debug("accelc: guard: check not shared (%s: %s)", type(e).__name__, e)
        return None


def _digest(scope: _Scope, t: torch.Tensor):
    """The digest of t's values, once per tensor object and version."""
    held = scope.digests.get(id(t))
    if held is not None and held[0]() is t and held[1] == t._version:
        return held[2]
    digest = tuple(values_digest([t])[0])
    scope.digests[id(t)] = (weakref.ref(t), t._version, digest)
    return digest


def lookup(k: tuple | None, program: fx.GraphModule):
    """The check another program kept under k, or None. A program never reads its own: its second draw of inputs
    at the example's shapes (same key) is checked as the guard draws it."""
    scope = _scope.get()
    if k is None or scope is None or k not in scope.checks:
        return None
    owner, check = scope.checks[k]
    if owner() is program:
        return None
    scope.reused += 1
    return check


def keep(k: tuple | None, program: fx.GraphModule, check) -> None:
    """check kept under k for the other programs; a failed check at k stays (the verdict of the two draws)."""
    scope = _scope.get()
    if k is None or scope is None:
        return
    held = scope.checks.get(k)
    if held is None or held[1].passed:
        scope.checks[k] = (weakref.ref(program), check)
