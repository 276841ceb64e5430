"""Capture: nn.Module -> torch.fx.GraphModule in accelc's canonical form.

1. torch.fx.symbolic_trace; where it fails (data-dependent control flow: branches on shapes,
   `if mask is None`-style library code), torch.export (non-strict), whose ATen graph keeps the
   module path of every node in meta["nn_module_stack"]. The captured graph must reproduce the
   model's output on the example inputs, else the next method is tried.
2. Every node gets its module path ("blocks.0.fc1"), module class, and the shape, dtype and
   device of its value on the example inputs (accelc.meta names the keys).
3. The canonical form (accelc.capture.canonical).
The call contract (which inputs the graph takes, how its output is rebuilt) is
accelc.capture.contract's.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import io
import logging
import os
import sys
import time
import traceback
import weakref
from pathlib import Path

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from accelc import meta, runtime
from accelc.capture.canonical import canonicalize
from accelc.capture.shaped import settle_shaped
from accelc.capture.contract import CALL_SPEC, CallSpec, buffer_state, find_fills, left_out, restore_buffers
from accelc.capture import lean_export, stored
from accelc.capture.asserts import format_at_run_time
from accelc.capture.overflow import finite_branches
from accelc.capture.side_effects import side_effects
from accelc.capture.paths import annotate_paths, keep_module_stacks
from accelc.capture.pickling import program_module
from accelc.capture.shapes import SHAPES, InputShapes, export_dims, position_limits, within_limits
from accelc.errors import CaptureError, InputError
from accelc.capture.check import at_other_sizes, check_same, checked, settle_lower_ends as lower_ends
from accelc.numerics import same_values, upcast_run

log = logging.getLogger("accelc")


PARTS = "accelc_capture_parts"   # gm.meta: {"capture: <part>": seconds} of the capture that made it (the summary's)


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None, dynamic=True, kept: Path | None = None,
            tracing=None) -> tuple[fx.GraphModule, str, object]:
    """Returns (graph module, capture method, the model's eager output on `args`, `kwargs`). The
    graph takes the CallSpec's flat positional inputs (gm.meta[CALL_SPEC]: the positional
    arguments, then the tensor keyword arguments); gm.meta[SHAPES] says which shapes it takes
    (dynamic: OptimizeConfig.dynamic, for torch.export). Buffers the forward updates in place get
    back their values after each run here; symbolic_trace is not tried on such a model (it runs
    buffer updates once, at trace time, instead of recording them). kept: the folder of graphs kept across
    processes (accelc.capture.stored), None for none: a graph torch.export made is kept there, and one kept
    before for the same model and example is read back (checked as a fresh capture is) instead of exporting.
    tracing: called once as the tracers begin (not where a kept graph is read back)."""
    kwargs = dict(kwargs or {})
    state = buffer_state(model)
    given = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in (*args, *kwargs.values())]
    t0 = time.perf_counter()
    with torch.no_grad(), side_effects(model), (stored.files_run() if kept else contextlib.nullcontext()) as files:
        expected = model(*args, **kwargs)
    parts = {"capture: the model's call": time.perf_counter() - t0}
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
    _check_declared(spec, spec.positions(dynamic), flat)
    if isinstance(spec.positions(dynamic), tuple):     # a range past the model's positions: said before tracing
        within_limits(spec.positions(dynamic), position_limits(model, spec.names), spec.names)
    failures = []
    k = stored.key(model, spec, flat, expected, dynamic, files) if kept else None
    found = _kept(kept, k, model, spec, flat, expected, state) if k else None
    if found is None:
        if tracing is not None:
            tracing()
        t0 = time.perf_counter()
        with quiet_torch_logs():
            found = _try_tracers(model, spec, flat, expected, state, updated, failures, dynamic)
        parts["capture: tracing and its checks"] = time.perf_counter() - t0
        if found is not None and k and found[1] == "torch.export":
            stored.keep(kept, k, found[0], model)
    if found is not None:
        find_fills(model, spec, args, kwargs, state)    # optional ids / masks a call may leave out, as the model lets it
        found[0].meta[PARTS] = {name: round(t, 2) for name, t in parts.items()}
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


def _try_tracers(model, spec, flat, expected, state, updated, failures, dynamic=True):
    """(graph module, method, expected) from the first tracer whose graph reproduces the model;
    None when none does (each failure appended to `failures`)."""
    # torch.export traces a batch of one as a batch of two (export_program): where the model runs another
    # way at one (a branch on the size), that program differs from it at the example, and the example's
    # own shapes are traced instead
    tracers = (("symbolic_trace", _symbolic_trace), ("torch.export", _export),
               ("torch.export", functools.partial(_export, grow=False)))
    for method, trace in tracers:
        if trace is not _export and method == "torch.export" and (
                dynamic is not True or not failures or "differs from the model's" not in failures[-1]
                or not _batch_of_two(flat)):
            continue
        if method == "symbolic_trace" and updated:
            failures.append(f"{method}: not tried: forward updates buffers in place ({', '.join(updated[:3])}), "
                            "which it cannot record")
            continue
        if method == "symbolic_trace" and spec.template is not None:
            failures.append(f"{method}: not tried: the output holds tensors in objects a traced graph cannot return")
            continue
        try:
            gm = trace(model, spec, flat, dynamic)
            restore_buffers(model, state)   # tracing (and export's own check) ran the forward's updates
            restore_buffers(gm, state)
            gm.meta[CALL_SPEC] = spec
            gm.meta.setdefault(SHAPES, InputShapes.traced(spec.names, spec.positions(dynamic), flat))
            _check_against_model(gm, make_canonical(gm, flat), model, spec, flat, expected, state)
            if method == "torch.export":
                settle_lower_ends(model, spec, gm, flat)
            return gm, method, expected
        except Exception as e:  # each method's failure is reported together below
            where = model_line(e)
            failures.append(f"{method}: {type(e).__name__}: {_first_line(e)}" + (f" (at {where})" if where else ""))
        finally:
            restore_buffers(model, state)
    return None


def _kept(folder: Path, k: str, model, spec, flat, expected, state):
    """(graph module, method, expected) from the graph kept under key k, checked against the model as a fresh
    capture is, on the example and at the other sizes its shape contract claims (check.at_other_sizes); None where
    none is kept or it does not reproduce the model (then removed)."""
    gm = stored.read(folder, k, model)
    if gm is None:
        return None
    try:
        gm.meta[CALL_SPEC] = spec
        with torch.no_grad():
            out = record_meta(gm, flat)
        restore_buffers(model, state)
        _check_against_model(gm, out, model, spec, flat, expected, state)
        at_other_sizes(gm, flat, lambda ins: spec.flat_output(flat_module(model, spec)(*ins)),
                       lambda ins, want: reference(model, spec, ins, want, state),
                       lambda ins: rerun(model, spec, ins, state), lambda: restore_buffers(model, state))
    except Exception as e:   # the model captured again, as if nothing were kept
        log.info("accelc: capture: the graph an earlier optimize kept does not reproduce the model (%s: %s): "
                 "captured again", type(e).__name__, _first_line(e))
        stored.drop(folder, k)
        return None
    finally:
        restore_buffers(model, state)
    log.info("accelc: capture: the graph an earlier optimize of this model kept, checked on the example")
    gm.meta[stored.KEPT] = True
    return gm, "torch.export", expected


def _check_against_model(gm, out, model, spec, flat, expected, state) -> None:
    """capture.check's verdict on a graph whose output on `flat` is `out` (a tracer's, or a kept one read back):
    raises where it does not reproduce the model's `expected`."""
    checked(gm, spec.flat_output(expected), out, lambda: reference(model, spec, flat, expected, state),
            lambda: rerun(model, spec, flat, state))


def settle_lower_ends(model, spec, gm: fx.GraphModule, flat: tuple) -> None:
    """check.settle_lower_ends on the model: its flat output, reference and rerun at the sizes tried."""
    shapes = gm.meta.get(SHAPES)
    if shapes is None or not any(r.lo == 2 for r in shapes.varying().values()):
        return      # (no dim to settle: the model's buffers not copied)
    state = buffer_state(model)
    lower_ends(gm, flat, lambda ins: spec.flat_output(flat_module(model, spec)(*ins)),
               lambda ins, want: reference(model, spec, ins, want, state), lambda ins: rerun(model, spec, ins, state),
               lambda: restore_buffers(model, state))


def rerun(model, spec, flat, state):
    """The model's flat output on `flat` once more, as it ran to give the output a graph is checked against (its
    buffers put back after, to `state`)."""
    try:
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            return flat_module(model, spec)(*flat)
    finally:
        restore_buffers(model, state)


def reference(model, spec, flat, expected, state=None):
    """The model's flat output on `flat` computed in higher precision (numerics.upcast_run, from the
    dtype of its first floating output in `expected`), its buffers put back after (to `state`, else
    as they are now)."""
    state = buffer_state(model) if state is None else state
    low = next((t.dtype for t in pytree.tree_leaves(spec.flat_output(expected))
                if isinstance(t, torch.Tensor) and t.is_floating_point()), torch.float32)
    try:
        with contextlib.redirect_stdout(io.StringIO()):     # what the forward prints, printed once already
            return upcast_run(flat_module(model, spec), *flat, low=low)
    finally:
        restore_buffers(model, state)


def _capture_advice(model, args, kwargs, expected, state, failures) -> str:
    """What to try when no tracer reproduced the model: the cause found by looking (output that
    changes from call to call), else the usual cause of the failures seen."""
    caches = [type(v).__name__ for v in (*args, *kwargs.values()) if "cache" in type(v).__name__.lower()]
    if caches:     # HF's DynamicCache given as its cache: every call (the tracers' too) appends to it
        return (f"The model appends to the {caches[0]} it is given (cache / past_key_values), so each call, the "
                "tracers' too, sees a longer cache and no graph reproduces it. Optimize it without one "
                "(use_cache=False), or optimize the causal LM itself, whose opt.generate() runs over a static "
                "cache accelc owns.")
    try:
        with torch.no_grad():
            again = model(*args, **kwargs)
        restore_buffers(model, state)
    except Exception:
        again = None
    try:
        if again is not None:
            check_same(expected, again)
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



def make_canonical(gm: fx.GraphModule, args: tuple):
    """Module paths, canonical form and value metadata for a graph from any tracer (also the
    graphs torch.compile hands the accelc backend). Returns gm's output on `args`."""
    annotate_paths(gm)
    canonicalize(gm)
    with torch.no_grad():
        out = record_meta(gm, args)
    if settle_shaped(gm.graph):     # needs the shapes record_meta gives
        gm.graph.lint()
        gm.recompile()
    return out


def export_program(model: nn.Module, args: tuple, kwargs: dict | None = None, dynamic=True, limits=None,
                   grow: bool = True) -> tuple[torch.export.ExportedProgram, str]:
    """torch.export (non-strict); returns (program, why its shapes are the example's: "" when dims
    vary). dynamic: True lets every dimension vary (batch, sequence; export fixes those the model
    pins down), False exports the example's shapes, a tuple (one entry per input, positional then
    keyword: {dim: (lo, hi)} or None) the ranges a user declared (other dims fixed). Where the
    dynamic export fails, the static one is used and the reason returned: never silently. A batch of
    one is traced as a batch of two (the example repeated) for dynamic=True: torch.export fixes
    every dim whose example is 0 or 1; where that program's guards refuse the example itself, the
    example's own shapes are traced. Keyword arguments must follow the forward's parameter order.
    limits ({input index: {dim: (most, why)}}, shapes.position_limits): upper ends the model's config
    sets (a learned position table), given to export as the dims' max, a declared range's open end
    included; a declared range past one is an InputError."""
    kwargs = dict(kwargs or {})
    values = (*args, *kwargs.values())
    limits = limits or {}
    if isinstance(dynamic, tuple) and limits:
        dynamic = within_limits(dynamic, limits)
    if dynamic is False:
        return _export_once(model, tuple(args), kwargs), "dynamic=False"
    examples = [(tuple(args), kwargs)]
    grown = _batch_of_two(values) if dynamic is True and grow else None
    if grown is not None:
        examples.insert(0, (grown[:len(args)], dict(zip(kwargs, grown[len(args):]))))
    failure = ""
    for example_args, example_kwargs in examples:
        if dynamic is True:
            specs = tuple(export_dims(a, {d: (None, most) for d, (most, _) in limits.get(i, {}).items()}, True)
                          for i, a in enumerate((*example_args, *example_kwargs.values())))
        else:
            specs = tuple(export_dims(a, d, False) for d, a in zip(dynamic, values))
        if _takes_varargs(model) and not example_kwargs:
            specs = (specs,)    # a forward(*xs) (flat_module's): one entry, the tuple the varargs bind
        try:
            ep = _export_once(model, example_args, example_kwargs, dynamic_shapes=specs)
            if example_args is not examples[-1][0]:
                checked = program_module(ep)
                with torch.no_grad():          # (its buffers' updates put back with the model's: _try_tracers)
                    checked(*args, **kwargs)    # shape guards traced at batch 2 may exclude batch 1
                _checked[ep] = checked          # (the module _export makes of it: unlifting took 0.3 s of an LM's)
            return ep, ""
        except Exception as e:   # said with the static program it falls back to
            failure = failure or _first_line(e)[:300] or type(e).__name__
            continue
    return (_export_once(model, tuple(args), kwargs), f"the dynamic export failed: {failure}")


def _check_declared(spec, declared, flat) -> None:
    """The ranges a user declared (dynamic=, by input position) must name dims the example has and
    hold the example's sizes."""
    if not isinstance(declared, tuple):
        return
    for name, ranges, a in zip(spec.names, declared, flat):
        for d, (lo, hi) in (ranges or {}).items():
            if not isinstance(a, torch.Tensor) or d >= a.dim():
                raise InputError(f"dynamic= gives a range for {name} dim {d}, which the example does not have")
            if not lo <= a.shape[d] <= (hi if hi is not None else a.shape[d]):
                raise InputError(f"the example's {name} dim {d} is {a.shape[d]}, outside the range {lo}..{hi} "
                                 "declared for it (dynamic=): give an example inside the range")


def _takes_varargs(model: nn.Module) -> bool:
    """Whether the forward takes its positional inputs as *args: torch.export then wants the dynamic
    shapes of all of them as one entry."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def _batch_of_two(values: tuple) -> tuple | None:
    """`values` with every tensor repeated along dim 0, where each is a batch of one; else None."""
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    if tensors and all(t.dim() >= 1 and t.shape[0] == 1 for t in tensors):
        return tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) else a for a in values)
    return None



def _symbolic_trace(model, spec: "CallSpec", flat, dynamic=True):
    """symbolic_trace with the forward's parameters the call leaves out (and its non-tensor keyword
    arguments) fixed; their placeholders are dropped, so the graph takes the CallSpec's flat inputs."""
    concrete = left_out(model, flat[:spec.n_args], exclude=spec.kw_names)
    concrete.update(spec.constants)
    gm = fx.symbolic_trace(model, concrete_args=concrete or None)
    keep_module_stacks(model, gm)
    format_at_run_time(gm)
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



# export_program's module of a program it ran on the example (its batch-1 check), for _export to take once
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _export_once(model, args: tuple, kwargs: dict, **options) -> torch.export.ExportedProgram:
    """torch.export, non-strict, with HF's fp16 overflow guards traced as they compute
    (accelc.capture.overflow), no stack trace collected for each node and no code generated for the graphs in
    between (accelc.capture.lean_export)."""
    with runtime.EXPORTS.export(), finite_branches(), lean_export.lean():     # (apart from other threads' calls)
        return torch.export.export(model, args, kwargs, strict=False, **options)


def _export(model, spec: "CallSpec", flat, dynamic=True, grow=True):
    limits = position_limits(model, spec.names)
    ep, static = export_program(flat_module(model, spec) if not spec.trivial else model, flat,
                                dynamic=spec.positions(dynamic), limits=limits, grow=grow)
    gm = _checked.pop(ep, None)
    gm = program_module(ep) if gm is None else gm
    shapes = InputShapes.of_export(gm, ep.range_constraints, spec.names, static)
    gm.meta[SHAPES] = dataclasses.replace(shapes, declared=spec.positions(dynamic)).capped(limits)
    return gm


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


def _library_dirs() -> tuple[str, ...]:
    """Where the frames of torch, accelc (its passes, kernels and models too), SymPy, NumPy and
    Python's own library live: a frame elsewhere is the model's code (transformers' or timm's included)."""
    names = ("torch", "contextlib", "sympy", "numpy", "accelc", "accelc.passes", "accelc.kernels", "accelc.models")
    return tuple(os.path.dirname(os.path.abspath(sys.modules[n].__file__)) + os.sep for n in names
                 if getattr(sys.modules.get(n), "__file__", None))


def model_line(e: BaseException) -> str:
    """'file:line in function: code' of the deepest frame of e's traceback in the model's own code
    (outside torch, accelc and the libraries under them): the line a tracer failed on, e.g. a branch
    on a tensor's values; '' where there is none."""
    skip = _library_dirs() + ("<frozen",)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    f = frames[-1]
    code = (f.line or "").strip()
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": `{code[:120]}`" if code else "")


class _Recorder(fx.Interpreter):
    """Runs a graph, storing each node's TensorMeta (and whether its value is None) as it goes."""

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            meta.set_tensor_meta(n, out)
        n.meta[meta.IS_NONE] = out is None  # e.g. an optional mask argument left at None
        return out


def record_meta(gm: fx.GraphModule, args: tuple):
    """Run gm on `args`, storing each node's TensorMeta; returns gm's output. (fx.Interpreter.run
    flattens the arguments and unflattens the output through the graph's codegen itself: an export
    graph takes its inputs flat.)"""
    return _Recorder(gm).run(*args)


# ---------------------------------------------------------------------------------------------
# canonical form
