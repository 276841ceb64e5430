"""The catalogue of ordinary model code and bad inputs a user brings: each either behaves as eager
does or is refused in one line naming the real cause and what to do. (Older cases live beside
the feature they test: matmul spellings and weight views in test_guard.py, channels-last views in
test_conv_gemm.py, bad model files in test_convert.py's BAD table, buffers and input mutation in
test_state.py.)"""
import logging
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc.cli import main
from accelc.errors import CaptureError, InputError, ModelFileError
from conftest import DEVICE, rel_l2

DEV = ["--device", DEVICE.type]
CFG = accelc.OptimizeConfig(only_if_faster=False)


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


def _error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("accelc: error")]


class _Fc(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x)


# --- gradients: an inference compiler says so, once, in its own words ----------------------------

class _InplaceAfterLinear(_Fc):
    def forward(self, x):
        y = self.fc(x)
        y.relu_()
        return y


def test_in_place_op_on_a_rewritten_output_with_grad_enabled():
    model = _InplaceAfterLinear().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert torch.is_grad_enabled()
    assert rel_l2(opt(x), model(x).detach()) < 1e-5


def test_an_input_that_requires_grad_is_refused_in_one_sentence():
    opt = accelc.optimize(_Fc().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    with pytest.raises(InputError, match="for inference and computes no gradients.*torch.no_grad"):
        opt(x)
    with torch.no_grad():       # the same input is fine where no gradient is asked for
        assert opt(x).shape == (4, 16)
    assert opt(x.detach()).shape == (4, 16)


# --- fused residuals broadcast as eager's add does -------------------------------------------------

class _Residual(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.r = nn.Parameter(torch.randn(*shape))

    def forward(self, x):
        return F.relu(self.fc(x) + self.r)


@pytest.mark.parametrize("x_shape,r_shape", [((4, 16), (1, 16)), ((4, 16), (16,)), ((2, 3, 16), (3, 16)),
                                             ((2, 3, 16), (2, 1, 16)), ((2, 3, 16), (3, 1))])
def test_residual_add_broadcasts_as_eager(x_shape, r_shape):
    model = _Residual(r_shape).to(DEVICE).eval()
    x = torch.randn(*x_shape, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert [r.kind for r in opt.rewritten] == ["linear"], opt.summary()
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


# --- capture failures name the real cause -----------------------------------------------------------

class _AlwaysDropout(_Fc):
    def forward(self, x):
        return F.dropout(self.fc(x), 0.5, training=True)


class _Branch(_Fc):
    def forward(self, x):
        y = self.fc(x)
        return y * 2 if y.sum() > 0 else y


def test_a_capture_failure_quotes_the_models_own_line():
    """Where the tracers fail, each failure names the line of the model's code it failed on (the
    deepest frame outside torch and accelc): here the branch on a tensor's value."""
    import inspect
    with pytest.raises(CaptureError) as e:
        accelc.optimize(_Branch().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    line = inspect.getsourcelines(_Branch.forward)[1] + 2
    where = f"(at {inspect.getsourcefile(_Branch)}:{line} in forward: `return y * 2 if y.sum() > 0 else y`)"
    failures = [ln for ln in str(e.value).splitlines() if ln.lstrip().startswith(("symbolic_trace:", "torch.export:"))]
    assert len(failures) == 2 and all(ln.endswith(where) for ln in failures), e.value


def test_randomness_in_eval_mode_is_named_not_branches():
    with pytest.raises(CaptureError) as e:
        accelc.optimize(_AlwaysDropout().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    assert "random numbers" in str(e.value) and "self.training" in str(e.value)
    assert "Branches" not in str(e.value)


def test_a_cache_given_to_the_forward_is_named_not_randomness():
    """A decoder given HF's DynamicCache appends to it at every call: the capture failure names the
    cache and what to do, not randomness."""
    T = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = T.LlamaModel(T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                        vocab_size=100, max_position_embeddings=64)).to(DEVICE).eval()
    ids = torch.randint(0, 100, (2, 8), device=DEVICE)
    with pytest.raises(CaptureError) as e:
        accelc.optimize(lm, {"input_ids": ids, "past_key_values": T.DynamicCache(config=lm.config), "use_cache": True},
                        CFG)
    assert "appends to the DynamicCache it is given" in str(e.value) and "Branches" not in str(e.value)


class _UsesItsCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return self.fc(x) * self.n


def test_output_that_depends_on_a_buffer_updated_in_forward():
    model = _UsesItsCounter().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert model.n.item() == 0
    with torch.no_grad():
        for _ in range(3):
            assert rel_l2(opt(x), model(x)) < 1e-5


def test_cli_capture_failure_is_one_paragraph_without_torch_graph_dumps(tmp_path, capsys):
    torch.save(_Branch(), tmp_path / "branchy.pt")
    assert main(["convert", str(tmp_path / "branchy.pt"), "-o", str(tmp_path / "o.pt2"), "--input-shape", "4x16",
                 *DEV]) == 1
    err = capsys.readouterr().err
    assert "def forward" not in err and len(err.splitlines()) <= 10, err
    assert "symbolic_trace:" in err and "torch.export:" in err and "Branches on tensor values" in err
    assert "-v shows" in err and _files(tmp_path) == ["branchy.pt"]


# --- model files, example-input files and output paths ------------------------------------------------

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


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, scale=None):
        y = self.fc(x)
        return y if scale is None else y * scale


def test_export_program_with_keyword_inputs_converts_and_keeps_its_call(tmp_path, capsys):
    model = _Scaled().to(DEVICE).eval()
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
    model = _Scaled().to(DEVICE).eval()
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


# --- the optimized module itself ----------------------------------------------------------------------

def test_optional_argument_left_out_is_said_at_optimize_and_at_the_call():
    model = _Scaled().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert "fixed at their defaults (not inputs of the optimized model" in opt.summary()
    assert "scale=None" in opt.summary()
    with pytest.raises(InputError, match=r"takes 1 positional input\(s\) \(x\).*'scale' was left at its default"):
        opt(x, torch.randn(4, 8, device=DEVICE))
    with pytest.raises(InputError, match="'scale' was not in the example.*left at its default, None"):
        opt(x, scale=torch.randn(4, 8, device=DEVICE))


def test_optimizing_an_optimized_module_is_refused():
    opt = accelc.optimize(_Fc().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    assert not opt.training
    with pytest.raises(InputError, match="already accelc's optimized module"):
        accelc.optimize(opt, torch.randn(4, 16, device=DEVICE))


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


# --- logging: quiet in the library, steps in the CLI ---------------------------------------------------

def test_library_is_quiet_and_logs_its_steps_to_the_accelc_logger(capfd, caplog):
    model, x = _Fc().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE)
    capfd.readouterr()
    accelc.optimize(model, x, CFG)
    err = capfd.readouterr().err
    assert "capturing" not in err and "checking" not in err
    with caplog.at_level(logging.INFO, logger="accelc"):
        accelc.optimize(model, x, CFG)
    text = caplog.text
    assert "capturing _Fc" in text and "captured with symbolic_trace" in text and "1 layer(s) rewritten" in text


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


# --- the third round's cases (issue 31) ---------------------------------------------------------------

def test_torch_compile_of_the_optimized_module_with_grad_enabled():
    """Its weights need no gradient (its own copy): torch.compile traces no backward through
    accelc's ops; the caller's model keeps requires_grad."""
    model = _Fc().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert torch.is_grad_enabled() and not any(p.requires_grad for p in opt.parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert rel_l2(torch.compile(opt)(x), model(x).detach()) < 1e-5


def test_an_example_that_overflows_the_configs_dtype_is_refused_naming_the_cast():
    model = _Fc().to(DEVICE).eval()
    with pytest.raises(InputError, match=r"past torch.float16's range \(at most 65504\): cast by "
                                         r"OptimizeConfig\(dtype='float16'\) they become inf"):
        accelc.optimize(model, torch.full((2, 16), 1e30, device=DEVICE), accelc.OptimizeConfig(dtype="fp16"))


class _GlueNames(nn.Module):
    """Submodules whose attribute names are op names."""

    def __init__(self):
        super().__init__()
        self.cat = nn.ConvTranspose1d(8, 8, 3, padding=1)
        self.t = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        mask = x.new_ones(x.shape[0], 1, 1) > 0      # tracer artefacts: new_ones, gt
        return self.fc(self.cat(x).transpose(1, 2)) * mask, self.t(y)


def test_layers_named_like_ops_are_listed_and_their_flops_counted():
    opt = accelc.optimize(_GlueNames().to(DEVICE).eval(), (torch.randn(2, 8, 16, device=DEVICE),
                                                           torch.randn(2, 4, 5, 5, device=DEVICE)), CFG)
    kept = {r.name: r for r in opt.layers if r.status == "kept"}
    assert set(kept) == {"cat", "t"} and kept["cat"].kind == "ConvTranspose1d" and kept["t"].kind == "ConvTranspose2d"
    assert kept["cat"].flops == 2 * 2 * 8 * 16 * 8 * 3 and kept["t"].flops > 0
    assert 0 < opt.info.accelc_flops < opt.info.flops
    assert "coverage: 100.0%" not in opt.summary()


def test_positional_inputs_by_name_a_dict_given_positionally_and_none_for_a_tensor():
    model = _Fc().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    with torch.no_grad():
        assert torch.equal(opt(x=x), opt(x))                  # by its parameter name, as eager takes it
    with pytest.raises(InputError, match="'x' is given both by position and by name"):
        opt(x, x=x)
    T = pytest.importorskip("transformers")
    bert = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    vocab_size=100, max_position_embeddings=64)).to(DEVICE).eval()
    inputs = {"input_ids": torch.randint(0, 100, (2, 8), device=DEVICE),
              "attention_mask": torch.ones(2, 8, dtype=torch.long, device=DEVICE)}
    opt = accelc.optimize(bert, inputs, CFG)
    with pytest.raises(InputError, match=r"call it as opt\(\*\*inputs\), not opt\(inputs\)"):
        opt(inputs)
    with torch.no_grad():     # None, as BERT takes it: its own default (every token visible), found at capture
        assert torch.equal(opt(input_ids=inputs["input_ids"], attention_mask=None).last_hidden_state,
                           opt(**inputs).last_hidden_state)
    opt = accelc.optimize(_Shifted().to(DEVICE).eval(), (x,), CFG, example_kwargs={"shift": torch.ones_like(x)})
    with pytest.raises(InputError, match=r"shift=None: the model was optimized with a tensor there"):
        opt(x, shift=None)      # a float input: no default is taken for it


class _Shifted(_Fc):
    def forward(self, x, shift=None):
        return self.fc(x if shift is None else x + shift)


@pytest.mark.parametrize("example,match", [(None, "optimize\\(\\) needs example inputs"),
                                           ((), "optimize\\(\\) needs example inputs"),
                                           (3, "example_inputs is a int: give a tensor")])
def test_missing_or_odd_example_inputs_are_one_line(example, match):
    with pytest.raises(InputError, match=match):
        accelc.optimize(_Fc().eval(), example)


def test_float64_is_refused_at_double_in_one_line():
    opt = accelc.optimize(_Fc().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    for cast in (lambda m: m.double(), lambda m: m.to(torch.float64)):
        with pytest.raises(InputError, match="not float64"):
            cast(opt)
    assert all(p.dtype == torch.float32 for p in opt.parameters())


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_a_conv_with_another_padding_mode_says_why_it_is_kept(mode):
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, padding_mode=mode)).to(DEVICE).eval()
    x = torch.randn(2, 4, 8, 8, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    (layer,) = opt.layers
    assert layer.status == "kept" and f"padding_mode='{mode}'" in layer.reason, opt.summary()
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-6


class _Chatty(_Fc):
    calls = 0            # a class counter

    def forward(self, x):
        print("forward of", tuple(x.shape))
        type(self).calls += 1
        self.last_batch = x.shape[0]
        return self.fc(x)


def test_python_side_effects_in_forward_are_said_once_at_optimize(capsys):
    """print, a class counter, a plain attribute set in forward: they run while accelc captures
    the model, never in the optimized model's calls; one warning says so (the print still shows)."""
    model = _Chatty().to(DEVICE).eval()
    with pytest.warns(UserWarning, match=r"forward printed to stdout and changed (_Chatty\.calls, _Chatty\.last_batch|"
                                         r"_Chatty\.calls).* Python side effects run at capture") as seen:
        opt = accelc.optimize(model, torch.randn(3, 16, device=DEVICE), CFG)
    assert sum("side effects" in str(w.message) for w in seen) == 1
    assert "forward of (3, 16)" in capsys.readouterr().out
    with torch.no_grad():
        opt(torch.randn(3, 16, device=DEVICE))
    assert "forward of" not in capsys.readouterr().out
    with warnings.catch_warnings(record=True) as quiet:          # no side effect: no word
        warnings.simplefilter("always")
        accelc.optimize(_Fc().to(DEVICE).eval(), torch.randn(3, 16, device=DEVICE), CFG)
    assert not any("side effects" in str(w.message) for w in quiet)


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


def test_a_call_in_another_dtype_names_the_cast_to_make():
    """fp16-optimized, called with fp32 (and the sibling: .half() after optimize, called with the
    example's fp32): one line naming the input, both dtypes and the cast; eager's own dtype errors
    elsewhere stay as they are."""
    model = _Fc().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, accelc.OptimizeConfig(dtype="fp16", only_if_faster=False))
    with pytest.raises(InputError, match=r"input 0 is float32, and the model was optimized for float16 inputs .*"
                                         r"x.to\(torch.float16\)"):
        opt(x)
    with torch.no_grad():
        assert opt(x.half()).dtype == torch.float16
    opt32 = accelc.optimize(model, x, CFG).half()
    with pytest.raises(InputError, match="input 0 is float32, and the model was optimized for float16"):
        opt32(x)
    with torch.no_grad():
        assert rel_l2(opt32(x.half()).float(), model(x)) < 1e-2


class _AddInput(nn.Module):
    def __init__(self, conv=False):
        super().__init__()
        self.layer = nn.Conv2d(4, 8, 3, padding=1) if conv else nn.Linear(16, 16)

    def forward(self, x, r):
        return torch.relu(self.layer(x) + r)


@pytest.mark.parametrize("conv,x_shape,r_full,r_calls", [
    (False, (4, 16), (4, 16), [(1, 16), (16,)]),
    (True, (2, 4, 6, 6), (2, 8, 6, 6), [(1, 8, 6, 6), (8, 1, 1), (2, 8, 1, 6)])])
def test_a_residual_input_that_broadcasts_at_call_time_adds_as_eager(conv, x_shape, r_full, r_calls):
    """The epilogue fused a residual of the output's shape; a call whose residual broadcasts to it
    (eager's add takes that) gets eager's result, not the kernel's shape error."""
    model = _AddInput(conv).to(DEVICE).eval()
    x = torch.randn(*x_shape, device=DEVICE)
    opt = accelc.optimize(model, (x, torch.randn(*r_full, device=DEVICE)), CFG)
    assert any("residual" in (r.kernel or "") for r in opt.rewritten), opt.summary()
    with torch.no_grad():
        for shape in r_calls:
            r = torch.randn(*shape, device=DEVICE)
            assert rel_l2(opt(x, r), model(x, r)) < 1e-5, shape


class _Branchy(nn.Module):
    """A shape branch: symbolic_trace cannot take it, torch.export pins the batch to its side of 4."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) * 2 if x.shape[0] > 4 else self.fc(x) - 1


def test_a_module_captured_by_export_pickles_with_its_shape_checks_and_output_type():
    """pickle / torch.save of an optimized model torch.export captured (the shape checks are a function
    export generates with exec; the output an HF ModelOutput built with pytree): it reads back, takes
    the same calls, refuses the same shapes (a call on the other side of a shape branch must not run
    the traced side silently) and returns the same output type."""
    import io
    import pickle

    torch.manual_seed(0)
    model = _Branchy().to(DEVICE).eval()
    x = torch.randn(6, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert opt.info.capture_method == "torch.export"
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    for back in (pickle.loads(pickle.dumps(opt)), torch.load(buf, weights_only=False)):
        with torch.no_grad():
            assert rel_l2(back(x), model(x)) < 1e-5
            with pytest.raises(InputError, match="shape"):
                back(torch.randn(3, 16, device=DEVICE))          # the other branch: refused, as before pickling
    T = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, vocab_size=100, max_position_embeddings=64))
    bert = bert.to(DEVICE).eval()
    ids = torch.randint(0, 100, (2, 16), device=DEVICE)
    opt = accelc.optimize(bert, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, CFG)
    back = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(opt))))      # twice: a read-back pickles again
    call = {"input_ids": torch.randint(0, 100, (3, 9), device=DEVICE), "attention_mask": torch.ones(3, 9, dtype=torch.long,
                                                                                                    device=DEVICE)}
    with torch.no_grad():
        got, want = back(**call), bert(**call)
    assert type(got) is type(want) and rel_l2(got.last_hidden_state, want.last_hidden_state) < 1e-5
    with pytest.raises(InputError):
        back(input_ids=torch.randint(0, 100, (3, 65), device=DEVICE), attention_mask=torch.ones(3, 65, dtype=torch.long,
                                                                                                  device=DEVICE))


def test_the_shape_checks_of_an_export_captured_module_compile_under_dynamo():
    """torch.compile traces the program's shape checks (ShapeGuards' function): built without
    __builtins__ in its globals, every Inductor compile of the glue failed (KeyError: '__builtins__')
    and the glue ran uncompiled, a GPU decode step three times slower; before pickling and after."""
    import pickle

    torch.manual_seed(0)
    model = _Branchy().to(DEVICE).eval()
    x = torch.randn(6, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert opt.info.capture_method == "torch.export"
    back = pickle.loads(pickle.dumps(opt))
    for gm in (opt.graph_module, back.graph_module):
        torch._dynamo.reset()
        compiled = torch.compile(gm, backend="eager", fullgraph=True)
        with torch.no_grad():
            out = compiled(x)
            assert rel_l2(out[0] if isinstance(out, (tuple, list)) else out, model(x)) < 1e-5
    if DEVICE.type == "cuda":     # the default runtime compiles the glue with Inductor: it must not give up
        with torch.no_grad():
            opt(x), opt(x)
        assert "could not compile" not in opt.summary()


def test_a_module_captured_by_symbolic_trace_pickles_and_deep_copies():
    """Its graph's inputs carry type annotations (x: torch.Tensor), which fx's own pickling names by a
    global it cannot import; a deep copy keeps the graph and its node metadata."""
    import copy
    import pickle

    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs(4)
    opt = accelc.optimize(model, (x,), CFG)
    assert opt.info.capture_method == "symbolic_trace"
    with torch.no_grad():
        want = opt(x)
        back = pickle.loads(pickle.dumps(opt))
        # (the runtime line counts the graphs captured so far: a read-back module has none yet)
        same = [line for line in opt.summary().splitlines() if not line.lstrip().startswith("runtime:")]
        assert torch.equal(back(x), want)
        assert [line for line in back.summary().splitlines() if not line.lstrip().startswith("runtime:")] == same
        twin = copy.deepcopy(opt)
        assert torch.equal(twin(x), want)
    assert [n.meta.keys() for n in twin.graph_module.graph.nodes] == [n.meta.keys() for n in opt.graph_module.graph.nodes]


def test_a_shallow_copy_of_the_optimized_module_keeps_its_graph_module():
    """copy.copy goes through __getstate__ like pickle: it must not take the pickling stand-in for
    the graph module (it did, and the copy failed at its first call)."""
    import copy

    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs(4)
    opt = accelc.optimize(model, (x,), CFG)
    with torch.no_grad():
        want = opt(x)
        twin = copy.copy(opt)
        assert twin.graph_module is opt.graph_module and twin.runner is None and torch.equal(twin(x), want)


def test_a_program_accelc_load_read_pickles(tmp_path):
    """accelc.load's module pickles as its program (its module holds export's hooks, which do not)."""
    import pickle

    torch.manual_seed(0)
    model = _Fc().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    accelc.save(accelc.optimize(model, x, CFG), tmp_path / "m.pt2")
    back = pickle.loads(pickle.dumps(accelc.load(tmp_path / "m.pt2")))
    y = torch.randn(7, 16, device=DEVICE)
    with torch.no_grad():
        assert rel_l2(back(y), model(y)) < 1e-5
    assert back.accelc_summary is not None and next(back.program.parameters()).device.type == x.device.type


@pytest.mark.parametrize("batch, match", [
    (torch.randn(4, 12), r"calibration batch 1 \(4x12\): the model itself fails on it .*shaped like the example \(4x16\)"),
    (torch.randint(0, 5, (4, 16)), r"calibration batch 1 \(4x16\): the model itself fails on it"),
    ("x", r"calibration batch 1 \(str\): the model itself fails on it"),
    (torch.full((4, 16), float("nan")), r"calibration batch 1 \(4x16\) holds NaN or inf"),
    ((torch.randn(4, 16), torch.randn(4, 16)), r"calibration batch 1 holds 2 input\(s\)"),
])
def test_a_calibration_batch_the_model_cannot_take_is_one_line_naming_it(batch, match):
    """Checked before any pass (it was a PassError from inside the int8 pass, or NaN statistics
    accepted silently)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    batch = tuple(b.to(DEVICE) for b in batch) if isinstance(batch, tuple) else \
        batch.to(DEVICE) if isinstance(batch, torch.Tensor) else batch
    config = accelc.OptimizeConfig(only_if_faster=False, int8=accelc.Int8Config(static=True, skip_first_last=False))
    with pytest.raises(InputError, match=match):
        accelc.optimize(model, x, config, calibration=[torch.randn(4, 16, device=DEVICE), batch])


def test_onnx_export_of_the_optimized_module_records_each_accelc_op_as_its_reference(tmp_path):
    """ONNX has no accelc ops: torch.onnx.export of an optimized model records each one as its
    PyTorch reference (it failed deep in the exporter), and ONNX Runtime's result is eager's."""
    ort = pytest.importorskip("onnxruntime")
    T = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, vocab_size=100, max_position_embeddings=64))
    bert = bert.to(DEVICE).eval()
    ids = torch.randint(0, 100, (2, 16), device=DEVICE)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    # (eager glue: on a GPU the Inductor glue keeps the LayerNorms, and the test wants one rewritten)
    opt = accelc.optimize(bert, inputs, accelc.OptimizeConfig(only_if_faster=False, glue="eager"))
    assert {r.kernel.split("[")[0] for r in opt.rewritten} >= {"accelc::linear", "accelc::layer_norm"}, opt.summary()
    path = tmp_path / "bert.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(opt, (), str(path), kwargs=inputs, dynamo=True, verbose=False)
        want = bert(**inputs).last_hidden_state
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {i.name: inputs[i.name].cpu().numpy() for i in session.get_inputs()}
    got = torch.from_numpy(session.run(None, feed)[0])
    assert rel_l2(got, want.cpu()) < 1e-5


def test_a_saved_program_with_changed_weight_bytes_is_refused_at_load(tmp_path):
    """accelc's files carry their weights' CRC-32, which accelc.load verifies (the archive reader
    checks none: a flipped byte in a weight loaded and ran without a word)."""
    torch.manual_seed(0)
    model = _Fc().to(DEVICE).eval()
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


# --- the CLI's values, each refused before any work, in one line naming the flag ------------------

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
        accelc.report(_Fc(), torch.randn(2, 16), rep_ms=float("nan"))


def _tiny_bert():
    T = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           vocab_size=100, max_position_embeddings=64)
        return T.BertModel(cfg).to(DEVICE).eval()


def test_an_hf_model_with_its_glue_and_graphs_pickles_and_compiles_after_calls():
    """The default runtime (on the GPU: Inductor glue, a CUDA graph per shape bucket) after it has
    run: pickle / torch.save and torch.compile of the optimized HF model with grad enabled give
    eager's numbers and the HF output type; the read-back module runs through its own runtime."""
    import io
    import pickle

    torch.manual_seed(0)
    bert = _tiny_bert()
    ids = torch.randint(0, 100, (2, 16), device=DEVICE)
    opt = accelc.optimize(bert, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, CFG)
    calls = [{"input_ids": torch.randint(0, 100, (b, n), device=DEVICE),
              "attention_mask": torch.ones(b, n, dtype=torch.long, device=DEVICE)} for b, n in ((2, 16), (3, 9))]
    with torch.no_grad():
        want = [bert(**c).last_hidden_state for c in calls]
        got = [opt(**c).last_hidden_state for c in calls]
    assert all(rel_l2(g, w) < 1e-5 for g, w in zip(got, want))
    if DEVICE.type == "cuda":
        assert opt.runner is not None and opt.runner.cuda_graphs and "could not compile" not in opt.summary()
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    for back in (pickle.loads(pickle.dumps(opt)), torch.load(buf, weights_only=False)):
        with torch.no_grad():
            out = [back(**c) for c in calls]
        assert type(out[0]) is type(bert(**calls[0]))
        assert all(rel_l2(o.last_hidden_state, w) < 1e-5 for o, w in zip(out, want))
    assert torch.is_grad_enabled()
    compiled = torch.compile(opt)
    out = [compiled(**c).last_hidden_state for c in calls]
    assert all(rel_l2(o.detach(), w) < 1e-5 for o, w in zip(out, want))


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
