"""What accelc writes on torch.fx nodes, named once.

Every node of a captured graph carries, in node.meta:
  PATH         the module path it came from ("blocks.0.fc1"; "" for the root's own ops)
  MODULE_TYPE  that module's class, qualified ("torch.nn.modules.linear.Linear"), or None
  VALUE        a TensorMeta (shape, dtype, device) of its value on the example inputs
  IS_NONE      True when its value was None (an optional argument the caller left out)
and, once passes ran,
  REWRITE      on a node that calls an accelc op: its accelc.rewrite.Rewrite (the layer)
  SKIP         why no rule took this node (explain() writes it)
  REVERTED     on the nodes the guard put back: (the layer's Rewrite, reason, "reverted" | "kept")
  ABSORBED     module paths folded into this node (a batch norm into its conv), for layer names
  DERIVED      on a get_attr of a tensor a pass made (a folded or stacked weight): (fn, source
               targets), fn(*sources) recomputing it from the model's own tensors, so a layer whose
               tensors were released can be rebuilt from the model (accelc.records.Rewrite.eager)
The graph module's own meta holds REPLACED during a pass (accelc.rewrite.replace_uses).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import fx

PATH = "accelc_path"
MODULE_TYPE = "accelc_module_type"
VALUE = "accelc_meta"
IS_NONE = "accelc_none"
REWRITE = "accelc"
SKIP = "accelc_skip"
REVERTED = "accelc_reverted"
ABSORBED = "accelc_absorbed"
DERIVED = "accelc_derived"
REPLACED = "accelc_replaced"


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    contiguous: bool = True      # eager's value was contiguous (row-major)

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), t.dtype, t.device, t.is_contiguous())

    def empty(self) -> torch.Tensor:
        """A meta-device tensor of this shape and dtype, for kernels' why_unsupported checks."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def tensor_meta(node) -> TensorMeta | None:
    """The TensorMeta of a node's value, or None (not a node, not a tensor, not recorded)."""
    return node.meta.get(VALUE) if isinstance(node, fx.Node) else None


def set_tensor_meta(node: fx.Node, t: torch.Tensor) -> None:
    node.meta[VALUE] = TensorMeta.of(t)


def meta_tensor(node) -> torch.Tensor | None:
    """An empty meta-device tensor shaped like the node's value, or None."""
    m = tensor_meta(node)
    return None if m is None else m.empty()


def path(node: fx.Node) -> str:
    return node.meta.get(PATH, "")


def rewrite_of(node):
    """The Rewrite of a node that calls an accelc op, else None."""
    return node.meta.get(REWRITE) if isinstance(node, fx.Node) else None


def explain(node: fx.Node, reason: str) -> None:
    """Record why `node` stays as it is. One policy for every pass: the first reason given for a
    node stands (the pass that knows the node best runs first: attention before linear_act sees
    the matmuls of an attention it refused). On a node that is already an accelc layer (the int8
    pass choosing float for it), the reason becomes the layer's note instead."""
    rw = rewrite_of(node)
    if rw is not None:
        rw.note = reason
    elif reason:
        node.meta.setdefault(SKIP, reason)


def reason_kept(node: fx.Node) -> str | None:
    return node.meta.get(SKIP)


def bound_args(n: fx.Node, names) -> dict:
    """n's arguments by parameter name: its positional ones named by `names` in order, then its
    keywords as given (unknown names included: callers refuse or drop them)."""
    bound = dict(zip(names, n.args))
    bound.update(n.kwargs)
    return bound


def arg(n: fx.Node, i: int, name: str, default=None):
    """n's argument at position i, or its keyword `name`, or `default`."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def sole_user(n: fx.Node):
    """The one node that reads n, or None (no reader, or several)."""
    return next(iter(n.users)) if len(n.users) == 1 else None


def op_name(n: fx.Node) -> str:
    """A node's op in one word: the module's attribute name, the method, or the function's name
    (an aten overload's op: aten.view.default -> view)."""
    if n.op == "call_module":
        return n.target.rpartition(".")[2]
    if n.op == "call_method":
        return str(n.target)
    name = getattr(n.target, "__name__", str(n.target))
    return name.split(".")[0]


def attr_value(gm: fx.GraphModule, node: fx.Node):
    """The parameter / buffer a get_attr node reads ("layer1.0.conv1.weight")."""
    return functools.reduce(getattr, node.target.split("."), gm)


def runs_accelc(model) -> bool:
    """Whether `model` is a program whose graph calls accelc's ops (what accelc.save and convert write)."""
    graph = getattr(model, "graph", None)
    return isinstance(graph, fx.Graph) and any(getattr(n.target, "namespace", None) == "accelc" for n in graph.nodes)
