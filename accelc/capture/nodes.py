"""Node-level graph helpers that capture, the runner and the passes share: which ops may return a
view of their input, what a node is a view of, which ops write in place, what a reshape reads;
swapping a node for another and erasing what nothing reads any more."""
from __future__ import annotations

import torch
from torch import fx

from accelc import meta

_RESHAPES = {"view", "reshape", "_unsafe_view"}


def reshape_of(node):
    """The tensor a view / reshape node reshapes, else None."""
    if isinstance(node, fx.Node) and node.op in ("call_method", "call_function") and node.args \
            and isinstance(node.args[0], fx.Node) and meta.op_name(node) in _RESHAPES:
        return node.args[0]
    return None



def erase_dead(nodes) -> list:
    """Erase the nodes of `nodes` nothing reads any more (repeatedly: each erase may free others);
    returns those erased."""
    alive, erased = list(nodes), []
    changed = True
    while changed:
        changed = False
        for n in list(alive):
            if not n.users:
                n.graph.erase_node(n)
                alive.remove(n)
                erased.append(n)
                changed = True
    return erased

# ops whose result may share memory with their first argument
VIEW_OPS = {"view", "reshape", "permute", "transpose", "t", "getitem", "select", "slice", "narrow", "expand",
             "unsqueeze", "squeeze", "flatten", "unflatten", "as_strided", "detach", "alias", "contiguous",
             "view_as", "unfold", "diagonal", "split", "chunk", "unbind", "movedim", "T", "mT"}


# conversions that return their input itself where it already has the dtype / device asked
_MAY_RETURN_INPUT = {"to", "type", "type_as", "float", "half", "double", "bfloat16", "long", "int", "bool"}


def view_base(node: fx.Node) -> fx.Node:
    """The node whose memory `node` may be a view of (itself if it is not a view op). Followed too:
    an in-place op's result, the tensor it wrote (`length.copy_(start)` is `length`), and a
    conversion's, which is its input where nothing needed converting (`length.to(torch.long)`)."""
    while node.op in ("call_method", "call_function") and node.args and isinstance(node.args[0], fx.Node) \
            and (meta.op_name(node) in VIEW_OPS or meta.op_name(node) in _MAY_RETURN_INPUT or _returns_first(node)):
        node = node.args[0]
    return node


def _returns_first(node: fx.Node) -> bool:
    """An in-place op that returns the tensor it wrote (aten's `x.add_(y)` is x); an op that writes an argument
    and returns new tensors (accelc::qkv_rotary, writing the cache) does not."""
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None
    return is_inplace(node)


def written_args(node: fx.Node) -> list:
    """The nodes an op writes in place: those its schema marks written (an aten in-place op's self, a custom op's
    mutated arguments), or the first argument of a method or function named in place (`x.add_(y)`)."""
    if not is_inplace(node):
        return []
    if isinstance(node.target, torch._ops.OpOverload):
        out = []
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                out += [value] if isinstance(value, fx.Node) else []
        return out
    return [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []


def is_inplace(node: fx.Node) -> bool:
    if node.op not in ("call_method", "call_function"):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    name = meta.op_name(node)
    return (name.endswith("_") and not name.startswith("_")) or name in ("iadd", "isub", "imul", "itruediv")


def swap(old: fx.Node, new: fx.Node) -> None:
    """`new` takes `old`'s metadata and readers; `old` is erased."""
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)
