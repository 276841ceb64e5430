"""accelc.report: per-layer eager / ONNX Runtime / accelc rows, the JSON schema, the writers, the
export fallbacks and the CLI. On the CPU: ORT's CPU provider and Triton's interpreter."""
import csv
import io
import json
import math

import pytest
import torch
import torch.nn.functional as F

import accelc
from accelc.baselines import ort
from accelc.report import REPORT_SCHEMA, SCHEMA_VERSION, validate
from conftest import DEVICE, rel_l2

try:   # the reference validator where installed (the test extra); accelc's own one always
    import jsonschema
except ImportError:
    jsonschema = None


def check_schema(data):
    validate(data)
    if jsonschema is not None:
        jsonschema.validate(data, REPORT_SCHEMA)

FAST = dict(rep_ms=5, progress=False)


@pytest.fixture(scope="module")
def mlp_report():
    model = accelc.models.get("mlp").to(DEVICE)
    return accelc.report(model, model.example_inputs(4), **FAST)


def test_mlp_rows(mlp_report):
    rep = mlp_report
    rewritten = [r for r in rep.layers if r.status == "rewritten"]
    assert len(rewritten) == 4
    for r in rewritten:
        assert r.eager_ms > 0 and r.ort_ms > 0 and r.accelc_ms > 0, r
        assert math.isclose(r.speedup_vs_ort, r.ort_ms / r.accelc_ms)
        assert math.isclose(r.speedup_vs_eager, r.eager_ms / r.accelc_ms)
        assert r.accelc_pass and r.ort_pass, r
        assert r.accelc_rel_error < 1e-5 and r.ort_rel_error < 1e-5        # fp32 layers
        assert r.accelc_sqnr_db > 100 and r.ort_export.startswith("torchscript")
        assert r.kernel.startswith("accelc::linear") and r.input_shape
    e2e = rep.end_to_end
    assert e2e.eager_ms > 0 and e2e.ort_ms > 0 and e2e.accelc_ms > 0 and e2e.accelc_rel_error < 1e-5
    t = rep.totals
    assert math.isclose(t["accelc_ms"], sum(r.accelc_ms for r in rewritten))
    assert math.isclose(t["ort_ms"], sum(r.ort_ms for r in rewritten))
    h = rep.header
    if DEVICE.type == "cpu":
        assert h["interpreted"] and "NOT performance figures" in h["note"]
        assert "CPUExecutionProvider" in h["ort"]
    assert h["versions"]["torch"] == torch.__version__ and h["date"] and h["device"]


def test_json_schema_and_writers(mlp_report, tmp_path):
    paths = mlp_report.write(tmp_path)
    assert sorted(p.name for p in paths) == ["report.csv", "report.html", "report.json", "report.md"]
    data = json.loads((tmp_path / "report.json").read_text())
    check_schema(data)
    assert data["schema_version"] == SCHEMA_VERSION
    # broken reports do not validate: the schema checks something
    for bad in (dict(data, layers=[dict(data["layers"][0], status="fast")]),
                dict(data, layers=[dict(data["layers"][0], eager_ms="1.0")]),
                {k: v for k, v in data.items() if k != "totals"},
                dict(data, schema_version=SCHEMA_VERSION + 1)):
        with pytest.raises(ValueError):
            validate(bad)
        if jsonschema is not None:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, REPORT_SCHEMA)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "report.csv").read_text())))
    assert len(rows) == len(mlp_report.layers) + 1 and rows[-1]["layer"].startswith("end-to-end")
    md = (tmp_path / "report.md").read_text()
    assert "| layer | kind | input shape | kernel | eager ms | ORT ms | accelc ms" in md
    assert "total (timed layers)" in md and "end-to-end" in md
    page = (tmp_path / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    assert page.count("<svg") == 2                       # per-layer chart and end-to-end chart
    for r in mlp_report.layers:                          # one bar per layer and timing
        assert f"<title>{r.layer}</title>" in page
    assert page.count("<rect") >= 3 * 4 + 3
    if mlp_report.header["note"]:
        assert "NOT performance figures" in page and "NOT performance figures" in md
    again = accelc.Report.from_dict(data)               # JSON round trip
    assert again.to_markdown() == md and again.to_dict() == data
    with pytest.raises(ValueError, match="format"):
        mlp_report.write(tmp_path, formats=("pdf",))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="not a folder"):
        mlp_report.write(tmp_path / "a_file")


@pytest.mark.parametrize("name", ["vit"])
def test_attention_model(name):
    model = accelc.models.get(name).to(DEVICE)
    rep = accelc.report(model, model.example_inputs(2), accelc.OptimizeConfig(dtype="fp16"), **FAST)
    attn = [r for r in rep.layers if r.kind == "attention"]
    assert attn and all(r.status == "rewritten" for r in attn)
    for r in attn:
        assert r.ort_ms > 0 and r.accelc_ms > 0 and r.accelc_pass and r.ort_pass, r
    kept = [r for r in rep.layers if r.status == "kept"]
    assert kept and all(r.reason and r.accelc_ms is None for r in kept)
    check_schema(rep.to_dict())


def test_layer_whose_export_fails(monkeypatch):
    """Every exporter fails on the GELU layer: its row says why; the other rows and the report
    are complete."""
    real = ort.torch_export

    def failing(module, tensors, path, dynamo):
        inner = getattr(module, "module", None)   # the layer inside ort's tensor-arguments wrapper
        if isinstance(inner, torch.fx.GraphModule) and any(n.target is F.gelu for n in inner.graph.nodes):
            raise RuntimeError("Exporting the operator 'aten::gelu' is not supported (test)")
        return real(module, tensors, path, dynamo)

    monkeypatch.setattr(ort, "torch_export", failing)
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    rep = accelc.report(model, model.example_inputs(2), **FAST)
    gelu = [r for r in rep.layers if "gelu" in r.kernel]
    others = [r for r in rep.layers if r.status == "rewritten" and "gelu" not in r.kernel]
    assert gelu and others
    for r in gelu:
        assert r.ort_ms is None and r.speedup_vs_ort is None and r.accelc_ms > 0
        assert "ONNX export failed" in r.ort_error and "torchscript" in r.ort_error and "dynamo" in r.ort_error
    assert all(r.ort_ms > 0 for r in others)
    assert rep.totals["ort_failed"] == len(gelu)
    assert "ONNX export failed" in rep.to_markdown()


def test_half_export_falls_back_to_fp32_then_fp16(monkeypatch, tmp_path):
    real = ort.torch_export

    def no_half(module, tensors, path, dynamo):
        if any(t.dtype == torch.float16 for t in tensors):
            raise RuntimeError("ORT refused it (test)")
        return real(module, tensors, path, dynamo)

    monkeypatch.setattr(ort, "torch_export", no_half)
    layer = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.LayerNorm(16)).half().to(DEVICE).eval()
    x = torch.randn(4, 32, device=DEVICE, dtype=torch.float16)
    exp = ort.export(layer, [x], str(tmp_path / "l.onnx"), DEVICE)
    assert exp.method == "torchscript fp32->fp16" and len(exp.errors) == 2
    out = ort.OrtRunner(exp.path, [x], DEVICE).run()[0]
    assert out.dtype == torch.float16
    assert rel_l2(out, layer.float()(x.float())) < 5e-3


def test_without_ort():
    model = accelc.models.get("mlp").to(DEVICE)
    rep = accelc.report(model, model.example_inputs(2), with_ort=False, **FAST)
    assert all(r.ort_ms is None and "not asked" in r.ort_error for r in rep.layers if r.status == "rewritten")
    check_schema(rep.to_dict())


def test_cli_report(tmp_path, capsys):
    from accelc.cli import main

    out = tmp_path / "rep"
    assert main(["report", "mlp", "-o", str(out), "--batch-size", "2", "--format", "json,md",
                 "--rep-ms", "5", "--device", DEVICE.type]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    check_schema(json.loads((out / "report.json").read_text()))
    assert "vs ONNX Runtime" in capsys.readouterr().out
    assert main(["report", "mlp", "-o", str(out), "--format", "pdf"]) == 1
    assert "--format" in capsys.readouterr().err
    assert main(["report", "no_such_model", "-o", str(out)]) == 1
