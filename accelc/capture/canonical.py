"""Capture's canonical form: the many spellings of one operation become one, so a rule's pattern is
written once.

nn.Linear / aten.linear -> F.linear(x, w, b) (b may be None); nn.Conv2d / nn.Conv1d (zero padding) ->
F.conv2d / F.conv1d(x, w, b, stride, padding, dilation, groups); eval nn.BatchNorm2d -> F.batch_norm(x,
running_mean, running_var, weight, bias, False, momentum, eps); activation modules, methods, aten ops
-> F.relu, F.gelu, F.silu, torch.sigmoid, torch.tanh (relu6 from its clamp spellings); torch.add /
aten.add / x.add(y) -> operator.add; x @ y / aten.matmul -> torch.matmul; activations written out in
pointwise ops -> their call (accelc.capture.written); nn.LayerNorm / aten.layer_norm ->
F.layer_norm(x, shape, w, b, eps), RMSNorm likewise; zero pads -> F.pad(x, pad); eval-mode dropout and
Identity are removed. In-place forms are canonicalised only where nothing else reads their input.
The rewrites that need the values' shapes run after record_meta: accelc.capture.shaped.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils import parametrize

from accelc import meta
from accelc.capture.nodes import swap, view_base
from accelc.capture.written import fold_written_activations
from accelc.kernels.epilogue import ACTIVATIONS

aten = torch.ops.aten

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
    F.conv1d: F.conv1d, aten.conv1d.default: F.conv1d, aten.conv1d.padding: F.conv1d,
    F.softmax: F.softmax, torch.softmax: F.softmax, aten.softmax.int: F.softmax,
    aten._softmax.default: F.softmax,
    aten.transpose.int: torch.transpose,
    F.scaled_dot_product_attention: F.scaled_dot_product_attention,
    aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
    operator.truediv: operator.truediv, torch.div: operator.truediv, aten.div.Tensor: operator.truediv,
    operator.mul: operator.mul, torch.mul: operator.mul, aten.mul.Tensor: operator.mul,
    torch.chunk: torch.chunk, aten.chunk.default: torch.chunk,
}
_METHODS = {"addmm": torch.addmm, "bmm": torch.matmul, "baddbmm": torch.baddbmm, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "add": operator.add,
            "matmul": torch.matmul, "t": torch.t, "softmax": F.softmax, "transpose": torch.transpose,
            "mul": operator.mul, "div": operator.truediv, "chunk": torch.chunk}
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
    inline_grad_regions(gm)
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
    fold_written_activations(g)
    g.lint()
    gm.recompile()



def inline_grad_regions(gm: fx.GraphModule) -> int:
    """torch.export puts code a model runs under torch.no_grad() (HF's rotary embedding) in a
    wrap_with_set_grad_enabled call of a submodule. Grad mode changes no value, and accelc runs
    inference without grad: each such region is inlined, so the rules see into it and Dynamo does
    not break the glue's graph there. Returns how many were."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    g, count = gm.graph, 0
    while True:
        n = next((n for n in g.nodes if hop is not None and n.op == "call_function" and n.target is hop), None)
        if n is None:
            return count
        sub = getattr(gm, n.args[1].target)
        env = dict(zip([p for p in sub.graph.nodes if p.op == "placeholder"], n.args[2:]))
        out = None
        with g.inserting_before(n):
            for s in sub.graph.nodes:
                if s.op == "output":
                    out = fx.map_arg(s.args[0], lambda x: env[x])
                elif s.op == "get_attr":
                    name = f"{n.args[1].target}_{s.target.replace('.', '_')}"
                    setattr(gm, name, sub.get_submodule(s.target) if isinstance(getattr(sub, s.target, None), nn.Module)
                            else getattr(sub, s.target))
                    env[s] = g.get_attr(name)
                elif s.op != "placeholder":
                    env[s] = g.node_copy(s, lambda x: env[x])
        for u in list(n.users):
            if u.op == "call_function" and u.target is operator.getitem and isinstance(out, (tuple, list)):
                u.replace_all_uses_with(out[u.args[1]])
                g.erase_node(u)
        if n.users:
            n.replace_all_uses_with(out)
        holder = n.args[1]
        g.erase_node(n)
        if not holder.users:
            g.erase_node(holder)
            gm.delete_submodule(holder.target)
        count += 1


# pointwise ops a written-out activation is made of: how to evaluate each on float64 tensors


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
        swap(n, new)
    elif _module_activation(mod) is not None and (not getattr(mod, "inplace", False) or _only_reader(n)):
        fn, kwargs = ACTIVATIONS[_module_activation(mod)]
        with g.inserting_before(n):
            new = g.call_function(fn, (n.args[0],), kwargs)
        swap(n, new)
    elif _base_type(mod) in (nn.Conv2d, nn.Conv1d) and mod.padding_mode == "zeros":
        fn = F.conv2d if _base_type(mod) is nn.Conv2d else F.conv1d
        with g.inserting_before(n):
            w = g.get_attr(f"{n.target}.weight")
            b = g.get_attr(f"{n.target}.bias") if mod.bias is not None else None
            new = g.call_function(fn, (n.args[0], w, b, mod.stride, mod.padding, mod.dilation, mod.groups))
        for a in (w, b):
            if a is not None:
                a.meta[meta.PATH] = n.target
        swap(n, new)
    elif _base_type(mod) in (nn.Conv2d, nn.Conv1d):       # padding_mode reflect / replicate / circular
        meta.explain(n, f"padding_mode={mod.padding_mode!r}: accelc's conv pads with zeros only")
    elif type(mod) is nn.BatchNorm2d and not mod.training and mod.track_running_stats:
        with g.inserting_before(n):
            ins = [g.get_attr(f"{n.target}.{name}") if getattr(mod, name) is not None else None
                   for name in ("running_mean", "running_var", "weight", "bias")]
            new = g.call_function(F.batch_norm, (n.args[0], *ins, False, mod.momentum or 0.0, mod.eps))
        for a in ins:
            if a is not None:
                a.meta[meta.PATH] = n.target
        swap(n, new)
    elif isinstance(mod, nn.GELU):
        with g.inserting_before(n):
            new = g.call_function(F.gelu, (n.args[0],), _gelu_kwargs(mod.approximate))
        swap(n, new)
    elif type(mod) is nn.Softmax and mod.dim is not None:     # (dim=None: the legacy implicit dim, left as is)
        with g.inserting_before(n):
            new = g.call_function(F.softmax, (n.args[0], mod.dim))
        swap(n, new)
    elif type(mod) in (nn.ZeroPad2d, nn.ConstantPad2d, nn.ZeroPad1d, nn.ConstantPad1d) and mod.value == 0:
        with g.inserting_before(n):
            new = g.call_function(F.pad, (n.args[0], tuple(mod.padding)))
        swap(n, new)
    elif type(mod) is nn.RMSNorm:
        with g.inserting_before(n):
            w = g.get_attr(f"{n.target}.weight") if mod.weight is not None else None
            new = g.call_function(F.rms_norm, (n.args[0], tuple(mod.normalized_shape), w, mod.eps))
        if w is not None:
            w.meta[meta.PATH] = n.target
        swap(n, new)
    elif type(mod) is nn.LayerNorm:
        with g.inserting_before(n):
            w = g.get_attr(f"{n.target}.weight") if mod.weight is not None else None
            b = g.get_attr(f"{n.target}.bias") if mod.bias is not None else None
            new = g.call_function(F.layer_norm, (n.args[0], tuple(mod.normalized_shape), w, b, mod.eps))
        for a in (w, b):
            if a is not None:
                a.meta[meta.PATH] = n.target
        swap(n, new)


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


def _base_type(mod) -> type:
    """The module's class, or the one a parametrization (torch.nn.utils.parametrize: weight_norm) subclassed: its
    parametrized weight is read as the module's attribute (`conv.weight`), computed from its parameters, and
    fold_weights computes it once."""
    return type(mod).__bases__[0] if parametrize.is_parametrized(mod) else type(mod)


def _module_activation(mod) -> str | None:
    """The ACTIVATIONS name of an activation module (nn.Hardtanh(0, 6) is relu6), else None."""
    if type(mod) is nn.Hardtanh:
        return "relu6" if (mod.min_val, mod.max_val) == (0, 6) else None
    return _ACTIVATION_MODULES.get(type(mod))


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
    elif target is torch.chunk:     # (input, chunks, dim); dims_from_end counts dim from the end
        bound = dict(zip(("input", "chunks", "dim"), args))
        if len(args) > 3 or set(kwargs) - {"chunks", "dim"}:
            return
        args = (bound["input"], bound.get("chunks", kwargs.get("chunks")), bound.get("dim", kwargs.get("dim", 0)))
        kwargs = {}
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
    F.conv1d: (("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
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
    return isinstance(src, fx.Node) and len(src.users) == 1 and view_base(src).op not in ("get_attr", "placeholder")



def _dropout_trains(n) -> bool:
    if n.target is F.dropout:
        return bool(n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True))
    return bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("train", False))
