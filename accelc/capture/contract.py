"""The call contract of a captured graph: how a user's call (positional and keyword arguments,
constants, outputs held in objects) maps onto the graph's flat inputs and outputs and back, and the
model state (buffers) a forward may update."""
from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils import _pytree as pytree

from accelc import meta
from accelc.capture.nodes import view_base, written_args
from accelc.errors import InputError
from accelc.numerics import REL_L2_FLOOR, rel_l2, same_values

CALL_SPEC = "accelc_call_spec"   # gm.meta key: the CallSpec of a captured graph


class _Slot:
    """Where the i-th output tensor goes in an output template."""
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


Slot = _Slot     # (pickled by its own name, accelc.capture.contract._Slot: capture.output_template reads it back)
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
        try:
            new = copy.copy(obj)
        except Exception:   # an object that cannot be copied (one holding a file or a lock) is no data container
            memo[id(obj)] = obj
            return obj
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


def rebuilt_output(template, out):
    """A graph's flat output `out` put back in the output template's structure (new objects each call)."""
    return _remap(template, lambda s: out[s.i], {})


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
    fills: dict = field(default_factory=dict)   # {keyword: (value, input of its shape)}: see find_fills
    fill_dtypes: dict = field(default_factory=dict)   # {keyword: the example's dtype}
    params: tuple = ()           # the forward's positional parameters, in order (a call's positional inputs past the
                                 # example's bind to them by name, as eager binds them)

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
        return CallSpec(len(args), tuple(tensors), constants, template, arg_names, defaults,
                        params=tuple(positional) if len(positional) >= len(args) else ())

    @property
    def names(self) -> tuple:
        """The flat inputs' names: the positional arguments' (the forward's, or input_<i>), then the
        tensor keyword arguments'."""
        return tuple(self.arg_names) + tuple(self.kw_names)

    def positions(self, dynamic):
        """OptimizeConfig.dynamic as capture's exporter takes it: True / False as they are, {input
        name: {dim: (lo, hi)}} as one entry per flat input (None: every dim fixed)."""
        if not isinstance(dynamic, dict):
            return dynamic
        unknown = sorted(set(dynamic) - set(self.names))
        if unknown:
            raise InputError(f"dynamic= names {unknown[0]!r}, which is not a tensor input of the call the model was "
                             f"optimized with (its inputs: {', '.join(self.names)})")
        return tuple(dynamic.get(n) for n in self.names)

    @property
    def trivial(self) -> bool:
        return not self.kw_names and not self.constants and self.template is None

    def flat(self, args, kwargs) -> tuple:
        """The graph's inputs for a call model(*args, **kwargs); InputError where the call does
        not fit what was captured."""
        if not kwargs and not self.kw_names and len(args) == self.n_args:
            return tuple(args)   # the common call, checked in a line
        if len(args) == 1 and isinstance(args[0], Mapping) and self.n_args == 0 and self.kw_names:
            raise InputError(f"the optimized model takes its inputs by keyword ({', '.join(self.kw_names)}), as its "
                             "example was a dict: call it as opt(**inputs), not opt(inputs)")
        twice = [n for n in self.arg_names[:len(args)] if n in kwargs]
        if twice:
            raise InputError(f"{twice[0]!r} is given both by position and by name")
        named = [n for n in self.arg_names[len(args):] if n in kwargs]
        if named:            # positional inputs given by their parameter names, as eager takes them
            kwargs = dict(kwargs)
            args = tuple(args) + tuple(kwargs.pop(n) for n in self.arg_names[len(args):] if n in named)
        if len(args) > self.n_args and len(args) <= len(self.params):
            # inputs the example gave by name, given by position (opt(ids, mask) for an example of input_ids= and
            # attention_mask=): bound to the forward's parameters by name, as eager binds them
            extra = dict(zip(self.params[self.n_args:len(args)], args[self.n_args:]))
            twice = [n for n in extra if n in kwargs]
            if twice:
                raise InputError(f"{twice[0]!r} is given both by position and by name")
            args, kwargs = tuple(args[:self.n_args]), {**kwargs, **extra}
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
        at_default = [k for k in extra if k in self.defaults and _same_constant(kwargs[k], self.defaults[k])]
        if at_default:       # given explicitly at the default the graph fixed (token_type_ids=None): that call
            kwargs = {k: v for k, v in kwargs.items() if k not in at_default}
            extra = [k for k in extra if k not in at_default]
        if extra:
            default = (f" (it was left at its default, {self.defaults[extra[0]]!r}, fixed in the graph)"
                       if extra[0] in self.defaults else "")
            cache = next((k for k in extra if k in _CACHE_KEYWORDS), None)
            if cache is not None:     # HF's generate calling an optimized inner model with its cache
                raise InputError(f"keyword argument {cache!r}: the optimized model was captured without a KV cache, "
                                 "so generate() cannot step it; optimize the causal LM itself "
                                 "(opt = accelc.optimize(lm, inputs)) and call opt.generate(...), which runs over "
                                 "accelc's own cache")
            raise InputError(f"keyword argument {extra[0]!r} was not in the example the model was optimized with"
                             f"{default}, so the captured graph has no input for it; optimize with an example "
                             "that passes it")
        for k, v in self.constants.items():
            if k in kwargs and not _same_constant(kwargs[k], v):
                raise InputError(f"keyword argument {k}={kwargs[k]!r}: the model was optimized with {k}={v!r}, "
                                 "fixed in the captured graph; optimize again with the value you call it with")
        fills = getattr(self, "fills", {})     # (a module pickled before fills: none)
        fill = [k for k in fills if kwargs.get(k) is None]
        if fill:      # an optional input left out (or None) where the model's default is a constant tensor
            kwargs = dict(kwargs)
            for k in fill:
                value, like = fills[k]
                shape = kwargs.get(like, args[self.arg_names.index(like)] if like in self.arg_names[:len(args)] else None)
                if isinstance(shape, torch.Tensor):     # (else the input it takes its shape from is missing: said below)
                    kwargs[k] = torch.full(shape.shape, value, dtype=self.fill_dtypes[k], device=shape.device)
        none = [k for k in self.kw_names if k in kwargs and kwargs[k] is None]
        if none:
            raise InputError(f"{none[0]}=None: the model was optimized with a tensor there, and its graph takes "
                             f"one; pass the tensor (what None means to the model), or optimize with an example "
                             f"that leaves {none[0]} out")
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
        return out if self.template is None else rebuilt_output(self.template, out)


_CACHE_KEYWORDS = ("cache", "past_key_values", "cache_position")   # what HF's generate passes a decoder step


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



def find_fills(model, spec: CallSpec, args: tuple, kwargs: dict, state: dict) -> None:
    """The optional integer inputs (ids, masks) of the example a call may leave out, as the model lets it
    (HF's token_type_ids, attention_mask): where the forward's default is None and the model, run with it
    left out, gives exactly what it gives with the input filled with 0 or with 1 (tried on the example's
    other inputs), a call without it gets that fill, at the shape of an input of the example's same shape.
    Sets spec.fills; the model's buffers put back to `state` after."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    names = list(spec.arg_names) + list(spec.kw_names)
    given = list(args) + [kwargs[k] for k in spec.kw_names]
    for k in spec.kw_names:
        t = kwargs[k]
        if k not in params or params[k].default is not None or t.is_floating_point() or t.dim() == 0:
            continue
        like = next((n for n, x in zip(names, given) if n != k and isinstance(x, torch.Tensor)
                     and x.shape == t.shape), None)
        if like is None:
            continue
        without = {n: v for n, v in kwargs.items() if n != k}
        try:
            with torch.no_grad():
                left = model(*args, **without)
                for value in (0, 1):
                    if _same_output(left, model(*args, **dict(without, **{k: torch.full_like(t, value)}))):
                        spec.fills[k] = (value, like)
                        spec.fill_dtypes[k] = t.dtype
                        break
        except Exception:   # the model needs it: no fill, a call must pass it
            continue
        finally:
            restore_buffers(model, state)


def _same_output(a, b) -> bool:
    """Outputs the same up to rounding (the dtype's floor: another code path for the same values, as an
    all-ones mask against none); a filled input the model reads otherwise moves them far past it."""
    x, y = _tensors_in(a), _tensors_in(b)      # (those inside objects too: a cache)
    if len(x) != len(y):
        return False
    for p, q in zip(x, y):
        if p.shape != q.shape or p.dtype != q.dtype:
            return False
        elif not p.is_floating_point() or not (torch.isfinite(p).all() and torch.isfinite(q).all()):
            if not same_values(p, q):
                return False
        elif rel_l2(p, q) > REL_L2_FLOOR.get(p.dtype, REL_L2_FLOOR[torch.float32]):
            return False
    return True


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



def mutated_state(gm: fx.GraphModule) -> list[str]:
    """The module attributes (buffers) the graph updates in place: targets of get_attr nodes an
    in-place op writes, through views."""
    out = []
    for n in gm.graph.nodes:
        for arg in written_args(n):
            base = view_base(arg)
            if base.op == "get_attr" and base.target not in out:
                out.append(base.target)
    return out


def aliased_state(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """Pairs (written, other) of the graph's module tensors where `written` is updated in place
    (mutated_state) and `other`, another attribute of the graph, lies over the same memory: a
    tensor a capture reached by two paths (a module's buffer and an object's attribute) becomes two
    constants, which a compiler takes for independent, free to order a read of one before a write
    of the other."""
    tensors = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = meta.attr_value(gm, n)
            if isinstance(t, torch.Tensor) and not t.is_meta:
                try:
                    tensors[n.target] = t.untyped_storage().data_ptr()
                except (RuntimeError, NotImplementedError):   # a tensor without memory of its own
                    continue
    return [(w, o) for w in mutated_state(gm) if w in tensors
            for o, ptr in tensors.items() if o != w and ptr == tensors[w] and ptr != 0]
