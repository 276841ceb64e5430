"""accelc.optimize, stage by stage: the job (make_job: the model's copy and inputs, checked) -> capture ->
accelc.stages (passes and guard, the final module and its calls' plan, the OptimizedModule) -> warm-up
(accelc.warmup) -> a causal LM's generation step (attach_generation, the same stages over the step program)."""
from __future__ import annotations

import copy
import contextlib
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

from accelc import (compile_workers, fx_tracing, generation, meanwhile, regions, reuse, runner, runtime, shared_checks,
                    stages, tensor_parallel, warmup)
from accelc import progress as progress_bar
from accelc.capture import CALL_SPEC, buffer_state, capture, mutated_state, restore_buffers
from accelc.capture import reference as capture_reference
from accelc.capture import stored
from accelc.capture.trace import PARTS
from accelc.examples import carried_dims, check_calibration, check_example_inputs, separate_aliases
from accelc.config import OptimizeConfig, PRESETS
from accelc.latency import median_ms
from accelc.errors import AccelcError, InputError, short_error
from accelc.optimized import OptimizedModule
from accelc.step_module import StepModule


log = logging.getLogger("accelc")


@fx_tracing.own_flag
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
    t0 = time.perf_counter()
    given = {k: v for k, v in (("dynamic", dynamic), ("warmup_shapes", warmup_shapes)) if v is not None}
    if given:
        config = dataclasses.replace(resolve_config(config), **given)
    job = make_job(model, example_inputs, config, calibration, stacklevel=3, example_kwargs=example_kwargs)
    runtime.warn_if_interpreted(stacklevel=2)
    with progress_bar.showing("accelc", progress_bar.wanted(progress)):
        opt = optimize_job(job)
        opt.info.optimize_s = round(time.perf_counter() - t0, 2)
        if regions.background_running():     # (said where it shows: a call timed now shares the host with it)
            text = ("accelc: the glue for other shapes compiles in the background: until it ends, calls at other shapes "
                    "run uncompiled and every call shares the host with it (opt.wait_for_other_shapes() waits for it; "
                    "OptimizeConfig(other_shapes=\"now\") compiles it inside optimize)")
            log.info(text)
            progress_bar.write(text)
        return opt


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


def optimize_job(job: Job, release: bool = True, captured: tuple | None = None,
                 hold: list | None = None) -> OptimizedModule:
    """Capture, passes, guard and warm-up of a prepared model. Optimizing runs the model's
    forward many times; buffers that forward updates in place get back the values they had
    before, so the optimized module starts from the model's state. release=False: the device memory its checks
    used is left to the caller's release (a generation step's, inside its forward's optimize_job). A causal LM's
    generation step, optimized inside, shares the forward's layer checks (accelc.shared_checks). captured: the
    job's capture_job made already (a generation step's, in its forward's waits). The glue compiles an earlier
    optimize left in the background end first (OptimizeConfig.other_shapes): its races time a GPU of its own.
    hold: where the start of this job's background compile is put (warmup.run's; a generation step's)."""
    regions.wait_background()
    with heap_frozen(), shared_checks.sharing() if generation.is_causal_lm(job.model) else contextlib.nullcontext():
        return _optimize_job(job, release, captured, hold)


@contextlib.contextmanager
def heap_frozen():
    """The objects alive when an optimize begins left out of the garbage collector's passes until it ends
    (gc.freeze), unless the program froze some itself (then left as they are): the full collection that gives
    the checks' memory back at its end (release_cached_memory), and those during it, scan only what the optimize
    made. That collection took 0.35-0.78 s of an optimize's main thread on the GPU host (py-spy); a tiny Qwen2
    LM's on the CPU 0.23 -> 0.04 s. A nested optimize (a generation step's) finds them frozen already."""
    mine = gc.get_freeze_count() == 0
    if mine:
        gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()


def _optimize_job(job: Job, release: bool, captured: tuple | None = None, hold: list | None = None) -> OptimizedModule:
    state = buffer_state(job.model)
    held: list = []     # a causal LM's generation step's background compile, started once this optimize is done
    compile_workers.hold(job.device.type == "cuda")    # (the workers start as a capture traces: capture_job)
    try:
        gm, method, expected, capture_s = captured if captured is not None else capture_job(job)
        spec = gm.meta[CALL_SPEC]
        flat = spec.flat(job.args, job.kwargs)
        calibration = [spec.flat(b, job.kwargs) for b in job.calibration]
        lm = generation.is_causal_lm(job.model)
        if runner.declares_replayable_state(job.model):    # before optimize_graph's calls make the runner
            gm.meta[runner.REPLAYABLE_STATE] = True
        race = None
        if isinstance(job.model, StepModule):     # the call the program serves most (a generation step: decode)
            inputs, words = job.model.race_inputs(*job.args, **job.kwargs)
            race = (tuple(spec.flat(inputs, {})), words)
        # a causal LM's generation step captured in its forward's first wait for the compile workers, and the
        # forward's warm-up done in the step's (accelc.meanwhile), each the main thread's work while it would only
        # wait; not a sharded model's (its capture and CUDA graphs run collectives every rank pairs)
        early = lm and not tensor_parallel.is_sharded(job.model)
        with meanwhile.offered(functools.partial(step_captured, job), "the generation step's capture",
                               enabled=early) as step_capture:
            opt = optimize_graph(gm, flat, job.config, method, spec.flat_output(expected), job.device, calibration,
                                 cls=generation.OptimizedLM if lm else OptimizedModule, race=race,
                                 reference=lambda: capture_reference(job.model, spec, flat, spec.flat_output(expected)))
            opt.info.seconds["capture"] = capture_s
            opt.info.seconds.update(gm.meta.get(PARTS, {}))     # (the capture's parts: the summary's time line)
            opt.info.capture_kept = bool(gm.meta.get(stored.KEPT))
            with meanwhile.offered(functools.partial(forward_warm_up, opt, flat, job.device), "the forward's warm-up",
                                   enabled=early) as warm:
                if lm:
                    attach_generation(opt, job, step_capture, warm, held)
            if warm is not None:
                warm.result()       # (done, unless the step failed before its first wait)
            warmup.run(opt, flat, race, job.config.warmup_shapes, job.device, lambda: call_times(job, opt),
                       generates=lm, example_done=warm is not None, hold=hold)
    finally:
        restore_buffers(job.model, state)
        if release:
            release_cached_memory(job.device)
        compile_workers.release()
    for start in held:     # (after the forward's call timing and memory release: that thread shares the host)
        start()
    return opt


def forward_warm_up(opt: OptimizedModule, flat: tuple, device: torch.device) -> None:
    """A causal LM's forward's warm-up (warmup.example), its phase named as the forward's inside its step's."""
    with progress_bar.showing("accelc", False, part=""):
        warmup.example(opt, flat, None, device)


def capture_job(job: Job) -> tuple:
    """(graph, capture method, the model's output, seconds) of a job's model captured on its example."""
    t0 = time.perf_counter()
    log.info("accelc: capturing %s", type(job.model).__name__)
    progress_bar.phase(f"capturing {type(job.model).__name__}")
    gm, method, expected = capture(job.model, job.args, job.kwargs, dynamic=job.config.dynamic,
                                   kept=reuse.captures(), tracing=compile_workers.start)
    seconds = round(time.perf_counter() - t0, 2)
    log.info("accelc: captured with %s (%d graph nodes, %.1f s)", method, len(gm.graph.nodes), seconds)
    return gm, method, expected, seconds


def call_times(job: Job, opt: OptimizedModule) -> tuple:
    """(eager, accelc) ms a plain call of the example, as the user calls them (the summary's speed line), or ()
    where either fails: a measurement, not a verdict. Not for a graph that updates state (its calls would
    count), such as a generation step's cache writes."""
    if runner.declares_replayable_state(job.model) or mutated_state(opt.graph_module):
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


def attach_generation(opt, job: Job, step_capture: meanwhile.Work | None = None,
                      warm: meanwhile.Work | None = None, hold: list | None = None) -> None:
    """A causal LM's generate(): its step program optimized over accelc's static cache
    (accelc.generation); where that fails, generate() runs the original model, and that is said. step_capture:
    the step's capture offered to the forward's waits (step_captured), None to capture it here; warm: the
    forward's warm-up offered to the step's, done before generate() is timed; hold: where the step's background
    glue compile is put, for the forward's optimize to start at its end."""
    t0 = time.perf_counter()
    build = functools.partial(build_step, device=job.device)
    failed = None
    try:
        with progress_bar.showing("accelc", False, part="generation step: "):
            # (the forward's optimize_job releases the memory once, after this: a collection of the heap took 0.6-0.7 s)
            sjob, step, captured = step_capture.result() if step_capture is not None else step_captured(job)
            generation.loop_ahead(captured[2], job.model, job.config.kv_cache)   # (compiled beside the step's)
            program = optimize_job(sjob, release=False, captured=captured, hold=hold)
            if step_capture is not None and step_capture.ran_early:
                program.info.seconds["capture (during the forward's compiles)"] = program.info.seconds.pop("capture")
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
    if warm is not None:
        warm.result()
    if runtime.can_time(job.device):
        ids = job.kwargs.get("input_ids", job.args[0] if job.args else None)
        mask = job.kwargs.get("attention_mask")
        opt.note_speed(ids, mask if mask is not None else torch.ones_like(ids))
    opt.info.seconds["generation step"] = round(time.perf_counter() - t0, 2)


def step_job(model: nn.Module, args: tuple, kwargs: dict, config: OptimizeConfig, device: torch.device) -> tuple:
    """(the step program's Job, the cache step) of a causal LM (accelc.generation): the cache sized by `config`
    and the example call (args, kwargs)."""
    step, step_args = generation.make_step(model, args, kwargs, config)
    length = {1: (1, step.max_len)}     # the tokens of a step vary; the cache fixes the rest
    config = dataclasses.replace(config, dynamic={"input_ids": length, "position_ids": length}, warmup_shapes=())
    return Job(step, step_args, config, [step_args], device), step


def step_captured(job: Job) -> tuple:
    """(step Job, cache step, its capture_job) of a causal LM's job: the generation step's work that needs nothing
    of the forward's optimize (offered to its waits: accelc.meanwhile)."""
    with progress_bar.showing("accelc", False, part="generation step: "):
        sjob, step = step_job(job.model, job.args, job.kwargs, job.config, job.device)
        return sjob, step, capture_job(sjob)


def build_step(model: nn.Module, args: tuple, kwargs: dict, config: OptimizeConfig, device: torch.device,
               release: bool = True):
    """(step program, cache step) of a causal LM (step_job), the step optimized over its cache (release: as
    optimize_job's)."""
    job, step = step_job(model, args, kwargs, config, device)
    return optimize_job(job, release=release), step


def optimize_graph(gm: fx.GraphModule, args: tuple, config: OptimizeConfig, method: str, expected,
                   device: torch.device, calibration: list | None = None, cls=OptimizedModule,
                   race: tuple | None = None, reference=None) -> OptimizedModule:
    """accelc.stages' settle -> finish -> module on a captured graph in canonical form
    (accelc.capture.make_canonical) whose output on `args` is `expected` (see stages.settle for race and
    reference)."""
    settled = stages.settle(gm, args, config, device, expected, calibration, race, reference)
    return stages.module(stages.finish(settled), method, cls)


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
