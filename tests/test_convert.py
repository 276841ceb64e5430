"""`accelc convert`, accelc.save / accelc.load: round trips, and every bad input refused cleanly."""
import json
import os
import subprocess
import sys

import pytest
import torch

import accelc
from accelc.cli import main
from accelc.report_schema import validate
from conftest import DEVICE, NORMS_REWRITTEN, rel_l2

DEV = ["--device", DEVICE.type]


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


def _convert_ok(args, capsys):
    assert main(["convert", *args, *DEV]) == 0, capsys.readouterr().err
    return capsys.readouterr()


def _matches_model(out_path, model, batch_shapes):
    reloaded = accelc.load(out_path)
    assert any(n.target == torch.ops.accelc.linear.default for n in reloaded.graph.nodes)
    with torch.no_grad():
        for shape in batch_shapes:  # the example batch and another one
            x = torch.randn(*shape, device=DEVICE)
            assert rel_l2(reloaded(x), model(x)) < 1e-5
    return reloaded


def test_convert_builtin_name(tmp_path, capsys):
    out = tmp_path / "mlp.pt2"
    captured = _convert_ok(["mlp", "-o", str(out)], capsys)
    assert "4 layer(s) rewritten" in captured.out and f"wrote {out}" in captured.out
    assert "accelc: loading mlp" in captured.err and "accelc: writing" in captured.err
    reloaded = _matches_model(out, accelc.models.get("mlp").to(DEVICE), [(64, 24), (3, 24)])
    assert reloaded.accelc_summary["info"]["pass_counts"]["linear_act"] == 4
    assert _files(tmp_path) == ["mlp.pt2"]


def test_convert_full_module_file_with_shape_and_report(tmp_path, capsys):
    model = accelc.models.get("transformer_mlp")
    torch.save(model, tmp_path / "model.pt")
    out = tmp_path / "opt.pt2"
    _convert_ok([str(tmp_path / "model.pt"), "-o", str(out), "--input-shape", "2x16x64",
                 "--report", str(tmp_path / "rep")], capsys)
    _matches_model(out, model.to(DEVICE), [(2, 16, 64), (5, 7, 64)])
    # 8 linears and, where the glue is eager, 5 LayerNorms (one per block and the final one)
    n = 13 if NORMS_REWRITTEN else 8
    assert (tmp_path / "rep" / "summary.txt").read_text().startswith(f"accelc: {n} layer(s) rewritten")
    assert '"status": "rewritten"' in (tmp_path / "rep" / "layers.json").read_text()
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    validate(report)
    rows = [r for r in report["layers"] if r["status"] == "rewritten"]
    assert len(rows) == n and all(r["accelc_ms"] > 0 and r["eager_ms"] > 0 for r in rows)
    # one number for one layer's error: the summary's (the guard's) is the report's
    summary = json.loads((tmp_path / "rep" / "layers.json").read_text())["layers"]
    assert {r["name"]: r["rel_error"] for r in summary if r["status"] == "rewritten"} == {
        r["layer"]: r["accelc_rel_error"] for r in rows}
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == [
        "layers.json", "report.csv", "report.html", "report.json", "report.md", "summary.txt"]


def test_convert_export_program_uses_its_example_inputs(tmp_path, capsys):
    model = accelc.models.get("mlp").to(DEVICE)
    ep = torch.export.export(model, model.example_inputs(batch_size=16))
    torch.export.save(ep, tmp_path / "in.pt2")
    out = tmp_path / "out.pt2"
    _convert_ok([str(tmp_path / "in.pt2"), "-o", str(out)], capsys)
    _matches_model(out, model, [(16, 24)])


def test_batch_one_example_does_not_freeze_the_program_at_batch_one(tmp_path, capsys):
    """torch.export fixes dims whose example is 1: the program is traced at batch 2."""
    out = tmp_path / "b1.pt2"
    _convert_ok(["mlp", "-o", str(out), "--input-shape", "1x24"], capsys)
    _matches_model(out, accelc.models.get("mlp").to(DEVICE), [(1, 24), (4, 24), (7, 24)])


def test_convert_example_inputs_file_and_dtype(tmp_path, capsys):
    torch.save((torch.randn(8, 24),), tmp_path / "inputs.pt")
    out = tmp_path / "half.pt2"
    _convert_ok(["mlp", "-o", str(out), "--example-inputs", str(tmp_path / "inputs.pt"), "--dtype", "bf16"],
                capsys)
    reloaded = accelc.load(out)
    x = torch.randn(8, 24, device=DEVICE)
    ref = accelc.models.get("mlp").to(DEVICE, torch.float64)(x.double())
    assert reloaded(x.bfloat16()).dtype == torch.bfloat16
    assert rel_l2(reloaded(x.bfloat16()), ref) < 3e-2


def _bad_files(tmp_path):
    model = accelc.models.get("mlp")
    torch.save(model, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(os.urandom(4096))
    torch.jit.save(torch.jit.script(torch.nn.Linear(4, 4)), tmp_path / "script.pt")
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "inputs.pt").write_bytes(b"not a tensor file")
    torch.save((torch.full((4, 24), float("nan")),), tmp_path / "nan.pt")


BAD = [
    (["nosuch.pt"], "no such file or built-in model"),
    (["truncated.pt"], "not a readable PyTorch file"),
    (["garbage.pt"], "not a readable PyTorch file"),
    (["script.pt"], "is a TorchScript archive"),
    (["weights.pt"], "holds a state_dict, not a model"),
    (["good.pt"], "carries no example inputs: give --input-shape"),
    (["good.pt", "--input-shape", "8xAx2"], "expected positive sizes like 8x3x224x224"),
    (["good.pt", "--input-shape", "8x0"], "expected positive sizes"),
    (["good.pt", "--input-shape", "4x7"], "forward failed on inputs of shape 4x7"),
    (["good.pt", "--example-inputs", "inputs.pt"], "is not a readable tensor file"),
    (["mlp", "--example-inputs", "missing.pt"], "no such example-inputs file"),
    (["mlp", "--example-inputs", "nan.pt"], "example input 0 (4x24) holds NaN or inf"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_one_line_no_output(tmp_path, capsys, monkeypatch, argv, message):
    _bad_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    assert main(["convert", *argv, "-o", "out.pt2", *DEV]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("accelc: error")]
    assert len(err) == 1 and message in err[0], err
    assert _files(tmp_path) == before  # no OUT, no temporary file


@pytest.mark.parametrize("out,message", [("x.pt", "must end in .pt2"), ("nodir/x.pt2", "does not exist")])
def test_bad_output_path(tmp_path, capsys, out, message):
    assert main(["convert", "mlp", "-o", str(tmp_path / out), *DEV]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_asked_without_gpu(tmp_path, capsys):
    assert main(["convert", "mlp", "-o", str(tmp_path / "x.pt2"), "--device", "cuda"]) == 1
    assert "no CUDA GPU is available" in capsys.readouterr().err
    assert _files(tmp_path) == []


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def half_written(ep, f, **kwargs):
        open(f, "wb").write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(torch.export, "save", half_written)
    with pytest.raises(accelc.ModelFileError, match="could not write .*out.pt2.*disk full"):
        accelc.convert("mlp", tmp_path / "out.pt2", device=DEVICE.type)
    assert _files(tmp_path) == []


def test_existing_output_kept_when_convert_fails(tmp_path, capsys):
    (tmp_path / "out.pt2").write_bytes(b"previous result")
    assert main(["convert", str(tmp_path / "nosuch.pt"), "-o", str(tmp_path / "out.pt2"), *DEV]) == 1
    assert (tmp_path / "out.pt2").read_bytes() == b"previous result"


def test_verbose_shows_the_traceback(tmp_path):
    with pytest.raises(accelc.ModelFileError):
        main(["--verbose", "convert", "nosuch.pt", "-o", str(tmp_path / "x.pt2"), *DEV])


def test_load_refuses_non_programs(tmp_path):
    (tmp_path / "x.pt2").write_bytes(b"junk")
    with pytest.raises(accelc.ModelFileError, match="not a readable torch.export program"):
        accelc.load(tmp_path / "x.pt2")
    with pytest.raises(accelc.ModelFileError, match="no such file"):
        accelc.load(tmp_path / "missing.pt2")


def test_save_load_python_api_and_plain_torch_export_load(tmp_path):
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    (x,) = model.example_inputs()
    opt = accelc.optimize(model, (x,))
    accelc.save(opt, tmp_path / "t.pt2")
    ep = torch.export.load(tmp_path / "t.pt2")  # plain torch, after `import accelc`
    with torch.no_grad():
        assert rel_l2(ep.module()(x), opt(x)) < 1e-6


def test_cli_as_a_process(tmp_path):
    out = tmp_path / "m.pt2"
    r = subprocess.run([sys.executable, "-m", "accelc", "convert", "mlp", "-o", str(out), *DEV],
                       capture_output=True, text=True)
    assert r.returncode == 0 and out.is_file(), r.stderr
    r = subprocess.run([sys.executable, "-m", "accelc", "convert", "nosuch.pt", "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_convert_takes_example_inputs_saved_as_a_dict_of_named_tensors(tmp_path, capsys):
    """A tokenizer's output saved as dict(inputs): the model's keyword inputs (it was refused)."""
    import warnings

    T = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, vocab_size=100, max_position_embeddings=64)).eval()
    torch.save(bert, tmp_path / "bert.pt")
    ids = torch.randint(0, 100, (2, 16))
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "inputs.pt")
    out = tmp_path / "bert.pt2"
    _convert_ok([str(tmp_path / "bert.pt"), "-o", str(out), "--example-inputs", str(tmp_path / "inputs.pt")], capsys)
    call = {"input_ids": torch.randint(0, 100, (3, 9), device=DEVICE),
            "attention_mask": torch.ones(3, 9, dtype=torch.long, device=DEVICE)}
    with torch.no_grad():
        got, want = accelc.load(out)(**call), bert.to(DEVICE)(**call)
    assert rel_l2(got.last_hidden_state, want.last_hidden_state) < 1e-5
    torch.save({0: ids}, tmp_path / "bad.pt")
    assert main(["convert", str(tmp_path / "bert.pt"), "-o", str(tmp_path / "b.pt2"), "--example-inputs",
                 str(tmp_path / "bad.pt")]) == 1
    assert "keys are not input names" in capsys.readouterr().err
    torch.save(T.BatchEncoding({"input_ids": ids}), tmp_path / "enc.pt")     # the tokenizer's object itself
    assert main(["convert", str(tmp_path / "bert.pt"), "-o", str(tmp_path / "b.pt2"), "--example-inputs",
                 str(tmp_path / "enc.pt")]) == 1
    assert "holds a BatchEncoding" in (err := capsys.readouterr().err) and "torch.save(dict(inputs), path)" in err


def test_convert_report_of_a_batch_norm_model(tmp_path, capsys):
    """convert --report on a Conv + BatchNorm model (the report once failed on every such model)."""
    out = tmp_path / "cnn.pt2"
    _convert_ok(["cnn_small", "-o", str(out), "--input-shape", "1x3x32x32", "--report", str(tmp_path / "rep")], capsys)
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    validate(report)
    assert {r["layer"] for r in report["layers"] if r["status"] == "rewritten"} >= {"features.0+1+2", "features.4+5+6"}


def test_convert_whose_report_fails_says_the_program_is_complete(tmp_path, capsys, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("the report's own failure\nsecond line")
    monkeypatch.setattr(sys.modules["accelc.convert"], "measure", broken)
    out = tmp_path / "mlp.pt2"
    assert main(["convert", "mlp", "-o", str(out), "--report", str(tmp_path / "rep"), *DEV]) == 1
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("accelc: error")]
    assert err == [f"accelc: error: {out} is written and complete; only the report failed: "
                   "RuntimeError: the report's own failure second line"]
    assert f"wrote {out}" in captured.out
    _matches_model(out, accelc.models.get("mlp").to(DEVICE), [(3, 24)])
    with pytest.raises(accelc.ReportFailedError) as info:    # the Python entry point: the module comes with it
        accelc.convert("mlp", tmp_path / "again.pt2", report_dir=str(tmp_path / "rep2"), device=DEVICE.type)
    assert isinstance(info.value.optimized, accelc.OptimizedModule) and (tmp_path / "again.pt2").is_file()


def test_loaded_program_called_in_another_dtype_names_the_cast(tmp_path):
    """A .pt2 optimized for fp16 called with fp32 inputs: the InputError the in-memory module gives,
    not the kernel's own ValueError."""
    from accelc.errors import InputError

    model = accelc.models.get("cnn_small").to(DEVICE).half()
    (x,) = model.example_inputs(2)
    opt = accelc.optimize(model, (x.half(),))
    accelc.save(opt, tmp_path / "cnn.pt2")
    loaded = accelc.load(tmp_path / "cnn.pt2")
    for module in (opt, loaded):
        with pytest.raises(InputError, match=r"input 0 is float32, and the model was optimized for float16.*"
                                             r"x\.to\(torch\.float16\)"):
            module(x.float())
