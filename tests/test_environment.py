"""The releases accelc is tested with, said at import when the installed ones are others (accelc.version)."""
import re
import subprocess
import sys
from pathlib import Path

from accelc.version import TESTED, environment_problems


def test_the_tested_releases_are_pyprojects_bounds():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    for name, (lo, hi) in TESTED.items():
        found = re.search(rf'"{name}>=(\d+)\.(\d+),<(\d+)\.(\d+)"', text)
        assert found, name
        assert (lo, hi) == ((int(found[1]), int(found[2])), (int(found[3]), int(found[4]))), name


def test_releases_outside_the_tested_ones_are_one_line_each():
    said = environment_problems({"torch": "2.14.1", "triton": "3.5.0", "torchvision": "0.29.0"})
    assert len(said) == 2 and "torch 2.11 to 2.13, not 2.14.1" in said[0] and "pip install 'torch>=2.11,<2.14'" in said[0]
    assert "triton 3.6 to 3.9, not 3.5.0" in said[1]
    assert environment_problems({"torch": "2.13.0+cpu", "triton": "3.9.0", "torchvision": "0.28.0+cpu"}) == []
    (line,) = environment_problems({"torch": "2.13.0+cpu", "triton": "3.9.0", "torchvision": "0.29.1"})
    assert "torchvision 0.29.1 is not the release for torch 2.13.0+cpu (0.28)" in line and "torchvision::nms" in line
    # the issue's own case, met again here (2026-11-27): the public index's (CUDA) torchvision 0.28.0 beside
    # the CPU torch 2.13.0+cpu, the right release but another build
    (line,) = environment_problems({"torch": "2.13.0+cpu", "triton": "3.9.0", "torchvision": "0.28.0"})
    assert "torchvision 0.28.0 is another build (default) than torch 2.13.0+cpu (cpu" in line
    assert environment_problems({"torch": "2.13.0", "triton": "3.9.0", "torchvision": "0.28.0"}) == []


def test_import_says_an_untested_torch_once_in_one_line(tmp_path):
    """A stand-in torch's metadata of an untested release: accelc's import warns once, in one line."""
    code = ("import warnings, importlib.metadata as m\n"
            "real = m.version\n"
            "m.version = lambda name: '2.15.0' if name == 'torch' else real(name)\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import accelc\n"
            "said = [str(x.message) for x in w if 'tested with torch' in str(x.message)]\n"
            "print(len(said), said[0].count(chr(10)) if said else -1)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["1", "0"], (out.stdout, out.stderr[-2000:])


def test_dir_of_the_package_is_its_documented_names():
    import accelc

    assert dir(accelc) == sorted(accelc.__all__) and "near_miss" not in dir(accelc)
    assert all(hasattr(accelc, name) for name in accelc.__all__)
    import accelc.near_miss  # noqa: F401  (the internals stay importable by their full names)
