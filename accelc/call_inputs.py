"""What a call of an optimized module was given: a tracer's values (the plain graph answers them), or an array of
numbers where a tensor belongs (refused in words)."""
from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree


def array_input(args, example) -> str | None:
    """The first positional input that is an array of numbers but no tensor (a numpy array, a list or tuple of
    numbers) where the example (flat, as args) had a tensor, in words; None where there is none."""
    def numbers(v) -> bool:
        return isinstance(v, (list, tuple)) and len(v) > 0 and all(
            isinstance(x, (int, float, bool)) or numbers(x) for x in v)
    example = tuple(example or ())
    for i, v in enumerate(args):
        if isinstance(v, torch.Tensor) or i >= len(example) or not isinstance(example[i], torch.Tensor):
            continue
        where = f"input {i}"
        if type(v).__module__ == "numpy" and type(v).__name__ == "ndarray":
            return f"{where} is a numpy array"
        if numbers(v):
            return f"{where} is a Python {type(v).__name__} of numbers"
    return None


def traced(args, kwargs) -> bool:
    """Whether this call is a tracer's (Dynamo, export, fx), not a real one."""
    compiler = torch.compiler
    if compiler.is_compiling() or (hasattr(compiler, "is_exporting") and compiler.is_exporting()):
        return True
    return any(isinstance(x, (fx.Proxy, FakeTensor)) for x in pytree.tree_leaves((args, kwargs)))
