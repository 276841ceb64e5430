"""The CLI, files and logs under bad use: paths checked before the work, files that are not what they seem
(an ONNX file, a pickle of a class not installed), a signal while writing, numbers out of range, progress and
logging as asked. Split from test_bad_inputs.py."""
import logging
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

import accelc
from accelc.cli import main
from accelc.errors import ModelFileError
from conftest import DEVICE, rel_l2
from bad_models import CFG, Fc, Branch, Scaled


DEV = ["--device", DEVICE.type]


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


def _error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("accelc: error")]


def test_cli_capture_failure_is_one_paragraph_without_torch_graph_dumps(tmp_path, capsys):
    torch.save(Branch(), tmp_path / "branchy.pt")
    assert main(["convert", str(tmp_path / "branchy.pt"), "-o", str(tmp_path / "o.pt2"), "--input-shape", "4x16",
                 *DEV]) == 1
    err = capsys.readouterr().err
    assert "def forward" not in err and len(err.splitlines()) <= 10, err
    assert "symbolic_trace:" in err and "torch.export:" in err and "Branches on tensor values" in err
    assert "-v shows" in err and _files(tmp_path) == ["branchy.pt"]


_MAIN_SCRIPT = """
import torch, torch.nn as nn
class MainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
    def forward(self, x):
        return self.fc(x)
torch.save(MainNet(), "main.pt")
"""


def test_onnx_file_and_main_class_pickle_say_what_they_are(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    subprocess.run([sys.executable, "-c", _MAIN_SCRIPT], check=True, cwd=tmp_path)
    onnx = pytest.importorskip("onnx")
    node = onnx.helper.make_node("Relu", ["x"], ["y"])
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])])
    onnx.save(onnx.helper.make_model(graph), str(tmp_path / "m.onnx"))
    assert main(["convert", "m.onnx", "-o", "o.pt2", "--input-shape", "4x16", *DEV]) == 1
    [line] = _error_lines(capsys)
    assert "is an ONNX model" in line and "torch.export program" in line
    assert main(["convert", "main.pt", "-o", "o.pt2", "--input-shape", "4x16", *DEV]) == 1
    [line] = _error_lines(capsys)
    assert "class 'MainNet' was defined in the script that saved it (__main__)" in line and "PYTHONPATH" in line
    assert not (tmp_path / "o.pt2").exists()


def test_pickle_of_a_module_that_is_not_installed(tmp_path, capsys):
    (tmp_path / "mymodels.py").write_text(_MAIN_SCRIPT.replace('torch.save(MainNet(), "main.pt")', ""))
    subprocess.run([sys.executable, "-c", "import torch, mymodels; torch.save(mymodels.MainNet(), 'm.pt')"],
                   check=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": ""})
    assert main(["convert", str(tmp_path / "m.pt"), "-o", str(tmp_path / "o.pt2"), "--input-shape", "4x16", *DEV]) == 1
    [line] = _error_lines(capsys)
    assert "module 'mymodels', which cannot be imported here" in line


def test_model_pickle_given_as_example_inputs(tmp_path, capsys):
    torch.save(nn.Sequential(nn.Linear(16, 8)), tmp_path / "model.pt")
    assert main(["convert", "mlp", "-o", str(tmp_path / "o.pt2"), "--example-inputs", str(tmp_path / "model.pt"),
                 *DEV]) == 1
    [line] = _error_lines(capsys)
    assert "holds a Sequential, not only tensors" in line and "\x1b" not in line and "weights_only" not in line


def test_export_program_with_keyword_inputs_converts_and_keeps_its_call(tmp_path, capsys):
    model = Scaled().to(DEVICE).eval()
    x, s = torch.randn(4, 16, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (x,), {"scale": s}, dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(ep, tmp_path / "kw.pt2")
    assert main(["convert", str(tmp_path / "kw.pt2"), "-o", str(tmp_path / "o.pt2"), *DEV]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "_guards_fn" not in out and "_assert" not in out      # the program's shape checks are not layers
    reloaded = accelc.load(tmp_path / "o.pt2")
    x2, s2 = torch.randn(7, 16, device=DEVICE), torch.randn(7, 8, device=DEVICE)
    with torch.no_grad():
        assert rel_l2(reloaded(x2, scale=s2), model(x2, scale=s2)) < 1e-5


def test_saved_optimized_model_takes_keywords_by_name(tmp_path):
    model = Scaled().to(DEVICE).eval()
    x, s = torch.randn(4, 16, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    opt = accelc.optimize(model, x, CFG, example_kwargs={"scale": s})
    accelc.save(opt, tmp_path / "o.pt2")
    reloaded = accelc.load(tmp_path / "o.pt2")
    x2, s2 = torch.randn(3, 16, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    with torch.no_grad():
        assert rel_l2(reloaded(x2, scale=s2), model(x2, scale=s2)) < 1e-5
    with pytest.raises(ModelFileError, match="must end in .pt2"):
        accelc.save(opt, tmp_path / "o")                    # the CLI's rule, for the API too
    assert _files(tmp_path) == ["o.pt2"]


@pytest.mark.parametrize("flag", ["--report", "-o"])
def test_output_paths_checked_before_the_work(tmp_path, capsys, flag):
    (tmp_path / "taken").write_text("a file")
    argv = ["convert", "mlp", "-o", str(tmp_path / "o.pt2"), "--report", str(tmp_path / "taken"), *DEV]
    message = "output folder '{}' is a file".format(tmp_path / "taken")
    if flag == "-o":
        argv = ["convert", "mlp", "-o", str(tmp_path / "taken" / "o.pt2"), *DEV]
    assert main(argv) == 1
    [line] = _error_lines(capsys)
    assert message in line
    assert _files(tmp_path) == ["taken"]            # nothing written, nothing left half-done


def test_output_folder_a_path_goes_to_is_not_a_file(tmp_path, capsys):
    (tmp_path / "o.pt2").mkdir()
    assert main(["convert", "mlp", "-o", str(tmp_path / "o.pt2"), *DEV]) == 1
    assert "is a folder: give a file name ending in .pt2" in _error_lines(capsys)[0]


def test_read_only_output_folder_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    assert main(["convert", "mlp", "-o", str(tmp_path / "o.pt2"), *DEV]) == 1
    [line] = _error_lines(capsys)
    assert f"output folder '{tmp_path}' is not writable (Permission denied)" in line
    assert main(["report", "mlp", "-o", str(tmp_path / "rep"), *DEV]) == 1
    [line] = _error_lines(capsys)
    assert f"'{tmp_path}' (where output folder '{tmp_path / 'rep'}' would be made) is not writable" in line
    assert _files(tmp_path) == []


_SIGTERM_SCRIPT = """
import os, sys, time, torch
import accelc.cli
def slow_save(ep, f, **kwargs):
    open(f, "wb").write(b"partial")
    print("WRITING", flush=True)
    time.sleep(60)
torch.export.save = slow_save
sys.exit(accelc.cli.main(["convert", "mlp", "-o", sys.argv[1], "--device", sys.argv[2]]))
"""


def test_sigterm_while_writing_leaves_no_temporary_file(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_SCRIPT, str(tmp_path / "o.pt2"), DEVICE.type],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "WRITING" in line:
            break
    assert any(p.name.startswith(".o.tmp-") for p in tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "accelc: terminated" in err, err
    assert _files(tmp_path) == []


def test_cli_and_api_keep_the_models_dtype_unless_asked(monkeypatch, tmp_path):
    seen = []
    real = accelc.optimize

    def spy(model, inputs, config=None, **kw):
        seen.append(config.dtype)
        return real(model, inputs, config, **kw)
    monkeypatch.setattr(accelc, "optimize", spy)
    assert main(["optimize", "mlp", "--batch-size", "2", *DEV]) == 0
    assert main(["optimize", "mlp", "--batch-size", "2", "--dtype", "bf16", *DEV]) == 0
    assert seen == [None, torch.bfloat16]


def test_library_is_quiet_and_logs_its_steps_to_the_accelc_logger(capfd, caplog):
    model, x = Fc().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE)
    capfd.readouterr()
    accelc.optimize(model, x, CFG)
    err = capfd.readouterr().err
    assert "capturing" not in err and "checking" not in err
    with caplog.at_level(logging.INFO, logger="accelc"):
        accelc.optimize(model, x, CFG)
    text = caplog.text
    assert "capturing Fc" in text and "captured with symbolic_trace" in text and "1 layer(s) rewritten" in text


def test_cli_shows_steps_and_verbose_after_the_command(tmp_path, capsys):
    assert main(["convert", "mlp", "-o", str(tmp_path / "o.pt2"), "-v", *DEV]) == 0
    err = capsys.readouterr().err
    assert "accelc: loading mlp" in err and "accelc: capturing" in err and f"accelc: writing {tmp_path}" in err


def test_report_progress_follows_the_logger(tmp_path, capsys):
    assert main(["report", "mlp", "-o", str(tmp_path / "r"), "--batch-size", "2", "--no-ort", "--format", "json",
                 "--rep-ms", "1", *DEV]) == 0
    assert "accelc report: 1/5 " in capsys.readouterr().err
    model = accelc.models.get("mlp").to(DEVICE)
    accelc.report(model, model.example_inputs(batch_size=2), with_ort=False, rep_ms=1)
    assert "accelc report" not in capsys.readouterr().err     # the API: silent unless logging is on


def test_cli_steps_shown_after_the_library_was_asked_quietly(tmp_path, capsys):
    """logging caches "INFO is off" per logger; the CLI's level change must clear that cache."""
    assert not logging.getLogger("accelc").isEnabledFor(logging.INFO)    # cached as off
    assert main(["convert", "mlp", "-o", str(tmp_path / "o.pt2"), *DEV]) == 0
    assert "accelc: loading mlp" in capsys.readouterr().err


def test_an_hf_program_reads_back_in_a_process_without_transformers_imported(tmp_path):
    """Its outputs' pytree types register when their package is imported: read_export imports it
    and reads again, without torch's logged traceback."""
    T = pytest.importorskip("transformers")
    bert = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    vocab_size=100)).eval()
    path = tmp_path / "bert.pt2"
    torch.export.save(torch.export.export(bert, (), {"input_ids": torch.randint(0, 100, (2, 8))}, strict=False), path)
    code = ("import sys; from pathlib import Path; from accelc.serialize import read_export; "
            f"ep = read_export(Path({str(path)!r})); "
            "print(type(ep).__name__, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["ExportedProgram", "True"], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "deserializing" not in done.stderr


def test_load_of_a_folder_names_the_files_in_it(tmp_path):
    with pytest.raises(ModelFileError, match="is a folder: give the program file .* holds no .pt2 file"):
        accelc.load(tmp_path)
    (tmp_path / "model.pt2").write_bytes(b"")
    with pytest.raises(ModelFileError, match=r"is a folder: .*\(here: model.pt2\)"):
        accelc.load(tmp_path)


def test_a_saved_program_with_changed_weight_bytes_is_refused_at_load(tmp_path):
    """accelc's files carry their weights' CRC-32, which accelc.load verifies (the archive reader
    checks none: a flipped byte in a weight loaded and ran without a word)."""
    torch.manual_seed(0)
    model = Fc().to(DEVICE).eval()
    path = tmp_path / "m.pt2"
    accelc.save(accelc.optimize(model, torch.randn(4, 16, device=DEVICE), CFG), path)
    assert accelc.load(path) is not None                      # as written: reads back
    data = bytearray(path.read_bytes())
    weight = model.fc.weight.detach().cpu().contiguous().numpy().tobytes()
    at = data.find(weight)
    assert at > 0, "the weight's bytes as stored in the archive"
    data[at + len(weight) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="do not match the checksum"):
        accelc.load(path)


@pytest.mark.parametrize("argv, said", [
    (["optimize", "mlp", "--batch-size", "-3"], "argument --batch-size: must be above 0, not -3"),
    (["report", "mlp", "-o", "{tmp}/r", "--batch-size", "0"], "argument --batch-size: must be above 0, not 0"),
    (["report", "mlp", "-o", "{tmp}/r", "--rep-ms", "0"], "argument --rep-ms: must be above 0, not 0"),
    (["report", "mlp", "-o", "{tmp}/r", "--rep-ms", "nan"], "argument --rep-ms: must be above 0, not nan"),
    (["report", "mlp", "-o", "{tmp}/r", "--rep-ms", "fast"], "argument --rep-ms: 'fast' is not a number"),
])
def test_cli_numbers_out_of_range_are_usage_errors(tmp_path, capsys, argv, said):
    """A negative batch size reached torch.randn's "negative dimension"; a zero, negative or NaN
    --rep-ms was taken and the report timed nothing for its budget."""
    with pytest.raises(SystemExit) as e:
        main([a.format(tmp=tmp_path) for a in argv])
    assert e.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, said", [
    (["report", "mlp", "-o", ""], "the output folder name is empty"),
    (["convert", "mlp", "-o", ""], "the output file name is empty: give a file name ending in .pt2"),
    (["convert", "mlp", "-o", "{tmp}/o.pt2", "--input-shape", ""], "input shape '': expected positive sizes"),
    (["optimize", "mlp", "--dynamic", "features:-1=1..4"], "dynamic['features'] names dim -1: dims are counted from 0"),
    (["report", "mlp", "-o", "{tmp}/r", "--input-shape", "3x3", "--no-ort"],
     "the model's forward failed on inputs of shape 3x3: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
])
def test_cli_empty_names_and_values_are_one_line_naming_them(tmp_path, capsys, monkeypatch, argv, said):
    """`report -o ""` wrote its four files into the working folder; `--input-shape ""` was taken as
    no shape; a negative dim was blamed on its range; a report whose model fails on the inputs
    raised the model's error from inside capture, without the shapes."""
    monkeypatch.chdir(tmp_path)
    assert main([a.format(tmp=tmp_path) for a in argv] + DEV) == 1
    (line,) = _error_lines(capsys)
    assert line.startswith(f"accelc: error: {said}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_report_rep_ms_is_checked_before_optimizing():
    with pytest.raises(ValueError, match="rep_ms is the timing budget per measurement in ms: a number above 0"):
        accelc.report(Fc(), torch.randn(2, 16), rep_ms=float("nan"))


_TUNE_SCRIPT = """
import json, sys, warnings, torch, accelc
torch.manual_seed(0)
model = accelc.models.get("mlp").cuda().half()
(x,) = model.example_inputs(64)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=False, cuda_graphs=False))
    with torch.no_grad():
        y = opt(x).float()
print(json.dumps({"warnings": [str(w.message) for w in seen if "tuning-cache" in str(w.message)],
                  "out": y.sum().item(), "rewritten": sum(r.status == "rewritten" for r in opt.layers)}))
"""


@pytest.mark.skipif(DEVICE.type != "cuda", reason="tuning runs on the GPU only (the interpreter takes fixed configs)")
@pytest.mark.parametrize("damage", ["entry", "torn"])
def test_a_damaged_tuning_cache_on_the_gpu_is_tuned_again_with_one_warning_per_file(tmp_path, damage):
    """Real kernels, real timing, fresh processes: a cache another version or a crash left (an entry
    of the wrong shape, a torn file) is no TypeError: each such file is named once, tuned again and
    rewritten valid; the results are the undamaged run's."""
    import json as _json

    env = {**__import__("os").environ, "ACCELC_CACHE_DIR": str(tmp_path), "ACCELC_AUTOTUNE": "1"}

    def run():
        done = subprocess.run([sys.executable, "-c", _TUNE_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return _json.loads(done.stdout.strip().splitlines()[-1])

    first = run()
    files = sorted((tmp_path / "tuning").glob("*.json"))
    assert files and first["warnings"] == [] and first["rewritten"] > 0
    for f in files:
        f.write_text(_json.dumps({**_json.loads(f.read_text()), "timings_us": [1, 2]}) if damage == "entry"
                     else f.read_text()[:20])
    second = run()
    assert len(second["warnings"]) == len(files) and all(any(f.name in w for w in second["warnings"]) for f in files)
    assert second["out"] == first["out"] and second["rewritten"] == first["rewritten"]
    for f in files:
        assert isinstance(_json.loads(f.read_text())["timings_us"][0][0], dict)     # rewritten whole
    assert run()["warnings"] == []


def test_batch_size_for_a_model_without_its_own_inputs_is_one_line(tmp_path, capsys):
    """--batch-size sets a built-in model's example batch: given for a saved module that has no example inputs
    of its own to size, it is refused naming the flags to use instead (it was silently ignored)."""
    path = tmp_path / "net.pt"
    torch.save(nn.Linear(4, 4), path)
    for argv in (["optimize", str(path), "--batch-size", "2"], ["convert", str(path), "-o", str(tmp_path / "o.pt2"),
                                                                 "--batch-size", "2"]):
        assert main([*argv, *DEV]) == 1
        (line,) = _error_lines(capsys)
        assert "--batch-size sets a built-in model's example batch" in line and "--input-shape" in line, line
    assert not (tmp_path / "o.pt2").exists()


def test_the_weights_checksum_is_the_crc_of_the_bytes_as_stored():
    """serialize.weights_checksum reads each tensor's bytes in place (no copy of the weights): the CRC-32 over the
    names and bytes as before, for every dtype and layout a program holds, so files written before still load."""
    import types
    import zlib

    from accelc.serialize import weights_checksum
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(8, 4, generator=g).half(), "b": torch.randn(3, 5, generator=g).t(),
             "c": torch.randn(6, generator=g).bfloat16(), "d": torch.tensor(3)}
    crc = 0
    for name in sorted(state):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(state[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    ep = types.SimpleNamespace(state_dict=state, constants={})
    assert weights_checksum(ep) == {"crc32": crc, "tensors": 4}


def test_convert_refuses_its_own_program_and_overwriting_its_input(tmp_path, monkeypatch, capsys):
    """A program accelc wrote converted again reported 0 layers rewritten (its ops are no layers of a model), and
    -o naming the input overwrote the model being read."""
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "mlp", "-o", "m.pt2", *DEV]) == 0
    before = (tmp_path / "m.pt2").read_bytes()
    capsys.readouterr()
    assert main(["convert", "m.pt2", "-o", "again.pt2", *DEV]) == 1
    assert "'m.pt2' already runs accelc's kernels" in capsys.readouterr().err and not (tmp_path / "again.pt2").exists()
    assert main(["convert", "m.pt2", "-o", "./m.pt2", *DEV]) == 1
    assert "is the model file being converted" in capsys.readouterr().err
    assert (tmp_path / "m.pt2").read_bytes() == before
