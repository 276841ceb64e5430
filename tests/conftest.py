import math
import os

import pytest
import torch

# on a GPU the guard would keep these tests' tiny layers in PyTorch (faster there): tests that are
# about that choice set OptimizeConfig(only_if_faster=True) themselves
os.environ.setdefault("ACCELC_ONLY_IF_FASTER", "0")
# every test's optimize judges its layers itself (one test's record would otherwise settle another's identical
# model, its logs and timings unseen): the tests of accelc.reuse turn it on with a cache folder of their own
os.environ.setdefault("ACCELC_REUSE", "0")

import accelc  # noqa: F401  (sets TRITON_INTERPRET=1 when there is no GPU, registers the ops)
from accelc.numerics import REL_L2_FLOOR, rel_l2  # noqa: F401  (rel_l2: the tests import it from here)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# LayerNorms are rewritten where the glue is eager: the default glue on a GPU is Inductor's, which
# keeps them to fuse with their neighbours (passes/norms.py)
NORMS_REWRITTEN = DEVICE.type != "cuda"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Floors for a kernel's relative L2 error against an fp64 reference: the project's table
# (accelc.numerics.REL_L2_FLOOR), with a kernel tested alone in fp32 held to a few fp32 roundings.
REL_FLOOR = {**REL_L2_FLOOR, torch.float32: 1e-6}


def count_calls(monkeypatch, owner, name: str) -> list:
    """owner.name wrapped (for the test) to append 1 to the returned list at each call, then run as it was."""
    calls = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


def padding_check_as_on_a_gpu(monkeypatch) -> None:
    """optimize's padding check (finish), which runs where the runner replays CUDA graphs (a GPU), made to run
    here: stages sees a plan with CUDA graphs; the runner itself plans as it does on this machine."""
    from accelc import runner, stages

    class Graphs:
        def __getattr__(self, name):
            return getattr(runner, name)

        @staticmethod
        def plan(*a):
            glue, _, how = runner.plan(*a)
            return glue, True, how

    monkeypatch.setattr(stages, "runner", Graphs())


class CausalLogits(torch.nn.Module):
    """A causal LM called on its ids alone, returning its logits without a cache: what tests optimize as a plain
    model (tests/test_fp8.py, tests/test_norm_linear.py)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(ids, use_cache=False).logits


def assert_close_to_ref(out, ref, eager, dtype, atol, rtol):
    """out / eager: the kernel's and eager PyTorch's results in `dtype`; ref: the same math in
    fp64. The kernel must be within (atol, rtol) of ref elementwise, and its relative L2 error
    at most 2x eager's own (or the dtype's floor)."""
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)
    err, eager_err = rel_l2(out, ref), rel_l2(eager, ref)
    assert err <= max(2 * eager_err, REL_FLOOR[dtype]), (err, eager_err)
    assert not math.isnan(err)


def forced_outputs(tuner, cfg, fn, repeats=2):
    """fn()'s outputs (a list, one per run) with the tuner's config cfg forced, or None where the tuner
    would not offer cfg for these sizes. Fails when the launcher never consulted the tuner (the call
    took another path, so cfg was not what ran)."""
    from accelc.tuning import NotACandidate

    try:
        with tuner.force(cfg):
            outs = [fn() for _ in range(repeats)]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            assert tuner.chosen, "the launcher did not consult the tuner"
    except NotACandidate:
        return None
    return outs


def pytest_terminal_summary(terminalreporter):
    """The skipped tests summed by reason at the end of a run (-q says only how many: most need a GPU)."""
    import collections

    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter()
    for report in skipped:
        text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[str(text).removeprefix("Skipped: ")] += 1
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for reason, n in reasons.most_common(10):
        terminalreporter.write_line(f"{n:5d}  {reason[:160]}")
    if len(reasons) > 10:
        terminalreporter.write_line(f"{sum(n for _, n in reasons.most_common()[10:]):5d}  ({len(reasons) - 10} other reasons)")


SM90_HEADER = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(ROOT, "bench"))
from gluon_compile import Sm90Driver
from triton.runtime import driver
driver.set_active(Sm90Driver())
"""


def run_for_sm90(script: str) -> str:
    """stdout of `script` run in a process without the interpreter whose Triton compiles for sm90 through
    bench/gluon_compile.py's stand-in driver (nothing launches: what a kernel compiles to, read without a GPU);
    ROOT (the repository) defined for it. The process's failure fails the test with its stderr."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", f"ROOT = {root!r}\n" + SM90_HEADER + script], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def times_as_on_a_gpu(monkeypatch, *modules) -> None:
    """Each module's `runtime` (accelc.runtime as it imported it) says the device can be timed (can_time), there
    alone: the module takes its GPU branch on this machine."""
    import types

    from accelc import runtime

    shim = types.SimpleNamespace(**{k: getattr(runtime, k) for k in dir(runtime) if not k.startswith("__")})
    shim.can_time = lambda device: True
    for module in modules:
        monkeypatch.setattr(module, "runtime", shim)


def warmup_takes_the_gpu_branch(monkeypatch) -> None:
    """optimize's warm-up stage (accelc.warmup) takes the GPU's branch on this machine: runtime.can_time true
    there alone, the CUDA graph captures (OptimizedModule.warm_up) skipped; the caller records what it needs."""
    from accelc import warmup
    from accelc.optimized import OptimizedModule

    times_as_on_a_gpu(monkeypatch, warmup)
    monkeypatch.setattr(OptimizedModule, "warm_up", lambda self, inputs: None)
