"""optimize's stages after capture, each taking what the one before hands on:

  settle   a captured graph in canonical form -> Settled: the passes' rewrites, settled by the guard (or an
           identical optimize's verdicts replayed, accelc.reuse), and the eager graph's GPU time
  finish   Settled -> Finished: the module over the final graph (holding exactly what it reads), its call
           contract and the sizes every layer passed at, the calls' plan (padding checked where the runner
           pads), the guard's record kept for reuse, the output on the example
  module   Finished -> the OptimizedModule (or OptimizedLM) with its layer records and OptimizeInfo, each part
           of the info from the stage that owns it

accelc.api.optimize_graph runs them in order. Capture before them, and the warm-up and the generation step after
them, are accelc.api.optimize_job's.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import fx

from accelc import buckets, guard, layer_compiles, meta, persistent_step, reuse, runner, runtime, tensor_parallel
from accelc import progress as progress_bar
from accelc.capture import CALL_SPEC
from accelc.capture.shapes import CHECKED_AT, SHAPES
from accelc.flops import node_flops
from accelc.latency import layer_ms
from accelc.numerics import output_error, sqnr_db
from accelc.optimized import OptimizedModule, collect_layers
from accelc.pipeline import run_passes
from accelc.records import OptimizeInfo
from accelc.rewrite import PassContext, layers

log = logging.getLogger("accelc")


@dataclass
class Settled:
    """What settle hands on: the graph with its layers rewritten and settled, and how it got there."""
    gm: fx.GraphModule
    ctx: PassContext              # its example inputs (ctx.example_inputs) among what the passes read
    expected: object              # the captured graph's output on the example (the model's)
    counts: dict                  # pass name -> rewrites made
    checks: dict                  # layer name -> its final check (the guard's, or the replayed record's)
    seconds: dict                 # where the time went, by phase
    memo: reuse.Memo | None       # the identical optimize's record replayed; None where the guard ran
    eager_ms: float | None        # the eager graph's GPU ms a call on the example (None where not timed)
    model_bytes: int              # the captured graph's tensor bytes, before the passes
    reference: object             # the model's output in higher precision, run at most once (or None)
    digest: str | None = None     # the reuse key a new record is kept under
    kept: tuple = ()              # (layers before the guard, tuner picks before it): what reuse.record needs
    decode: str = ""              # a generation step's decode: one persistent kernel or the chain (persistent_step)
    records: list | None = None   # its layers' records, read before one persistent kernel took their place


@dataclass
class Finished:
    """What finish hands on: the final module and what optimize decided for its calls."""
    gm: fx.GraphModule
    got: object                   # its output on the example
    plan: buckets.CallPlan
    settled: Settled = field(repr=False)


def settle(gm: fx.GraphModule, args: tuple, config, device: torch.device, expected, calibration: list | None = None,
           race: tuple | None = None, reference=None) -> Settled:
    """The passes on `gm` (captured on `args`, its output there `expected`), then the guard's verdicts on every
    rewritten layer, or the verdicts of an identical optimize replayed. race: (inputs, in words) the guard's speed race times layers on,
    where not `args`. reference: the model's output on `args` in higher precision, called where the padding
    check or the guard's output budget needs the model's own error: run once for both."""
    reference = run_once(reference) if reference is not None else None
    ctx = PassContext(config, args, calibration if calibration is not None else [args], device,
                      shapes=gm.meta.get(SHAPES), race=race,
                      output_budget=(expected, reference) if reference is not None else None)
    model_bytes = tensor_bytes([gm])
    t0 = time.perf_counter()
    digest = reuse.key(gm, args, config, device, ctx.calibration, race, ctx.shapes)
    memo = reuse.lookup(digest)
    reuse_s = time.perf_counter() - t0
    kept: tuple = ()
    # each rank decides alone: a tensor-parallel graph's collectives stand in locally (tensor_parallel)
    with tensor_parallel.local_collectives():
        eager_ms = memo.eager_gpu_ms if memo is not None else eager_gpu_ms(gm, args, config, device)
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
            kept = (reuse.layer_list(gm), reuse.picks())
            log.info("accelc: %d layer(s) rewritten; checking each against PyTorch%s", len(layers(gm)),
                     " (first calls tune the kernels)" if runtime.can_time(device) else "")
            if ctx.shapes is not None and config.padding and runner.plan(config, device, gm)[1]:   # (finish pads)
                ctx.later_inputs = buckets.padded_inputs(args, ctx.shapes)
            checks = guard.settle(gm, ctx)
            seconds = {"passes": round(t1 - t0, 2), "guard (kernel tuning included)": round(time.perf_counter() - t1, 2),
                       **ctx.seconds}
    t0 = time.perf_counter()
    chain: list = []     # (a generation step's: after the guard settled every layer of it)
    decode = persistent_step.offer(gm, ctx, lambda: chain.append(collect_layers(gm, checks, node_flops(gm))))
    if decode:
        seconds["decode step race"] = round(time.perf_counter() - t0, 2)
    return Settled(gm, ctx, expected, counts, checks, seconds, memo, eager_ms, model_bytes, reference, digest, kept,
                   decode, chain[0] if chain else None)


def finish(s: Settled) -> Finished:
    """The module over s's final graph, holding exactly what the graph reads (not the float weights of layers now
    in int8), with the call contract, the sizes checked and the calls' plan in its meta; the padding check where
    the runner pads; the guard's record kept for a later identical optimize."""
    old, ctx, config, args = s.gm, s.ctx, s.ctx.config, s.ctx.example_inputs
    gm = fx.GraphModule(old, old.graph, class_name=type(old).__name__)
    if old.meta.get(runner.REPLAYABLE_STATE, False):
        gm.meta[runner.REPLAYABLE_STATE] = True
    gm.meta[SHAPES] = ctx.shapes
    gm.meta[CHECKED_AT] = list(ctx.checked_at)
    plan = gm.meta[buckets.CALL_PLAN] = buckets.CallPlan()
    t0 = time.perf_counter()    # (the summary's end-to-end error against eager's: in the interpreter, a fifth of a
    with torch.no_grad():       # small model's optimize, which the time line had left in "the rest")
        got = gm(*args)
    s.seconds["the optimized model's check"] = round(time.perf_counter() - t0, 2)
    padded = ctx.shapes is not None and config.padding and runner.plan(config, ctx.device, gm)[1]
    if padded:
        padding_check(gm, args, ctx, s.memo, s.seconds,
                      None if s.reference is None else own_error_of(s.expected, s.reference))
    if s.memo is None and s.digest is not None:
        padding = (plan.padding, plan.padding_note) if "padding check" in s.seconds else None
        before, picked = s.kept
        reuse.keep(s.digest, reuse.record(before, ctx, s.checks, s.eager_ms, s.seconds, picked, padding))
    if padded and len(set(tensor_parallel.on_every_rank(gm, repr(plan.padding)))) > 1:
        plan.padding, plan.padding_note = None, ("no padding: the ranks' padding checks differ (a tensor-parallel "
                                                 "program's calls take the same shapes on every rank)")
    return Finished(gm, got, plan, s)


def module(f: Finished, method: str, cls=OptimizedModule) -> OptimizedModule:
    """The optimized module of f (a `cls`), its layer records and OptimizeInfo (the graph captured by `method`)."""
    gm, s = f.gm, f.settled
    ctx, config = s.ctx, s.ctx.config
    weights = [rw.weight_bytes for rw in map(meta.rewrite_of, layers(gm)) if rw.weight_bytes]
    err = output_error(f.got, s.expected)
    originals = [meta.rewrite_of(n).original for n in layers(gm)]
    info = OptimizeInfo(capture_method=method, device=runtime.backend_name(ctx.device), pass_counts=s.counts,
                        end_to_end_rel_error=err, int8=config.int8 is not None, fp8=config.fp8 is not None,
                        end_to_end_sqnr_db=sqnr_db(err),
                        float_weight_bytes=sum(b[0] for b in weights), int8_weight_bytes=sum(b[1] for b in weights),
                        model_weight_bytes=s.model_bytes, weight_bytes=tensor_bytes([gm]),
                        original_weight_bytes=tensor_bytes([gm, *originals]) - tensor_bytes([gm]),
                        runtime=runner.plan(config, ctx.device, gm)[2], seconds=s.seconds,
                        shapes=ctx.shapes.describe(ctx.checked_at) + f.plan.describe() if ctx.shapes is not None else "",
                        reused=s.memo.made if s.memo is not None else "", decode_step=s.decode)
    records = s.records if s.records is not None else collect_layers(gm, s.checks, node_flops(gm))
    info.flops = sum(r.flops for r in records)
    info.accelc_flops = sum(r.flops for r in records if r.status == "rewritten")
    if s.eager_ms is not None and ctx.race is None:  # (layers raced on other inputs: no eager times on the example's)
        info.eager_gpu_ms = s.eager_ms
        info.accelc_eager_gpu_ms = sum(ctx.eager_ms.get(r.name, 0.0) for r in records if r.status == "rewritten")
    return cls(gm, records, info, example_inputs=ctx.example_inputs, config=config,
               call_spec=s.gm.meta.get(CALL_SPEC))


def run_once(fn):
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


def padding_check(gm: fx.GraphModule, args: tuple, ctx, memo, seconds: dict, own) -> None:
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
    # sizes whose kernels the workers have (or compile now): the example's, and those the guard handed over as it
    # began (ctx.later_inputs, layer_compiles.later_ahead): no second pass over the layers to hand them over
    handed = {_sizes(args), *map(_sizes, ctx.later_inputs)}

    def before(sized: tuple) -> None:
        # the padded calls tune their layers at new sizes: every candidate compiled first by the workers at once
        # (a compile that Triton's LLVM aborts on ends a worker, not this process)
        if _sizes(sized) not in handed:
            layer_compiles.candidates_ahead(gm, sized, rewritten)
    with tensor_parallel.local_collectives():
        plan.padding, plan.padding_note = buckets.find(gm, args, ctx.shapes, ctx.config.tolerance_for, own, before)
    seconds["padding check"] = round(time.perf_counter() - t0, 2)


def _sizes(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None for a in args)


def eager_gpu_ms(gm: fx.GraphModule, args: tuple, config, device: torch.device) -> float | None:
    """The eager model's GPU time a call on the example inputs, over a CUDA graph as the guard
    times each layer (OptimizeConfig.only_if_faster, on a GPU): the denominator of the summary's
    share of eager time now in accelc kernels. None where not timed or the model cannot be
    captured in a CUDA graph (a plain-call time would count host overhead the layers' exclude)."""
    if not (runtime.can_time(device) and config.only_if_faster):
        return None
    with torch.no_grad():
        ms, graphed = layer_ms(lambda: gm(*args), device, rep_ms=50)
    return ms if graphed else None


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
