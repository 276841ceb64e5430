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
    assert err.startswith("accelc: error: no built-in model 'nosuchmodel'") and "built-in models: " in err
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
def test_optimize_and_convert_on_every_builtin_model(name, tmp_path, capsys):
    """`accelc optimize` and `accelc convert` on each built-in model, the program read back and called
    (`accelc report` on each: tests/test_report.py)."""
    import torch

    import accelc
    from conftest import DEVICE, rel_l2

    dev = ["--device", DEVICE.type]
    assert main(["optimize", name, "--batch-size", "1", *dev]) == 0, capsys.readouterr().err
    assert "layer(s) rewritten" in capsys.readouterr().out
    out = tmp_path / f"{name}.pt2"
    assert main(["convert", name, "-o", str(out), *dev]) == 0, capsys.readouterr().err
    model = accelc.models.get(name).to(DEVICE)
    inputs = model.example_inputs()
    with torch.no_grad():
        got, want = accelc.load(out)(*inputs), model(*inputs)
    assert rel_l2(got, want) < 1e-4
