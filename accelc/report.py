"""accelc.report: every layer timed three ways (eager PyTorch, ONNX Runtime, accelc) and checked
against a higher-precision reference, plus the whole model the same three ways.

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
import math
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from accelc import runtime
from accelc.api import _config, _to_dtype, device_of, optimize
from accelc.baselines import ort
from accelc.guard import _reference, error_stats, layer_inputs, sqnr_db, verdict
from accelc.latency import layer_ms, median_ms

SCHEMA_VERSION = 1
FORMATS = ("json", "csv", "md", "html")
INTERPRETER_NOTE = ("No GPU: accelc's Triton kernels ran in Triton's CPU interpreter and ONNX Runtime on its "
                    "CPU provider. The accelc timings below are NOT performance figures; they show only "
                    "that every layer ran and how accurate it was.")


@dataclass
class LayerRow:
    layer: str
    kind: str
    status: str                       # rewritten | reverted | kept
    kernel: str = ""
    reason: str = ""                  # why kept / reverted / float, and export failures
    input_shape: str = ""
    dtype: str = ""
    eager_ms: float | None = None
    ort_ms: float | None = None
    accelc_ms: float | None = None
    speedup_vs_ort: float | None = None
    speedup_vs_eager: float | None = None
    accelc_rel_error: float | None = None    # vs the fp32 (fp64 for fp32 layers) reference
    accelc_max_abs_error: float | None = None
    accelc_sqnr_db: float | None = None
    accelc_pass: bool | None = None
    ort_rel_error: float | None = None
    ort_max_abs_error: float | None = None
    ort_sqnr_db: float | None = None
    ort_pass: bool | None = None
    eager_rel_error: float | None = None
    tolerance: float | None = None
    ort_export: str = ""              # which exporter produced the ONNX file ORT ran
    ort_error: str = ""               # why ORT has no number for this layer
    timer: str = ""                   # how eager / accelc / ORT were timed


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
        return cls(header=data["header"], layers=[LayerRow(**r) for r in data["layers"]], totals=data["totals"],
                   end_to_end=LayerRow(**data["end_to_end"]), schema_version=data["schema_version"])

    def to_dict(self) -> dict:
        return _clean({"schema_version": self.schema_version, "header": self.header,
                       "layers": [asdict(r) for r in self.layers], "totals": self.totals,
                       "end_to_end": asdict(self.end_to_end)})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_csv(self) -> str:
        buf = io.StringIO()
        names = list(LayerRow.__dataclass_fields__)
        w = csv.DictWriter(buf, fieldnames=names)
        w.writeheader()
        for r in self.layers + [self.end_to_end]:
            w.writerow({k: ("" if v is None else v) for k, v in _clean(asdict(r)).items()})
        return buf.getvalue()

    def to_markdown(self) -> str:
        from accelc.report_html import markdown

        return markdown(self)

    def to_html(self) -> str:
        from accelc.report_html import html

        return html(self)

    def write(self, out_dir, formats=FORMATS, stem: str = "report") -> list[Path]:
        """Write the report files into out_dir (created if missing); returns their paths. Each file
        is written to a temporary name and renamed into place."""
        from accelc.serialize import atomic_path

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
            with atomic_path(path) as tmp:
                Path(tmp).write_text(makers[f]())
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

class _Progress:
    """One line on stderr, rewritten in place: [####------] 4/10 blocks.0.fc1+gelu"""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = enabled and sys.stderr.isatty()   # a log file gets one line per item instead

    def step(self, label: str):
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        line = f"accelc report [{'#' * filled}{'-' * (width - filled)}] {self.done + 1}/{self.total} {label}"
        sys.stderr.write("\r" + line[:110].ljust(110) if self.tty else line + "\n")
        sys.stderr.flush()
        self.done += 1

    def close(self):
        if self.enabled:
            sys.stderr.write(("\r" if self.tty else "") + f"accelc report: measured {self.total} item(s)".ljust(110)
                             + "\n")
            sys.stderr.flush()


def _errors(out, ref):
    """(rel L2, max abs, SQNR dB) of out vs ref over the finite reference entries."""
    rel, max_abs = error_stats(out, ref)
    return rel, max_abs, sqnr_db(rel)


def _speedup(base, fast):
    return base / fast if base and fast else None


def _ort_measure(module, ins, device, workdir, name, rep_ms, tf32):
    """(ms, outputs, export method, error) of `module` on `ins` in ORT."""
    path = str(Path(workdir) / (name.replace("/", "_")[:80] + ".onnx"))
    exp = ort.export(module, ins, path, device, allow_tf32=tf32)
    if exp.path is None:
        return None, None, "", f"ONNX export failed: {exp.error}"
    try:
        runner = ort.OrtRunner(exp.path, ins, device, allow_tf32=tf32)
        outs = [o.clone() for o in runner.run()]
        # ORT cannot be captured in accelc's CUDA graph: do_bench over run_with_iobinding (its own
        # CUDA graph inside where the session allows), whose L2 flush hides the host launch cost
        ms = median_ms(runner.run, runner.device if runner.on_gpu else torch.device("cpu"), rep_ms=rep_ms)
        return ms, outs, exp.method + (" +cuda graph" if runner.cuda_graph else ""), ""
    except Exception as e:  # ORT accepted the file but could not run it on these inputs
        return None, None, exp.method, f"ORT run failed: {ort._short(e)}"


def report(model, example_inputs, config=None, *, with_ort: bool = True, progress: bool = True,
           rep_ms: float = 100, model_name: str = "") -> Report:
    """Optimize `model` (accelc.optimize with `config`), then time and check every rewritten layer
    and the whole model three ways. See the module docstring."""
    config = _config(config)
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    opt = optimize(model, args, config)
    return measure(opt, model, args, config, with_ort=with_ort, progress=progress, rep_ms=rep_ms,
                   model_name=model_name)


def measure(opt, model, args: tuple, config, *, with_ort: bool = True, progress: bool = True,
            rep_ms: float = 100, model_name: str = "") -> Report:
    """The report of `opt`, which accelc.optimize(model, args, config) returned (accelc convert
    --report uses this, to not optimize twice)."""
    config = _config(config)
    if config.dtype is not None:
        model, args = _to_dtype(model, args, config.dtype)
    model.eval()
    device = device_of(model, args)
    interpreted = runtime.interpreted() or device.type != "cuda"
    ort_why_not = ort.available() if with_ort else "ONNX Runtime not asked for (with_ort=False)"
    tf32 = config.fp32_precision == "tf32"

    gm = opt.graph_module
    nodes = {n.meta["accelc"].layer: n for n in gm.graph.nodes if "accelc" in n.meta}
    captured = layer_inputs(gm, args)
    timer = ("CUDA-graph median (L2 flushed)" if device.type == "cuda" else "CPU perf_counter median")
    rows: list[LayerRow] = []
    todo = [r for r in opt.layers if r.status == "rewritten" and r.name in nodes]
    bar = _Progress(len(todo) + 1, progress)
    with tempfile.TemporaryDirectory(prefix="accelc-report-") as workdir, torch.no_grad():
        for rec in opt.layers:
            row = LayerRow(layer=rec.name, kind=rec.kind, status=rec.status, kernel=rec.kernel, reason=rec.reason,
                           input_shape=" ".join("x".join(map(str, s)) for s in rec.input_shapes[:1]),
                           dtype=rec.dtype, tolerance=rec.tolerance)
            rows.append(row)
            if rec.status != "rewritten" or rec.name not in nodes:
                continue
            bar.step(rec.name)
            node = nodes[rec.name]
            rw = node.meta["accelc"]
            ins, (a, kw) = captured[node]
            ref = _reference(rw.original, ins)
            eager_out = rw.original(*ins)
            accelc_out = node.target(*a, **kw)
            row.eager_ms, g1 = layer_ms(lambda: rw.original(*ins), device, rep_ms)
            row.accelc_ms, g2 = layer_ms(lambda: node.target(*a, **kw), device, rep_ms)
            row.timer = timer if (g1 and g2) or device.type != "cuda" else "plain do_bench (graph capture failed)"
            row.accelc_rel_error, row.accelc_max_abs_error, row.accelc_sqnr_db = _errors(accelc_out, ref)
            row.eager_rel_error = _errors(eager_out, ref)[0]
            row.accelc_pass = _passes(row.accelc_rel_error, row, config, rw.quantized)
            _fill_ort(row, rw.original, ins, ref, device, workdir, rec.name, rep_ms, tf32, ort_why_not)
            row.ort_pass = None if row.ort_rel_error is None else _passes(row.ort_rel_error, row, config, False)

        bar.step("whole model")
        e2e = _whole_model(model, opt, args, device, workdir, ort_why_not, rep_ms, timer, tf32)
        bar.close()

    timed = [r for r in rows if r.accelc_ms is not None]
    both = [r for r in timed if r.ort_ms is not None]
    totals = {
        "layers": len(rows), "rewritten": sum(r.status == "rewritten" for r in rows),
        "reverted": sum(r.status == "reverted" for r in rows), "kept": sum(r.status == "kept" for r in rows),
        "eager_ms": sum(r.eager_ms for r in timed), "accelc_ms": sum(r.accelc_ms for r in timed),
        "ort_ms": sum(r.ort_ms for r in both) if both else None,
        "accelc_ms_where_ort": sum(r.accelc_ms for r in both) if both else None,
        "ort_failed": sum(r.ort_ms is None for r in timed),
        "accelc_pass": sum(bool(r.accelc_pass) for r in timed),
        "faster_than_ort_1_5x": sum(bool(r.speedup_vs_ort and r.speedup_vs_ort >= 1.5) for r in timed),
    }
    totals["speedup_vs_eager"] = _speedup(totals["eager_ms"], totals["accelc_ms"])
    totals["speedup_vs_ort"] = _speedup(totals["ort_ms"], totals["accelc_ms_where_ort"])
    return Report(header=_header(model_name or type(model).__name__, opt, config, device, args, interpreted,
                                 ort_why_not, timer),
                  layers=rows, totals=totals, end_to_end=e2e)


def _passes(rel, row, config, quantized: bool) -> bool:
    """The guard's rule (accelc.guard.verdict), for a layer's accelc or ORT output."""
    known = row.tolerance is not None and not math.isnan(row.tolerance)
    tol = row.tolerance if known else config.tolerance_for(torch.float32)
    return not verdict(rel, row.eager_rel_error or 0.0, tol, config, quantized)


def _whole_model(model, opt, args, device, workdir, ort_why_not, rep_ms, timer, tf32) -> LayerRow:
    row = LayerRow(layer="end-to-end (whole model)", kind="model", status="", kernel="accelc.optimize",
                   input_shape=" ".join("x".join(map(str, t.shape)) for t in args if isinstance(t, torch.Tensor)),
                   timer=timer)
    ref_model = _upcast(model)
    ref = ref_model(*[t.to(torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else torch.float64)
                      if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args])
    row.eager_ms, _ = layer_ms(lambda: model(*args), device, rep_ms)
    row.accelc_ms, _ = layer_ms(lambda: opt(*args), device, rep_ms)
    row.accelc_rel_error, row.accelc_max_abs_error, row.accelc_sqnr_db = _errors(opt(*args), ref)
    row.eager_rel_error = _errors(model(*args), ref)[0]
    _fill_ort(row, model, list(args), ref, device, workdir, "model", rep_ms, tf32, ort_why_not)
    return row


def _fill_ort(row, module, ins, ref, device, workdir, name, rep_ms, tf32, ort_why_not) -> None:
    """ORT's time and errors for `module` on `ins` into `row`, then the speedups (eager and accelc
    already timed)."""
    if ort_why_not:
        row.ort_error = ort_why_not
    else:
        row.ort_ms, outs, row.ort_export, row.ort_error = _ort_measure(module, ins, device, workdir, name,
                                                                       rep_ms, tf32)
        if outs is not None:
            row.ort_rel_error, row.ort_max_abs_error, row.ort_sqnr_db = _errors(
                outs[0] if len(outs) == 1 else outs, ref)
    row.speedup_vs_ort = _speedup(row.ort_ms, row.accelc_ms)
    row.speedup_vs_eager = _speedup(row.eager_ms, row.accelc_ms)


def _upcast(model):
    p = next(iter(model.parameters()), None)
    target = torch.float64 if p is None or p.dtype == torch.float32 else torch.float32
    return copy.deepcopy(model).to(target)


def _header(name, opt, config, device, args, interpreted, ort_why_not, timer) -> dict:
    import triton

    import accelc

    if device.type == "cuda":
        dev = torch.cuda.get_device_name(device)
    else:
        dev = "CPU" + (" (Triton interpreter)" if runtime.interpreted() else "")
    return {
        "model": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": dev,
        "versions": {"accelc": accelc.__version__, "torch": torch.__version__, "triton": triton.__version__,
                     "onnxruntime": _ort_version(), "cuda": torch.version.cuda},
        "ort": ort_why_not or ort.provider_note(device),
        "dtype": str(config.dtype or _dtype_of(args)).replace("torch.", ""),
        "int8": config.int8 is not None,
        "input_shapes": [list(t.shape) for t in args if isinstance(t, torch.Tensor)],
        "timer": f"{timer}; ORT: do_bench median of run_with_iobinding (ORT's own CUDA graph where the "
                 "session allows it)" if device.type == "cuda" else timer,
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
                 "speedup_vs_ort", "speedup_vs_eager", "accelc_rel_error", "ort_rel_error", "accelc_pass"],
    "properties": {
        **{k: {"type": "string"} for k in ("layer", "kind", "status", "kernel", "reason", "input_shape",
                                           "dtype", "ort_export", "ort_error", "timer")},
        **{k: _NUM for k in ("eager_ms", "ort_ms", "accelc_ms", "speedup_vs_ort", "speedup_vs_eager",
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
