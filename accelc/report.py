"""accelc.report: every layer timed three ways (eager PyTorch, ONNX Runtime, accelc; on a GPU also
torch.compile) by one timer (accelc.latency.side_ms) and checked against a higher-precision
reference, plus the whole model the same ways (torch.compile in both its default and
reduce-overhead modes).

    rep = accelc.report(model, example_inputs, config)      # -> Report
    rep.write("out/")   # report.json (schema REPORT_SCHEMA), report.csv, report.md, report.html

A layer is one rewritten node group (its module path): its original subgraph is eager PyTorch's
version of it and is exported to ONNX as ORT's (accelc.baselines.ort); all three run on the same
inputs, captured at that layer during a forward pass on the example inputs. Layers accelc kept
as PyTorch are listed with the reason and not timed: they are the same in eager and accelc.
"""
from __future__ import annotations

import copy
import csv
import datetime
import io
import json
import logging
import math
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import triton

from accelc import guard, meta, report_html, runtime
from accelc.api import Job, optimize_prepared, prepare
from accelc.baselines import ort
from accelc.capture import flat_module
from accelc.errors import short_error
from accelc.files import write_text
from accelc.guard import LayerCheck, verdict
from accelc.numerics import error_stats, sqnr_db
from accelc.latency import side_method, side_ms
from accelc.optimized import LayerRecord
from accelc.rewrite import layers
from accelc.version import __version__

SCHEMA_VERSION = 3   # 2: torch.compile columns; every side timed by latency.side_ms; 3: ORT optimizer row
NO_CUDA_ORT = ("ORT ran on its CPU provider (no CUDAExecutionProvider here): numbers checked, no speedup "
               "stated against it; pip install 'accelc[ort-gpu]' for the CUDA provider")
FORMATS = ("json", "csv", "md", "html")
INTERPRETER_NOTE = ("No GPU: accelc's Triton kernels ran in Triton's CPU interpreter and ONNX Runtime on its "
                    "CPU provider. The accelc timings below are NOT performance figures; they show only "
                    "that every layer ran and how accurate it was.")


@dataclass
class LayerRow:
    """One layer of the report: the optimizer's record of it (kind, status, kernel, the guard's
    check: one error figure for a layer everywhere) and what the report adds, the times of the
    three sides and ONNX Runtime's numbers."""
    record: LayerRecord
    eager_ms: float | None = None
    ort_ms: float | None = None
    accelc_ms: float | None = None
    ort_rel_error: float | None = None
    ort_max_abs_error: float | None = None
    ort_sqnr_db: float | None = None
    ort_pass: bool | None = None
    ort_export: str = ""              # which exporter produced the ONNX file ORT ran
    ort_error: str = ""               # why ORT has no number for this layer
    timer: str = ""                   # how eager / accelc / ORT were timed
    compile_ms: float | None = None   # torch.compile (default mode) of the same subgraph / model
    compile_ro_ms: float | None = None   # the whole model: torch.compile(mode="reduce-overhead")
    compile_error: str = ""           # why torch.compile has no number here
    # the whole model: ORT with its transformer optimizer (fused attention, LayerNorm, GELU)
    ort_opt_ms: float | None = None
    ort_opt_rel_error: float | None = None
    ort_opt_method: str = ""          # exporter, optimizer model type, the fusions it made
    ort_opt_error: str = ""           # why there is no such number (no fusions, export failed...)

    # the record's fields under the report's names
    layer = property(lambda self: self.record.name)
    kind = property(lambda self: self.record.kind)
    status = property(lambda self: self.record.status)
    kernel = property(lambda self: self.record.kernel)
    reason = property(lambda self: self.record.reason)
    dtype = property(lambda self: self.record.dtype)
    input_shape = property(lambda self: " ".join("x".join(map(str, s)) for s in self.record.input_shapes[:1]))
    accelc_rel_error = property(lambda self: self.record.rel_error)         # vs the fp32 (fp64 for fp32 layers) reference
    accelc_max_abs_error = property(lambda self: self.record.max_abs_error)
    accelc_sqnr_db = property(lambda self: self.record.sqnr_db)
    eager_rel_error = property(lambda self: self.record.eager_rel_error)
    tolerance = property(lambda self: self.record.tolerance)
    # the guard's verdict; the whole-model row (status "") has none
    accelc_pass = property(lambda self: self.record.check.passed if self.record.check and self.status else None)
    # against the faster of plain ORT and ORT with its transformer optimizer (the whole model)
    speedup_vs_ort = property(lambda self: _speedup(
        min((v for v in (self.ort_ms, self.ort_opt_ms) if v), default=None), self.accelc_ms))
    speedup_vs_eager = property(lambda self: _speedup(self.eager_ms, self.accelc_ms))
    # against the better of torch.compile's modes (what a user would pick instead)
    speedup_vs_compile = property(lambda self: _speedup(
        min((v for v in (self.compile_ms, self.compile_ro_ms) if v), default=None), self.accelc_ms))

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ROW_FIELDS}

    @classmethod
    def from_dict(cls, d: dict) -> "LayerRow":
        shapes = tuple(tuple(int(x) for x in s.split("x")) for s in d["input_shape"].split()) if d["input_shape"] else ()
        check = None
        if d["accelc_pass"] is not None or d["accelc_rel_error"] is not None:
            num = {k: math.nan if d[k] is None else d[k] for k in
                   ("accelc_rel_error", "eager_rel_error", "accelc_max_abs_error", "tolerance", "accelc_sqnr_db")}
            check = LayerCheck(bool(d["accelc_pass"] in (True, None)), num["accelc_rel_error"], num["eager_rel_error"],
                               num["accelc_max_abs_error"], num["tolerance"], shapes,
                               getattr(torch, d["dtype"]) if d["dtype"] else None, sqnr_db=num["accelc_sqnr_db"])
        record = LayerRecord(d["layer"], d["kind"], d["status"], d["kernel"], d["reason"], check, shapes, d["dtype"])
        return cls(record, **{f.name: d[f.name] for f in fields(cls) if f.name != "record" and f.name in d})


# the JSON / CSV columns of a row, in order
ROW_FIELDS = ("layer", "kind", "status", "kernel", "reason", "input_shape", "dtype", "eager_ms", "ort_ms", "accelc_ms",
              "speedup_vs_ort", "speedup_vs_eager", "accelc_rel_error", "accelc_max_abs_error", "accelc_sqnr_db",
              "accelc_pass", "ort_rel_error", "ort_max_abs_error", "ort_sqnr_db", "ort_pass", "eager_rel_error",
              "tolerance", "ort_export", "ort_error", "timer", "compile_ms", "compile_ro_ms", "speedup_vs_compile",
              "compile_error", "ort_opt_ms", "ort_opt_rel_error", "ort_opt_method", "ort_opt_error")


@dataclass
class Report:
    header: dict
    layers: list[LayerRow]
    totals: dict
    end_to_end: LayerRow
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        """A report read back from its JSON (e.g. to write it in another format)."""
        validate(data)
        return cls(header=data["header"], layers=[LayerRow.from_dict(r) for r in data["layers"]],
                   totals=data["totals"], end_to_end=LayerRow.from_dict(data["end_to_end"]),
                   schema_version=data["schema_version"])

    def to_dict(self) -> dict:
        return _clean({"schema_version": self.schema_version, "header": self.header,
                       "layers": [r.to_dict() for r in self.layers], "totals": self.totals,
                       "end_to_end": self.end_to_end.to_dict()})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(ROW_FIELDS))
        w.writeheader()
        for r in self.layers + [self.end_to_end]:
            w.writerow({k: ("" if v is None else v) for k, v in _clean(r.to_dict()).items()})
        return buf.getvalue()

    def to_markdown(self) -> str:
        return report_html.markdown(self)

    def to_html(self) -> str:
        return report_html.html(self)

    def write(self, out_dir, formats=FORMATS, stem: str = "report") -> list[Path]:
        """Write the report files into out_dir (created if missing); returns their paths. Each file
        is written to a temporary name and renamed into place."""
        out = Path(out_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"report folder {str(out)!r} exists and is not a folder")
        out.mkdir(parents=True, exist_ok=True)
        makers = {"json": self.to_json, "csv": self.to_csv, "md": self.to_markdown, "html": self.to_html}
        unknown = [f for f in formats if f not in makers]
        if unknown:
            raise ValueError(f"unknown report format(s) {unknown}; formats: {list(makers)}")
        paths = []
        for f in formats:
            path = out / f"{stem}.{f}"
            write_text(path, makers[f]())
            paths.append(path)
        return paths


def _clean(obj):
    """NaN / inf -> None, so that the JSON is standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------
# measuring

log = logging.getLogger("accelc")

class _Progress:
    """The report's progress on the "accelc" logger at INFO (the CLI shows it; the Python API only
    where the application enables that logger): one line rewritten in place on a terminal,
    [####------] 4/10 blocks.0.fc1+gelu, else one log record per item."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and log.isEnabledFor(logging.INFO)
        self.tty = self.enabled and sys.stderr.isatty() and _logs_to_stderr()

    def step(self, label: str):
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        line = f"accelc report [{'#' * filled}{'-' * (width - filled)}] {self.done + 1}/{self.total} {label}"
        if self.tty:
            sys.stderr.write("\r" + line[:110].ljust(110))
            sys.stderr.flush()
        else:
            log.info(line)
        self.done += 1

    def close(self):
        if self.enabled:
            if self.tty:
                sys.stderr.write("\r" + " " * 110 + "\r")
            log.info(f"accelc report: measured {self.total} item(s)")


def _logs_to_stderr() -> bool:
    """Whether the accelc logger's records end up on stderr (the CLI's handler)."""
    logger = log
    while logger is not None:
        if any(isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stderr
               for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def _errors(out, ref):
    """(rel L2, max abs, SQNR dB) of out vs ref over the finite reference entries."""
    rel, max_abs = error_stats(out, ref)
    return rel, max_abs, sqnr_db(rel)


def _speedup(base, fast):
    return base / fast if base and fast else None


def _compile_measure(module, ins, device, rep_ms, modes, whole_model=False):
    """(ms of the first mode, ms of the second mode or None, error) of torch.compile(module) in
    each mode, on `ins`, timed by side_ms as the other sides are. (Not torch._dynamo.reset():
    accelc's own Inductor-compiled glue lives in the same caches.)"""
    times, errors = [], []
    for mode in modes:
        try:
            compiled = torch.compile(module, mode=None if mode == "default" else mode, dynamic=False)
            compiled(*ins)   # compile now, not inside the timer
            times.append(side_ms(lambda: compiled(*ins), device, rep_ms, whole_model))
        except Exception as e:   # a graph torch.compile cannot take: said in the row
            times.append(None)
            errors.append(f"torch.compile ({mode}) failed: {short_error(e)}")
    return times[0], times[1] if len(times) > 1 else None, "; ".join(errors)


def _ort_measure(module, ins, device, workdir, name, rep_ms, tf32, whole_model=False):
    """(ms, outputs, export method, error) of `module` on `ins` in ORT, timed by side_ms as the
    other sides are."""
    path = str(Path(workdir) / (name.replace("/", "_")[:80] + ".onnx"))
    exp = ort.export(module, ins, path, device, allow_tf32=tf32)
    if exp.path is None:
        return None, None, "", f"ONNX export failed: {exp.error}"
    try:
        runner = ort.OrtRunner(exp.path, ins, device, allow_tf32=tf32)
        outs = [o.clone() for o in runner.run()]
        # run_with_iobinding (ORT's own CUDA graph inside where the session allows it), timed by
        # the same function as eager and accelc
        ms = side_ms(runner.run, runner.device if runner.on_gpu else torch.device("cpu"), rep_ms, whole_model)
        return ms, outs, exp.method + (" +cuda graph" if runner.cuda_graph else ""), ""
    except Exception as e:  # ORT accepted the file but could not run it on these inputs
        return None, None, exp.method, f"ORT run failed: {short_error(e)}"


def report(model, example_inputs=(), config=None, *, with_ort: bool = True, progress: bool = True, example_kwargs=None,
           rep_ms: float = 100, model_name: str = "", with_compile: bool | None = None) -> Report:
    """Optimize `model` (accelc.optimize with `config`), then time every rewritten layer and the
    whole model three ways. See the module docstring."""
    job = prepare(model, example_inputs, config, example_kwargs=example_kwargs)
    opt = optimize_prepared(job)
    return measure(opt, job, with_ort=with_ort, progress=progress, rep_ms=rep_ms, with_compile=with_compile,
                   model_name=model_name or type(model).__name__)


def measure(opt, job: Job, *, with_ort: bool = True, progress: bool = True, rep_ms: float = 100,
            model_name: str = "", with_compile: bool | None = None) -> Report:
    """The report of `opt`, which accelc.optimize made of the prepared `job` (accelc.api.prepare;
    accelc convert --report uses this, to not optimize twice). Each layer runs on the inputs the
    guard checked it on (the same forward pass), and its accelc error is the guard's."""
    model, args, config, device = job.model, job.args, job.config, job.device
    call = opt
    if opt.call_spec is not None and not opt.call_spec.trivial:   # keyword inputs, a cache in the output: both sides on the graph's flat inputs
        spec = opt.call_spec
        model, args = flat_module(model, spec), spec.flat(job.args, job.kwargs)
        call = opt.call_flat
    interpreted = runtime.interpreted() or device.type != "cuda"
    ort_why_not = ort.available() if with_ort else "ONNX Runtime not asked for (with_ort=False)"
    # a GPU report against ORT's CPU provider: ORT's numbers are checked, its times are no baseline
    no_ratio = (NO_CUDA_ORT if device.type == "cuda" and not ort_why_not and not ort.has_cuda() else None)
    tf32 = config.fp32_precision == "tf32"
    # torch.compile beside them: what a user would pick instead (on the CPU only when asked: its
    # C++ compile per layer costs more than the report there is worth)
    with_compile = device.type == "cuda" if with_compile is None else with_compile

    gm = opt.graph_module
    nodes = {meta.rewrite_of(n).layer: n for n in layers(gm)}
    captured = guard.layer_inputs(gm, args, model)
    timer = side_method(device)
    rows: list[LayerRow] = []
    todo = [r for r in opt.layers if r.status == "rewritten" and r.name in nodes]
    bar = _Progress(len(todo) + 1, progress)
    with tempfile.TemporaryDirectory(prefix="accelc-report-") as workdir, torch.no_grad():
        for rec in opt.layers:
            row = LayerRow(rec)
            rows.append(row)
            if rec.status != "rewritten" or rec.name not in nodes:
                continue
            bar.step(rec.name)
            node = nodes[rec.name]
            rw = meta.rewrite_of(node)
            original = rw.eager(model)       # int8 layers: their float weights live in the model
            ins, (a, kw) = captured[node]
            row.eager_ms = side_ms(lambda: original(*ins), device, rep_ms)
            row.accelc_ms = side_ms(lambda: node.target(*a, **kw), device, rep_ms)
            row.timer = "per layer: GPU time per call" if device.type == "cuda" else timer
            _fill_ort(row, original, ins, lambda: guard.reference(original, ins), device, workdir, rec.name,
                      rep_ms, tf32, ort_why_not, config, no_ratio)
            if with_compile:
                row.compile_ms, _, row.compile_error = _compile_measure(original, ins, device, rep_ms, modes=("default",))

        bar.step("whole model")
        e2e = _whole_model(model, call, args, config, device, workdir, ort_why_not, rep_ms, timer, tf32, no_ratio)
        if with_compile:
            e2e.compile_ms, e2e.compile_ro_ms, e2e.compile_error = _compile_measure(
                model, args, device, rep_ms, modes=("default", "reduce-overhead"), whole_model=True)
        bar.close()

    timed = [r for r in rows if r.accelc_ms is not None]
    both = [r for r in timed if r.ort_ms is not None]
    totals = {
        "layers": len(rows), "rewritten": sum(r.status == "rewritten" for r in rows),
        "reverted": sum(r.status == "reverted" for r in rows), "kept": sum(r.status == "kept" for r in rows),
        "eager_ms": sum(r.eager_ms for r in timed), "accelc_ms": sum(r.accelc_ms for r in timed),
        "ort_ms": sum(r.ort_ms for r in both) if both else None,
        "accelc_ms_where_ort": sum(r.accelc_ms for r in both) if both else None,
        "ort_failed": sum(r.ort_ms is None and not (no_ratio and r.ort_error == no_ratio) for r in timed),
        "accelc_pass": sum(bool(r.accelc_pass) for r in timed),
        "faster_than_ort_1_5x": sum(bool(r.speedup_vs_ort and r.speedup_vs_ort >= 1.5) for r in timed),
    }
    totals["speedup_vs_eager"] = _speedup(totals["eager_ms"], totals["accelc_ms"])
    totals["speedup_vs_ort"] = _speedup(totals["ort_ms"], totals["accelc_ms_where_ort"])
    totals["no_ort_ratio"] = ort_why_not or no_ratio
    compiled = [r for r in timed if r.compile_ms is not None]
    totals["compile_ms"] = sum(r.compile_ms for r in compiled) if compiled else None
    totals["speedup_vs_compile"] = _speedup(totals["compile_ms"], sum(r.accelc_ms for r in compiled))
    return Report(header=_header(model_name or type(model).__name__, opt, config, device, args, interpreted,
                                 ort_why_not, timer),
                  layers=rows, totals=totals, end_to_end=e2e)


def _whole_model(model, opt, args, config, device, workdir, ort_why_not, rep_ms, timer, tf32, no_ratio=None
                 ) -> LayerRow:
    ref = _upcast(model)(*[t.to(torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else torch.float64)
                           if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args])
    check = guard.compare(opt(*args), model(*args), ref, list(args), config)
    row = LayerRow(LayerRecord("end-to-end (whole model)", "model", "", "accelc.optimize", check=check),
                   timer="whole model: per call as a user calls it" if device.type == "cuda" else timer)
    row.eager_ms = side_ms(lambda: model(*args), device, rep_ms, whole_model=True)
    row.accelc_ms = side_ms(lambda: opt(*args), device, rep_ms, whole_model=True)
    _fill_ort(row, model, list(args), lambda: ref, device, workdir, "model", rep_ms, tf32, ort_why_not, config,
              no_ratio, whole_model=True)
    if ort_why_not or no_ratio:
        row.ort_opt_error = ort_why_not or no_ratio
    else:
        _fill_ort_optimized(row, model, list(args), ref, device, workdir, rep_ms, tf32, config)
    return row


MAX_OPTIMIZED = 3   # ORT optimizer candidates timed per model (fused attention first)


def _fill_ort_optimized(row, model, args, ref, device, workdir, rep_ms, tf32, config) -> None:
    """ORT at its best on the whole model: each candidate of ORT's transformer optimizer
    (ort.optimized_candidates) that matches the reference as the guard asks of accelc is timed
    by side_ms; the fastest is kept, with how it was made."""
    cands, errors = ort.optimized_candidates(model, args, workdir, device)
    tol = row.tolerance if not math.isnan(row.tolerance) else config.tolerance_for(torch.float32)

    def judge(outs):
        rel = _errors(outs[0] if len(outs) == 1 else outs, ref)[0]
        return rel, verdict(rel, row.eager_rel_error or 0.0, tol, config, False)

    def timer(runner):
        return side_ms(runner.run, device if runner.on_gpu else torch.device("cpu"), rep_ms, whole_model=True)

    timed, refused = ort.time_candidates(cands, device, judge, timer, MAX_OPTIMIZED, allow_tf32=tf32)
    if not timed:
        row.ort_opt_error = "; ".join(errors + refused) or "ORT's transformer optimizer fused nothing"
        return
    best = min(timed, key=lambda t: t.ms)
    row.ort_opt_ms, row.ort_opt_rel_error = best.ms, best.rel_error
    row.ort_opt_method = best.candidate.method + (" +cuda graph" if best.cuda_graph else "")
    if len(timed) > 1:
        row.ort_opt_method += f"; the fastest of {len(timed)} candidates"


def _fill_ort(row, module, ins, ref, device, workdir, name, rep_ms, tf32, ort_why_not, config,
              no_ratio: str | None = None, whole_model: bool = False) -> None:
    """ORT's time, errors against the reference `ref()` and verdict (the guard's rule) for `module`
    on `ins`, into `row`. no_ratio: why ORT's time is not recorded (its CPU provider on a GPU
    report): the row keeps ORT's errors and no speedup against it."""
    if ort_why_not:
        row.ort_error = ort_why_not
        return
    row.ort_ms, outs, row.ort_export, row.ort_error = _ort_measure(module, ins, device, workdir, name, rep_ms, tf32,
                                                                   whole_model)
    if no_ratio and row.ort_ms is not None:
        row.ort_ms, row.ort_error = None, no_ratio
    if outs is not None:
        row.ort_rel_error, row.ort_max_abs_error, row.ort_sqnr_db = _errors(outs[0] if len(outs) == 1 else outs, ref())
        if row.status:
            tol = row.tolerance if not math.isnan(row.tolerance) else config.tolerance_for(torch.float32)
            row.ort_pass = not verdict(row.ort_rel_error, row.eager_rel_error or 0.0, tol, config, False)


def _upcast(model):
    p = next(iter(model.parameters()), None)
    target = torch.float64 if p is None or p.dtype == torch.float32 else torch.float32
    return copy.deepcopy(model).to(target)


def _header(name, opt, config, device, args, interpreted, ort_why_not, timer) -> dict:
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
        "ort": ort_why_not or ort.provider_note(device),
        "dtype": str(config.dtype or _dtype_of(args)).replace("torch.", ""),
        "int8": config.int8 is not None,
        "input_shapes": [list(t.shape) for t in args if isinstance(t, torch.Tensor)],
        "timer": f"{timer}; ORT called through run_with_iobinding (its own CUDA graph where the session "
                 "allows it)" if device.type == "cuda" else timer,
        "interpreted": bool(interpreted),
        "note": INTERPRETER_NOTE if interpreted else "",
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


# The JSON's schema (JSON Schema draft 2020-12); tests validate every report against it.
_NUM = {"type": ["number", "null"]}
_ROW = {
    "type": "object",
    "required": ["layer", "kind", "status", "kernel", "reason", "input_shape", "eager_ms", "ort_ms", "accelc_ms",
                 "speedup_vs_ort", "speedup_vs_eager", "accelc_rel_error", "ort_rel_error", "accelc_pass",
                 "compile_ms", "speedup_vs_compile"],
    "properties": {
        **{k: {"type": "string"} for k in ("layer", "kind", "status", "kernel", "reason", "input_shape",
                                           "dtype", "ort_export", "ort_error", "timer", "compile_error")},
        **{k: _NUM for k in ("eager_ms", "ort_ms", "accelc_ms", "speedup_vs_ort", "speedup_vs_eager",
                             "compile_ms", "compile_ro_ms", "speedup_vs_compile",
                             "accelc_rel_error", "accelc_max_abs_error", "accelc_sqnr_db", "ort_rel_error",
                             "ort_max_abs_error", "ort_sqnr_db", "eager_rel_error", "tolerance")},
        "accelc_pass": {"type": ["boolean", "null"]}, "ort_pass": {"type": ["boolean", "null"]},
    },
}
REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "accelc per-layer report",
    "type": "object",
    "required": ["schema_version", "header", "layers", "totals", "end_to_end"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "header": {"type": "object", "required": ["model", "date", "device", "versions", "ort", "dtype", "timer",
                                                  "interpreted", "note"],
                   "properties": {"interpreted": {"type": "boolean"}, "versions": {"type": "object"}}},
        "layers": {"type": "array", "items": {**_ROW, "properties": {
            **_ROW["properties"], "status": {"enum": ["rewritten", "reverted", "kept"]}}}},
        "totals": {"type": "object", "required": ["eager_ms", "accelc_ms", "ort_ms", "speedup_vs_eager",
                                                  "speedup_vs_ort"]},
        "end_to_end": _ROW,
    },
}


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def validate(data, schema: dict = REPORT_SCHEMA, where: str = "report") -> None:
    """Check `data` against `schema` (the subset of JSON Schema REPORT_SCHEMA uses: type, required,
    properties, items, enum, const), so that a report can be checked where the jsonschema
    package is not installed. Raises ValueError naming the first offending field."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        ok = any((isinstance(data, (int, float)) and not isinstance(data, bool)) if t == "number"
                 else isinstance(data, _TYPES[t]) for t in types)
        if not ok:
            raise ValueError(f"{where}: {data!r:.60} is not of type {types}")
    if "const" in schema and data != schema["const"]:
        raise ValueError(f"{where}: {data!r} is not {schema['const']!r}")
    if "enum" in schema and data not in schema["enum"]:
        raise ValueError(f"{where}: {data!r} is not one of {schema['enum']}")
    if isinstance(data, dict):
        for key in schema.get("required", []):
            if key not in data:
                raise ValueError(f"{where}: missing {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in data:
                validate(data[key], sub, f"{where}.{key}")
    if isinstance(data, list) and "items" in schema:
        for i, item in enumerate(data):
            validate(item, schema["items"], f"{where}[{i}]")
