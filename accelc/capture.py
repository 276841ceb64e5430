"""Capture: nn.Module -> torch.fx.GraphModule in accelc's canonical form.

1. torch.fx.symbolic_trace; where it fails (data-dependent control flow: branches on shapes,
   `if mask is None`-style library code), torch.export (non-strict), whose ATen graph keeps the
   module path of every node in meta["nn_module_stack"]. The captured graph must reproduce the
   model's output on the example inputs, else the next method is tried.
2. Every node gets its module path ("blocks.0.fc1"), module class, and the shape, dtype and
   device of its value on the example inputs (accelc.meta names the keys).
3. Canonical form: the many spellings of one operation become one, so a pattern is written once.
   nn.Linear / aten.linear -> F.linear(x, w, b) (b may be None); nn.Conv2d (zero padding) ->
   F.conv2d(x, w, b, stride, padding, dilation, groups); eval nn.BatchNorm2d -> F.batch_norm(x,
   running_mean, running_var, weight, bias, False, momentum, eps); activation modules, methods,
   aten ops -> F.relu, F.gelu, F.silu, torch.sigmoid, torch.tanh; torch.add / aten.add /
   x.add(y) -> operator.add; x @ y / aten.matmul -> torch.matmul; a GELU written out in pointwise
   ops -> F.gelu; nn.LayerNorm / aten.layer_norm -> F.layer_norm(x, shape, w, b, eps); eval-mode dropout and Identity are removed. In-place forms are canonicalised only where nothing else reads their input.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import _pytree as pytree

from accelc import meta
from accelc.errors import CaptureError, InputError
from accelc.kernels.epilogue import ACTIVATIONS
from accelc.numerics import rel_l2, same_values

aten = torch.ops.aten


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None) -> tuple[fx.GraphModule, str, object]:
    """Returns (graph module, capture method, the model's eager output on `args`, `kwargs`). The
    graph takes the CallSpec's flat positional inputs (gm.meta[CALL_SPEC]: the positional
    arguments, then the tensor keyword arguments). Buffers the forward updates in place get back
    their values after each run here; symbolic_trace is not tried on such a model (it runs buffer
    updates once, at trace time, instead of recording them)."""
    kwargs = dict(kwargs or {})
    state = buffer_state(model)
    given = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in (*args, *kwargs.values())]
    with torch.no_grad():
        expected = model(*args, **kwargs)
    updated = [name for name, b in model.named_buffers() if name in state and not same_values(b, state[name])]
    restore_buffers(model, state)
    names = [str(i) for i in range(len(args))] + list(kwargs)
    changed = [names[i] for i, (t, g) in enumerate(zip((*args, *kwargs.values()), given))
               if isinstance(t, torch.Tensor) and not same_values(t, g)]
    if changed:
        raise CaptureError(f"the model's forward changes its input {changed[0]} in place (x.add_(...), x[...] = ...): "
                           "accelc optimizes forwards that leave their inputs as they are; write the update "
                           "out of place (x = x + ...)")
    spec = CallSpec.of(model, args, kwargs, expected)
    flat = spec.flat(args, kwargs)
    failures = []
    with quiet_torch_logs():
        found = _try_tracers(model, spec, flat, expected, state, updated, failures)
    if found is not None:
        return found
    raise CaptureError("accelc could not capture the model as a graph.\n  " + "\n  ".join(failures) + "\n"
                       + _capture_advice(model, args, kwargs, expected, state, failures))


@contextlib.contextmanager
def quiet_torch_logs():
    """torch's own loggers at ERROR, and stderr held back, while a tracer works: a failing
    torch.export logs and prints whole graphs (accelc reports the failure, once). Left alone with
    accelc's log at DEBUG (-v)."""
    if logging.getLogger("accelc").isEnabledFor(logging.DEBUG):
        yield
        return
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _try_tracers(model, spec, flat, expected, state, updated, failures):
    """(graph module, method, expected) from the first tracer whose graph reproduces the model;
    None when none does (each failure appended to `failures`)."""
    for method, trace in (("symbolic_trace", _symbolic_trace), ("torch.export", _export)):
        if method == "symbolic_trace" and updated:
            failures.append(f"{method}: not tried: forward updates buffers in place ({', '.join(updated[:3])}), "
                            "which it cannot record")
            continue
        if method == "symbolic_trace" and spec.template is not None:
            failures.append(f"{method}: not tried: the output holds tensors in objects a traced graph cannot return")
            continue
        try:
            gm = trace(model, spec, flat)
            restore_buffers(model, state)   # tracing (and export's own check) ran the forward's updates
            restore_buffers(gm, state)
            gm.meta[CALL_SPEC] = spec
            _check_same(spec.flat_output(expected), prepare(gm, flat))
            return gm, method, expected
        except Exception as e:  # each method's failure is reported together below
            failures.append(f"{method}: {type(e).__name__}: {_first_line(e)}")
        finally:
            restore_buffers(model, state)
    return None


def _capture_advice(model, args, kwargs, expected, state, failures) -> str:
    """What to try when no tracer reproduced the model: the cause found by looking (output that
    changes from call to call), else the usual cause of the failures seen."""
    try:
        with torch.no_grad():
            again = model(*args, **kwargs)
        restore_buffers(model, state)
    except Exception:
        again = None
    try:
        if again is not None:
            _check_same(expected, again)
    except RuntimeError:
        return ("The model's output differs between two calls on the same inputs: it draws random numbers "
                "in eval mode (F.dropout(x, p, training=True), torch.rand...), so no graph can be checked "
                "against it. Tie the randomness to self.training (F.dropout(x, p, self.training)) or "
                "remove it for inference.")
    if any("differs from the model's" in f or "data-dependent" in f.lower() or "guard" in f.lower()
           for f in failures):
        return ("Branches on tensor values (if x.sum() > 0) defeat both tracers: rewrite them with "
                "torch.where or torch.cond, or optimize the submodules that trace on their own.")
    return ("Optimize the submodules that trace on their own, or export the model yourself "
            "(torch.export.export) and give accelc the program (.pt2).")


CALL_SPEC = "accelc_call_spec"   # gm.meta key: the CallSpec of a captured graph


class _Slot:
    """Where the i-th output tensor goes in an output template."""
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, type)


def _remap(obj, visit, memo: dict):
    """`obj` with every tensor (and _Slot) in it replaced by visit(it): tuples, lists, dicts,
    dataclasses, HF ModelOutputs and plain objects (a DynamicCache) are copied along the way, so
    the caller's objects are never changed. Objects reached twice are copied once."""
    if isinstance(obj, (torch.Tensor, _Slot)):
        return visit(obj)
    if isinstance(obj, _ATOMS) or id(obj) in memo:
        return obj if isinstance(obj, _ATOMS) else memo[id(obj)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        new = type(obj)(*(_remap(v, visit, memo) for v in obj))
    elif type(obj) in (tuple, list):
        new = type(obj)(_remap(v, visit, memo) for v in obj)
    elif isinstance(obj, dict) or hasattr(obj, "__dict__"):
        new = copy.copy(obj)
        memo[id(obj)] = new
        if isinstance(obj, dict):
            for k, v in obj.items():
                dict.__setitem__(new, k, _remap(v, visit, memo))
        for k, v in getattr(obj, "__dict__", {}).items():
            object.__setattr__(new, k, _remap(v, visit, memo))
        return new
    else:
        return obj
    memo[id(obj)] = new
    return new


def _tensors_in(obj) -> list:
    """The distinct tensors anywhere in obj (see _remap), in the order first met."""
    found = {}
    _remap(obj, lambda t: found.setdefault(id(t), t), {})
    return list(found.values())


@dataclass
class CallSpec:
    """How a user's call of the model maps onto the captured graph and back.

    The graph takes the positional arguments, then the keyword arguments that are tensors (in the
    forward's order); keyword arguments that are not tensors (use_cache=False) are fixed at
    capture, as torch.export fixes them. An output holding tensors where the tracers cannot see
    them (HF's DynamicCache, a plain object) is captured as its flat tuple of tensors and rebuilt
    around the graph's result on each call, as the model returns it."""
    n_args: int
    kw_names: tuple = ()
    constants: dict = field(default_factory=dict)
    template: object = None      # the output with _Slots for its tensors, where it needs rebuilding
    arg_names: tuple = ()        # the forward's names of the positional arguments
    defaults: dict = field(default_factory=dict)   # parameters the call left out, fixed at these defaults

    @staticmethod
    def of(model, args, kwargs, expected) -> "CallSpec":
        try:
            params = list(inspect.signature(model.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        order = [p.name for p in params]
        positional = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        arg_names = tuple(positional[:len(args)]) if len(positional) >= len(args) else tuple(
            f"input_{i}" for i in range(len(args)))
        defaults = {k: v for k, v in left_out(model, args).items() if k not in kwargs}
        tensors = sorted((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)),
                         key=lambda k: order.index(k) if k in order else len(order))
        constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        template = None
        seen = {id(t) for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)}
        hidden = _tensors_in(expected)
        if any(id(t) not in seen for t in hidden):
            index = {id(t): i for i, t in enumerate(hidden)}
            template = _remap(expected, lambda t: _Slot(index[id(t)]), {})
        return CallSpec(len(args), tuple(tensors), constants, template, arg_names, defaults)

    @property
    def trivial(self) -> bool:
        return not self.kw_names and not self.constants and self.template is None

    def flat(self, args, kwargs) -> tuple:
        """The graph's inputs for a call model(*args, **kwargs); InputError where the call does
        not fit what was captured."""
        if not kwargs and not self.kw_names and len(args) == self.n_args:
            return tuple(args)   # the common call, checked in a line
        if len(args) > self.n_args:
            left = list(self.defaults)        # in the forward's order: the first extra argument is the first of these
            fixed = left[0] if left else None
            said = (f"; {fixed!r} was left at its default ({self.defaults[fixed]!r}) in the example, and is fixed "
                    "in the captured graph: optimize with an example that passes it" if fixed else "")
            raise InputError(f"the optimized model takes {self.n_args} positional input(s) "
                             f"({', '.join(self.arg_names)}), as its example had; got {len(args)}{said}")
        if len(args) < self.n_args:
            raise InputError(f"the optimized model takes {self.n_args} positional input(s) "
                             f"({', '.join(self.arg_names)}), as its example had; got {len(args)}")
        extra = sorted(set(kwargs) - set(self.kw_names) - set(self.constants))
        if extra:
            default = (f" (it was left at its default, {self.defaults[extra[0]]!r}, fixed in the graph)"
                       if extra[0] in self.defaults else "")
            raise InputError(f"keyword argument {extra[0]!r} was not in the example the model was optimized with"
                             f"{default}, so the captured graph has no input for it; optimize with an example "
                             "that passes it")
        for k, v in self.constants.items():
            if k in kwargs and not _same_constant(kwargs[k], v):
                raise InputError(f"keyword argument {k}={kwargs[k]!r}: the model was optimized with {k}={v!r}, "
                                 "fixed in the captured graph; optimize again with the value you call it with")
        missing = [k for k in self.kw_names if k not in kwargs]
        if missing:
            raise InputError(f"keyword argument {missing[0]!r} is missing: the model was optimized with it, "
                             "and its graph takes it")
        return tuple(args) + tuple(kwargs[k] for k in self.kw_names)

    def flat_output(self, out):
        """The model's output as the graph returns it (its tensors, flat, where it needs rebuilding)."""
        return out if self.template is None else tuple(_tensors_in(out))

    def rebuild(self, out):
        """The graph's output as the model returns it."""
        if self.template is None:
            return out
        return _remap(self.template, lambda s: out[s.i], {})


def _same_constant(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return a is b


def buffer_state(model) -> dict:
    """Copies of the model's buffers, by name: restore_buffers puts them back after forwards that
    update buffers in place."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def restore_buffers(model, state: dict) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in state and b.shape == state[name].shape:
                b.copy_(state[name])


def mutated_state(gm: fx.GraphModule) -> list[str]:
    """The module attributes (buffers) the graph updates in place: targets of get_attr nodes an
    in-place op writes, through views."""
    out = []
    for n in gm.graph.nodes:
        if _is_inplace(n) and n.args and isinstance(n.args[0], fx.Node):
            base = _view_base(n.args[0])
            if base.op == "get_attr" and base.target not in out:
                out.append(base.target)
    return out


def prepare(gm: fx.GraphModule, args: tuple):
    """Module paths, canonical form and value metadata for a graph from any tracer (also the
    graphs torch.compile hands the accelc backend). Returns gm's output on `args`."""
    _annotate_paths(gm)
    canonicalize(gm)
    with torch.no_grad():
        out = record_meta(gm, args)
    if _unflatten_addmm(gm.graph):    # needs the shapes record_meta gives
        gm.graph.lint()
        gm.recompile()
    return out


def export_program(model: nn.Module, args: tuple, kwargs: dict | None = None) -> torch.export.ExportedProgram:
    """torch.export (non-strict) with every dimension allowed to vary (batch, sequence); export
    specializes those the model pins down. Static shapes if that fails. A batch of one is traced
    as a batch of two (the example repeated): torch.export fixes every dim whose example is 0 or
    1, and a program traced at batch 1 would take batch 1 only; where the batch-2 program's shape
    guards refuse the example itself, the example's own shapes are traced. Keyword arguments must
    follow the forward's parameter order."""
    kwargs = dict(kwargs or {})
    grown = _batch_of_two((*args, *kwargs.values()))
    examples = [(tuple(args), kwargs)]
    if grown is not None:
        examples.insert(0, (grown[:len(args)], dict(zip(kwargs, grown[len(args):]))))
    for example_args, example_kwargs in examples:
        dynamic = tuple({i: torch.export.Dim.AUTO for i in range(a.dim())} if isinstance(a, torch.Tensor) else None
                        for a in (*example_args, *example_kwargs.values()))
        try:
            ep = torch.export.export(model, example_args, example_kwargs, dynamic_shapes=dynamic, strict=False)
            if example_args is not examples[-1][0]:
                with torch.no_grad():
                    ep.module()(*args, **kwargs)    # shape guards traced at batch 2 may exclude batch 1
            return ep
        except Exception:
            continue
    return torch.export.export(model, tuple(args), kwargs, strict=False)


def _batch_of_two(values: tuple) -> tuple | None:
    """`values` with every tensor repeated along dim 0, where each is a batch of one; else None."""
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    if tensors and all(t.dim() >= 1 and t.shape[0] == 1 for t in tensors):
        return tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) else a for a in values)
    return None


def _symbolic_trace(model, spec: "CallSpec", flat):
    """symbolic_trace with the forward's parameters the call leaves out (and its non-tensor keyword
    arguments) fixed; their placeholders are dropped, so the graph takes the CallSpec's flat inputs."""
    concrete = left_out(model, flat[:spec.n_args], exclude=spec.kw_names)
    concrete.update(spec.constants)
    gm = fx.symbolic_trace(model, concrete_args=concrete or None)
    if not concrete:
        return gm
    params = list(inspect.signature(model.forward).parameters)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(params) != len(placeholders):
        raise RuntimeError("the forward's parameters do not line up with the traced graph's inputs")
    for name, node in zip(params, placeholders):
        if name in concrete:
            value = concrete[name]
            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, lambda a: value if a is node else a)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
            gm.graph.erase_node(node)
    # CallSpec orders the tensor keywords as the forward does: what is left lines up with `flat`
    if sum(n.op == "placeholder" for n in gm.graph.nodes) != len(flat):
        raise RuntimeError("the forward's parameters do not line up with the example's arguments")
    gm.recompile()
    return gm


def left_out(model, args, exclude=()) -> dict:
    """The forward parameters with defaults that `args` leaves out, at their defaults: captured
    as constants (as torch.export does), so that the rules see `attn_mask=None` rather than a graph
    input that might be anything. Calling the captured graph with such an argument set raises."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in params[len(args):]
            if p.kind in kinds and p.default is not inspect.Parameter.empty and p.name not in exclude}


def _export(model, spec: "CallSpec", flat):
    return export_program(flat_module(model, spec) if not spec.trivial else model, flat).module()


def flat_module(model: nn.Module, spec: "CallSpec") -> nn.Module:
    """The model as a module whose forward takes the CallSpec's flat inputs and returns the flat
    output: a shallow copy (the same parameters, buffers and submodules under the same names, so a
    graph traced from it has the model's paths) of a subclass overriding forward. Deep copies and
    .to() conversions of it stay flat."""
    cls = type(model)
    flat_cls = type(cls.__name__, (cls,), {"forward": _flat_forward, "__module__": cls.__module__})
    shell = copy.copy(model)
    shell.__class__ = flat_cls
    shell.accelc_call_spec = spec
    return shell


def _flat_forward(self, *flat):
    spec = self.accelc_call_spec
    kw = dict(zip(spec.kw_names, flat[spec.n_args:]), **spec.constants)
    return spec.flat_output(super(type(self), self).forward(*flat[:spec.n_args], **kw))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


# How far a correct captured graph may differ from the model (the same ops, possibly regrouped,
# decomposed, or given another kernel by the tracer: an SDPA with an all-zero mask where eager took
# none), relative L2 per output tensor: a few roundings of its dtype.
_SAME = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _check_same(expected, got):
    exp_leaves, got_leaves = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    if len(exp_leaves) != len(got_leaves):
        raise RuntimeError("the captured graph returns a different output structure than the model")
    for e, g in zip(exp_leaves, got_leaves):
        if not isinstance(e, torch.Tensor):
            continue
        if not (isinstance(g, torch.Tensor) and g.shape == e.shape and g.dtype == e.dtype):
            raise RuntimeError("the captured graph's output has another shape or dtype than the model's")
        if not e.is_floating_point():
            same = torch.equal(e, g)
        else:
            nan, inf = torch.isnan(e), torch.isinf(e)
            finite = ~(nan | inf)
            same = (torch.equal(nan, torch.isnan(g)) and torch.equal(e[inf], g[inf])
                    and rel_l2(g[finite], e[finite]) <= _SAME.get(e.dtype, 1e-5))
        if not same:
            raise RuntimeError("the captured graph's output differs from the model's on the example inputs")


def record_meta(gm: fx.GraphModule, args: tuple):
    """Run gm on `args`, storing each node's TensorMeta; returns gm's output. (fx.Interpreter.run
    flattens the arguments and unflattens the output through the graph's codegen itself: an export
    graph takes its inputs flat.)"""

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                meta.set_tensor_meta(n, out)
            n.meta[meta.IS_NONE] = out is None  # e.g. an optional mask argument left at None
            return out

    return _Recorder(gm).run(*args)


# ---------------------------------------------------------------------------------------------
# module paths

def _annotate_paths(gm: fx.GraphModule) -> None:
    """meta.PATH: the module path a node came from; meta.MODULE_TYPE: that module's original
    class, qualified name (graph modules keep only stand-in containers)."""
    modules = dict(gm.named_modules())
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        if n.op == "call_module":
            path, cls = n.target, type(modules[n.target])
        elif n.op == "get_attr":
            path, cls = n.target.rpartition(".")[0], None
        else:
            path, cls = (_clean_path(list(stack.values())[-1][0]), list(stack.values())[-1][1]) if stack else ("", None)
        n.meta[meta.PATH] = path
        n.meta[meta.MODULE_TYPE] = cls if cls is None or isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


_TRACER_ROOT = re.compile(r"^(L\['[^']*'\]|L__self__)\.?")


def _clean_path(path: str) -> str:
    """Drop the tracer's name for the root module: L['self'].blocks.0 (strict export),
    L['fn'].0 (torch.compile), L__self__.fc -> blocks.0, 0, fc."""
    return _TRACER_ROOT.sub("", path)


# ---------------------------------------------------------------------------------------------
# canonical form

# activation modules -> their ACTIVATIONS entry (kernels/epilogue.py), the one table of activations
_ACTIVATION_MODULES = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh",
                       nn.ReLU6: "relu6", nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid"}
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)

# spelling -> canonical callable, for call_function targets
_FUNCTIONS = {
    F.linear: F.linear, F.relu: F.relu, F.silu: F.silu,
    torch.relu: F.relu, aten.relu.default: F.relu,
    F.gelu: F.gelu, aten.gelu.default: F.gelu,
    aten.silu.default: F.silu,
    F.relu6: F.relu6, aten.relu6.default: F.relu6,
    F.hardswish: F.hardswish, aten.hardswish.default: F.hardswish,
    F.hardsigmoid: F.hardsigmoid, aten.hardsigmoid.default: F.hardsigmoid,
    F.sigmoid: torch.sigmoid, aten.sigmoid.default: torch.sigmoid,
    F.tanh: torch.tanh, aten.tanh.default: torch.tanh,
    torch.add: operator.add, aten.add.Tensor: operator.add,
    operator.matmul: torch.matmul, aten.matmul.default: torch.matmul,
    aten.linear.default: F.linear,
    aten.addmm.default: torch.addmm, torch.addmm: torch.addmm,
    torch.bmm: torch.matmul, aten.bmm.default: torch.matmul,      # bmm is matmul of two 3-D tensors
    torch.baddbmm: torch.baddbmm, aten.baddbmm.default: torch.baddbmm,
    aten.t.default: torch.t,
    F.conv2d: F.conv2d, aten.conv2d.default: F.conv2d, aten.conv2d.padding: F.conv2d, F.batch_norm: F.batch_norm,
    F.softmax: F.softmax, torch.softmax: F.softmax, aten.softmax.int: F.softmax,
    aten._softmax.default: F.softmax,
    aten.transpose.int: torch.transpose,
    F.scaled_dot_product_attention: F.scaled_dot_product_attention,
    aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
    operator.truediv: operator.truediv, torch.div: operator.truediv, aten.div.Tensor: operator.truediv,
    operator.mul: operator.mul, torch.mul: operator.mul, aten.mul.Tensor: operator.mul,
}
_METHODS = {"addmm": torch.addmm, "bmm": torch.matmul, "baddbmm": torch.baddbmm, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "add": operator.add,
            "matmul": torch.matmul, "t": torch.t, "softmax": F.softmax, "transpose": torch.transpose,
            "mul": operator.mul, "div": operator.truediv}
# in-place spelling -> out-of-place canonical (only where the mutated input has no other reader)
_INPLACE_FUNCTIONS = {torch.relu_: F.relu, operator.iadd: operator.add, aten.relu_.default: F.relu,
                      aten.add_.Tensor: operator.add, aten.hardswish_.default: F.hardswish,
                      aten.hardsigmoid_.default: F.hardsigmoid, aten.relu6_.default: F.relu6}
# clamps to [0, 6] in their other spellings -> F.relu6 (in place: where nothing else reads the input)
_RELU6_SPELLINGS = {F.hardtanh: ("input", "min_val", "max_val", "inplace"),
                    aten.hardtanh.default: ("input", "min_val", "max_val"),
                    aten.hardtanh_.default: ("input", "min_val", "max_val"),
                    torch.clamp: ("input", "min", "max"), aten.clamp.default: ("input", "min", "max"),
                    torch.clip: ("input", "min", "max"), aten.clip.default: ("input", "min", "max")}
_RELU6_METHODS = {"clamp": ("min", "max"), "clip": ("min", "max")}
_INPLACE_METHODS = {"relu_": F.relu, "add_": operator.add, "sigmoid_": torch.sigmoid, "tanh_": torch.tanh}


def canonicalize(gm: fx.GraphModule) -> None:
    g = gm.graph
    modules = dict(gm.named_modules())
    for n in list(g.nodes):
        if n.op == "call_module":
            _canonical_module(gm, n, modules[n.target])
        elif n.op == "call_method":
            if n.target in _RELU6_METHODS and _clamps_to_relu6(n):
                n.op, n.target, n.args, n.kwargs = "call_function", F.relu6, n.args[:1], {}
            elif n.target in _METHODS:
                _retarget(n, _METHODS[n.target])
            elif n.target in _INPLACE_METHODS and _only_reader(n):
                _retarget(n, _INPLACE_METHODS[n.target])
        elif n.op == "call_function":
            target = n.target
            if target in _RELU6_SPELLINGS and _clamps_to_relu6(n):
                n.target, n.args, n.kwargs = F.relu6, n.args[:1], {}
            elif target in _INPLACE_FUNCTIONS and _only_reader(n):
                _retarget(n, _INPLACE_FUNCTIONS[target])
            elif target in _FUNCTIONS and (not _inplace_arg(n) or _only_reader(n)):
                _retarget(n, _FUNCTIONS[target])
            elif target in (F.dropout, aten.dropout.default) and not _dropout_trains(n):
                n.replace_all_uses_with(n.args[0])
                g.erase_node(n)
            elif target in _ATEN_BATCH_NORM:
                _canonical_aten_batch_norm(g, n)
            elif target in _LAYER_NORMS:
                _canonical_layer_norm(g, n)
            elif target in _RMS_NORMS:
                _canonical_rms_norm(n)
            elif target in _PADS:
                _canonical_pad(n)
            elif target is aten._assert_tensor_metadata.default and not n.users:
                # torch.export's check of a cast's dtype and device, fixed by the graph itself: as
                # a reader it would keep every value it checks out of the rules' single-reader chains
                g.erase_node(n)
    _fold_written_activations(g)
    g.lint()
    gm.recompile()


_RESHAPES = {"view", "reshape", "_unsafe_view"}


def reshape_of(node):
    """The tensor a view / reshape node reshapes, else None."""
    if isinstance(node, fx.Node) and node.op in ("call_method", "call_function") and node.args \
            and isinstance(node.args[0], fx.Node) and meta.op_name(node) in _RESHAPES:
        return node.args[0]
    return None


def _unflatten_addmm(g: fx.Graph) -> bool:
    """HF's Conv1D (GPT-2, GPT-J's MLPs in some ports): addmm(b, x.view(-1, K), W).view(*lead, N)
    -> F.linear(x, W.t(), b). Eager runs the same kernel either way (F.linear flattens a contiguous
    input into that addmm), and the activation and residual add that follow then meet the GEMM
    directly instead of through the view, so the epilogue takes them. Returns whether it changed g."""
    changed = False
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not torch.addmm or len(n.args) != 3 or n.kwargs:
            continue
        bias, flat, w = n.args
        x, out = reshape_of(flat), meta.sole_user(n)
        if x is None or reshape_of(out) is not n:
            continue
        mx, mw, mo = meta.tensor_meta(x), meta.tensor_meta(w), meta.tensor_meta(out)
        if None in (mx, mw, mo) or len(mx.shape) < 2 or len(mw.shape) != 2 \
                or tuple(mo.shape) != (*mx.shape[:-1], mw.shape[1]):
            continue
        with g.inserting_before(n):
            wt = g.call_function(torch.t, (w,))
            linear = g.call_function(F.linear, (x, wt, bias))
        wt.meta.update(n.meta)
        wt.meta[meta.VALUE] = meta.TensorMeta(tuple(mw.shape[::-1]), mw.dtype, mw.device, contiguous=False)
        linear.meta.update(n.meta)
        linear.meta[meta.VALUE] = mo
        out.replace_all_uses_with(linear)
        g.erase_node(out)
        g.erase_node(n)
        if not flat.users:
            g.erase_node(flat)
        changed = True
    return changed


# pointwise ops a written-out activation is made of: how to evaluate each on float64 tensors
_POINTWISE_FUNCTIONS = {
    operator.mul: operator.mul, operator.add: operator.add, operator.sub: operator.sub,
    operator.truediv: operator.truediv, operator.neg: operator.neg, operator.pow: operator.pow,
    torch.sub: torch.sub, aten.sub.Tensor: torch.sub, aten.mul.Scalar: operator.mul, aten.add.Scalar: operator.add,
    aten.neg.default: operator.neg, torch.neg: operator.neg,
    torch.pow: torch.pow, aten.pow.Tensor_Scalar: torch.pow, aten.pow.Tensor_Tensor: torch.pow,
    torch.tanh: torch.tanh, torch.sigmoid: torch.sigmoid, torch.erf: torch.erf, aten.erf.default: torch.erf,
    torch.special.erf: torch.erf, torch.sqrt: torch.sqrt, F.relu6: F.relu6,
}
_POINTWISE_METHODS = {"pow": torch.pow, "erf": torch.erf, "neg": operator.neg, "sub": torch.sub}
# the activations a written-out form may compute: (the fewest ops its written form takes, the
# ACTIVATIONS entry of the canonical call that replaces it)
_WRITTEN_ACTIVATIONS = (
    (4, "gelu_tanh"),      # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3))): gelu_new, gelu_fast
    (4, "gelu"),           # x * 0.5 * (1 + erf(x / sqrt(2)))
    (3, "quick_gelu"),     # x * sigmoid(1.702 * x)
    (3, "hardswish"),      # x * relu6(x + 3) / 6
    (3, "hardsigmoid"),    # relu6(x + 3) / 6
    (2, "silu"),           # x * sigmoid(x)
)
_PROBE = torch.cat([torch.linspace(-9, 9, 361, dtype=torch.float64),
                    torch.tensor([-40.0, -15.0, 15.0, 40.0, 1e-3, -1e-3, 0.0], dtype=torch.float64)])


def _pointwise_fn(n: fx.Node):
    if n.op == "call_function":
        return _POINTWISE_FUNCTIONS.get(n.target)
    if n.op == "call_method":
        return _POINTWISE_METHODS.get(n.target)   # (mul / add / tanh ... methods: canonical functions by now)
    return None


_MAX_WRITTEN_OPS = 16        # a written GELU takes 8 to 10


def _written_expression(root: fx.Node, x: fx.Node | None = None):
    """(the single tensor the pointwise expression at `root` is a function of, its interior
    nodes) where `root` computes f(x) from x and number constants only; None otherwise. With x
    given, the walk stops there (x may itself be pointwise: silu(h + 1) is silu of h + 1)."""
    leaves, interior, todo = set(), [], [root]
    while todo:
        n = todo.pop()
        if n in interior:
            continue
        if _pointwise_fn(n) is None or n.kwargs or len(interior) >= _MAX_WRITTEN_OPS:
            return None
        interior.append(n)
        for a in n.args:
            if isinstance(a, fx.Node):
                (todo.append(a) if a is not x and _pointwise_fn(a) is not None and not a.kwargs else leaves.add(a))
            elif not isinstance(a, (int, float)) or isinstance(a, bool):
                return None
    return (leaves.pop(), interior) if len(leaves) == 1 else None


def _written_candidates(root: fx.Node) -> list:
    """Each (x, interior) for which root is a pointwise function of x alone: x the expression's
    one leaf, or one of its own pointwise nodes (nearest the root first)."""
    whole = _written_expression(root)
    found = [] if whole is None else [whole]
    pointwise, todo = [], [root]
    while todo and len(pointwise) < _MAX_WRITTEN_OPS:
        n = todo.pop(0)
        for a in n.all_input_nodes:
            if a not in pointwise and _pointwise_fn(a) is not None and not a.kwargs:
                pointwise.append(a)
                todo.append(a)
    for x in pointwise:
        sub = _written_expression(root, x)
        if sub is not None and sub[0] is x:
            found.append(sub)
    return found


def _evaluate(root: fx.Node, x: fx.Node, values: torch.Tensor) -> torch.Tensor:
    memo = {x: values}

    def ev(n):
        if not isinstance(n, fx.Node):
            return n
        if n not in memo:
            memo[n] = _pointwise_fn(n)(*(ev(a) for a in n.args))
        return memo[n]
    return ev(root)


def _fold_written_activations(g: fx.Graph) -> None:
    """An activation written out in pointwise ops (_WRITTEN_ACTIVATIONS: HF's gelu_new /
    gelu_fast, the erf GELU, CLIP's quick_gelu, hardswish and hardsigmoid through relu6, SiLU), in any
    order of its commutative operands, becomes its canonical call (F.gelu(x, approximate=...),
    quick_gelu(x), F.hardswish(x) ...), so that the epilogue rules see it. Told by evaluating the
    expression, in float64, on probe values (NaN and inf included) against each form: an
    expression is replaced only where it computes that function to 1e-9."""
    gone: set = set()
    special = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)
    for root in reversed(list(g.nodes)):
        if root in gone or _pointwise_fn(root) is None:
            continue
        for x, interior in _written_candidates(root):     # (one op alone is a call already)
            if len(interior) >= 2 and _fold_as_activation(g, root, x, interior, special, gone):
                break


def _fold_as_activation(g, root, x, interior, special, gone) -> bool:
    """Replace root by the canonical call of the activation it computes of x, if any."""
    try:
        got, got_special = _evaluate(root, x, _PROBE), _evaluate(root, x, special)
    except Exception:
        return False
    if not isinstance(got, torch.Tensor) or got.shape != _PROBE.shape:
        return False
    for fewest_ops, name in _WRITTEN_ACTIVATIONS:
        fn, kwargs = ACTIVATIONS[name]
        if len(interior) < fewest_ops:
            continue
        want, want_special = fn(_PROBE, **kwargs), fn(special, **kwargs)
        if torch.allclose(got, want, rtol=1e-9, atol=1e-9) and same_values(got_special, want_special):
            with g.inserting_before(root):
                call = g.call_function(fn, (x,), dict(kwargs))
            _swap(root, call)
            gone.add(root)
            gone.update(erase_dead([n for n in interior if n is not root]))
            return True
    return False


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


# ATen's eval batch norms (torch.export keeps them): (input, weight, bias, running_mean, running_var,
# [training,] momentum, eps, ...); the _native_..._no_training form returns (out, save_mean, save_invstd)
_ATEN_BATCH_NORM = {aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default}


# F.layer_norm / torch.layer_norm / aten.layer_norm: (input, normalized_shape, weight=None,
# bias=None, eps=1e-5[, cudnn_enable]); aten.native_layer_norm returns (out, mean, rstd)
_LAYER_NORMS = {F.layer_norm, torch.layer_norm, aten.layer_norm.default, aten.native_layer_norm.default}
_LAYER_NORM_PARAMS = ("input", "normalized_shape", "weight", "bias", "eps")


def _canonical_layer_norm(g: fx.Graph, n: fx.Node) -> None:
    """-> F.layer_norm(x, normalized_shape, weight, bias, eps), every argument positional."""
    args = _norm_args(n, _LAYER_NORM_PARAMS, eps=1e-5)
    if args is None:
        return
    if n.target is not aten.native_layer_norm.default:
        n.target, n.args, n.kwargs = F.layer_norm, args, {}
        return
    _first_output_as(g, n, F.layer_norm, args)


# F.rms_norm / torch.rms_norm / aten.rms_norm: (input, normalized_shape, weight=None, eps=None)
_RMS_NORMS = {F.rms_norm, torch.rms_norm, aten.rms_norm.default}
_RMS_NORM_PARAMS = ("input", "normalized_shape", "weight", "eps")


def _canonical_rms_norm(n: fx.Node) -> None:
    """-> F.rms_norm(x, normalized_shape, weight, eps), every argument positional (eps None: the
    dtype's machine epsilon, as F.rms_norm takes it)."""
    args = _norm_args(n, _RMS_NORM_PARAMS, eps=None)
    if args is not None:
        n.target, n.args, n.kwargs = F.rms_norm, args, {}


def _norm_args(n: fx.Node, params: tuple, eps) -> tuple | None:
    """A norm call's (input, normalized_shape as a tuple, ...params, eps) positionally, other
    keywords dropped (cudnn_enable); None without input and shape."""
    given = {k: v for k, v in meta.bound_args(n, params).items() if k in params}
    if "input" not in given or "normalized_shape" not in given:
        return None
    shape = given["normalized_shape"]
    given["normalized_shape"] = tuple(shape) if isinstance(shape, (list, tuple)) else shape
    return tuple(given.get(p, eps if p == "eps" else None) for p in params)


def _first_output_as(g: fx.Graph, n: fx.Node, target, args) -> None:
    """An ATen norm returning (out, saved statistics...) -> target(*args), where only its output
    is read (getitem 0); left as written where the saved statistics are read."""
    users = list(n.users)
    if not users or any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
        return
    with g.inserting_before(n):
        new = g.call_function(target, args)
    new.meta.update(users[0].meta)
    for u in users:
        u.replace_all_uses_with(new)
        g.erase_node(u)
    g.erase_node(n)


def _canonical_aten_batch_norm(g: fx.Graph, n: fx.Node) -> None:
    """-> F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), for eval
    batch norms whose running statistics are given."""
    if n.target is aten.batch_norm.default:
        x, w, b, mean, var, training, momentum, eps = n.args[:8]
        if training or mean is None or var is None:
            return
        n.target, n.args, n.kwargs = F.batch_norm, (x, mean, var, w, b, False, momentum, eps), {}
        return
    x, w, b, mean, var, momentum, eps = n.args[:7]
    _first_output_as(g, n, F.batch_norm, (x, mean, var, w, b, False, momentum, eps))


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
                a.meta[meta.PATH] = n.target
        _swap(n, new)
    elif _module_activation(mod) is not None and (not getattr(mod, "inplace", False) or _only_reader(n)):
        fn, kwargs = ACTIVATIONS[_module_activation(mod)]
        with g.inserting_before(n):
            new = g.call_function(fn, (n.args[0],), kwargs)
        _swap(n, new)
    elif type(mod) is nn.Conv2d and mod.padding_mode == "zeros":
        with g.inserting_before(n):
            w = g.get_attr(f"{n.target}.weight")
            b = g.get_attr(f"{n.target}.bias") if mod.bias is not None else None
            new = g.call_function(F.conv2d, (n.args[0], w, b, mod.stride, mod.padding, mod.dilation, mod.groups))
        for a in (w, b):
            if a is not None:
                a.meta[meta.PATH] = n.target
        _swap(n, new)
    elif type(mod) is nn.BatchNorm2d and not mod.training and mod.track_running_stats:
        with g.inserting_before(n):
            ins = [g.get_attr(f"{n.target}.{name}") if getattr(mod, name) is not None else None
                   for name in ("running_mean", "running_var", "weight", "bias")]
            new = g.call_function(F.batch_norm, (n.args[0], *ins, False, mod.momentum or 0.0, mod.eps))
        for a in ins:
            if a is not None:
                a.meta[meta.PATH] = n.target
        _swap(n, new)
    elif isinstance(mod, nn.GELU):
        with g.inserting_before(n):
            new = g.call_function(F.gelu, (n.args[0],), _gelu_kwargs(mod.approximate))
        _swap(n, new)
    elif type(mod) in (nn.ZeroPad2d, nn.ConstantPad2d) and mod.value == 0:
        with g.inserting_before(n):
            new = g.call_function(F.pad, (n.args[0], tuple(mod.padding)))
        _swap(n, new)
    elif type(mod) is nn.RMSNorm:
        with g.inserting_before(n):
            w = g.get_attr(f"{n.target}.weight") if mod.weight is not None else None
            new = g.call_function(F.rms_norm, (n.args[0], tuple(mod.normalized_shape), w, mod.eps))
        if w is not None:
            w.meta[meta.PATH] = n.target
        _swap(n, new)
    elif type(mod) is nn.LayerNorm:
        with g.inserting_before(n):
            w = g.get_attr(f"{n.target}.weight") if mod.weight is not None else None
            b = g.get_attr(f"{n.target}.bias") if mod.bias is not None else None
            new = g.call_function(F.layer_norm, (n.args[0], tuple(mod.normalized_shape), w, b, mod.eps))
        for a in (w, b):
            if a is not None:
                a.meta[meta.PATH] = n.target
        _swap(n, new)


# F.pad / aten.pad (input, pad, mode="constant", value=None); aten.constant_pad_nd (input, pad, value=0)
_PADS = {F.pad: ("input", "pad", "mode", "value"), aten.pad.default: ("input", "pad", "mode", "value"),
         aten.constant_pad_nd.default: ("input", "pad", "value")}


def _canonical_pad(n: fx.Node) -> None:
    """A zero pad -> F.pad(x, pad), the two arguments positional (the form the conv rules fold
    into the conv's padding); other modes and fill values stay as written."""
    names = _PADS[n.target]
    bound = meta.bound_args(n, names)
    if set(bound) - set(names) or bound.get("mode", "constant") != "constant" or bound.get("value") not in (None, 0):
        return
    n.target, n.args, n.kwargs = F.pad, (bound["input"], bound["pad"]), {}


def _module_activation(mod) -> str | None:
    """The ACTIVATIONS name of an activation module (nn.Hardtanh(0, 6) is relu6), else None."""
    if type(mod) is nn.Hardtanh:
        return "relu6" if (mod.min_val, mod.max_val) == (0, 6) else None
    return _ACTIVATION_MODULES.get(type(mod))


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
    elif target is torch.addmm:
        if kwargs.pop("beta", 1) != 1 or kwargs.pop("alpha", 1) != 1 or len(args) != 3 or kwargs:
            return  # beta * bias + alpha * x @ w stays as written
    elif target is operator.truediv:
        if kwargs.get("rounding_mode") is not None or len(args) != 2:
            return  # floor / trunc division stays as written
    elif target is F.softmax:
        dim = kwargs.pop("dim", args[1] if len(args) > 1 else None)
        if kwargs.get("dtype") is not None or dim is None or len(args) > 2 and args[2] is not False:
            return  # softmax with a dtype cast (or aten's half_to_float) stays as written
        args, kwargs = (args[0], dim), {}
    elif target in _CANONICAL_ARGS:
        names, defaults, n_positional = _CANONICAL_ARGS[target]
        if set(kwargs) - set(names) or len(args) > len(names):
            return  # an argument this table does not know: left as written
        bound = dict(zip(names, args))
        values = [bound[k] if k in bound else kwargs.get(k, d) for k, d in zip(names, defaults)]
        args, kwargs = tuple(values[:n_positional]), dict(zip(names[n_positional:], values[n_positional:]))
    elif target is torch.transpose:
        args = (args[0], kwargs.pop("dim0", args[1] if len(args) > 1 else None),
                kwargs.pop("dim1", args[2] if len(args) > 2 else None))
    n.op, n.target, n.args, n.kwargs = "call_function", target, args, kwargs
    if target in _INPLACE_ACTIVATIONS:
        n.args = args[:1]


# canonical callables whose arguments are all written out, in order: (names, defaults, how many
# of them positionally; the rest as keywords, in this order). F.scaled_dot_product_attention takes
# scale and enable_gqa only as keywords.
_CANONICAL_ARGS = {
    F.conv2d: (("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
               (None, None, None, 1, 0, 1, 1), 7),
    F.batch_norm: (("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
                   (None, None, None, None, None, False, 0.1, 1e-5), 8),
    torch.baddbmm: (("input", "batch1", "batch2", "beta", "alpha"), (None, None, None, 1, 1), 3),
    F.scaled_dot_product_attention: (
        ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
        (None, None, None, None, 0.0, False, None, False), 6),
}


def _gelu_kwargs(approximate: str) -> dict:
    return dict(ACTIVATIONS["gelu_tanh" if approximate == "tanh" else "gelu"][1])


def _clamps_to_relu6(n) -> bool:
    """F.hardtanh(x, 0, 6), torch.clamp(x, 0, 6), x.clamp(min=0, max=6) ...: relu6 written
    another way (in place only where nothing else reads x)."""
    names = _RELU6_SPELLINGS.get(n.target) if n.op == "call_function" else ("self",) + _RELU6_METHODS[n.target]
    bound = meta.bound_args(n, names)
    lo, hi = bound.get(names[1]), bound.get(names[2])
    if set(bound) - set(names) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in (lo, hi)):
        return False
    inplace = bound.get("inplace", False) or n.target is aten.hardtanh_.default
    return lo == 0 and hi == 6 and (not inplace or _only_reader(n))


_INPLACE_ACTIVATIONS = (F.relu, F.silu, F.relu6, F.hardswish, F.hardsigmoid)


def _inplace_arg(n) -> bool:
    """F.relu(x, inplace=True) / F.relu(x, True)."""
    if n.target in _INPLACE_ACTIVATIONS:
        return bool(n.kwargs.get("inplace", n.args[1] if len(n.args) > 1 else False))
    return False


def _only_reader(n) -> bool:
    """An in-place op may become out-of-place when nothing else reads the tensor it mutates and
    that tensor lives only inside this call: not module state (a buffer the next call reads), not
    a caller's input (eager changes the caller's tensor), nor a view of either."""
    src = n.args[0] if n.args else None
    return isinstance(src, fx.Node) and len(src.users) == 1 and _view_base(src).op not in ("get_attr", "placeholder")


# ops whose result may share memory with their first argument
VIEW_OPS = {"view", "reshape", "permute", "transpose", "t", "getitem", "select", "slice", "narrow", "expand",
             "unsqueeze", "squeeze", "flatten", "unflatten", "as_strided", "detach", "alias", "contiguous",
             "view_as", "unfold", "diagonal", "split", "chunk", "unbind", "movedim", "T", "mT"}


def _view_base(node: fx.Node) -> fx.Node:
    """The node whose memory `node` may be a view of (itself if it is not a view op)."""
    while node.op in ("call_method", "call_function") and node.args and isinstance(node.args[0], fx.Node) \
            and meta.op_name(node) in VIEW_OPS:
        node = node.args[0]
    return node


def _is_inplace(node: fx.Node) -> bool:
    if node.op not in ("call_method", "call_function"):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    name = meta.op_name(node)
    return (name.endswith("_") and not name.startswith("_")) or name in ("iadd", "isub", "imul", "itruediv")


def _dropout_trains(n) -> bool:
    if n.target is F.dropout:
        return bool(n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True))
    return bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("train", False))
