"""A testing module beside bench/fuzz_models.py: how a fuzzed case is optimized and called beyond the plain call (its
call classes: an input given twice, a branch on the batch size, keywords at their defaults, two threads at once, and
the reuse class, state changed between two optimizes that read back what the first kept)."""
from __future__ import annotations

import random

import torch
from torch import nn


# how a case is optimized and called beyond the plain one (#57's classes): one input given as two
# (aliased at optimize, two tensors later), a branch on the batch size, keywords passed at their
# defaults, two threads calling at once
CALLS = ("plain", "plain", "plain", "alias", "branch", "keywords", "threads")


def call_class(seed: int) -> str:
    return random.Random(seed * 7919 + 1).choice(CALLS)


class Twin(nn.Module):
    """Two inputs through the fuzzed model: its output for each, and their sum where they agree in shape."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        a, b = self.net(x), self.net(y)
        return (a, b)


class SizeBranch(nn.Module):
    """The fuzzed model behind a branch on the batch size (torch.export captures it, as a shape-dependent
    model's), and a keyword with a default (`scale`) and an optional tensor (`bias`)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, scale: float = 2.0, bias=None):
        out = self.net(x)
        first = out[0] if isinstance(out, tuple) else out
        first = first * scale if x.shape[0] > 1 else first * (scale + 1.0)
        if bias is not None:
            first = first + bias
        return (first, *out[1:]) if isinstance(out, tuple) else first


_SHIFT = {"value": 0.0}    # a module global the reuse class's forward reads (outside the model: no key sees it)


class Restated(nn.Module):
    """The reuse class (#88): the fuzzed model behind state that is no parameter or buffer, a plain tensor attribute
    (`gain`, which an export bakes into the graph) and a module global (_SHIFT), both changed between two optimizes
    of the same model, as a new process would find them: the second optimize reads back what the first kept."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.gain = torch.tensor(1.5)

    def forward(self, x):
        out = self.net(x)
        first = out[0] if isinstance(out, tuple) else out
        first = first * self.gain.to(first.dtype) + _SHIFT["value"] if x.shape[0] > 1 else first
        return (first, *out[1:]) if isinstance(out, tuple) else first


def optimized_twice(model, example, config, device):
    """model optimized with reuse on over a cache folder of its own, its state changed (Restated), optimized again:
    the second optimize's module (the one compared with eager, the state left as changed); the environment put back."""
    import os
    import tempfile

    import accelc
    saved = {k: os.environ.get(k) for k in ("ACCELC_REUSE", "ACCELC_CACHE_DIR")}
    with tempfile.TemporaryDirectory(prefix="accelc-fuzz-reuse-") as folder:
        os.environ.update(ACCELC_REUSE="1", ACCELC_CACHE_DIR=folder)
        _SHIFT["value"] = 0.0
        try:
            accelc.optimize(model, example, config)
            model.gain = torch.tensor(-0.75, device=device)
            _SHIFT["value"] = 0.25
            return accelc.optimize(model, example, config)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def threaded(opt, x):
    """opt called from two threads at once, on x and on x reversed along the batch: the first thread's
    output, which the caller compares with eager; the second's must be bit for bit the same call made
    alone, else a RuntimeError (two calls at once corrupted one another)."""
    import threading

    from torch.utils import _pytree as pytree

    other = tuple(t.flip(0).clone() for t in x)
    outs, errors = [None, None], []

    def run(i, args):
        try:
            with torch.no_grad():
                outs[i] = opt(*[t.clone() for t in args])
        except Exception as e:      # raised below, in the caller's thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(0, x)), threading.Thread(target=run, args=(1, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    with torch.no_grad():
        alone = opt(*[t.clone() for t in other])
    if not all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(outs[1]), pytree.tree_leaves(alone))):
        raise RuntimeError("two calls at once: the second thread's output differs from the same call made alone")
    return outs[0]
