"""accelc's version, in one place (the package, the CLI and report headers read it), and the releases of its
dependencies it is tested with (pyproject.toml's bounds: tests/test_cli.py keeps the two the same)."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__version__ = "0.1.0"

# [lowest, past the highest) release (major, minor) tested: the GPU runs on torch 2.11 + triton 3.6 + transformers
# 5.17 (the device image's), CI on torch 2.13 + the newest triton and transformers the bounds admit. transformers is
# no requirement of accelc's own (the `hf` extra names it): said only where it is installed
TESTED = {"torch": ((2, 11), (2, 14)), "triton": ((3, 6), (3, 10)), "transformers": ((5, 17), (5, 26))}
# torchvision's release for a torch release: 0.(minor + 15) (torch 2.11 <-> torchvision 0.26)
_TORCHVISION_OFFSET = 15


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _build(version: str) -> str:
    """A wheel's build tag ("cpu", "cu130"; "" for the default index's)."""
    return version.partition("+")[2]


def environment_problems(versions: dict | None = None) -> list[str]:
    """One line for each installed release accelc is not tested with: torch or triton outside TESTED, a
    torchvision that is not torch's own (timm's and torchvision's models then fail to import:
    `operator torchvision::nms does not exist`). versions: {package: version} (default: installed)."""
    if versions is None:
        from importlib import metadata

        versions = {}
        for name in ("torch", "triton", "transformers", "torchvision"):
            try:
                versions[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
    out = []
    for name, (lo, hi) in TESTED.items():
        v = versions.get(name)
        if v is not None and not lo <= _release(v) < hi:
            out.append(f"accelc {__version__} is tested with {name} {lo[0]}.{lo[1]} to {hi[0]}.{hi[1] - 1}, not {v}: "
                       f"it may fail or give wrong numbers (pip install '{name}>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}' with "
                       "the index it came from)")
    torch_v, vision = versions.get("torch"), versions.get("torchvision")
    if torch_v is not None and vision is not None:
        major, minor = _release(torch_v)
        want = (0, minor + _TORCHVISION_OFFSET) if major == 2 else None
        build, vision_build = _build(torch_v) or "default", _build(vision) or "default"
        if want is not None and _release(vision) == want and build != vision_build:
            out.append(f"torchvision {vision} is another build ({vision_build}) than torch {torch_v} ({build}; "
                       "'default': the public index's, CUDA on Linux): timm's and torchvision's models may fail "
                       "to import (operator torchvision::nms does not exist); install torchvision from the index "
                       "torch came from (README: Install)")
        if want is not None and _release(vision) != want:
            out.append(f"torchvision {vision} is not the release for torch {torch_v} ({want[0]}.{want[1]}): timm's "
                       "and torchvision's models may fail to import (operator torchvision::nms does not exist); "
                       f"install torch's own: pip install 'torchvision=={want[0]}.{want[1]}.*' with torch's index "
                       "(README: Troubleshooting)")
    return out


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """accelc's own source (its modules and the shipped tuning table), digested: what is kept for a later
    optimize (the guard's verdicts, captured graphs) is keyed on it, so that a change anywhere makes it anew."""
    h = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.json")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()
