"""The example inputs optimize is given, made ready before capture: checked (empty, NaN, past the dtype's
range; calibration batches the model cannot take), one tensor given as two inputs separated, and a dim
declared on one input carried to the inputs the model ties to it."""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.utils import _pytree as pytree

from accelc.capture import buffer_state, restore_buffers
from accelc.errors import InputError, short_error


def carried_dims(model: nn.Module, args: tuple, kwargs: dict, declared: dict) -> dict:
    """`declared` (dynamic=, by input name) with each declared dim carried to the same dim of the inputs
    left out of it whose size in the example is the same (a BERT's attention mask beside its input_ids):
    a dim declared on one input is the size of the inputs the model ties to it, which would otherwise be
    fixed at the example's size and refuse every call of another. Where the model does not tie them,
    torch.export fixes the carried dim again, as it fixes any dim the model pins."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    inputs = {**dict(zip(params, args)), **kwargs}
    out = {name: dict(dims) for name, dims in declared.items()}
    for name, t in inputs.items():
        if name in declared or not isinstance(t, torch.Tensor):
            continue
        for other, dims in declared.items():
            source = inputs.get(other)
            for d, bounds in (dims or {}).items():
                if isinstance(source, torch.Tensor) and d < t.dim() and d < source.dim() \
                        and t.shape[d] == source.shape[d] and t.shape[d] > 1:
                    out.setdefault(name, {}).setdefault(d, bounds)
    return out


def separate_aliases(tree):
    """`tree` with every tensor that shares memory with an earlier one replaced by a copy. One tensor
    given as two inputs (`{"input_ids": ids, "labels": ids}`, `(x, x)`) is two inputs to the user's
    later calls: torch.export would merge them into one graph input, and every check on the example
    would pass while calls with two different tensors go wrong."""
    seen = set()

    def own(t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
            return t
        key = (t.device, t.untyped_storage().data_ptr())
        if key in seen:
            return t.clone()
        seen.add(key)
        return t
    return pytree.tree_map(own, tree)


def check_calibration(model: nn.Module, args: tuple, batches: list, kwargs: dict) -> None:
    """Each calibration batch must be one the model takes as it takes the example (int8 statistics
    are read off the optimized graph running it): non-finite values or a batch the model itself
    fails on are refused in one line naming the batch, before any pass runs."""
    def shapes(b):
        return ", ".join("x".join(map(str, t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__ for t in b)
    state = buffer_state(model)
    try:
        for i, b in enumerate(batches):
            if len(b) != len(args):
                raise InputError(f"calibration batch {i} holds {len(b)} input(s) ({shapes(b)}), the example "
                                 f"{len(args)} ({shapes(args)}): give each batch as the example's inputs")
            for t in b:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                    raise InputError(f"calibration batch {i} ({shapes(b)}) holds NaN or inf: int8 scales read off it "
                                     "would be too; give finite batches of real data")
            try:
                with torch.no_grad():
                    model(*b, **kwargs)
            except Exception as e:
                raise InputError(f"calibration batch {i} ({shapes(b)}): the model itself fails on it "
                                 f"({short_error(e)}); give batches shaped like the example ({shapes(args)})") from None
    finally:
        restore_buffers(model, state)


def check_example_inputs(args: tuple, kwargs: dict | None = None, cast: str | None = None) -> None:
    """The guard checks every rewritten layer on the example inputs: they must hold numbers to
    check on. Empty tensors and NaN / inf values are refused, naming the input; `cast`: the
    OptimizeConfig.dtype the inputs were just cast to (a value past its range became inf)."""
    named = [(str(i), t) for i, t in enumerate(pytree.tree_leaves(args))]
    named += [(repr(k), t) for k, v in (kwargs or {}).items() for t in pytree.tree_leaves(v)]
    for i, t in named:
        if not isinstance(t, torch.Tensor):
            continue
        shape = "x".join(map(str, t.shape)) or "scalar"
        if t.numel() == 0:
            raise InputError(f"example input {i} ({shape}) is empty: accelc checks every rewritten layer on the "
                             "example inputs, so give at least one row (batch size >= 1)")
        if (t.is_floating_point() or t.is_complex()) and t.device.type != "meta" and not torch.isfinite(t).all():
            if cast is not None:
                raise InputError(f"example input {i} ({shape}) holds values past {t.dtype}'s range (at most "
                                 f"{torch.finfo(t.dtype).max:.6g}): cast by OptimizeConfig(dtype={str(cast).replace('torch.', '')!r}) they "
                                 "become inf; scale the inputs, or optimize in a wider dtype")
            raise InputError(f"example input {i} ({shape}) holds NaN or inf: accelc checks every rewritten layer "
                             "on the example inputs, so give finite ones (real data, or torch.randn)")
