"""The inputs the guard checks each layer on besides the example: a second draw at the same shapes, and the
example's other sizes (the ends of the graph's ranges, an odd size between, or another batch)."""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from accelc.capture.shapes import memory_layout, repeated_to


def other_inputs(args: tuple, shapes=None) -> list[tuple[str, tuple]]:
    """Inputs the guard checks the layers on besides the example, as (label, inputs)."""
    return [(label, inputs) for label, inputs, _ in sized_other_inputs(args, shapes)]


def sized_other_inputs(args: tuple, shapes=None) -> list[tuple[str, tuple, dict | None]]:
    """Inputs the guard checks the layers on besides the example, as (label, inputs, sizes): ("on a
    second draw of the inputs", same shapes, drawn independently); where `shapes` (the graph's
    InputShapes) has dims that vary, the ends of their ranges and an odd size in between
    (InputShapes.other_shapes, `sizes` the varying dims' sizes); else, where every tensor input has
    the same leading dim b, ("at batch b2", b2 != b). Floating-point tensors are drawn normal with
    each example tensor's mean and std; integer ones (token ids, masks) uniform over the example's
    range; bool ones and everything else are the example's, repeated or cut to size."""
    gen = torch.Generator().manual_seed(12345)
    tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    out = [("on a second draw of the inputs", draw(args, gen, [None] * len(args)), None)]
    if shapes is not None and not shapes.free and shapes.varying():
        for label, sizes in shapes.other_shapes(args):
            out.append((label, draw(args, gen, shapes.shaped(args, sizes)), sizes))
        return out
    batches = {t.shape[0] if t.dim() else None for t in tensors}
    if len(batches) == 1 and None not in batches:
        b = batches.pop()
        # one row fewer: a tail the example did not have, in the same tuning bucket (next power of
        # two of the rows) as the example, so the check tunes nothing new
        b2 = b + 2 if b <= 2 else b - 1
        out.append((f"at batch {b2}", draw(args, gen, [(b2, *a.shape[1:]) if isinstance(a, torch.Tensor) and a.dim()
                                                        else None for a in args]), None))
    return out


def draw(args, gen, shapes: list):
    """args drawn anew (see other_inputs), each tensor at its shape in `shapes` (None: its own)."""
    def one(t, shape):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        shape = tuple(t.shape) if shape is None else tuple(shape)
        if t.is_floating_point() and t.numel() > 1:
            x = torch.randn(shape, generator=gen, dtype=torch.float32)
            x = x * t.float().std().item() + t.float().mean().item()
        elif t.dtype in (torch.int32, torch.int64) and t.numel() > 0:
            lo, hi = int(t.min()), int(t.max())
            x = torch.randint(lo, hi + 1, shape, generator=gen, dtype=t.dtype)
        elif shape == tuple(t.shape):
            return t
        else:   # repeated along each dim, then cut to size
            return repeated_to(t, shape)
        return x.to(device=t.device, dtype=t.dtype).contiguous(memory_format=memory_layout(t))
    return tuple(one(a, s) if isinstance(a, torch.Tensor) else pytree.tree_map(lambda t: one(t, None), a)
                 for a, s in zip(args, shapes))
