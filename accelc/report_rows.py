"""The report's rows and the report itself: one LayerRow per layer (the optimizer's LayerRecord plus
the times and ONNX Runtime's numbers the report adds), and Report with its writers (JSON in the
schema of accelc.report_schema, CSV; Markdown and HTML through accelc.report_html). Measuring is
accelc.report's."""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from accelc import report_html
from accelc.files import write_text
from accelc.records import LayerCheck, LayerRecord
from accelc.report_schema import SCHEMA_VERSION, validate

FORMATS = ("json", "csv", "md", "html")


def speedup(base, fast):
    """base / fast where both are known, else None."""
    return base / fast if base and fast else None


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
    no_ratio: str = ""                # why no side's time is divided by accelc's (interpreter timings)
    eager_spread: float | None = None    # (p90 - p10) / median of eager's timing samples (latency.Timing)
    accelc_spread: float | None = None   # the same of accelc's

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
    speedup_vs_ort = property(lambda self: None if self.no_ratio else speedup(
        min((v for v in (self.ort_ms, self.ort_opt_ms) if v), default=None), self.accelc_ms))
    speedup_vs_eager = property(lambda self: None if self.no_ratio else speedup(self.eager_ms, self.accelc_ms))
    # against the better of torch.compile's modes (what a user would pick instead)
    speedup_vs_compile = property(lambda self: None if self.no_ratio else speedup(
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
              "compile_error", "ort_opt_ms", "ort_opt_rel_error", "ort_opt_method", "ort_opt_error", "no_ratio",
              "eager_spread", "accelc_spread")


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

    def __str__(self) -> str:       # print(report): the Markdown table, not the dataclass's fields
        return self.to_markdown()

    def __repr__(self) -> str:
        return (f"<accelc.Report of {self.header.get('model') or 'a model'}: {len(self.layers)} layer(s); print() "
                "shows the table, .write(folder) the files>")

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
