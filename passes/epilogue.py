"""What may follow a GEMM-shaped op and be folded into its kernel's epilogue (kernels/epilogue.py):
an activation of the epilogue's table and a residual add, in either order. Used by the rules of
linear_act and conv_gemm."""
from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from accelc import meta
from accelc.kernels.epilogue import activation_named


def activation_name(node) -> str | None:
    """The kernels/epilogue.py ACTIVATIONS name of a canonical activation node, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or len(node.args) != 1:
        return None
    return activation_named(node.target, dict(node.kwargs))


@dataclass
class Epilogue:
    nodes: list                  # the absorbed nodes, in order
    activation: str = "none"
    residual: fx.Node | None = None
    residual_first: bool = False

    def label(self, op: str) -> str:
        """The kernel label for summaries: accelc::linear[gelu+residual], accelc::conv2d[residual+relu]."""
        parts = [] if self.activation == "none" else [self.activation]
        if self.residual is not None:
            parts.insert(0 if self.residual_first else len(parts), "residual")
        return f"accelc::{op}" + (f"[{'+'.join(parts)}]" if parts else "")


def absorb(anchor: fx.Node) -> Epilogue:
    """Walk forward from `anchor` through sole users: an activation, a residual add of a tensor
    of the same shape and dtype, in either order (act(y) + r, or act(y + r))."""
    ep = Epilogue(nodes=[])
    node = anchor

    def residual_of(add, n):
        if not (isinstance(add, fx.Node) and add.op == "call_function" and add.target is operator.add):
            return None
        other = add.args[1] if add.args[0] is n else add.args[0]
        if other is n or not isinstance(other, fx.Node):
            return None
        mo, mn = meta.tensor_meta(other), meta.tensor_meta(n)
        if mo is None or mn is None or (mo.shape, mo.dtype) != (mn.shape, mn.dtype):
            return None
        return other

    user = meta.sole_user(node)
    res = residual_of(user, node)
    if res is not None and activation_name(meta.sole_user(user)) is not None:
        act_node = meta.sole_user(user)
        ep.nodes += [user, act_node]
        ep.residual, ep.residual_first, ep.activation = res, True, activation_name(act_node)
        return ep
    act = activation_name(user)
    if act is not None:
        ep.nodes.append(user)
        ep.activation = act
        node = user
        user = meta.sole_user(node)
    res = residual_of(user, node)
    if res is not None:
        ep.nodes.append(user)
        ep.residual = res
    return ep
