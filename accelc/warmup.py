"""optimize's warm-up stage: what the optimized module compiles and captures before optimize returns, so that
calls do not wait for it.

In: the optimized module, the example's graph inputs, the call a program serves most (a generation step's decode
step, or None), OptimizeConfig.warmup_shapes. Out, on a GPU: the glue compiled and the CUDA graphs of the example
and that call captured (the summary's "warmup"; a generation step's example, a prefill at the example prompt's
length, only that call's: prompts come at every length, and its first call captures it on the dynamic glue),
the dynamic glue for the shapes not warmed compiled ("glue for
other shapes"; a causal LM's forward's left to its first call at another shape, said: generate() does not run it;
with OptimizeConfig.other_shapes="background", the default, handed to a thread of its own after the call's timing,
a generation step's writing copies of its cache, after its forward's timing),
the plain call timed (info.call_ms), the warm-up shapes captured ("warm-up shapes") and said in the
call plan; on a CPU only the shapes asked for, checked and said.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Callable

import torch

from accelc import buckets, runtime, tensor_parallel
from accelc.cuda_graphs import clone_tensors
from accelc.runner import REPLAYABLE_STATE
from accelc import progress as progress_bar
from accelc.capture.shapes import CHECKED_AT, SHAPES, repeated_to
from accelc.errors import InputError
from accelc.optimized import OptimizedModule


FORWARD_GLUE_LATER = ("the forward's glue for other shapes compiles at its first call at another shape (generate() "
                      "runs the generation step, whose own is compiled; warmup_shapes compiles the forward's too)")


def run(opt: OptimizedModule, flat: tuple, race: tuple | None, warmup_shapes, device: torch.device,
        call_times: Callable[[], tuple], generates: bool = False, example_done: bool = False,
        hold: list | None = None) -> None:
    """The stage (module docstring); call_times: (eager, accelc) ms a plain call of the example, or ().
    generates: a causal LM's forward, whose generate() runs a step program of its own: the forward's dynamic glue
    is left to its first call at another shape unless warmup_shapes asks for shapes (said in the shapes line).
    example_done: `example` ran already (a causal LM's forward's, in its generation step's waits). hold: where a
    background compile's start is put instead of started (a generation step's, started once its forward's
    optimize has timed its call: api._optimize_job)."""
    warm = inputs_for(opt, warmup_shapes)
    if not runtime.can_time(device):
        if warm:
            note(opt, f"{len(warm)} warm-up shape(s) not captured: no CUDA graphs on this device")
        return
    if not example_done:
        example(opt, flat, race, device)
    flat = _own(flat)
    t0 = time.perf_counter()
    shapes = opt.graph_module.meta.get(SHAPES)
    later = not warm and _later(opt, flat)
    if generates and not warm:
        if shapes is not None and (shapes.free or shapes.varying()):
            note(opt, FORWARD_GLUE_LATER)
    elif not later:
        progress_bar.phase("glue for other shapes")
        if opt.compile_other_shapes(flat):    # the dynamic glue: compiled here, not at a first request
            for inputs in apart_inputs(opt, flat):    # and its variants Dynamo compiles apart (a batch of one)
                opt.compile_other_shapes(inputs)
            opt.info.seconds["glue for other shapes"] = round(time.perf_counter() - t0, 2)
    t1 = time.perf_counter()
    opt.info.call_ms = call_times()
    if opt.info.call_ms:        # (the summary's speed line: eager and accelc timed on the example)
        opt.info.seconds["the example's call timed"] = round(time.perf_counter() - t1, 2)
    if later and not generates:     # (after the call's timing: that thread's compiles would share the host)
        # (the example's tensors copied: the caller may write into its own while that thread reads them)
        inputs = [clone_tensors(flat), *apart_inputs(opt, flat)]
        if hold is not None:     # (meanwhile calls at other shapes, the step's speed measured, run uncompiled glue)
            opt.hold_other_shapes(inputs[0])
            hold.append(lambda: opt.compile_other_shapes_later(inputs))
        else:
            opt.compile_other_shapes_later(inputs)
    if warm:
        t0 = time.perf_counter()
        for inputs in warm:
            opt.warm_up(inputs)
        seconds = round(time.perf_counter() - t0, 2)
        opt.info.seconds["warm-up shapes"] = seconds
        note(opt, f"{len(warm)} warm-up shape(s) captured at optimize time ({seconds:.1f} s)")


def example(opt: OptimizedModule, flat: tuple, race: tuple | None, device: torch.device) -> None:
    """The glue compiled and the CUDA graph captured for the call the program serves most (the example, or a
    generation step's decode: `race`), not at the user's first call (the summary's "warmup"); nothing where no
    CUDA graphs run. Needs nothing of another program's optimize: a causal LM's forward's is done in its generation
    step's first wait for the compile workers (accelc.meanwhile)."""
    if not runtime.can_time(device):
        return
    t0 = time.perf_counter()
    progress_bar.phase("warm-up (glue compiled, CUDA graphs captured)")
    flat = _own(flat)     # (an example passed as a view of the caller's tensor: see _own)
    if race is None:      # compile the glue and capture the example's CUDA graph now, not at the user's first call
        opt.warm_up(flat)
    else:                 # the call a generation step serves most (decode): its graph, its glue compiled static; the
        opt.warm_up(race[0])    # example (a prefill at one prompt length) takes the dynamic glue below, as others
    opt.info.seconds["warmup"] = round(time.perf_counter() - t0, 2)


def _later(opt: OptimizedModule, flat: tuple) -> bool:
    """Whether the glue for other shapes compiles after optimize returns (OptimizeConfig.other_shapes): not a
    tensor-parallel program (its collectives pair across ranks in call order); a program whose calls update state
    in place (a generation step's cache) only where its compile's calls can write copies of that state rather
    than the cache the caller's calls write meanwhile (regions.Glue.apart_ok: a glue cut into regions, whose
    copies fit in memory)."""
    gm = opt.graph_module
    if opt.config.other_shapes != "background" or tensor_parallel.group_of(gm) is not None:
        return False
    return not gm.meta.get(REPLAYABLE_STATE) or opt.compiles_apart_from_state(flat)


def apart_inputs(opt: OptimizedModule, flat: tuple) -> list[tuple]:
    """The graph inputs at the sizes the dynamic glue compiles apart from the example's: Dynamo specializes a
    size of 1, so a batch of one runs a compile of its own (5 s of BERT's glue at a first request, H200), and
    an example with a size of 1 leaves every other size's compile to a first call. Sizes: each varying
    size that is 1 in the example at 2 (where its range reaches 2); then, where a leading dim (the batch)
    varies from 1 and the example's is more, the same with it at 1. [] for a graph of fixed sizes."""
    shapes = opt.graph_module.meta.get(SHAPES)
    if shapes is None or shapes.free or not shapes.varying():
        return []
    ranges, example = shapes.varying(), shapes.sizes_in(flat)
    general = {k: 2 for k, n in example.items() if n == 1 and (ranges[k].hi is None or ranges[k].hi >= 2)}
    ones = {k: 1 for k, n in shapes.sizes_in(flat, leading=True).items() if n >= 2 and ranges[k].lo <= 1}
    sizes = [s for s in (general, {**general, **ones} if ones else {}) if s]
    return [_own(shapes.inputs_at(flat, s)) for s in sizes]


def _own(inputs: tuple) -> tuple:
    """Inputs made from the example's as tensors of their own: a view of it (inputs_at and repeated_to cut
    one) compiles glue whose guards read its base, which a request's tensor has not, so the request compiled
    that glue again."""
    return tuple(a.clone() if isinstance(a, torch.Tensor) and a._base is not None else a for a in inputs)


def inputs_for(opt: OptimizedModule, warmup_shapes) -> list[tuple]:
    """The graph inputs of OptimizeConfig.warmup_shapes (the example's values repeated to size), the
    largest first (the output arena is sized once); InputError naming what does not fit."""
    if not warmup_shapes:
        return []
    shapes = opt.graph_module.meta.get(SHAPES)
    any_shape = shapes is not None and shapes.free and not shapes.static     # symbolic_trace: no shapes recorded
    if any_shape and warmup_shapes != "buckets":
        return _free_inputs(opt, shapes, warmup_shapes)
    if shapes is None or shapes.free or not shapes.varying():
        why = ("the graph was traced with no shapes recorded (symbolic_trace): list the shapes instead" if any_shape
               else "the optimized model takes one shape per input (no dim varies), so there is nothing to warm up "
                    "beyond the example")
        raise InputError(f"warmup_shapes{'=' + repr(warmup_shapes) if isinstance(warmup_shapes, str) else ''}: {why}")
    if warmup_shapes == "buckets":
        plan = buckets.call_plan(opt.graph_module).padding
        if plan is None:
            return []
        open_ended = [plan.words[s] for s, r in plan.ranges.items() if r.hi is None]
        if open_ended:
            raise InputError(f'warmup_shapes="buckets": {", ".join(open_ended)} has no upper end; declare one '
                             '(dynamic={name: {dim: (lo, hi)}}) or list the shapes')
        syms = list(plan.ranges)
        grid = itertools.product(*(buckets.bucket_sizes(plan.ranges[s].lo, plan.ranges[s].hi) for s in syms))
        all_sizes = [dict(zip(syms, combo)) for combo in grid]
    else:
        try:
            all_sizes = [shapes.sizes_of(named, opt.example_inputs) for named in warmup_shapes]
        except ValueError as e:
            raise InputError(str(e)) from None
    all_sizes.sort(key=lambda sz: -math.prod(sz.values()))
    return [_own(shapes.inputs_at(opt.example_inputs, sz)) for sz in all_sizes]


def _free_inputs(opt: OptimizedModule, shapes, warmup_shapes) -> list[tuple]:
    """warmup_shapes of a graph that takes any shape its code takes (symbolic_trace): each named input at
    its shape (the example repeated and cut), the others as in the example; checked against the ranges
    declared for it (dynamic=), as a call is."""
    out = []
    for named in warmup_shapes:
        unknown = sorted(set(named) - set(shapes.names))
        if unknown:
            raise InputError(f"warm-up shape for {unknown[0]!r}: the optimized model's inputs are {list(shapes.names)}")
        for n, a in zip(shapes.names, opt.example_inputs):
            if n in named and isinstance(a, torch.Tensor) and len(tuple(named[n])) != a.dim():
                raise InputError(f"warm-up shape {tuple(named[n])} for {n!r}: it has {a.dim()} dims")
        args = tuple(repeated_to(a, tuple(named[n])) if n in named and isinstance(a, torch.Tensor) else a
                     for n, a in zip(shapes.names, opt.example_inputs))
        refused = shapes.check(args)
        if refused:
            raise InputError(f"warm-up shape: {refused}")
        out.append(_own(args))
    out.sort(key=lambda a: -sum(t.numel() for t in a if isinstance(t, torch.Tensor)))
    return out


def note(opt: OptimizedModule, text: str) -> None:
    """The warm-up's words in the call plan and the summary's shapes line."""
    plan = opt.graph_module.meta[buckets.CALL_PLAN] = buckets.call_plan(opt.graph_module)
    plan.warmed = text
    gm = opt.graph_module
    opt.info.shapes = gm.meta[SHAPES].describe(gm.meta.get(CHECKED_AT, ())) + plan.describe()
