"""The `accelc` command line (accelc/cli.py)."""
import subprocess
import sys

import pytest

from accelc.cli import main


def test_optimize_builtin_model_prints_summary(capsys):
    assert main(["optimize", "mlp", "--batch-size", "8", "--keep-slower"]) == 0   # no speed verdict: same on any device
    out = capsys.readouterr().out
    assert "4 layer(s) rewritten, 0 reverted" in out and "accelc::linear[relu]" in out


def test_list_models(capsys):
    assert main(["list-models"]) == 0
    out = capsys.readouterr().out
    assert "mlp" in out and "transformer_mlp" in out


def test_unknown_model_is_one_clear_line(capsys):
    assert main(["optimize", "nosuchmodel"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("accelc: error: no such file or built-in model: 'nosuchmodel'") and "mlp" in err
    assert "package.module:name" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_installed_entry_point_and_version():
    out = subprocess.run([sys.executable, "-m", "accelc", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("accelc ")


def test_runtime_flags(capsys):
    assert main(["optimize", "mlp", "--batch-size", "4", "--glue", "eager", "--no-cuda-graphs", "--keep-slower"]) == 0
    assert "runtime: eager glue, direct kernel launches, plain calls" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["optimize", "mlp", "--glue", "xla"])   # argparse: one line naming the choices
    assert e.value.code == 2 and "invalid choice: 'xla'" in capsys.readouterr().err


def test_batch_size_zero_is_one_clear_line(capsys):
    with pytest.raises(SystemExit) as e:     # a usage error, said before any work
        main(["optimize", "mlp", "--batch-size", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --batch-size: must be above 0, not 0" in err and "Traceback" not in err


@pytest.mark.parametrize("name", __import__("accelc").models.names())
def test_optimize_and_convert_on_every_builtin_model(name, tmp_path, capsys, monkeypatch):
    """`accelc optimize` and `accelc convert` on each built-in model, the program read back and called
    (`accelc report` on each: tests/test_report.py); convert, a second optimize of the same model, reuses the
    first one's verdicts (accelc.reuse, on as for a user) and its exported graph (accelc.capture.stored), and says
    so."""
    import torch

    import accelc
    from conftest import DEVICE, rel_l2

    monkeypatch.setenv("ACCELC_REUSE", "1")
    monkeypatch.setenv("ACCELC_CACHE_DIR", str(tmp_path / "cache"))
    dev = ["--device", DEVICE.type]
    assert main(["optimize", name, "--batch-size", "1", *dev]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "layer(s) rewritten" in said and "verdicts of an identical optimize" not in said
    out = tmp_path / f"{name}.pt2"
    assert main(["convert", name, "-o", str(out), "--batch-size", "1", *dev]) == 0, capsys.readouterr().err
    again = capsys.readouterr().out
    assert "verdicts of an identical optimize" in again
    # the graph torch.export made the first time, read back (accelc.capture.stored); a traced one traced again
    assert ("capture: torch.export, the graph an earlier optimize kept" in again) == ("capture: torch.export" in said)
    model = accelc.models.get(name).to(DEVICE)
    inputs = model.example_inputs(batch_size=2)      # the program takes other batches than its example's
    with torch.no_grad():
        got, want = accelc.load(out)(*inputs), model(*inputs)
    assert rel_l2(got, want) < 1e-4


_OWN = """import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build():
    return Net()


net = Net()
"""


@pytest.mark.parametrize("model", ["ownmodels:build", "ownmodels:Net", "ownmodels:net", "net.pt"])
def test_optimize_takes_ones_own_model_by_module_name_or_file(model, tmp_path, monkeypatch, capsys):
    """`accelc optimize` on a user's model: package.module:name (a builder, a class, an instance) imported
    from the current folder, or a torch.save'd module whose class lives there; inputs by --input-shape."""
    import torch

    from conftest import DEVICE

    (tmp_path / "ownmodels.py").write_text(_OWN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    if model == "net.pt":
        sys.path.insert(0, str(tmp_path))
        import ownmodels
        torch.save(ownmodels.Net(), tmp_path / "net.pt")
        sys.path.remove(str(tmp_path))
        sys.modules.pop("ownmodels")        # a new process: its class found through the current folder
    monkeypatch.delitem(sys.modules, "ownmodels", raising=False)
    assert main(["optimize", model, "--input-shape", "4x32", "--device", DEVICE.type]) == 0, capsys.readouterr().err
    assert "2 layer(s) rewritten" in capsys.readouterr().out


def test_ones_own_model_that_cannot_be_had_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "ownmodels.py").write_text(_OWN + "\ndef needs(width):\n    return Net()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "ownmodels", raising=False)
    for model, said in (("nosuchpackage.models:net", "cannot import nosuchpackage.models"),
                        ("ownmodels:missing", "ownmodels has no 'missing'"),
                        ("ownmodels:needs", "needs arguments to build the model"),
                        ("ownmodels:torch", "is a module, not an nn.Module"),
                        ("ownmodels:net", "carries no example inputs: give --input-shape")):
        assert main(["optimize", model]) == 1
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, (model, err)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the flags act on a GPU")
def test_gpu_only_flags_on_a_cpu_are_said(capsys):
    assert main(["optimize", "mlp", "--batch-size", "2", "--no-cuda-graphs", "--keep-slower"]) == 0
    err = capsys.readouterr().err
    assert "accelc: --no-cuda-graphs changes nothing on a CPU" in err and "accelc: --keep-slower changes nothing" in err


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["optimize", "--help"], ["report", "-h"]])
def test_help_and_version_answer_without_importing_torch(argv):
    """`accelc --version` / `--help` as the console script runs them (argv[0] `accelc`): the parser alone,
    torch and the kernels not imported (they took 1.5 s idle, 6-12 s on a busy machine)."""
    import time

    code = ("import sys, time; sys.argv = ['/somewhere/bin/accelc'] + %r; t0 = time.perf_counter()\n"
            "from accelc.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            "print('RESULT', code, 'torch' in sys.modules, round(time.perf_counter() - t0, 3))") % argv
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, out.stderr
    _, code_, torch_imported, seconds = lines[0].split()
    assert code_ in ("0", "None") and torch_imported == "False", (out.stdout, out.stderr)
    assert float(seconds) < 1.0, f"{argv}: {seconds} s in main (process {time.perf_counter() - t0:.1f} s)"
    assert ("accelc " in out.stdout) if argv == ["--version"] else ("usage: accelc" in out.stdout)


def test_the_formats_the_cli_checks_are_the_reports():
    from accelc import cli
    from accelc.report_rows import FORMATS

    assert cli._FORMATS == FORMATS


_LM = '''
import torch
import transformers as T


def tiny():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                            max_position_embeddings=64)).eval()
'''


def test_input_shape_gives_a_language_model_token_ids(tmp_path, monkeypatch, capsys):
    """--input-shape on a model that embeds token ids (the README's tensor-parallel line, a causal LM): ids below its
    vocabulary's size, not floats (which failed inside its embedding)."""
    pytest.importorskip("transformers")
    import torch

    from accelc.convert import random_inputs

    from conftest import DEVICE
    (tmp_path / "ownlms.py").write_text(_LM)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "ownlms", raising=False)
    assert main(["optimize", "ownlms:tiny", "--input-shape", "1x8", "--device", DEVICE.type]) == 0, \
        capsys.readouterr().err
    assert "layer(s) rewritten" in capsys.readouterr().out
    import ownlms
    (ids,) = random_inputs(ownlms.tiny(), [(2, 5)], DEVICE)
    assert ids.dtype == torch.long and ids.shape == (2, 5) and 0 <= ids.min() and ids.max() < 100
