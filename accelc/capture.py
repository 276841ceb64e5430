"""Capture: nn.Module -> torch.fx.GraphModule in accelc's canonical form.

1. torch.fx.symbolic_trace; where it fails (data-dependent control flow: branches on shapes,
   `if mask is None`-style library code), torch.export (non-strict), whose ATen graph keeps the
   module path of every node in meta["nn_module_stack"]. The captured graph must reproduce the
   model's output on the example inputs, else the next method is tried.
2. Every node gets meta["accelc_path"], the module path it came from ("blocks.0.fc1"), and
   meta["accelc_meta"] (shape, dtype, device of its value on the example inputs).
3. Canonical form: the many spellings of one operation become one, so a pattern is written once.
   nn.Linear / aten.linear -> F.linear(x, w, b) (b may be None); nn.Conv2d (zero padding) ->
   F.conv2d(x, w, b, stride, padding, dilation, groups); eval nn.BatchNorm2d -> F.batch_norm(x,
   running_mean, running_var, weight, bias, False, momentum, eps); activation modules, methods,
   aten ops -> F.relu, F.gelu, F.silu, torch.sigmoid, torch.tanh; torch.add / aten.add /
   x.add(y) -> operator.add; x @ y / aten.matmul -> torch.matmul; eval-mode dropout and Identity
   are removed. In-place forms are canonicalised only where nothing else reads their input.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import _pytree as pytree

from accelc.errors import CaptureError

aten = torch.ops.aten


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def capture(model: nn.Module, args: tuple) -> tuple[fx.GraphModule, str, object]:
    """Returns (graph module, capture method, the model's eager output on `args`)."""
    with torch.no_grad():
        expected = model(*args)
    failures = []
    for method, trace in (("symbolic_trace", _symbolic_trace), ("torch.export", _export)):
        try:
            gm = trace(model, args)
            _check_same(expected, prepare(gm, args))
            return gm, method, expected
        except Exception as e:  # each method's failure is reported together below
            failures.append(f"{method}: {type(e).__name__}: {_first_line(e)}")
    raise CaptureError(
        "accelc could not capture the model as a graph.\n  " + "\n  ".join(failures) + "\n"
        "Branches on tensor values (if x.sum() > 0) defeat both tracers: rewrite them with "
        "torch.where or torch.cond, or optimize the submodules that trace on their own."
    )


def prepare(gm: fx.GraphModule, args: tuple):
    """Module paths, canonical form and value metadata for a graph from any tracer (also the
    graphs torch.compile hands the accelc backend). Returns gm's output on `args`."""
    _annotate_paths(gm)
    canonicalize(gm)
    with torch.no_grad():
        return record_meta(gm, args)


def export_program(model: nn.Module, args: tuple) -> torch.export.ExportedProgram:
    """torch.export (non-strict) with every dimension allowed to vary (batch, sequence); export
    specializes those the model pins down. Static shapes if that fails."""
    dynamic = tuple({i: torch.export.Dim.AUTO for i in range(a.dim())} if isinstance(a, torch.Tensor) else None
                    for a in args)
    try:
        return torch.export.export(model, args, dynamic_shapes=dynamic, strict=False)
    except Exception:
        return torch.export.export(model, args, strict=False)


def _symbolic_trace(model, args):
    return fx.symbolic_trace(model)


def _export(model, args):
    return export_program(model, args).module()


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _check_same(expected, got):
    exp_leaves, got_leaves = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    if len(exp_leaves) != len(got_leaves):
        raise RuntimeError("the captured graph returns a different output structure than the model")
    for e, g in zip(exp_leaves, got_leaves):
        if isinstance(e, torch.Tensor) and not torch.allclose(e, g, rtol=1e-5, atol=1e-6, equal_nan=True):
            raise RuntimeError("the captured graph's output differs from the model's on the example inputs")


def flat_inputs(gm: fx.GraphModule, args: tuple) -> list:
    """The values of gm's placeholders for call arguments `args` (export graphs take them flat)."""
    return list(gm.graph._codegen.process_inputs(*args))


def record_meta(gm: fx.GraphModule, args: tuple):
    """Run gm on `args`, storing each node's TensorMeta; returns gm's output."""

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                n.meta["accelc_meta"] = TensorMeta(tuple(out.shape), out.dtype, out.device)
            n.meta["accelc_none"] = out is None  # e.g. an optional mask argument left at None
            return out

    out = _Recorder(gm).run(*flat_inputs(gm, args))
    return gm.graph._codegen.process_outputs(out)


def tensor_meta(node) -> TensorMeta | None:
    return node.meta.get("accelc_meta") if isinstance(node, fx.Node) else None


# ---------------------------------------------------------------------------------------------
# module paths

def _annotate_paths(gm: fx.GraphModule) -> None:
    """meta["accelc_path"]: the module path a node came from; meta["accelc_module_type"]: that
    module's original class, qualified name (graph modules keep only stand-in containers)."""
    modules = dict(gm.named_modules())
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        if n.op == "call_module":
            path, cls = n.target, type(modules[n.target])
        elif n.op == "get_attr":
            path, cls = n.target.rpartition(".")[0], None
        else:
            path, cls = (_clean_path(list(stack.values())[-1][0]), list(stack.values())[-1][1]) if stack else ("", None)
        n.meta["accelc_path"] = path
        n.meta["accelc_module_type"] = cls if cls is None or isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


_TRACER_ROOT = re.compile(r"^(L\['[^']*'\]|L__self__)\.?")


def _clean_path(path: str) -> str:
    """Drop the tracer's name for the root module: L['self'].blocks.0 (strict export),
    L['fn'].0 (torch.compile), L__self__.fc -> blocks.0, 0, fc."""
    return _TRACER_ROOT.sub("", path)


# ---------------------------------------------------------------------------------------------
# canonical form

_ACTIVATION_MODULES = {nn.ReLU: F.relu, nn.SiLU: F.silu, nn.Sigmoid: torch.sigmoid, nn.Tanh: torch.tanh}
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)

# spelling -> canonical callable, for call_function targets
_FUNCTIONS = {
    F.linear: F.linear, F.relu: F.relu, F.silu: F.silu,
    torch.relu: F.relu, aten.relu.default: F.relu,
    F.gelu: F.gelu, aten.gelu.default: F.gelu,
    aten.silu.default: F.silu,
    F.sigmoid: torch.sigmoid, aten.sigmoid.default: torch.sigmoid,
    F.tanh: torch.tanh, aten.tanh.default: torch.tanh,
    torch.add: operator.add, aten.add.Tensor: operator.add,
    operator.matmul: torch.matmul, aten.matmul.default: torch.matmul,
    aten.linear.default: F.linear,
    aten.t.default: torch.t,
    F.conv2d: F.conv2d, aten.conv2d.default: F.conv2d, F.batch_norm: F.batch_norm,
    F.softmax: F.softmax, torch.softmax: F.softmax, aten.softmax.int: F.softmax,
    aten._softmax.default: F.softmax,
    aten.transpose.int: torch.transpose,
    F.scaled_dot_product_attention: F.scaled_dot_product_attention,
    aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
    operator.truediv: operator.truediv, torch.div: operator.truediv, aten.div.Tensor: operator.truediv,
    operator.mul: operator.mul, torch.mul: operator.mul, aten.mul.Tensor: operator.mul,
}
_METHODS = {"relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "add": operator.add,
            "matmul": torch.matmul, "t": torch.t, "softmax": F.softmax, "transpose": torch.transpose,
            "mul": operator.mul, "div": operator.truediv}
# in-place spelling -> out-of-place canonical (only where the mutated input has no other reader)
_INPLACE_FUNCTIONS = {torch.relu_: F.relu, operator.iadd: operator.add, aten.relu_.default: F.relu,
                      aten.add_.Tensor: operator.add}
_INPLACE_METHODS = {"relu_": F.relu, "add_": operator.add, "sigmoid_": torch.sigmoid, "tanh_": torch.tanh}


def canonicalize(gm: fx.GraphModule) -> None:
    g = gm.graph
    modules = dict(gm.named_modules())
    for n in list(g.nodes):
        if n.op == "call_module":
            _canonical_module(gm, n, modules[n.target])
        elif n.op == "call_method":
            if n.target in _METHODS:
                _retarget(n, _METHODS[n.target])
            elif n.target in _INPLACE_METHODS and _only_reader(n):
                _retarget(n, _INPLACE_METHODS[n.target])
        elif n.op == "call_function":
            target = n.target
            if target in _INPLACE_FUNCTIONS and _only_reader(n):
                _retarget(n, _INPLACE_FUNCTIONS[target])
            elif target in _FUNCTIONS and (not _inplace_arg(n) or _only_reader(n)):
                _retarget(n, _FUNCTIONS[target])
            elif target in (F.dropout, aten.dropout.default) and not _dropout_trains(n):
                n.replace_all_uses_with(n.args[0])
                g.erase_node(n)
    g.lint()
    gm.recompile()


def _canonical_module(gm, n, mod):
    g = gm.graph
    if isinstance(mod, nn.Identity) or (isinstance(mod, _DROPOUT_MODULES) and not mod.training):
        n.replace_all_uses_with(n.args[0])
        g.erase_node(n)
    elif isinstance(mod, nn.Linear):
        with g.inserting_before(n):
            w = g.get_attr(f"{n.target}.weight")
            b = g.get_attr(f"{n.target}.bias") if mod.bias is not None else None
            new = g.call_function(F.linear, (n.args[0], w, b))
        for a in (w, b):
            if a is not None:
                a.meta["accelc_path"] = n.target
        _swap(n, new)
    elif type(mod) in _ACTIVATION_MODULES and (not getattr(mod, "inplace", False) or _only_reader(n)):
        with g.inserting_before(n):
            new = g.call_function(_ACTIVATION_MODULES[type(mod)], (n.args[0],))
        _swap(n, new)
    elif type(mod) is nn.Conv2d and mod.padding_mode == "zeros":
        with g.inserting_before(n):
            w = g.get_attr(f"{n.target}.weight")
            b = g.get_attr(f"{n.target}.bias") if mod.bias is not None else None
            new = g.call_function(F.conv2d, (n.args[0], w, b, mod.stride, mod.padding, mod.dilation, mod.groups))
        for a in (w, b):
            if a is not None:
                a.meta["accelc_path"] = n.target
        _swap(n, new)
    elif type(mod) is nn.BatchNorm2d and not mod.training and mod.track_running_stats:
        with g.inserting_before(n):
            ins = [g.get_attr(f"{n.target}.{name}") if getattr(mod, name) is not None else None
                   for name in ("running_mean", "running_var", "weight", "bias")]
            new = g.call_function(F.batch_norm, (n.args[0], *ins, False, mod.momentum or 0.0, mod.eps))
        for a in ins:
            if a is not None:
                a.meta["accelc_path"] = n.target
        _swap(n, new)
    elif isinstance(mod, nn.GELU):
        with g.inserting_before(n):
            new = g.call_function(F.gelu, (n.args[0],), _gelu_kwargs(mod.approximate))
        _swap(n, new)


def _swap(old, new):
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def _retarget(n, target):
    """Point n at the canonical callable, with canonical arguments."""
    args, kwargs = tuple(n.args), dict(n.kwargs)
    kwargs.pop("inplace", None)
    if target is F.gelu:
        kwargs = _gelu_kwargs(kwargs.get("approximate", "none"))
    elif target is F.linear:
        args = (args + (kwargs.pop("bias", None),))[:3] if len(args) < 3 else args
    elif target is operator.add:
        if kwargs.pop("alpha", 1) != 1 or len(args) != 2:
            return  # x + alpha * y stays as written
    elif target is operator.truediv:
        if kwargs.get("rounding_mode") is not None or len(args) != 2:
            return  # floor / trunc division stays as written
    elif target is F.softmax:
        dim = kwargs.pop("dim", args[1] if len(args) > 1 else None)
        if kwargs.get("dtype") is not None or dim is None or len(args) > 2 and args[2] is not False:
            return  # softmax with a dtype cast (or aten's half_to_float) stays as written
        args, kwargs = (args[0], dim), {}
    elif target in _POSITIONAL:
        names, defaults = _POSITIONAL[target]
        bound = dict(zip(names, args))
        args = tuple(bound.get(k, kwargs.pop(k, d)) for k, d in zip(names, defaults))
        kwargs = {}
    elif target is torch.transpose:
        args = (args[0], kwargs.pop("dim0", args[1] if len(args) > 1 else None),
                kwargs.pop("dim1", args[2] if len(args) > 2 else None))
    n.op, n.target, n.args, n.kwargs = "call_function", target, args, kwargs
    if target is F.relu or target is F.silu:
        n.args = args[:1]


# canonical callables whose arguments are all made positional: (names, defaults)
_POSITIONAL = {
    F.conv2d: (("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
               (None, None, None, 1, 0, 1, 1)),
    F.batch_norm: (("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
                   (None, None, None, None, None, False, 0.1, 1e-5)),
}


def _gelu_kwargs(approximate: str) -> dict:
    return {"approximate": "tanh"} if approximate == "tanh" else {}


def _inplace_arg(n) -> bool:
    """F.relu(x, inplace=True) / F.relu(x, True)."""
    if n.target in (F.relu, F.silu):
        return bool(n.kwargs.get("inplace", n.args[1] if len(n.args) > 1 else False))
    return False


def _only_reader(n) -> bool:
    """An in-place op may become out-of-place when nothing else reads the tensor it mutates."""
    src = n.args[0] if n.args else None
    return isinstance(src, fx.Node) and len(src.users) == 1


def _dropout_trains(n) -> bool:
    if n.target is F.dropout:
        return bool(n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True))
    return bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("train", False))
