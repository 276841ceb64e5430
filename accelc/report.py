"""accelc.report: every layer timed three ways (eager PyTorch, ONNX Runtime, accelc; on a GPU also
torch.compile) by one timer (accelc.latency.side_ms) and checked against a higher-precision
reference, plus the whole model the same ways (torch.compile in both its default and
reduce-overhead modes).

    rep = accelc.report(model, example_inputs, config)      # -> Report
    rep.write("out/")   # report.json (schema accelc.report_schema), report.csv, report.md, report.html

A layer is one rewritten node group (its module path): its original subgraph is eager PyTorch's
version of it and is exported to ONNX as ORT's (accelc.baselines.ort); all three run on the same
inputs, captured at that layer during a forward pass on the example inputs. Layers accelc kept
as PyTorch are listed with the reason and not timed: they are the same in eager and accelc.

This module measures; the rows, the Report and its writers are accelc.report_rows', the JSON schema
accelc.report_schema's.
"""
from __future__ import annotations

import copy
import datetime
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from accelc import fx_tracing, guard, layer_check, meta, runtime
from accelc import progress as progress_bar
from accelc.api import Job, make_job, optimize_job
from accelc.baselines import ort
from accelc.capture import flat_module
from accelc.errors import InputError, short_error
from accelc.latency import side_method, side_ms
from accelc.numerics import error_stats, sqnr_db
from accelc.records import LayerRecord
from accelc.report_rows import LayerRow, Report, speedup
from accelc.rewrite import layers
from accelc.version import __version__

NO_CUDA_ORT = ("ORT ran on its CPU provider (no CUDAExecutionProvider here): numbers checked, no speedup "
               "stated against it; pip install 'accelc[ort-gpu]' for the CUDA provider")
NO_INTERPRETED_RATIO = "accelc ran in Triton's CPU interpreter: its times are no performance figures, so no ratio"
INTERPRETER_NOTE = ("No GPU: accelc's Triton kernels ran in Triton's CPU interpreter{ort}. The accelc timings "
                    "below are NOT performance figures; they show only that every layer ran and how accurate it was.")


log = logging.getLogger("accelc")


@dataclass
class Sides:
    """What every measurement of one report shares: where and how long each side is timed, and
    ONNX Runtime's standing."""
    device: torch.device
    config: object                   # accelc.config.OptimizeConfig
    workdir: str                     # where the ONNX files go
    rep_ms: float
    tf32: bool                       # ORT and torch.compile may use TF32 (config.fp32_precision)
    timer: str                       # how the sides are timed, in words (latency.side_method)
    ort_why_not: str | None = None   # why ORT is not measured at all
    no_ratio: str | None = None      # why ORT's times are no baseline (its CPU provider on a GPU report)


class _Progress:
    """The report's progress: where optimize's progress is shown (the CLI on a terminal), its bar goes on
    with "timing every layer" i of N (accelc.progress); else, where the "accelc" logger is on at INFO (the
    CLI's log, an application's), one record per item."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and log.isEnabledFor(logging.INFO)
        self.shown = enabled and progress_bar.active()
        if self.shown:
            progress_bar.phase("timing every layer", total)

    def step(self, label: str):
        if self.shown:
            progress_bar.step(label)
        elif self.enabled:
            log.info(f"accelc report: {self.done + 1}/{self.total} {label}")
        self.done += 1

    def close(self):
        if self.enabled:
            log.info(f"accelc report: measured {self.total} item(s)")


def _errors(out, ref):
    """(rel L2, max abs, SQNR dB) of out vs ref over the finite reference entries."""
    rel, max_abs = error_stats(out, ref)
    return rel, max_abs, sqnr_db(rel)


def _compile_measure(module, ins, sides: Sides, modes, whole_model=False):
    """(ms of the first mode, ms of the second mode or None, error) of torch.compile(module) in
    each mode, on `ins`, timed by side_ms as the other sides are. (Not torch._dynamo.reset():
    accelc's own Inductor-compiled glue lives in the same caches.)"""
    times, errors = [], []
    for mode in modes:
        try:
            compiled = torch.compile(module, mode=None if mode == "default" else mode, dynamic=False)
            compiled(*ins)   # compile now, not inside the timer
            times.append(side_ms(lambda: compiled(*ins), sides.device, sides.rep_ms, whole_model))
        except Exception as e:   # a graph torch.compile cannot take: said in the row
            times.append(None)
            errors.append(f"torch.compile ({mode}) failed: {short_error(e)}")
    return times[0], times[1] if len(times) > 1 else None, "; ".join(errors)


def _ort_measure(module, ins, name, sides: Sides, whole_model=False):
    """(ms, outputs, export method, error) of `module` on `ins` in ORT, timed by side_ms as the
    other sides are."""
    path = str(Path(sides.workdir) / (name.replace("/", "_")[:80] + ".onnx"))
    exp = ort.export(module, ins, path, sides.device, allow_tf32=sides.tf32)
    if exp.path is None:
        return None, None, "", f"ONNX export failed: {exp.error}"
    try:
        runner = ort.OrtRunner(exp.path, ins, sides.device, allow_tf32=sides.tf32)
        outs = [o.clone() for o in runner.run()]
        # run_with_iobinding (ORT's own CUDA graph inside where the session allows it), timed by
        # the same function as eager and accelc
        ms = side_ms(runner.run, runner.device if runner.on_gpu else torch.device("cpu"), sides.rep_ms, whole_model)
        return ms, outs, exp.method + (" +cuda graph" if runner.cuda_graph else ""), ""
    except Exception as e:  # ORT accepted the file but could not run it on these inputs
        return None, None, exp.method, f"ORT run failed: {short_error(e)}"


@fx_tracing.own_flag
def report(model, example_inputs=(), config=None, *, with_ort: bool = True, progress: bool | None = None,
           example_kwargs=None, rep_ms: float = 100, model_name: str = "", with_compile: bool | None = None) -> Report:
    """Optimize `model` (accelc.optimize with `config`), then time every rewritten layer and the
    whole model three ways. See the module docstring."""
    if not (isinstance(rep_ms, (int, float)) and rep_ms > 0):    # said before optimizing, not after (NaN too)
        raise ValueError(f"rep_ms is the timing budget per measurement in ms: a number above 0, not {rep_ms!r}")
    if meta.runs_accelc(model):
        raise InputError("this program already runs accelc's kernels (an accelc.save / accelc convert output): "
                         "report the model it was made from, whose layers the report times against them")
    job = make_job(model, example_inputs, config, example_kwargs=example_kwargs)
    # progress as optimize's: optimize's phases, then the timing's i of N, on stderr where asked (True) or in an
    # interactive session (None); from Python it had shown nothing, progress=True or not. The "accelc" logger's
    # records of each item, where it is on, unless progress=False
    with progress_bar.showing("accelc", progress_bar.wanted(progress)):
        opt = optimize_job(job)
        return measure(opt, job, with_ort=with_ort, progress=progress is not False, rep_ms=rep_ms,
                       with_compile=with_compile, model_name=model_name or type(model).__name__)


def measure(opt, job: Job, *, with_ort: bool = True, progress: bool = True, rep_ms: float = 100,
            model_name: str = "", with_compile: bool | None = None) -> Report:
    """The report of `opt`, which accelc.optimize made of the `job` (accelc.api.make_job; accelc
    convert --report uses this, to not optimize twice). Each layer runs on the inputs the guard
    checked it on (the same forward pass), and its accelc error is the guard's."""
    model, args, config, device = job.model, job.args, job.config, job.device
    opt.wait_for_other_shapes()     # (a background glue compile would share the host and the GPU with the timing)
    call = opt
    if opt.call_spec is not None and not opt.call_spec.trivial:   # keyword inputs, a cache in the output: both sides on the graph's flat inputs
        spec = opt.call_spec
        model, args = flat_module(model, spec), spec.flat(job.args, job.kwargs)
        call = opt.call_flat
    interpreted = runtime.interpreted() or device.type != "cuda"
    ort_why_not = ort.available() if with_ort else "ONNX Runtime not asked for (with_ort=False)"
    # torch.compile beside them: what a user would pick instead (on the CPU only when asked: its
    # C++ compile per layer costs more than the report there is worth)
    with_compile = device.type == "cuda" if with_compile is None else with_compile

    gm = opt.graph_module
    nodes = {meta.rewrite_of(n).layer: n for n in layers(gm)}
    captured = guard.layer_inputs(gm, args, model)
    rows: list[LayerRow] = []
    todo = [r for r in opt.layers if r.status == "rewritten" and r.name in nodes]
    bar = _Progress(len(todo) + 1, progress)
    with tempfile.TemporaryDirectory(prefix="accelc-report-") as workdir, torch.no_grad():
        sides = Sides(device, config, workdir, rep_ms, config.fp32_precision == "tf32", side_method(device),
                      ort_why_not,
                      # a GPU report against ORT's CPU provider: ORT's numbers are checked, its times are no baseline
                      NO_CUDA_ORT if device.type == "cuda" and not ort_why_not and not ort.has_cuda() else None)
        no_ratio = NO_INTERPRETED_RATIO if interpreted else ""
        for rec in opt.layers:
            row = LayerRow(rec, no_ratio=no_ratio)
            rows.append(row)
            if rec.status != "rewritten" or rec.name not in nodes:
                continue
            bar.step(rec.name)
            node = nodes[rec.name]
            rw = meta.rewrite_of(node)
            original = rw.eager(model)       # int8 layers: their float weights live in the model
            ins, (a, kw) = captured[node]
            row.eager_ms, row.eager_spread = _with_spread(side_ms(lambda: original(*ins), device, rep_ms))
            row.accelc_ms, row.accelc_spread = _with_spread(side_ms(lambda: node.target(*a, **kw), device, rep_ms))
            row.timer = "per layer: GPU time per call" if device.type == "cuda" else sides.timer
            _fill_ort(row, original, ins, lambda: layer_check.reference(original, ins), rec.name, sides)
            if with_compile:
                row.compile_ms, _, row.compile_error = _compile_measure(original, ins, sides, modes=("default",))

        bar.step("whole model")
        e2e = _whole_model(model, call, args, sides)
        e2e.no_ratio = no_ratio
        if with_compile:
            e2e.compile_ms, e2e.compile_ro_ms, e2e.compile_error = _compile_measure(
                model, args, sides, modes=("default", "reduce-overhead"), whole_model=True)
        bar.close()
    return Report(header=_header(model_name or type(model).__name__, opt, args, interpreted, sides),
                  layers=rows, totals=_totals(rows, sides, no_ratio), end_to_end=e2e)


def _totals(rows: list[LayerRow], sides: Sides, no_ratio: str = "") -> dict:
    timed = [r for r in rows if r.accelc_ms is not None]
    both = [r for r in timed if r.ort_ms is not None]
    totals = {
        "layers": len(rows), "rewritten": sum(r.status == "rewritten" for r in rows),
        "reverted": sum(r.status == "reverted" for r in rows), "kept": sum(r.status == "kept" for r in rows),
        "eager_ms": sum(r.eager_ms for r in timed), "accelc_ms": sum(r.accelc_ms for r in timed),
        "ort_ms": sum(r.ort_ms for r in both) if both else None,
        "accelc_ms_where_ort": sum(r.accelc_ms for r in both) if both else None,
        "ort_failed": sum(r.ort_ms is None and not (sides.no_ratio and r.ort_error == sides.no_ratio) for r in timed),
        "accelc_pass": sum(bool(r.accelc_pass) for r in timed),
        "faster_than_ort_1_5x": sum(bool(r.speedup_vs_ort and r.speedup_vs_ort >= 1.5) for r in timed),
    }
    ratio = (lambda a, b: None) if no_ratio else speedup
    totals["speedup_vs_eager"] = ratio(totals["eager_ms"], totals["accelc_ms"])
    totals["speedup_vs_ort"] = ratio(totals["ort_ms"], totals["accelc_ms_where_ort"])
    totals["no_ort_ratio"] = sides.ort_why_not or sides.no_ratio
    totals["no_ratio"] = no_ratio or None
    compiled = [r for r in timed if r.compile_ms is not None]
    totals["compile_ms"] = sum(r.compile_ms for r in compiled) if compiled else None
    totals["speedup_vs_compile"] = ratio(totals["compile_ms"], sum(r.accelc_ms for r in compiled))
    return totals


def _with_spread(ms: float) -> tuple[float, float | None]:
    """(a side_ms time as a plain float, the spread of its samples: None where the timer kept none)."""
    return float(ms), getattr(ms, "spread", None)


def _whole_model(model, opt, args, sides: Sides) -> LayerRow:
    device, rep_ms = sides.device, sides.rep_ms
    ref = _upcast(model)(*[t.to(torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else torch.float64)
                           if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args])
    check = layer_check.compare(opt(*args), model(*args), ref, list(args), sides.config)
    row = LayerRow(LayerRecord("end-to-end (whole model)", "model", "", "accelc.optimize", check=check),
                   timer="whole model: per call as a user calls it" if device.type == "cuda" else sides.timer)
    row.eager_ms, row.eager_spread = _with_spread(side_ms(lambda: model(*args), device, rep_ms, whole_model=True))
    row.accelc_ms, row.accelc_spread = _with_spread(side_ms(lambda: opt(*args), device, rep_ms, whole_model=True))
    _fill_ort(row, model, list(args), lambda: ref, "model", sides, whole_model=True)
    if sides.ort_why_not or sides.no_ratio:
        row.ort_opt_error = sides.ort_why_not or sides.no_ratio
    else:
        _fill_ort_optimized(row, model, list(args), ref, sides)
    return row


MAX_OPTIMIZED = 3   # ORT optimizer candidates timed per model (fused attention first)


def _fill_ort_optimized(row, model, args, ref, sides: Sides) -> None:
    """ORT at its best on the whole model: each candidate of ORT's transformer optimizer
    (ort.optimized_candidates) that matches the reference as the guard asks of accelc is timed
    by side_ms; the fastest is kept, with how it was made."""
    cands, errors = ort.optimized_candidates(model, args, sides.workdir, sides.device)
    tol = row.tolerance if not math.isnan(row.tolerance) else sides.config.tolerance_for(torch.float32)

    def judge(outs):
        rel = _errors(outs[0] if len(outs) == 1 else outs, ref)[0]
        return rel, layer_check.verdict(rel, row.eager_rel_error or 0.0, tol, sides.config, False)

    def timer(runner):
        return side_ms(runner.run, sides.device if runner.on_gpu else torch.device("cpu"), sides.rep_ms,
                       whole_model=True)

    timed, refused = ort.time_candidates(cands, sides.device, judge, timer, MAX_OPTIMIZED, allow_tf32=sides.tf32)
    if not timed:
        row.ort_opt_error = "; ".join(errors + refused) or "ORT's transformer optimizer fused nothing"
        return
    best = min(timed, key=lambda t: t.ms)
    row.ort_opt_ms, row.ort_opt_rel_error = best.ms, best.rel_error
    row.ort_opt_method = best.candidate.method + (" +cuda graph" if best.cuda_graph else "")
    if len(timed) > 1:
        row.ort_opt_method += f"; the fastest of {len(timed)} candidates"


def _fill_ort(row, module, ins, ref, name, sides: Sides, whole_model: bool = False) -> None:
    """ORT's time, errors against the reference `ref()` and verdict (the guard's rule) for `module`
    on `ins`, into `row`. Where sides.no_ratio says why (its CPU provider on a GPU report), ORT's
    time is not recorded: the row keeps ORT's errors and no speedup against it."""
    if sides.ort_why_not:
        row.ort_error = sides.ort_why_not
        return
    row.ort_ms, outs, row.ort_export, row.ort_error = _ort_measure(module, ins, name, sides, whole_model)
    if sides.no_ratio and row.ort_ms is not None:
        row.ort_ms, row.ort_error = None, sides.no_ratio
    if outs is not None:
        row.ort_rel_error, row.ort_max_abs_error, row.ort_sqnr_db = _errors(outs[0] if len(outs) == 1 else outs, ref())
        if row.status:
            tol = row.tolerance if not math.isnan(row.tolerance) else sides.config.tolerance_for(torch.float32)
            row.ort_pass = not layer_check.verdict(row.ort_rel_error, row.eager_rel_error or 0.0, tol, sides.config,
                                                   False)


def _upcast(model):
    p = next(iter(model.parameters()), None)
    target = torch.float64 if p is None or p.dtype == torch.float32 else torch.float32
    return copy.deepcopy(model).to(target)


def _header(name, opt, args, interpreted, sides: Sides) -> dict:
    device, timer = sides.device, sides.timer
    if device.type == "cuda":
        dev = torch.cuda.get_device_name(device)
    else:
        dev = "CPU" + (" (Triton interpreter)" if runtime.interpreted() else "")
    return {
        "model": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": dev,
        "versions": {"accelc": __version__, "torch": torch.__version__, "triton": triton.__version__,
                     "onnxruntime": _ort_version(), "cuda": torch.version.cuda},
        "ort": sides.ort_why_not or ort.provider_note(device),
        "dtype": str(sides.config.dtype or _dtype_of(args) or _dtype_of(opt.graph_module.parameters())
                     or _dtype_of(opt.graph_module.buffers())).replace("torch.", ""),
        "int8": sides.config.int8 is not None, "fp8": sides.config.fp8 is not None,
        "input_shapes": [list(t.shape) for t in args if isinstance(t, torch.Tensor)],
        "timer": f"{timer}; ORT called through run_with_iobinding (its own CUDA graph where the session "
                 "allows it)" if device.type == "cuda" else timer,
        "interpreted": bool(interpreted),
        "note": INTERPRETER_NOTE.format(ort="" if sides.ort_why_not else " and ONNX Runtime on its CPU provider")
                if interpreted else "",
        "capture": opt.info.capture_method,
    }


def _dtype_of(args):
    for t in args:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return ""


def _ort_version():
    try:
        import onnxruntime

        return onnxruntime.__version__
    except Exception:  # reported in the header's "ort" entry
        return None
