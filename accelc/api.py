"""accelc.optimize: capture -> passes -> guard -> OptimizedModule."""
from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import logging
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from accelc import (buckets, compile_workers, generation, guard, layer_compiles, meta, reuse, runner, runtime,
                    tensor_parallel, warmup)
from accelc import progress as progress_bar
from accelc.capture import CALL_SPEC, buffer_state, capture, mutated_state, restore_buffers
from accelc.capture import reference as capture_reference
from accelc.capture.shapes import CHECKED_AT, SHAPES
from accelc.examples import carried_dims, check_calibration, check_example_inputs, separate_aliases
from accelc.config import OptimizeConfig, PRESETS
from accelc.flops import node_flops
from accelc.latency import layer_ms, median_ms
from accelc.errors import AccelcError, InputError, short_error
from accelc.numerics import output_error, sqnr_db
from accelc.optimized import OptimizedModule, collect_layers
from accelc.step_module import StepModule
from accelc.records import OptimizeInfo
from accelc.pipeline import run_passes
from accelc.rewrite import PassContext, layers


log = logging.getLogger("accelc")


def optimize(model: nn.Module, example_inputs=(), config: OptimizeConfig | str | None = None,
             calibration=None, example_kwargs: dict | None = None, dynamic=None,
             warmup_shapes=None, progress: bool | None = None) -> OptimizedModule:
    """Rewrite `model`'s recognised layers into accelc's Triton kernels.

    example_inputs: a tensor or a tuple of positional arguments, on the device the model runs
        on; they fix the shapes the guard checks and the layers are named and measured with. A
        dict (a tokenizer's output) is taken as keyword arguments, as `model(**inputs)`.
    example_kwargs: keyword arguments of the example call (`attention_mask=...`,
        `use_cache=False`). Tensors among them are inputs of the optimized model, to be passed
        by the same names on each call; other values are fixed at capture (as torch.export fixes
        them), and a call with another value raises InputError. Arguments the example leaves out
        are captured at their defaults.
    config: an OptimizeConfig, a PRESETS name ("fp16", ...), or None for the defaults.
    calibration: with int8 static scales or smoothing (Int8Config), a list of input batches
        (tensors or tuples, like example_inputs) the activation ranges are measured on; the
        example inputs when None.
    dynamic: which input shapes the optimized model takes (OptimizeConfig.dynamic; given here,
        it replaces the config's): True (default) every batch size and sequence length up to the
        model's limits, False the example's shapes only, or {"input_ids": {0: (1, 64), 1: (1, 512)}}.
    warmup_shapes: shapes captured, and their kernel sizes tuned, at optimize time, not at their
        first call (OptimizeConfig.warmup_shapes; given here, it replaces the config's):
        [{"input_ids": (8, 128)}], or "buckets". Calls never tune: a kernel size neither the guard's
        checks nor a warm-up met runs with the config tuned for the nearest size.
    progress: show optimize's phases and the guard's layer i of N (accelc.progress) on stderr; None
        (default): shown in an interactive session (a Python prompt, IPython, Jupyter), not otherwise.

    Layers accelc does not recognise, and rewritten layers whose numbers the guard rejects, run
    as PyTorch; OptimizedModule.summary() lists every one with its reason.

    accelc works on a copy of the model: the optimized module owns its weights, a snapshot taken
    now. Later changes to `model` (load_state_dict, in-place updates, training) never reach it;
    optimize again to take them. The caller's model is left as it is: its forward is not run
    (buffers it updates in forward keep their values) and its mode is not changed (the copy runs
    in eval mode: accelc optimizes for inference).
    """
    given = {k: v for k, v in (("dynamic", dynamic), ("warmup_shapes", warmup_shapes)) if v is not None}
    if given:
        config = dataclasses.replace(resolve_config(config), **given)
    job = make_job(model, example_inputs, config, calibration, stacklevel=3, example_kwargs=example_kwargs)
    runtime.warn_if_interpreted(stacklevel=2)
    with progress_bar.showing("accelc", progress_bar.wanted(progress)):
        return optimize_job(job)


@dataclass
class Job:
    """A model and its inputs made ready for optimizing: in the config's dtype, in eval mode. The
    report times this same model against what optimize_job made of it."""
    model: nn.Module
    args: tuple
    config: OptimizeConfig
    calibration: list
    device: torch.device
    kwargs: dict = field(default_factory=dict)


def make_job(model: nn.Module, example_inputs, config=None, calibration=None, stacklevel: int = 2,
            copy_model: bool = True, example_kwargs: dict | None = None) -> Job:
    """The checks and conversions of optimize() before capture (see there). copy_model=False:
    the caller gives up `model` (a model loaded from a file), so it is not copied."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes an nn.Module, not {type(model).__name__}")
    if isinstance(model, OptimizedModule):
        raise InputError("this model is already accelc's optimized module: use it as it is, or optimize the "
                         "original model (with another config or example)")
    config = resolve_config(config)
    kwargs = dict(example_kwargs or {})
    if isinstance(example_inputs, Mapping):
        kwargs, example_inputs = {**dict(example_inputs), **kwargs}, ()
    if example_inputs is None:
        example_inputs = ()
    if not isinstance(example_inputs, (torch.Tensor, tuple, list)):
        raise InputError(f"example_inputs is a {type(example_inputs).__name__}: give a tensor, a tuple or list of the "
                         "model's positional inputs, or a dict of its keyword inputs (a tokenizer's output)")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not args and not kwargs:
        raise InputError("optimize() needs example inputs, the model called on them as a user calls it: accelc "
                         "captures the model on them and checks every rewritten layer's numbers there "
                         "(optimize(model, x), optimize(model, (x, y)) or optimize(model, tokenizer_output))")
    check_example_inputs(args, kwargs)
    args, kwargs = separate_aliases((args, kwargs))
    if isinstance(config.dynamic, dict):
        config = dataclasses.replace(config, dynamic=carried_dims(model, args, kwargs, config.dynamic))
    batches = [args] if calibration is None else [
        (b,) if isinstance(b, torch.Tensor) else tuple(b) for b in calibration]
    copied = False
    if config.dtype is not None:
        original = model
        model, args = to_dtype(model, args, config.dtype)
        kwargs = cast_floats(kwargs, config.dtype)
        batches = [to_dtype(model, b, config.dtype)[1] for b in batches]
        copied = model is not original
        check_example_inputs(args, kwargs, cast=config.dtype)
    if copy_model and not copied:
        try:
            model = copy.deepcopy(model)
        except Exception as e:
            raise AccelcError(f"accelc works on a copy of the model (the optimized module owns its weights), and "
                              f"this one cannot be copied: {short_error(e)}") from e
    if tensor_parallel.is_sharded(model):    # (parallelize_module's DTensors: this rank's plain modules)
        model = tensor_parallel.localize(model)
        log.info("accelc: a tensor-parallel model: this rank's shards, the plan's collectives in its graph")
    # accelc's own copy (or a model the caller gave up) serves inference only: no autograd records
    # through its runs, and no buffer written from its weights (a generation cache) becomes a graph's
    # non-leaf, which cannot be deep-copied
    for p in model.parameters():
        p.requires_grad_(False)
    if model.training:
        try:
            model.eval()
        except NotImplementedError:
            pass  # a torch.export program (ep.module()): its mode was fixed when it was exported
        else:
            warnings.warn("accelc optimizes for inference: the model is in training mode, and its optimized "
                          "copy runs in eval mode (dropout off, batch norm on running statistics)",
                          stacklevel=stacklevel + 1)
    if calibration is not None:
        check_calibration(model, args, batches, kwargs)
    return Job(model, args, config, batches, device_of(model, (args, kwargs)), kwargs)


def optimize_job(job: Job) -> OptimizedModule:
    """Capture, passes, guard and warm-up of a prepared model. Optimizing runs the model's
    forward many times; buffers that forward updates in place get back the values they had
    before, so the optimized module starts from the model's state."""
    state = buffer_state(job.model)
    compile_workers.hold(job.device.type == "cuda")    # (up by the time the guard's tuners ask)
    try:
        t0 = time.perf_counter()
        log.info("accelc: capturing %s", type(job.model).__name__)
        progress_bar.phase(f"capturing {type(job.model).__name__}")
        gm, method, expected = capture(job.model, job.args, job.kwargs, dynamic=job.config.dynamic)
        t1 = time.perf_counter()
        log.info("accelc: captured with %s (%d graph nodes, %.1f s)", method, len(gm.graph.nodes), t1 - t0)
        spec = gm.meta[CALL_SPEC]
        flat = spec.flat(job.args, job.kwargs)
        calibration = [spec.flat(b, job.kwargs) for b in job.calibration]
        lm = generation.is_causal_lm(job.model)
        if getattr(job.model, "replayable_state", False):    # before optimize_graph's calls make the runner
            gm.meta[runner.REPLAYABLE_STATE] = True
        race = None
        if isinstance(job.model, StepModule):     # the call the program serves most (a generation step: decode)
            inputs, words = job.model.race_inputs(*job.args, **job.kwargs)
            race = (tuple(spec.flat(inputs, {})), words)
        opt = optimize_graph(gm, flat, job.config, method, spec.flat_output(expected), job.device, calibration,
                             cls=generation.OptimizedLM if lm else OptimizedModule, race=race,
                             reference=lambda: capture_reference(job.model, spec, flat, spec.flat_output(expected)))
        opt.info.seconds["capture"] = round(t1 - t0, 2)
        warmup.run(opt, flat, race, job.config.warmup_shapes, job.device, lambda: call_times(job, opt), generates=lm)
        if lm:
            attach_generation(opt, job)
    finally:
        restore_buffers(job.model, state)
        release_cached_memory(job.device)
        compile_workers.release()
    return opt


def call_times(job: Job, opt: OptimizedModule) -> tuple:
    """(eager, accelc) ms a plain call of the example, as the user calls them (the summary's speed line), or ()
    where either fails: a measurement, not a verdict. Not for a graph that updates state (its calls would
    count), such as a generation step's cache writes."""
    if getattr(job.model, "replayable_state", False) or mutated_state(opt.graph_module):
        return ()
    try:
        # (a tensor-parallel program: as many calls on every rank, each pairing its collectives)
        calls = 20 if tensor_parallel.group_of(opt.graph_module) is not None else None
        with torch.no_grad():
            return (median_ms(lambda: job.model(*job.args, **job.kwargs), job.device, calls=calls),
                    median_ms(lambda: opt(*job.args, **job.kwargs), job.device, calls=calls))
    except Exception as e:
        log.debug("accelc: the example's call not timed: %s", e)
        return ()


def release_cached_memory(device: torch.device) -> None:
    """The device memory optimize's checks used, given back: the guard's higher-precision copy of the
    model, its inputs and outputs, the tuner's buffers stay cached by PyTorch's allocator after
    they are freed, held from other processes and counted in the optimized model's footprint (4 GiB
    after a 1.1B-parameter Llama, H100). Graphs' memory pools stay."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def attach_generation(opt, job: Job) -> None:
    """A causal LM's generate(): its step program optimized over accelc's static cache
    (accelc.generation); where that fails, generate() runs the original model, and that is said."""
    t0 = time.perf_counter()
    build = functools.partial(build_step, device=job.device)
    failed = None
    try:
        with progress_bar.showing("accelc", False, part="generation step: "):
            program, step = build(job.model, job.args, job.kwargs, job.config)
    except AccelcError as e:
        failed = str(e)
    except Exception as e:   # a family the step cannot take: said, and generate() stays HF's
        failed = short_error(e)
    # tensor parallel: every rank generates alike (a rank on accelc's step and one on HF's would pair their
    # collectives wrongly), so one rank's failure is every rank's
    failures = [f for f in tensor_parallel.on_every_rank(opt.graph_module, failed) if f is not None]
    if failures:
        opt.no_generation(job.model, failed or f"another rank's generation step failed: {failures[0]}")
        return
    opt.attach_generation(program, step, job.model, build)
    if runtime.can_time(job.device):
        ids = job.kwargs.get("input_ids", job.args[0] if job.args else None)
        mask = job.kwargs.get("attention_mask")
        opt.note_speed(ids, mask if mask is not None else torch.ones_like(ids))
    opt.info.seconds["generation step"] = round(time.perf_counter() - t0, 2)


def build_step(model: nn.Module, args: tuple, kwargs: dict, config: OptimizeConfig, device: torch.device):
    """(step program, cache step) of a causal LM (accelc.generation): the cache sized by `config` and the
    example call (args, kwargs), the step optimized over it."""
    step, step_args = generation.make_step(model, args, kwargs, config)
    length = {1: (1, step.max_len)}     # the tokens of a step vary; the cache fixes the rest
    config = dataclasses.replace(config, dynamic={"input_ids": length, "position_ids": length}, warmup_shapes=())
    return optimize_job(Job(step, step_args, config, [step_args], device)), step


def optimize_graph(gm: fx.GraphModule, args: tuple, config: OptimizeConfig, method: str, expected,
                   device: torch.device, calibration: list | None = None, cls=OptimizedModule,
                   race: tuple | None = None, reference=None) -> OptimizedModule:
    """Passes and guard on a captured graph in canonical form (accelc.capture.make_canonical) whose output on `args` is
    `expected`. race: (inputs, in words) the guard's speed race times layers on, where not `args`. reference: the
    model's output on `args` in higher precision, called where the padding check or the guard's output budget
    needs the model's own error: run once for both (a whole model in fp32)."""
    reference = _run_once(reference) if reference is not None else None
    ctx = PassContext(config, args, calibration if calibration is not None else [args], device,
                      shapes=gm.meta.get(SHAPES), race=race,
                      output_budget=(expected, reference) if reference is not None else None)
    model_bytes = tensor_bytes([gm])
    t0 = time.perf_counter()
    digest = reuse.key(gm, args, config, device, ctx.calibration, race, ctx.shapes)
    memo = reuse.lookup(digest)
    reuse_s = time.perf_counter() - t0
    # each rank decides alone: a tensor-parallel graph's collectives stand in locally (tensor_parallel)
    with tensor_parallel.local_collectives():
        eager_ms = memo.eager_gpu_ms if memo is not None else _eager_gpu_ms(gm, args, config, device)
        t0 = time.perf_counter()
        progress_bar.phase("rewriting (passes)")
        counts = run_passes(gm, ctx)
        t1 = time.perf_counter()
        if memo is not None and memo.fits(gm):
            progress_bar.phase("the guard's verdicts of an identical optimize, reused")
            checks = memo.replay(gm, ctx)
            log.info("accelc: %d layer(s) rewritten; the guard's verdicts of an identical optimize (%s) reused",
                     len(layers(gm)), memo.made)
            seconds = {"passes": round(t1 - t0, 2),
                       "guard: verdicts reused": round(time.perf_counter() - t1 + reuse_s, 2)}
        else:
            memo = None
            before, picked = reuse.layer_list(gm), reuse.picks()
            log.info("accelc: %d layer(s) rewritten; checking each against PyTorch%s", len(layers(gm)),
                     " (first calls tune the kernels)" if runtime.can_time(device) else "")
            checks = guard.settle(gm, ctx)
            seconds = {"passes": round(t1 - t0, 2), "guard (kernel tuning included)": round(time.perf_counter() - t1, 2),
                       **ctx.seconds}
    weights = [rw.weight_bytes for rw in map(meta.rewrite_of, layers(gm)) if rw.weight_bytes]
    # a module over the final graph holds exactly what the graph reads: not the float weights of
    # layers now in int8
    spec = gm.meta.get(CALL_SPEC)
    replayable = gm.meta.get(runner.REPLAYABLE_STATE, False)
    gm = fx.GraphModule(gm, gm.graph, class_name=type(gm).__name__)
    gm.meta[SHAPES] = ctx.shapes
    gm.meta[CHECKED_AT] = list(ctx.checked_at)
    plan = gm.meta[buckets.CALL_PLAN] = buckets.CallPlan()
    if replayable:
        gm.meta[runner.REPLAYABLE_STATE] = True
    with torch.no_grad():
        got = gm(*args)
    padded = ctx.shapes is not None and config.padding and runner.plan(config, device, gm)[1]
    if padded:
        _padding_check(gm, args, ctx, memo, seconds, None if reference is None else own_error_of(expected, reference))
    if memo is None and digest is not None:
        padding = (plan.padding, plan.padding_note) if "padding check" in seconds else None
        reuse.keep(digest, reuse.record(before, ctx, checks, eager_ms, seconds, picked, padding))
    if padded and len(set(tensor_parallel.on_every_rank(gm, repr(plan.padding)))) > 1:
        plan.padding, plan.padding_note = None, ("no padding: the ranks' padding checks differ (a tensor-parallel "
                                                 "program's calls take the same shapes on every rank)")
    err = output_error(got, expected)
    originals = [meta.rewrite_of(n).original for n in layers(gm)]
    info = OptimizeInfo(capture_method=method, device=runtime.backend_name(device), pass_counts=counts,
                        end_to_end_rel_error=err, int8=config.int8 is not None, fp8=config.fp8 is not None,
                        end_to_end_sqnr_db=sqnr_db(err),
                        float_weight_bytes=sum(b[0] for b in weights), int8_weight_bytes=sum(b[1] for b in weights),
                        model_weight_bytes=model_bytes, weight_bytes=tensor_bytes([gm]),
                        original_weight_bytes=tensor_bytes([gm, *originals]) - tensor_bytes([gm]),
                        runtime=runner.plan(config, device, gm)[2], seconds=seconds,
                        shapes=ctx.shapes.describe(ctx.checked_at) + plan.describe() if ctx.shapes is not None else "",
                        reused=memo.made if memo is not None else "")
    records = collect_layers(gm, checks, node_flops(gm))
    info.flops = sum(r.flops for r in records)
    info.accelc_flops = sum(r.flops for r in records if r.status == "rewritten")
    if eager_ms is not None and race is None:    # (layers raced on other inputs: no eager times on the example's)
        info.eager_gpu_ms = eager_ms
        info.accelc_eager_gpu_ms = sum(ctx.eager_ms.get(r.name, 0.0) for r in records if r.status == "rewritten")
    return cls(gm, records, info, example_inputs=args, config=config, call_spec=spec)


def _run_once(fn):
    """fn() run at the first call only: its result, or its exception raised again, at every call."""
    memo: list = []

    def once():
        if not memo:
            try:
                memo.append((fn(), None))
            except Exception as e:
                memo.append((None, e))
        out, err = memo[0]
        if err is not None:
            raise err
        return out
    return once


def own_error_of(expected, reference):
    """The model's own error on the example against its run in higher precision (reference()), or None where the
    model does not run in higher precision (a padded call then meets the dtype's floor alone, as the guard's
    output_error budget is then not applied, and says so)."""
    @functools.cache
    def own() -> float | None:
        try:
            ref = reference()
        except Exception:
            return None
        return output_error(expected, ref)
    return own


def _padding_check(gm: fx.GraphModule, args: tuple, ctx, memo, seconds: dict, own) -> None:
    """The calls' padding into gm's CallPlan: the memo's, or buckets.find's (its time into `seconds`). own(): the
    model's own error, None where unknown; a tensor-parallel graph takes it first, with its real collectives, on
    every rank alike (the check runs them locally, and asks for it only where a padded call passes)."""
    plan = buckets.call_plan(gm)
    if own is not None and tensor_parallel.group_of(gm) is not None:
        own()
    if memo is not None and memo.padding is not None:
        plan.padding, plan.padding_note = memo.padding
        return
    t0 = time.perf_counter()
    rewritten = set(layers(gm))

    def before(sized: tuple) -> None:
        # the padded calls tune their layers at new sizes: every candidate compiled first by the workers at once
        # (a compile that Triton's LLVM aborts on ends a worker, not this process)
        layer_compiles.candidates_ahead(gm, sized, rewritten)
    with tensor_parallel.local_collectives():
        plan.padding, plan.padding_note = buckets.find(gm, args, ctx.shapes, ctx.config.tolerance_for, own, before)
    seconds["padding check"] = round(time.perf_counter() - t0, 2)


def _eager_gpu_ms(gm: fx.GraphModule, args: tuple, config, device: torch.device) -> float | None:
    """The eager model's GPU time a call on the example inputs, over a CUDA graph as the guard
    times each layer (OptimizeConfig.only_if_faster, on a GPU): the denominator of the summary's
    share of eager time now in accelc kernels. None where not timed or the model cannot be
    captured in a CUDA graph (a plain-call time would count host overhead the layers' exclude)."""
    if not (runtime.can_time(device) and config.only_if_faster):
        return None
    with torch.no_grad():
        ms, graphed = layer_ms(lambda: gm(*args), device, rep_ms=50)
    return ms if graphed else None


def resolve_config(config) -> OptimizeConfig:
    """An OptimizeConfig from what optimize() accepts: one, a PRESETS name, or None."""
    if config is None:
        return OptimizeConfig()
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"no preset {config!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[config]()
    if not isinstance(config, OptimizeConfig):
        raise TypeError(f"config must be an OptimizeConfig or a preset name, not {type(config).__name__}")
    return config


def to_dtype(model, args, dtype):
    """(model, args) in `dtype`: a converted copy of the model when its dtype differs (the caller's
    is never converted in place), floating-point tensors of args converted."""
    p = next(iter(model.parameters()), None)
    if p is not None and p.dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    return model, tuple(cast_floats(args, dtype))


def cast_floats(tree, dtype):
    """tree with its floating-point tensors in `dtype`."""
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def device_of(model, args) -> torch.device:
    for t in pytree.tree_leaves(args):
        if isinstance(t, torch.Tensor):
            return t.device
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def tensor_bytes(modules) -> int:
    """Bytes of the parameters and buffers the modules hold, each storage counted once (tensors
    shared between modules, or views of one another, are one)."""
    seen, total = set(), 0
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            if t.device.type == "meta":
                continue
            key = (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


