"""The environment accelc runs in: which Triton / numpy pairs the CPU interpreter can take, and what a
user is told when it cannot."""
import numpy
import pytest
import torch
import triton
from torch import nn

import accelc
from accelc import runtime


@pytest.mark.parametrize("triton_version,numpy_version,broken", [
    ("3.6.0", "2.4.0", True), ("3.4.0", "2.5.1", True),
    ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.6", False), ("3.9.0", "2.4.6", False), ("3.10.0+git1", "2.4.6", False),
])
def test_interpreter_problem_names_the_versions(monkeypatch, triton_version, numpy_version, broken):
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    problem = runtime.interpreter_problem()
    assert (problem is not None) == broken
    if broken:
        assert triton_version in problem and numpy_version in problem and "triton>=3.7" in problem


@pytest.mark.skipif(not runtime.interpreted(), reason="the interpreter's environment (a GPU runs compiled kernels)")
def test_this_environment_runs_the_interpreter():
    # what the README's install resolves must be a pair the interpreter takes (the bound in pyproject)
    assert runtime.interpreter_problem() is None


@pytest.mark.skipif(not runtime.interpreted(), reason="the interpreter's failure mode")
def test_a_broken_interpreter_keeps_layers_in_pytorch_and_says_why(monkeypatch):
    monkeypatch.setattr(runtime, "interpreter_problem", lambda: "Triton 0.0's CPU interpreter cannot run with numpy 9.9")

    def fail(*args, **kwargs):
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    from accelc.kernels import gemm
    monkeypatch.setattr(gemm, "linear_launch", fail)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    opt = accelc.optimize(model, (x,))
    assert opt.layers and all(r.status == "reverted" for r in opt.layers)
    assert all("cannot run with numpy 9.9" in r.reason for r in opt.layers)
    torch.testing.assert_close(opt(x), model(x))


@pytest.mark.skipif(not runtime.interpreted(), reason="the interpreter's failure mode")
def test_triton_imported_before_accelc_is_named():
    """On a machine without a GPU, triton imported before accelc made its own library functions for
    the compiler: the interpreter then cannot run a kernel. Said in each layer's reason, not a
    riddle from inside Triton."""
    import subprocess
    import sys

    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "import triton, torch, accelc\nfrom torch import nn\n"
            "m = nn.Sequential(nn.Linear(16, 32), nn.ReLU()).eval()\n"
            "opt = accelc.optimize(m, torch.randn(4, 16))\n"
            "print(opt.layers[0].status, '|', opt.layers[0].reason)")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "reverted | kernel failed: triton was imported before accelc" in done.stdout, done.stdout + done.stderr


def test_accelc_imports_and_optimizes_without_transformers():
    """transformers is not a dependency (timm's models and users' own run without it): `import accelc`
    and optimize of a plain model work in a process where it cannot be imported. (The static KV cache's
    top-level import of it once made `import accelc` fail there.)"""
    import subprocess
    import sys

    code = ("import sys; sys.modules['transformers'] = None\n"      # import transformers now raises
            "import torch, accelc\nfrom torch import nn\n"
            "m = nn.Sequential(nn.Linear(16, 32), nn.ReLU()).eval()\n"
            "x = torch.randn(4, 16)\n"
            "opt = accelc.optimize(m, x)\n"
            "print(opt.layers[0].status, torch.allclose(opt(x), m(x), atol=1e-5))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-1] == "True", done.stdout + done.stderr[-3000:]
