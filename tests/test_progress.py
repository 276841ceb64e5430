"""optimize's progress (accelc.progress): its phases and the guard's layer i of N, shown when asked or
in an interactive session, silent in an application; a bar on a terminal, plain lines elsewhere."""
import io

import pytest

import accelc
from accelc import progress
from conftest import DEVICE


def _mlp():
    model = accelc.models.get("mlp").to(DEVICE)
    return model, model.example_inputs(4)


def test_asked_for_it_shows_each_phase_and_the_time(capfd):
    model, inputs = _mlp()
    capfd.readouterr()
    accelc.optimize(model, inputs, progress=True)
    err = capfd.readouterr().err
    for line in ("accelc: capturing ProcessMLP", "accelc: rewriting (passes)",
                 "accelc: checking each layer against PyTorch", "accelc: checking the layers on a second draw"):
        assert line in err, err
    assert "(4 layers)" in err and "accelc: done in " in err


def test_silent_by_default_outside_an_interactive_session(capfd, monkeypatch):
    model, inputs = _mlp()
    capfd.readouterr()
    accelc.optimize(model, inputs)
    assert "accelc: capturing" not in capfd.readouterr().err
    monkeypatch.setattr("sys.ps1", ">>> ", raising=False)       # a Python prompt: shown by default
    assert progress.wanted(None) and not progress.wanted(False)


def test_a_terminal_gets_a_bar_with_layer_i_of_n(monkeypatch):
    pytest.importorskip("tqdm")

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    out = Terminal()
    bar = progress.Bar("accelc", stream=out)
    bar.phase("checking each layer", 3)
    for name in ("fc1", "fc2", "head"):
        bar.step(name)
    bar.write("a log line above the bar")
    bar.close()
    text = out.getvalue()
    assert "accelc: checking each layer 3/3" in text and "head" in text and "a log line above the bar" in text
    assert "accelc: done in" in text


def test_the_generation_steps_phases_go_on_the_lms_bar():
    """A nested optimize (an LM's step program) names its phases on the outer bar, opens no bar of its own."""
    out = io.StringIO()
    with progress.showing("accelc", True) as outer:
        outer.stream = out
        with progress.showing("accelc", False, part="generation step: ") as inner:
            assert inner is outer
            progress.phase("capturing CacheStep")
    assert "accelc: generation step: capturing CacheStep" in out.getvalue()


def test_cli_report_shows_the_layers_it_times(tmp_path, capsys):
    from accelc.cli import main

    assert main(["report", "mlp", "-o", str(tmp_path / "r"), "--batch-size", "2", "--no-ort", "--format", "json",
                 "--rep-ms", "1", "--device", DEVICE.type]) == 0
    err = capsys.readouterr().err
    assert "accelc report: 1/5 " in err and "accelc report: 5/5 whole model" in err


def test_the_summary_says_how_long_optimize_took_and_where_the_time_went(monkeypatch):
    """The summary's time line: optimize's wall time to its return, then its phases in the order they run (those
    measured inside another beside it, not counted twice: the guard's other inputs, the capture's parts) and the
    rest no phase measured; a module whose info holds no phases (made outside optimize) has no such line."""
    from accelc.records import OptimizeInfo, time_line
    monkeypatch.setenv("ACCELC_REUSE", "0")
    model, inputs = _mlp()
    opt = accelc.optimize(model, inputs)
    line = next(x for x in opt.summary().splitlines() if x.startswith("time: "))
    seconds = opt.info.seconds
    assert opt.info.optimize_s > 0 and line.startswith(f"time: optimize {opt.info.optimize_s:.1f} s: capture ")
    for phase in ("capture", "passes", "guard (kernel tuning included)", "the optimized model's check"):
        assert f"{phase} {seconds[phase]:.1f}" in line, line      # (the last: it was a fifth of "the rest")
    assert line.index("capture") < line.index("passes") < line.index("guard") < line.index("the optimized model's")
    assert f"(of it: other inputs {seconds['guard: other inputs']:.1f}" in line
    assert f"capture {seconds['capture']:.1f} (of it: the model's call " in line and "tracing and its checks" in line
    top = sum(v for k, v in seconds.items() if k not in ("guard: other inputs", "timing layers")
              and not k.startswith("capture: "))
    assert top <= opt.info.optimize_s + 0.05
    info = OptimizeInfo("symbolic_trace", "cpu", seconds={"passes": 0.3, "guard (kernel tuning included)": 1.0,
                                                           "timing layers": 0.5, "capture": 0.5}, optimize_s=2.0)
    assert time_line(info) == ("time: optimize 2.0 s: capture 0.5, passes 0.3, guard (kernel tuning included) 1.0 "
                               "(of it: timing layers 0.5), the rest 0.2")
    assert time_line(OptimizeInfo("symbolic_trace", "cpu")) == ""


def test_a_report_from_python_shows_its_phases_when_asked(capsys):
    """accelc.report(...) ran for minutes with nothing on the screen, progress=True or not; quiet outside an
    interactive session unless asked, as optimize."""
    import torch

    import accelc
    from conftest import DEVICE
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()).to(DEVICE).eval()
    x = torch.randn(2, 16, device=DEVICE)
    accelc.report(m, (x,), with_ort=False, with_compile=False, rep_ms=1, progress=True)
    said = capsys.readouterr().err
    assert "accelc: capturing" in said and "accelc: timing every layer" in said and "accelc: done in" in said, said
    accelc.report(m, (x,), with_ort=False, with_compile=False, rep_ms=1, progress=False)
    assert "accelc:" not in capsys.readouterr().err
