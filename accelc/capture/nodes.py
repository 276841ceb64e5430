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
            and (meta.op_name(node) in VIEW_OPS or meta.op_name(node) in _MAY_RETURN_INPUT or is_inplace(node)):
        node = node.args[0]
    return node


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
