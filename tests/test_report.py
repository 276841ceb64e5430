"""accelc.report: per-layer eager / ONNX Runtime / accelc rows, the JSON schema, the writers, the
export fallbacks and the CLI. On the CPU: ORT's CPU provider and Triton's interpreter."""
import csv
import dataclasses
import io
import json
import math

import pytest
import torch
import torch.nn.functional as F

import accelc
from accelc.baselines import ort
from accelc.report_schema import REPORT_SCHEMA, SCHEMA_VERSION, validate
from conftest import DEVICE, NORMS_REWRITTEN, rel_l2

try:   # the reference validator where installed (the test extra); accelc's own one always
    import jsonschema
except ImportError:
    jsonschema = None


def check_schema(data):
    validate(data)
    if jsonschema is not None:
        jsonschema.validate(data, REPORT_SCHEMA)

FAST = dict(rep_ms=5, progress=False)
# a GPU report times ORT only where it has its CUDA provider (against its CPU build: numbers only)
ORT_TIMED = DEVICE.type != "cuda" or (ort.available() is None and ort.has_cuda())


def ort_timed(row) -> bool:
    """ORT's time is there where it is a baseline, and the reason in its place where not."""
    if ORT_TIMED:
        return row.ort_ms is not None and row.ort_ms > 0
    return row.ort_ms is None and row.speedup_vs_ort is None and "accelc[ort-gpu]" in row.ort_error


def ratio(got, base, fast) -> bool:
    """A speedup column: base / fast on the GPU; none where accelc's times are the interpreter's."""
    return got is None if DEVICE.type == "cpu" else got == pytest.approx(base / fast)


@pytest.fixture(scope="module")
def mlp_report():
    model = accelc.models.get("mlp").to(DEVICE)
    return accelc.report(model, model.example_inputs(4), **FAST)


def test_mlp_rows(mlp_report):
    rep = mlp_report
    rewritten = [r for r in rep.layers if r.status == "rewritten"]
    assert len(rewritten) == 4
    for r in rewritten:
        assert r.eager_ms > 0 and ort_timed(r) and r.accelc_ms > 0, r
        if ORT_TIMED:
            assert ratio(r.speedup_vs_ort, r.ort_ms, r.accelc_ms)
        assert ratio(r.speedup_vs_eager, r.eager_ms, r.accelc_ms)
        assert r.accelc_pass and r.ort_pass, r
        assert r.accelc_rel_error < 1e-5 and r.ort_rel_error < 1e-5        # fp32 layers
        assert r.accelc_sqnr_db > 100 and r.ort_export.startswith("dynamo")      # the current exporter first
        assert r.kernel.startswith("accelc::linear") and r.input_shape
    e2e = rep.end_to_end
    assert e2e.eager_ms > 0 and ort_timed(e2e) and e2e.accelc_ms > 0 and e2e.accelc_rel_error < 1e-5
    # no transformer: ORT's transformer optimizer has nothing to fuse, and the row says so
    assert e2e.ort_opt_ms is None and (not ORT_TIMED or "no fusions" in e2e.ort_opt_error)
    t = rep.totals
    assert math.isclose(t["accelc_ms"], sum(r.accelc_ms for r in rewritten))
    if ORT_TIMED:
        assert math.isclose(t["ort_ms"], sum(r.ort_ms for r in rewritten)) and t["no_ort_ratio"] is None
    else:
        assert t["ort_ms"] is None and t["speedup_vs_ort"] is None and "accelc[ort-gpu]" in t["no_ort_ratio"]
    h = rep.header
    if DEVICE.type == "cpu":
        assert h["interpreted"] and "NOT performance figures" in h["note"]
        # interpreter times are no baseline: no ratio anywhere, and the report says why
        assert t["speedup_vs_eager"] is None and t["speedup_vs_ort"] is None and "interpreter" in t["no_ratio"]
        assert all(r.speedup_vs_eager is None and "interpreter" in r.no_ratio for r in rewritten + [e2e])
        assert "no speedup columns: accelc ran in Triton's CPU interpreter" in rep.to_markdown()
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
        assert ort_timed(r) and r.accelc_ms > 0 and r.accelc_pass and r.ort_pass, r
    kept = [r for r in rep.layers if r.status == "kept"]
    assert all(r.reason and r.accelc_ms is None for r in kept)
    norms = [r for r in rep.layers if r.kind in ("LayerNorm", "layer_norm")]
    assert norms and all(r.status == ("rewritten" if NORMS_REWRITTEN else "kept") for r in norms)
    check_schema(rep.to_dict())
    # the whole model also in ORT at its best: its transformer optimizer fused LayerNorms and GELUs
    e = rep.end_to_end
    if ORT_TIMED:
        assert e.ort_opt_ms > 0 and "transformer optimizer" in e.ort_opt_method, e.ort_opt_error
        assert "LayerNormalization" in e.ort_opt_method and e.ort_opt_rel_error < 1e-2
        assert ratio(e.speedup_vs_ort, min(e.ort_ms, e.ort_opt_ms), e.accelc_ms)
        assert "Whole model in ORT with its transformer optimizer: " in rep.to_markdown()


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
    assert all(ort_timed(r) for r in others)
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
    assert exp.method == "dynamo fp32->fp16" and len(exp.errors) == 2
    assert exp.errors[0].startswith("dynamo float16") and exp.errors[1].startswith("torchscript float16")
    out = ort.OrtRunner(exp.path, [x], DEVICE).run()[0]
    assert out.dtype == torch.float16
    assert rel_l2(out.to(DEVICE), layer.float()(x.float())) < 5e-3   # on the CPU where ORT ran there


def test_without_ort():
    model = accelc.models.get("mlp").to(DEVICE)
    rep = accelc.report(model, model.example_inputs(2), with_ort=False, **FAST)
    assert all(r.ort_ms is None and "not asked" in r.ort_error for r in rep.layers if r.status == "rewritten")
    check_schema(rep.to_dict())


def test_gpu_report_states_no_speedup_against_cpu_ort(monkeypatch):
    """On a GPU with onnxruntime's CPU build, ORT's numbers are checked but its time is no
    baseline: no ORT time, no ratio, and the reason in its place."""
    import importlib
    report_mod = importlib.import_module("accelc.report")
    from accelc.records import LayerCheck, LayerRecord

    out = torch.randn(4, 8)
    monkeypatch.setattr(report_mod, "_ort_measure", lambda *a: (0.5, [out], "dynamo fp32", None))
    row = report_mod.LayerRow(LayerRecord("fc", "linear", "rewritten", "accelc::linear", "",
                                          LayerCheck(True, 1e-7, 1e-7, 0.0, 1e-3, ((4, 8),), torch.float32)))
    row.accelc_ms = 0.1
    sides = report_mod.Sides(torch.device("cuda"), accelc.OptimizeConfig(), "", 5, False, "",
                             no_ratio=report_mod.NO_CUDA_ORT)
    args = (row, None, [out], lambda: out.double(), "fc")
    report_mod._fill_ort(*args, sides)
    assert row.ort_ms is None and row.speedup_vs_ort is None and "accelc[ort-gpu]" in row.ort_error
    assert row.ort_rel_error == 0.0                                  # its accuracy is still there
    report_mod._fill_ort(*args, dataclasses.replace(sides, no_ratio=None))
    assert row.ort_ms == 0.5 and row.speedup_vs_ort == pytest.approx(5.0)


def test_one_timer_for_every_side(monkeypatch):
    """The timing policy: eager, accelc, ONNX Runtime and torch.compile are timed by the same
    function with the same arguments: per layer, and for the whole model (whole_model=True; both
    torch.compile modes there)."""
    import importlib
    report_mod = importlib.import_module("accelc.report")
    calls = []

    def spy(fn, device, rep_ms=100, whole_model=False):
        calls.append((whole_model, rep_ms, torch.device(device).type))
        fn()
        return 1.0
    monkeypatch.setattr(report_mod, "side_ms", spy)
    monkeypatch.setattr(torch, "compile", lambda module, **kw: module)   # the policy, not Inductor's time
    model = accelc.models.get("mlp").to(DEVICE)
    rep = accelc.report(model, model.example_inputs(2), with_compile=True, **FAST)
    rewritten = [r for r in rep.layers if r.status == "rewritten"]
    layer_calls = [c for c in calls if not c[0]]
    if ORT_TIMED:   # (ORT's CPU build on a GPU machine is timed on the CPU and its time dropped)
        assert len(layer_calls) == 4 * len(rewritten) and len([c for c in calls if c[0]]) == 5
        assert len({c[1:] for c in calls}) == 1                  # one rep_ms, one device kind
    assert all(r.eager_ms == r.accelc_ms == r.compile_ms == 1.0 for r in rewritten)
    e = rep.end_to_end
    assert e.eager_ms == e.accelc_ms == e.compile_ms == e.compile_ro_ms == 1.0
    assert "same" in rep.header["timer"]


def test_cli_report(tmp_path, capsys):
    from accelc.cli import main

    out = tmp_path / "rep"
    assert main(["report", "mlp", "-o", str(out), "--batch-size", "2", "--format", "json,md",
                 "--rep-ms", "5", "--device", DEVICE.type]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    check_schema(json.loads((out / "report.json").read_text()))
    printed = capsys.readouterr().out
    if DEVICE.type == "cpu":     # interpreter times: the summary line gives no ratio, and says why
        assert "no speedups: accelc ran in Triton's CPU interpreter" in printed and "vs ONNX Runtime" not in printed
    else:
        assert "vs ONNX Runtime" in printed
    assert main(["report", "mlp", "-o", str(out), "--format", "pdf"]) == 1
    assert "--format" in capsys.readouterr().err
    assert main(["report", "no_such_model", "-o", str(out)]) == 1


def test_chart_is_log_scale_so_one_slow_layer_does_not_flatten_the_rest():
    import re
    from accelc.report_html import _chart

    rows = [{"layer": f"l{i}", "eager_ms": ms, "ort_ms": 2 * ms, "accelc_ms": ms / 2, "speedup_vs_ort": 4.0}
            for i, ms in enumerate([0.015, 0.03, 0.05, 3.0])]
    svg = _chart(rows, "per-layer latency (ms)")
    widths = [float(w) for y, w in re.findall(r'<rect x="300" y="([\d.]+)" width="([\d.]+)"', svg)
              if y != "24"]   # the bars, not the legend's swatch
    assert len(widths) == 12 and "log scale" in svg
    assert min(widths) > 0.05 * max(widths)                  # linear: 0.0075 / 6 of the width
    assert widths[1] < widths[4] < widths[7] < widths[10]     # order kept: ORT 0.03 < 0.06 < 0.1 < 6 ms
    assert "0.001 ms" in svg and "10 ms" in svg               # decades marked


def test_torch_compile_columns():
    """torch.compile beside the other sides, timed by the same function: per layer (default mode)
    and the whole model in both modes; vs compile is against the faster mode."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(DEVICE).eval()
    rep = accelc.report(model, torch.randn(4, 16, device=DEVICE), accelc.OptimizeConfig(only_if_faster=False),
                        with_ort=False, with_compile=True, **FAST)
    rewritten = [r for r in rep.layers if r.status == "rewritten"]
    assert rewritten and all(r.compile_ms > 0 and r.compile_ro_ms is None for r in rewritten)
    assert all(ratio(r.speedup_vs_compile, r.compile_ms, r.accelc_ms) for r in rewritten)
    e = rep.end_to_end
    assert e.compile_ms > 0 and e.compile_ro_ms > 0 and not e.compile_error
    assert ratio(e.speedup_vs_compile, min(e.compile_ms, e.compile_ro_ms), e.accelc_ms)
    check_schema(rep.to_dict())
    assert "torch.compile ms" in rep.to_markdown() and "reduce-overhead" in rep.to_markdown()


def test_torch_compile_failure_is_said_in_the_row(monkeypatch):
    from accelc.api import make_job, optimize_job
    from accelc.report import measure

    def refuses(*args, **kwargs):
        raise RuntimeError("backend compiler failed (test)")
    model = accelc.models.get("mlp").to(DEVICE)
    job = make_job(model, model.example_inputs(2))
    opt = optimize_job(job)     # accelc's own glue compiled before torch.compile breaks
    monkeypatch.setattr(torch, "compile", refuses)
    rep = measure(opt, job, with_ort=False, with_compile=True, **FAST)
    rows = [r for r in rep.layers if r.status == "rewritten"] + [rep.end_to_end]
    assert all(r.compile_ms is None and r.speedup_vs_compile is None for r in rows)
    assert all("torch.compile (default) failed: RuntimeError: backend compiler failed" in r.compile_error for r in rows)
    assert rep.end_to_end.accelc_ms > 0 and rep.totals["compile_ms"] is None
    check_schema(rep.to_dict())


# ORT at its best: its transformer optimizer on the whole model, NHWC convs, the exporter order

def test_optimizer_model_types():
    """HF models by their config (heads and width given); other transformers get the BERT and
    GPT-2 fusions tried; a CNN or an MLP, none."""
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                                          num_hidden_layers=1, vocab_size=50))
    assert ort.optimizer_types(bert) == (["bert"], 2, 32)
    wrapped = torch.nn.Sequential(bert)                       # a user's wrapper around it
    assert ort.optimizer_types(wrapped) == (["bert"], 2, 32)
    assert ort.optimizer_types(accelc.models.get("vit"))[0] == ["bert", "gpt2"]
    assert ort.optimizer_types(accelc.models.get("mlp")) == ([], 0, 0)
    assert ort.optimizer_types(accelc.models.get("cnn_small")) == ([], 0, 0)


def test_exportable_attention_copies_and_leaves_the_model_alone():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=1,
                                  vocab_size=50, attn_implementation="sdpa")
    bert = transformers.BertModel(cfg).eval()
    m, what = ort.exportable_attention(bert)
    assert m is not bert and what == "HF eager attention"
    assert m.config._attn_implementation == "eager" and bert.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        assert rel_l2(m(ids)[0], bert(ids)[0]) < 1e-5

    class TimmStyle(torch.nn.Module):   # timm's Attention: a fused_attn switch
        def __init__(self):
            super().__init__()
            self.fused_attn = True
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)
    t = torch.nn.Sequential(TimmStyle())
    m, what = ort.exportable_attention(t)
    assert what == "unfused attention" and m[0].fused_attn is False and t[0].fused_attn is True
    plain = torch.nn.Linear(4, 4)
    assert ort.exportable_attention(plain) == (plain, "")


def test_optimizer_candidate_with_wrong_numbers_is_no_baseline(monkeypatch, tmp_path):
    """A candidate whose output is off (a fusion that changed the numbers) is refused with the
    reason; the fastest of the correct ones is kept, and vs ORT takes the faster ORT."""
    import importlib
    report_mod = importlib.import_module("accelc.report")
    from accelc.records import LayerCheck, LayerRecord

    ref = torch.randn(4, 8, dtype=torch.float64)

    class Runner:
        def __init__(self, path, args, device, allow_tf32=False):
            self.path, self.on_gpu, self.cuda_graph = path, False, False

        def run(self):
            return [ref.float() * (3.0 if self.path == "bad" else 1.0)]
    cands = [ort.OptimizedCandidate(p, [], f"cand {p}", {"Attention": 1}) for p in ("bad", "good")]
    monkeypatch.setattr(ort, "optimized_candidates", lambda *a, **k: (cands, ["torchscript: failed (test)"]))
    monkeypatch.setattr(ort, "OrtRunner", Runner)
    timed = []

    def side_ms(fn, device, rep_ms=100, whole_model=False):   # the one timer, as for every other side
        timed.append(whole_model)
        return 0.25
    monkeypatch.setattr(report_mod, "side_ms", side_ms)
    row = report_mod.LayerRow(LayerRecord("end-to-end (whole model)", "model", "", "accelc.optimize",
                                          check=LayerCheck(True, 1e-7, 1e-7, 0.0, 1e-5, ((4, 8),), torch.float32)))
    row.accelc_ms, row.ort_ms = 0.5, 1.0
    sides = report_mod.Sides(torch.device("cpu"), accelc.OptimizeConfig(), str(tmp_path), 5, False, "")
    report_mod._fill_ort_optimized(row, None, [], ref, sides)
    assert row.ort_opt_ms == 0.25 and row.ort_opt_method == "cand good" and row.ort_opt_rel_error < 1e-6
    assert timed == [True]                       # only the correct candidate, timed as a whole model
    assert row.speedup_vs_ort == pytest.approx(0.5)              # against the faster ORT
    monkeypatch.setattr(ort, "optimized_candidates", lambda *a, **k: (cands[:1], []))
    row.ort_opt_ms, row.ort_opt_method = None, ""
    report_mod._fill_ort_optimized(row, None, [], ref, sides)
    assert row.ort_opt_ms is None and "cand bad: error" in row.ort_opt_error and "over tolerance" in row.ort_opt_error
    assert row.speedup_vs_ort == pytest.approx(2.0)              # plain ORT only


def test_cuda_provider_options(monkeypatch):
    """On a GPU: cuDNN's exhaustive search and NHWC convs; a provider that refuses prefer_nhwc
    gets the session without it (not a failed export)."""
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    provs = ort.providers(torch.device("cuda", 0))
    assert provs[0][0] == "CUDAExecutionProvider"
    assert provs[0][1]["prefer_nhwc"] == "1" and provs[0][1]["cudnn_conv_algo_search"] == "EXHAUSTIVE"
    seen = []

    def session(path, so, providers):
        seen.append(providers[0][1])
        if "prefer_nhwc" in providers[0][1]:
            raise RuntimeError("Unknown provider option: prefer_nhwc (this build has no NHWC kernels)")
        return "session"
    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    assert ort.session("m.onnx", torch.device("cuda", 0)) == "session"
    assert "prefer_nhwc" in seen[0] and "prefer_nhwc" not in seen[1] and seen[1]["cudnn_conv_algo_search"] == "EXHAUSTIVE"

    def broken(path, so, providers):
        raise RuntimeError("Load model from m.onnx failed: protobuf parsing failed")
    monkeypatch.setattr(onnxruntime, "InferenceSession", broken)
    with pytest.raises(RuntimeError, match="protobuf"):     # other errors are not swallowed
        ort.session("m.onnx", torch.device("cuda", 0))


@pytest.mark.parametrize("name", accelc.models.names())
def test_cli_report_on_every_builtin_model(name, tmp_path, capsys):
    """Every built-in model through `accelc report` (a report on any model with Conv + BatchNorm once
    failed: the folded conv's released original read a tensor only the captured graph held)."""
    from accelc.cli import main

    out = tmp_path / "rep"
    assert main(["report", name, "-o", str(out), "--batch-size", "1", "--format", "json,md", "--rep-ms", "1",
                 "--no-ort", "--device", DEVICE.type]) == 0, capsys.readouterr().err
    data = json.loads((out / "report.json").read_text())
    check_schema(data)
    # the header names the model's dtype, token inputs or not ("inputs 2x24, ;" once)
    assert data["header"]["dtype"] == "float32"
    model_line = next(line for line in (out / "report.md").read_text().splitlines() if line.startswith("- model:"))
    assert ", float32; capture" in model_line, model_line
    rows = [r for r in data["layers"] if r["status"] == "rewritten"]
    assert rows and all(r["eager_ms"] > 0 and r["accelc_ms"] > 0 for r in rows)
    if DEVICE.type == "cpu":   # no ORT asked for: the note does not say it ran
        assert "ONNX Runtime" not in data["header"]["note"]


def test_report_of_a_batch_norm_model_rebuilds_the_folded_layers_from_the_model():
    """The Python entry point with ONNX Runtime on a Conv + BN model: each folded layer's original is
    rebuilt from the model's own conv and BN tensors, and gives the layer's eager numbers."""
    model = accelc.models.get("cnn_small").to(DEVICE)
    rep = accelc.report(model, model.example_inputs(2), **FAST)
    folded = [r for r in rep.layers if r.status == "rewritten" and r.layer.startswith("features.")]
    assert [r.layer for r in folded] == ["features.0+1+2", "features.4+5+6", "features.8+9"]
    for r in folded:
        assert r.eager_ms > 0 and r.accelc_ms > 0 and ort_timed(r), r
        assert r.ort_rel_error < 1e-4 and r.accelc_rel_error < 1e-4, r


def test_released_layer_reading_a_tensor_no_pass_can_recompute_is_one_clear_error():
    from accelc.records import _model_tensor

    with pytest.raises(ValueError, match="does not hold and no pass said how to recompute"):
        _model_tensor(torch.nn.Linear(2, 2), "weight_accelc_folded_w", None, "fc")


def test_int8_report_over_stacked_projections_rebuilds_them_from_the_model(tmp_path, capsys):
    """An int8 layer lets go of its float weights; over BERT's q / k / v stacked into one GEMM, the report
    recomputes the stacked float weight from the model's own three (it read a tensor only the graph held)."""
    from accelc.cli import main

    out = tmp_path / "rep"
    assert main(["report", "bert", "-o", str(out), "--int8", "--int8-all-layers", "--no-ort", "--batch-size", "1",
                 "--rep-ms", "1", "--format", "json", "--device", DEVICE.type]) == 0, capsys.readouterr().err
    rows = {r["layer"]: r for r in json.loads((out / "report.json").read_text())["layers"]}
    stacked = [name for name in rows if "query+key+value" in name]
    assert stacked and all(rows[n]["eager_ms"] > 0 for n in stacked), sorted(rows)


def test_the_report_reads_as_a_table_without_columns_it_cannot_fill(mlp_report):
    """print(report) is its Markdown table; a column no row fills (on a CPU: the speedups, torch.compile)
    is left out, not shown blank, and the HTML chart shows no ratio it does not have."""
    rep = mlp_report
    assert str(rep) == rep.to_markdown() and repr(rep).startswith("<accelc.Report of") and len(repr(rep)) < 200
    table = [line for line in str(rep).splitlines() if line.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    body = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    for j, name in enumerate(head):
        assert any(cells[j] for cells in body), f"column {name!r} is empty"
    if not any(r.speedup_vs_ort is not None for r in rep.layers):
        assert "vs ORT" not in head and "n/a" not in rep.to_html()


def test_each_timing_shows_its_spread_and_a_wide_one_is_warned_of(mlp_report):
    """Every timed side keeps the spread of its samples ((p90 - p10) / median), shown as ± beside its ms;
    timings spread past 25% (a busy machine: identical layers read 0.009 and 53 ms on one) get one
    sentence saying the figures are not to trust."""
    from accelc.report_html import spread_warning

    rows = [r for r in mlp_report.layers if r.status == "rewritten"] + [mlp_report.end_to_end]
    assert all(r.eager_spread is not None and r.eager_spread >= 0 and r.accelc_spread is not None for r in rows)
    assert "±" in str(mlp_report)
    d = mlp_report.to_dict()
    calm = dict(d, layers=[dict(r, eager_spread=0.05, accelc_spread=0.1) for r in d["layers"]],
                end_to_end=dict(d["end_to_end"], eager_spread=0.02, accelc_spread=0.02))
    assert spread_warning(calm) == ""
    busy = dict(calm, layers=[dict(calm["layers"][0], accelc_spread=3.0)] + calm["layers"][1:])
    said = spread_warning(busy)
    assert said.startswith("1 of ") and "the widest 300%" in said and "not to trust" in said
