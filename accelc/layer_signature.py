"""What makes two rewritten layers the same work for a timer: the op, the sizes, dtypes and strides of what it
reads, its other arguments, and the PyTorch subgraph it replaced, its weights' names aside. The repeated blocks
of a model (a transformer's layers) are so, and the guard's speed race times one such layer for all of them
(accelc.guard's _race): their times differ by noise alone, and a verdict one way for one block and the other for
its twin is noise too. And a digest of tensors' values (values_digest), for keys that must tell weights apart by
what they hold."""
from __future__ import annotations

import operator

import torch
from torch import fx


def signature(node: fx.Node, args: tuple, kwargs: dict, original: fx.GraphModule | None, extra=()) -> tuple:
    """node's call on args / kwargs (its values at the race's inputs), with `original`'s structure; `extra`: what
    else the caller times by (hashable)."""
    return (node.target, value(args), value(sorted(kwargs.items())), _structure(original), extra)


def value(v):
    """v as a key: a tensor by its sizes, dtype, strides, device and alignment; a container by its items."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, tuple(v.stride()), str(v.device), v.data_ptr() % 16)   # (TMA)
    if isinstance(v, (list, tuple)):
        return tuple(value(x) for x in v)
    if isinstance(v, dict):
        return ("dict", tuple((k, value(x)) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))))
    if v is None or v is Ellipsis or isinstance(v, (bool, int, float, str, torch.dtype, torch.device,
                                                    torch.memory_format, torch.layout)):
        return v
    if isinstance(v, slice):
        return ("slice", value(v.start), value(v.stop), value(v.step))
    return ("object", id(v))      # anything else: only the same object is the same


def _structure(gm: fx.GraphModule | None) -> tuple:
    """The subgraph's ops in order, their arguments as positions of earlier nodes or values; a weight (get_attr)
    by its size, not its name; a submodule by its type."""
    if gm is None:
        return ()
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                attr = operator.attrgetter(n.target)(gm)      # (a dotted path: a submodule's tensor)
            except AttributeError:
                attr = None
            out.append(("attr", value(attr) if isinstance(attr, torch.Tensor) else type(attr).__name__))
            continue
        target = type(gm.get_submodule(n.target)).__name__ if n.op == "call_module" else n.target
        as_args = fx.node.map_arg((n.args, n.kwargs), lambda m: ("node", index[m]))
        out.append((n.op, target if n.op != "placeholder" else "input", value(as_args[0]),
                    value(sorted(as_args[1].items()))))
    return tuple(out)


_CHUNK = 1 << 22    # elements of a tensor's values digested at once


def values_digest(tensors: list) -> list:
    """A digest of the tensors' values: per tensor, two position-weighted sums of its 32-bit words (of its
    bytes where they do not make whole words), computed where the tensor lives, read back once."""
    sums = []
    with torch.no_grad():
        for t in tensors:
            b = t.detach().contiguous().reshape(-1).view(torch.uint8)
            try:
                w = b.view(torch.int32) if b.numel() % 4 == 0 else b
            except RuntimeError:     # a storage offset that does not make whole words
                w = b
            acc = torch.zeros(2, dtype=torch.int64, device=t.device)
            for start in range(0, w.numel(), _CHUNK):
                part = w[start:start + _CHUNK].to(torch.int64)
                pos = torch.arange(start, start + part.numel(), device=t.device, dtype=torch.int64)
                acc[0] += (part * (pos * 0x9E3779B1 + 1)).sum()
                acc[1] += ((part + pos) * (part ^ 0x5BD1E995)).sum()
            sums.append(acc)
    return torch.stack(sums).cpu().tolist() if sums else []
