"""bench/spy_summary.py: py-spy's raw stacks of an optimize summed for its main thread (seconds at the sampling
rate): accelc's frames as a tree, the last accelc frame and its callee without the waits, what runs under a frame."""
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import spy_summary  # noqa: E402

MAIN = "thread (1): MainThread;<module> (x.py:1);optimize (accelc/api.py:79);optimize_job (accelc/api.py:166)"
STACKS = [
    (MAIN + ";capture (accelc/capture/trace.py:83);export (torch/export/__init__.py:1)", 80),
    (MAIN + ";check_layers (accelc/guard.py:251);compile_jobs (accelc/compile_workers.py:283);"
            "Thread.join (threading.py:1);Thread._wait_for_tstate_lock (threading.py:2)", 120),
    (MAIN + ";check_layers (accelc/guard.py:255);reference (accelc/layer_check.py:23);deepcopy (copy.py:1)", 40),
    ("thread (2): Thread-1 (_feed);_feed (accelc/compile_workers.py:388)", 400),      # not the main thread
    ("thread (1): MainThread;<module> (x.py:1);import_module (y.py:1)", 400),          # not inside optimize
]


def _profile(tmp_path) -> str:
    path = tmp_path / "cold.txt.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(f"{s} {n}\n" for s, n in STACKS)
    return str(path)


def test_the_tree_sums_the_main_threads_samples_inside_optimize(tmp_path, capsys):
    spy_summary.tree(_profile(tmp_path), depth=3, least=0.0, rate=40)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "6.00s optimize (accelc/api.py:79)"
    assert "    2.00s capture (accelc/capture/trace.py:83)" in out
    assert "    3.00s check_layers (accelc/guard.py:251)" in out and "    1.00s check_layers (accelc/guard.py:255)" in out


def test_last_leaves_the_waits_out_and_names_the_callee(tmp_path, capsys):
    spy_summary.last(_profile(tmp_path), top=5, rate=40)
    out = capsys.readouterr().out
    assert "3.00 s not waiting" in out
    assert "2.00 capture (accelc/capture/trace.py:83) -> export" in out
    assert "1.00 reference (accelc/layer_check.py:23) -> deepcopy" in out and "compile_jobs" not in out


def test_under_a_frame(tmp_path, capsys):
    spy_summary.under(_profile(tmp_path), "check_layers (accelc/guard.py", depth=1, rate=40)
    out = capsys.readouterr().out
    assert "4.00 s under check_layers" in out and "3.00 compile_jobs" in out and "1.00 reference" in out


def test_under_one_call_site_named_with_its_line(tmp_path, capsys):
    """A frame named as `tree` prints it, with its line, is that call site alone (the name without the line: every
    call of that function)."""
    spy_summary.under(_profile(tmp_path), "check_layers (accelc/guard.py:251)", depth=1, rate=40)
    out = capsys.readouterr().out
    assert "3.00 s under check_layers (accelc/guard.py:251)" in out and "3.00 compile_jobs" in out
    assert "reference" not in out
