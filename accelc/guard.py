"""Guard: owns the verdict on every rewritten layer before the user gets it.

`settle(gm, ctx)` checks every layer on the example inputs, puts back what fails and returns the
final check of every layer, by name:
  1. a layer that fails goes back: an int8 layer to its float kernel (checked again in 3.), any
     other to its original PyTorch subgraph (accelc.rewrite.revert, with the reason);
  2. on a GPU, with Int8Config.only_if_faster, each int8 layer is timed against its float kernel
     on the example inputs (the report's timer) and the slower one goes;
  3. the layers moved back to float in 1. and 2. are checked again; one that fails goes back to
     PyTorch;
  4. on a GPU, with OptimizeConfig.only_if_faster, each layer is timed against its original
     PyTorch subgraph the same way, and where PyTorch is not slower it stays PyTorch ("kept",
     with both times);
  5. with Int8Config / Fp8Config.output_error, the whole output's error against the model in higher
     precision held within that multiple of eager's own: past it, quantized layers go back to float,
     the lowest SQNR first, each said (each layer's floor alone does not bound their sum);
  6. the whole model's output on the example against eager's (accelc.output_check): far past rounding, layers
     go back to PyTorch until it is within, or the rewrite is refused (a fault outside every layer);
  7. an int8 layer that stays lets go of its float weights (accelc.rewrite.Rewrite.release_original),
     and so does any layer whose original subgraph holds tensors the optimized module does not (a
     packed gate / up weight, a folded BN): the report reads them from the model instead.

A check runs the rewritten graph on the example inputs, then on a second, independent draw of
inputs of the same shapes and, where the inputs share a batch dim, at another batch size
(other_inputs); a layer must pass on all of them. On a GPU each kernel also runs twice on the
example inputs and must give the same bits (non-determinism is a race: reverted). At each
accelc node three things are computed from the same inputs (the values eager PyTorch would give
that layer):
  - the accelc kernel's output,
  - the original subgraph's output (eager PyTorch, in the model's dtype),
  - the original subgraph in higher precision (fp32 for half models, fp64 for fp32 ones).
The layer passes when ||accelc - ref|| / ||ref|| is within the dtype's floor or within
`eager_error_factor` x eager's own error against the same reference, and is finite where the
reference is. An int8 layer is judged by its SQNR against the same reference instead,
10 log10(||ref||^2 / ||accelc - ref||^2) dB, which must reach Int8Config.sqnr_floor (Fp8Config's); an fp8
linear or gated layer's error must also stay within 1.1x the format's own (layer_check.within_the_format). The eager
output is what flows on, so each layer is judged on its real inputs and one layer's error does
not leak into the next one's verdict.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils import _pytree as pytree

from accelc import layer_compiles, meta, output_check, progress, runtime, shared_checks, tuning
from accelc.other_inputs import sized_other_inputs
from accelc.latency import layer_ms, median_ms
from accelc.kernels import REFERENCES
from accelc.layer_check import FP8_OPS, compare, failed, probed, quantized_format, reference, within_the_format
from accelc.layer_runner import LayerRunner
from accelc.layer_signature import signature, value as _value
from accelc.numerics import output_error, same_values
from accelc.records import LayerCheck
from accelc.rewrite import demote, forget_replacements, layers, revert

log = logging.getLogger("accelc")


@dataclass
class _Verdicts:
    """What settle's phases hand on: the layers that stay accelc's so far, with their checks; the
    checks of the layers put back, by name; the layers moved to their float kernel, to check again."""
    passed: dict = field(default_factory=dict)     # fx.Node -> LayerCheck
    put_back: dict = field(default_factory=dict)   # layer name -> LayerCheck
    recheck: set = field(default_factory=set)      # fx.Node


def settle(gm: fx.GraphModule, ctx) -> dict[str, LayerCheck]:
    """Check, revert, demote, choose int8 or float, check again, keep only what is faster
    (module docstring); returns {layer name: its final check} for every layer checked, reverted
    and kept ones included."""
    v = _Verdicts()
    if ctx.config.guard:
        _judge(gm, ctx, v, check_layers(gm, ctx), may_demote=True)
    _choose_int8_or_float(gm, ctx, v)
    if v.recheck and ctx.config.guard:
        _judge(gm, ctx, v, check_layers(gm, ctx, only=v.recheck), may_demote=False)
    _keep_the_faster(gm, ctx, v)
    _fit_the_error_budget(gm, ctx, v)
    output_check.defend(gm, ctx, _revert, v.put_back, v.passed)
    _finish(gm)
    return {**{meta.rewrite_of(n).layer: c for n, c in v.passed.items()}, **v.put_back}


def replay(gm: fx.GraphModule, decisions: list, checks: dict, ctx) -> dict[str, LayerCheck]:
    """What settle did to a graph the passes made alike, without its checks and races: its decisions
    (ctx.decisions: demoted, put back, kept as PyTorch, by layer name) made again in their order
    (accelc.reuse), then the whole output's check as settle's; returns settle's result, `checks`."""
    for op, layer, reason, status in decisions:
        node = next(n for n in layers(gm) if meta.rewrite_of(n).layer == layer)
        if op == "demote":
            demote(gm, node, reason)
        else:
            revert(gm, node, reason, status)
    checks = dict(checks)
    output_check.defend(gm, ctx, _revert, checks)
    _finish(gm)
    return checks


def _finish(gm: fx.GraphModule) -> None:
    forget_replacements(gm)
    _release_int8_float_weights(gm)
    _release_originals_not_held(gm)
    gm.graph.lint()
    gm.recompile()


def _demote(gm, ctx, node: fx.Node, note: str) -> fx.Node:
    ctx.decisions.append(("demote", meta.rewrite_of(node).layer, note, ""))
    return demote(gm, node, note)


def _revert(gm, ctx, node: fx.Node, reason: str, status: str = "reverted") -> None:
    ctx.decisions.append(("revert", meta.rewrite_of(node).layer, reason, status))
    revert(gm, node, reason, status)


def _judge(gm, ctx, v: _Verdicts, checks: dict, may_demote: bool) -> None:
    """Phases 1 and 3: a layer that passed stays; one that failed goes to its float kernel (to be
    checked again) where it has one and may_demote, else back to PyTorch."""
    for node, check in checks.items():
        rw = meta.rewrite_of(node)
        if check.passed:
            v.passed[node] = check
        elif may_demote and rw.fallback is not None:
            v.recheck.add(_demote(gm, ctx, node, f"{check.reason}: float kernel instead"))
        else:
            v.put_back[rw.layer] = check
            _revert(gm, ctx, node, check.reason)


def _choose_int8_or_float(gm, ctx, v: _Verdicts) -> None:
    """Phase 2 (a GPU, Int8Config.only_if_faster): an int8 layer slower than its float kernel on the
    example inputs goes to the float kernel (checked again in phase 3)."""
    config = ctx.config
    if not (runtime.can_time(ctx.device) and config.quantized is not None and config.quantized.only_if_faster):
        return
    int8 = [n for n in layers(gm) if meta.rewrite_of(n).quantized and meta.rewrite_of(n).fallback is not None]
    inputs, words = race_inputs(ctx)
    for node, (t8, tf) in _race(gm, inputs, int8, "fallback", ahead=ctx.race is not None).items():
        if t8 < tf:
            continue
        check = v.passed.pop(node, None)
        q, cfg = quantized_format(config), type(config.quantized).__name__
        note = (f"{q} {t8 * 1e3:.1f} us vs float {tf * 1e3:.1f} us on {words}: float kernel kept "
                f"({cfg}.only_if_faster)")
        v.recheck.add(_demote(gm, ctx, node, f"{q} SQNR {check.sqnr_db:.1f} dB; {note}" if check else note))


def _keep_the_faster(gm, ctx, v: _Verdicts) -> None:
    """Phase 4 (a GPU, OptimizeConfig.only_if_faster): each layer against its original PyTorch
    subgraph on the example inputs; where PyTorch is not slower it stays PyTorch ("kept")."""
    if not (runtime.can_time(ctx.device) and ctx.config.only_if_faster):
        return
    t0 = time.perf_counter()
    inputs, words = race_inputs(ctx)
    race = _race(gm, inputs, layers(gm), "original", ahead=ctx.race is not None)
    ctx.seconds["timing layers"] = round(time.perf_counter() - t0, 2)
    for node, (ta, to) in race.items():
        rw = meta.rewrite_of(node)
        if ta < to:
            if ctx.race is None:
                ctx.eager_ms[rw.layer] = to     # eager time of a layer accelc runs, on the example inputs
            continue
        if node in v.passed:
            v.put_back[rw.layer] = v.passed.pop(node)
        _revert(gm, ctx, node, f"{rw.kernel} {ta * 1e3:.1f} us vs PyTorch ({library(rw.kind)}) {to * 1e3:.1f} us on "
                         f"{words}: PyTorch kept (OptimizeConfig.only_if_faster)", status="kept")


def _fit_the_error_budget(gm, ctx, v: _Verdicts) -> None:
    """Phase 5 (Int8Config / Fp8Config.output_error): each quantized layer passed its SQNR floor, but their errors
    add up through the model. The whole output's error against the model in higher precision is held within
    output_error times eager's own: past it, quantized layers go back to their float kernel (to PyTorch, without
    one), the lowest SQNR first, in doubling steps (1, 1, 2, 4, ... layers: one forward each) until the output is
    within it or none is left; each said in its note, the float kernels checked again."""
    q = ctx.config.quantized
    budget = getattr(q, "output_error", None) if q is not None else None
    quantized = [n for n in v.passed if meta.rewrite_of(n).quantized]
    if budget is None or ctx.output_budget is None or not quantized:
        return
    expected, reference = ctx.output_budget
    try:
        ref = reference()
    except Exception as e:     # the model does not run in higher precision: the budget cannot be measured, said
        runtime.warn_once(f"output-error-{type(q).__name__}", f"accelc: {type(q).__name__}.output_error not applied: "
                          f"the model does not run in higher precision to measure it ({type(e).__name__}: {e})")
        return
    own = output_error(expected, ref)

    def error() -> float:
        gm.recompile()
        with torch.no_grad():
            return output_error(gm(*ctx.example_inputs), ref)

    err, order, moved, step = error(), sorted(quantized, key=lambda n: v.passed[n].sqnr_db), [], 1
    while err > budget * own and order:
        batch, order = order[:step], order[step:]
        for n in batch:
            check, rw = v.passed.pop(n), meta.rewrite_of(n)
            note = (f"{quantized_format(ctx.config)} SQNR {check.sqnr_db:.1f} dB; back to float: the output's error "
                    f"against the model in higher precision was {err:.2g}, past {budget:g}x eager's {own:.2g} "
                    f"({type(q).__name__}.output_error)")
            if rw.fallback is not None:
                moved.append(_demote(gm, ctx, n, note))
            else:
                v.put_back[rw.layer] = check
                _revert(gm, ctx, n, note)
        step = max(1, len(moved))
        err = error()
    if moved:
        log.info("accelc: %d quantized layer(s) back to float for the output's error budget (%.2g, %g x eager's %.2g)",
                 len(moved), err, budget, own)
        _judge(gm, ctx, v, check_layers(gm, ctx, only=set(moved)), may_demote=False)


# what eager PyTorch runs a layer of each kind with on an NVIDIA GPU (the library accelc's kernel lost to)
_LIBRARIES = {"linear": "cuBLAS", "gated_linear": "cuBLAS", "conv2d": "cuDNN", "conv2d_depthwise": "cuDNN", "conv1d": "cuDNN",
              "attention": "SDPA: cuDNN / flash", "layer_norm": "ATen", "rms_norm": "ATen", "rotary": "ATen"}


def library(kind: str) -> str:
    """The library eager PyTorch runs a layer of this kind with (int8 kinds: their float layer's)."""
    return _LIBRARIES.get(kind.removesuffix("_int8").removesuffix("_fp8"), "ATen")


def race_inputs(ctx) -> tuple[tuple, str]:
    """(inputs, what they are) the speed races time layers on: ctx.race where a program names the call
    it serves most (a generation step: a decode step), else the example inputs."""
    return ctx.race if ctx.race is not None else (ctx.example_inputs, "the example inputs")


# ---------------------------------------------------------------------------------------------
# checking

def check_layers(gm: fx.GraphModule, ctx, only=None) -> dict[fx.Node, LayerCheck]:
    """Check every rewritten node (or those in `only`) on the example inputs (ctx, a PassContext), then again on
    the other inputs
    of `other_inputs` (a second draw; other batch sizes and sequence lengths, the ends of the
    ranges `shapes` says the graph takes): a layer passes only if it passes on all of them. On a
    GPU each kernel runs twice on the example inputs and must give the same bits both times
    (accelc's kernels have no atomics: a difference is a race). A kernel's first call tunes it
    (accelc.tuning): the tuning log names the layer and how many are left. The time the checks on other
    inputs took goes to ctx.seconds ("guard: other inputs"). ctx.shapes (accelc.capture.InputShapes) give the
    other sizes; what the checks learn of them goes back there, a narrower contract where the program's own
    shape check refused one (InputShapes.narrowed), and the sizes every layer passed at into ctx.checked_at, the
    guard's record."""
    args, config, shapes = ctx.example_inputs, ctx.config, ctx.shapes
    todo = [n for n in layers(gm) if only is None or n in only]
    if only is None:
        layer_compiles.candidates_ahead(gm, args, set(todo), fill=True)    # (accelc.meanwhile's work done there)
        layer_compiles.later_ahead(gm, ctx.later_inputs, set(todo))     # (not waited for)
    progress.phase("checking each layer against PyTorch" + (" (first calls tune kernels)" if not runtime.interpreted()
                                                             else ""), len(todo))
    checks = _check_pass(gm, args, config, only, repeat=repeat_runs())
    t0 = time.perf_counter()
    others = sized_other_inputs(args, shapes)
    passing = {n for n, c in checks.items() if c.passed}
    # every other size's kernels handed to the workers at once, as the checks there serve them (the configs just
    # tuned on the example): each size's check runs while the later sizes' compile
    ahead = layer_compiles.others_ahead(gm, others, passing) if passing else None
    try:
        checks = _check_others(gm, ctx, checks, others, ahead is not None, only)
    finally:
        if ahead is not None:
            ahead.wait()
    key = "guard: other inputs"
    ctx.seconds[key] = round(ctx.seconds.get(key, 0.0) + time.perf_counter() - t0, 2)
    return checks


def _check_others(gm, ctx, checks: dict, others: list, handed: bool, only) -> dict:
    """check_layers' checks on the other inputs, each size's after the example's (`checks`); handed: their
    kernels' compiles handed to the workers (layer_compiles.others_ahead)."""
    args, config, shapes = ctx.example_inputs, ctx.config, ctx.shapes
    for label, more_args, sizes in others:
        passing = {n for n, c in checks.items() if c.passed}
        if not passing:
            break
        progress.phase(f"checking the layers {label}", len(passing))
        try:
            # numbers, not speed: the kernels run with the configs tuned for the example's sizes, as a
            # call of a size not tuned does (tuning every size the checks meet took 62 of 216 s of a
            # cold BERT optimize, H100); warm_up and warmup_shapes tune the sizes asked for
            with tuning.serving(say=False):
                layer_compiles.sizes_ahead(gm, more_args, passing, handed=handed)
                more = _check_pass(gm, more_args, config, passing, repeat=False)
        except Exception as e:   # the model itself does not run on them (a shape it fixes): nothing to check
            log.debug("accelc: guard: no check %s (%s: %s)", label, type(e).__name__, e)
            narrower = shapes.narrowed(str(e)) if shapes is not None else None
            if narrower is not None:    # a shape guard the program holds beyond its stated ranges
                shapes = ctx.shapes = narrower
            continue
        if sizes is not None and only is None:
            ctx.checked_at.append(shapes.checked_label(label, args, sizes))
        for n, c in more.items():
            if not c.passed:
                checks[n] = dataclasses.replace(c, reason=f"{c.reason} ({label})")
    return checks


def repeat_runs() -> bool:
    """Whether the guard runs each kernel twice: on a GPU (the CPU interpreter runs a program's
    operations one after another, so it cannot race)."""
    return not runtime.interpreted()


def _check_pass(gm, args, config, only, repeat: bool) -> dict[fx.Node, LayerCheck]:
    """One forward pass of the checks: at each layer (all, or those in `only`) the kernel's output
    against eager's and the higher-precision reference; eager's output flows on."""
    checks: dict[fx.Node, LayerCheck] = {}
    todo = [n for n in layers(gm) if only is None or n in only]

    def at_layer(runner, n, rw):
        ins = runner.layer_inputs(rw)
        # .forward: a GraphModule's __call__ prints a traceback to stderr before raising (the
        # model may not run at another batch size; other_inputs says so in the log)
        eager = (rw.original.forward if isinstance(rw.original, fx.GraphModule) else rw.original)(*ins)
        if only is not None and n not in only:
            return eager
        a, kw = runner.fetch_args_kwargs_from_env(n)
        progress.step(rw.layer)
        k = shared_checks.key(n, a, kw, rw, config)
        check = shared_checks.lookup(k, gm)     # the same kernel, weights and shapes, another program's check
        if check is None:
            check = _check_layer(n, rw, a, kw, ins, eager, config, repeat, f"layer {len(checks) + 1}/{len(todo)}")
            shared_checks.keep(k, gm, check)
        checks[n] = check
        return eager

    with torch.no_grad():
        LayerRunner(gm, at_layer).run(*args)
    return checks


def _check_layer(n: fx.Node, rw, a, kw, ins, eager, config, repeat: bool, task: str) -> LayerCheck:
    """One layer's check (_check_pass): its kernel on (a, kw) against eager's output and the reference on `ins`."""
    try:
        with tuning.task(f"{task} {rw.layer}"):
            out = n.target(*a, **kw)
            again = n.target(*a, **kw) if repeat else out
    except Exception as e:  # a kernel that fails to compile or launch is reverted, not fatal
        cause = (runtime.interpreted() and runtime.interpreter_problem()) or f"{type(e).__name__}: {e}"
        return failed(ins, eager, config, f"kernel failed: {cause}")
    ref = reference(rw.original, ins)
    check = compare(out, eager, ref, ins, config, rw.quantized)
    if n.target in FP8_OPS:      # (#92: within the format's own error, not only over the SQNR floor)
        check = within_the_format(check, REFERENCES[n.target](*a, **kw), ref)
    if check.blind and check.passed and n.target in REFERENCES and not rw.quantized:
        check = probed(n.target, REFERENCES[n.target], a, kw, check, config)
    if check.passed and not all(same_values(x, y) for x, y in zip(pytree.tree_leaves(out), pytree.tree_leaves(again))):
        check = dataclasses.replace(check, passed=False, reason=(
            "non-deterministic: two runs on the same inputs gave different results (a race in the kernel)"))
    return check


def layer_inputs(gm: fx.GraphModule, args: tuple, model=None) -> dict:
    """{rewritten node: (its original subgraph's inputs, (op args, op kwargs))} as the guard's
    forward pass on `args` computes them: eager outputs flow on from every layer, so these are the
    inputs each layer was checked on. `model`: where layers whose float weights were released
    (int8) read them (accelc.rewrite.Rewrite.eager)."""
    seen = {}

    def at_layer(runner, n, rw):
        ins = runner.layer_inputs(rw)
        seen[n] = (ins, runner.fetch_args_kwargs_from_env(n))
        return rw.eager(model)(*ins)

    with torch.no_grad():
        LayerRunner(gm, at_layer).run(*args)
    return seen


# ---------------------------------------------------------------------------------------------
# int8 or float

def _race(gm, args, nodes, against: str, ahead: bool = False) -> dict:
    """{node: (ms of its accelc call, ms of the other side)} on the inputs the guard checked it on, timed like the
    report (over a CUDA graph; both sides in plain calls where one cannot be captured). against: "fallback" (an
    int8 layer's float kernel) or "original" (the PyTorch layer it replaced). A conv layer is timed on
    channels-last inputs, as a run of accelc convs hands them on, both sides alike. ahead: inputs of sizes the
    checks did not tune (a generation step's decode rows): the raced kernels' compiles handed over first."""
    nodes = set(nodes)
    calls = {}
    # each kernel races on the config tuned for these sizes: a key the checks at other sizes ran on a borrowed
    # config (tuning.serving) tunes at its first launch here. A generation step races at one row a sequence,
    # a size those checks meet first; a race on a borrowed config (or the default) judges a kernel by a config it
    # will not serve with (warm-up tunes those sizes later)
    tuning.forget_borrowed()
    if nodes and ahead:   # their keys' candidates compiled by the workers in one batch, not one at each first launch
        layer_compiles.candidates_ahead(gm, args, nodes)

    def at_layer(runner, n, rw):
        if n in nodes:
            a, kw = runner.fetch_args_kwargs_from_env(n)
            if against == "fallback":
                fb = rw.fallback
                fa, fkw = runner.map_nodes_to_values(fb.args, n), runner.map_nodes_to_values(fb.kwargs, n)
                calls[n] = (lambda n=n, a=a, kw=kw: n.target(*a, **kw),
                            lambda fb=fb, a=fa, kw=fkw: fb.target(*a, **kw),
                            signature(n, a, kw, None, (against, fb.target, _value((fa, sorted(fkw.items()))))),
                            _device_of(a))
            else:
                ins = runner.layer_inputs(rw)
                if rw.kind in ("conv2d", "conv1d"):   # x and the residual; the packed weight stays as it is
                    a = tuple(_channels_last(v) if i in (0, 3) else v for i, v in enumerate(a))
                    ins = [_channels_last(v) for v in ins]
                calls[n] = (lambda n=n, a=a, kw=kw: n.target(*a, **kw),
                            lambda orig=rw.original, ins=ins: orig(*ins),
                            signature(n, a, kw, rw.original, (against, _value(ins))), _device_of(a))
        return runner.run_as_graph(n)

    times, timed = {}, {}     # one layer timed for its twins (accelc.layer_signature)
    with torch.no_grad():
        if nodes:
            LayerRunner(gm, at_layer).run(*args)
        for n, (ours, theirs, same, device) in calls.items():
            if same in timed:
                times[n] = timed[same]
                continue
            (ta, graph_a), (tb, graph_b) = layer_ms(ours, device, rep_ms=20), layer_ms(theirs, device, rep_ms=20)
            if graph_a != graph_b:    # one side refused capture: its time holds the host's launch cost, the
                ta, tb = median_ms(ours, device, rep_ms=20), median_ms(theirs, device, rep_ms=20)   # both so
                log.info("accelc: %s raced in plain calls (one side cannot be captured in a CUDA graph)",
                         meta.rewrite_of(n).layer)
            times[n] = timed[same] = (ta, tb)
    return times


def _device_of(args) -> torch.device:
    """The device of a layer's call: its first tensor argument's (its output may be a tuple: accelc::qkv_rotary's)."""
    return next(v.device for v in pytree.tree_leaves(args) if isinstance(v, torch.Tensor))


def _channels_last(v):
    """A 4-D floating-point tensor in channels-last memory, a 3-D one (a 1-D conv's) with its
    channels innermost likewise; anything else as it is."""
    if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point():
        return v.contiguous(memory_format=torch.channels_last)
    if isinstance(v, torch.Tensor) and v.dim() == 3 and v.is_floating_point():
        return v.transpose(1, 2).contiguous().transpose(1, 2)
    return v


def _release_int8_float_weights(gm: fx.GraphModule) -> None:
    """An int8 layer that stays no longer needs its float call: its fallback goes, and the nodes
    only that call read (weight.t(), the float weight's get_attr) leave the graph, so that the
    optimized module built from it holds the int8 weights alone."""
    for n in layers(gm):
        rw = meta.rewrite_of(n)
        if rw.quantized and rw.fallback is not None:
            rw.release_original()
    changed = True
    while changed:   # nodes with no readers that only feed a float fallback: aux views, weight reads
        changed = False
        for n in reversed(list(gm.graph.nodes)):
            if not n.users and (n.op == "get_attr" or (n.op == "call_function" and n.target is torch.t)):
                gm.graph.erase_node(n)
                changed = True


def _release_originals_not_held(gm: fx.GraphModule) -> None:
    """A kept layer's original subgraph (the report times it, ONNX Runtime's per-layer baseline
    exports it) holds the tensors it reads. Where the optimized module will not hold them itself
    (the pass packed gate and up into one new weight, folded a BN into a conv), they are a second
    copy kept for reports alone (924 MiB on a 1.1B Llama, H100: 47% of its weights): the layer lets
    go of them (release_original), and the report reads them from the model (Rewrite.eager)."""
    def storage(t):
        return t.device, t.untyped_storage().data_ptr()

    held = {storage(t) for t in (meta.attr_value(gm, n) for n in gm.graph.nodes if n.op == "get_attr")
            if isinstance(t, torch.Tensor)}
    for n in layers(gm):
        rw = meta.rewrite_of(n)
        if rw.released:
            continue
        reads = [meta.attr_value(rw.original, a) for a in rw.original.graph.nodes if a.op == "get_attr"]
        if any(isinstance(t, torch.Tensor) and t.device.type != "meta" and storage(t) not in held for t in reads):
            rw.release_original()
