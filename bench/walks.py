"""The walks of accelc's entry points: how far a call travels through the house before it returns. Each entry point
runs once on the CPU (the interpreter, tiny models) under a profile hook that sees every call made into accelc's
library (accelc/, its capture package, passes/; not the kernels: their jit functions are the kernels' own
business). Read per entry point:

  stays   distinct calls from one file of the library into a function of another (caller function -> callee
          function): the stops of the route, each counted once however often it is taken
  rooms   the library files the route enters
  returns of those calls, the ones into a file that is already on the calling stack (the route comes back to a
          room it has not left: a hub, or a circle through files)
  hub     of the stays, the ones into accelc/api.py
and, for optimize and generate, the user's model followed (the issue's reading of a walk: one argument followed
through the calls): the library functions called with it (model stays), their files, those in accelc/api.py; and the
user's example input tensor followed the same way (input stays / rooms / api.py entries), found among a function's
arguments or inside a tuple, list or dict argument (two levels): the model is captured early and travels as a
graph, the example's tensors travel the whole route (the checks, the races, the warm-up)

    python bench/walks.py [--json]              # in a checkout whose accelc is installed (pip install -e .)

Entry points: optimize (accelc.optimize of the built-in mlp), report (`accelc report mlp`, without ORT and
torch.compile), convert (`accelc convert mlp`), generate (accelc.optimize of a one-layer Llama, then generate).
Used for the before / after of the house's restructuring (the same script run on both trees).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import accelc  # noqa: E402

ROOT = Path(accelc.__file__).resolve().parent.parent
LIBRARY = [ROOT / "accelc", ROOT / "passes"]


def _library_of(filename: str) -> str | None:
    for base in LIBRARY:
        if filename.startswith(str(base) + os.sep):
            return str(Path(filename).relative_to(ROOT))
    return None


def _carries(value, obj, depth: int = 2) -> bool:
    if value is obj:
        return True
    if depth and isinstance(value, (tuple, list)):
        return any(_carries(v, obj, depth - 1) for v in value[:64])
    if depth and isinstance(value, dict):
        return any(_carries(v, obj, depth - 1) for v in list(value.values())[:64])
    return False


def walk(fn, follow=None, tensor=None) -> dict:
    """fn's walk (the module docstring's counts); follow: an object (the user's model) whose own route is also
    read: the library functions called with it among their arguments (`model stays`), their files, and how
    often that route enters accelc/api.py's functions."""
    stays, rooms, returns, route, carried = set(), set(), set(), [], []

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = _library_of(frame.f_code.co_filename)
        if callee is None:
            return
        rooms.add(callee)
        if follow is not None and any(v is follow for v in list(frame.f_locals.values())[:frame.f_code.co_argcount
                                                                                   + frame.f_code.co_kwonlyargcount]):
            route.append(f"{callee}:{frame.f_code.co_name}")
        if tensor is not None and any(_carries(v, tensor) for v in list(frame.f_locals.values())[
                :frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]):
            carried.append(f"{callee}:{frame.f_code.co_name}")
        caller, up = None, frame.f_back
        while up is not None:
            caller = _library_of(up.f_code.co_filename)
            if caller is not None:
                break
            up = up.f_back
        if caller is None or caller == callee:
            return
        edge = (f"{caller}:{up.f_code.co_name}", f"{callee}:{frame.f_code.co_name}")
        stays.add(edge)
        above = up.f_back
        while above is not None:
            if _library_of(above.f_code.co_filename) == callee:
                returns.add(edge)
                break
            above = above.f_back

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    hub = {e for e in stays if e[1].startswith("accelc/api.py:")}
    out = {"stays": len(stays), "rooms": len(rooms), "returns": len(returns), "hub": len(hub), "files": sorted(rooms)}
    if follow is not None:
        distinct = list(dict.fromkeys(route))
        out.update({"model stays": len(distinct), "model rooms": len({r.split(":")[0] for r in distinct}),
                    "model api.py entries": sum(1 for r in distinct if r.startswith("accelc/api.py:")),
                    "model route": distinct})
    if tensor is not None:
        distinct = list(dict.fromkeys(carried))
        out.update({"input stays": len(distinct), "input rooms": len({r.split(":")[0] for r in distinct}),
                    "input api.py entries": sum(1 for r in distinct if r.startswith("accelc/api.py:")),
                    "input route": distinct})
    return out


def _quiet(fn):
    def run():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            fn()
    return run


def entry_points(tmp: Path) -> dict:
    from accelc import cli

    from accelc import models
    mlp = models.get("mlp")
    example = mlp.example_inputs()

    def optimize():
        accelc.optimize(mlp, example)

    def report():
        cli.main(["report", "mlp", "-o", str(tmp / "report"), "--no-ort", "--compile", "no", "--device", "cpu",
                  "--rep-ms", "1"])

    def convert():
        cli.main(["convert", "mlp", "-o", str(tmp / "mlp.pt2"), "--device", "cpu"])

    import transformers as T
    torch.manual_seed(0)
    lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=100, max_position_embeddings=96,
                                          num_key_value_heads=1)).eval()

    ids = torch.randint(0, 100, (1, 8))

    def generate():
        opt = accelc.optimize(lm, (ids,))
        opt.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)

    first = example[0] if isinstance(example, (tuple, list)) else example
    return {"optimize": (optimize, mlp, first), "report": (report, None, None), "convert": (convert, None, None),
            "generate": (generate, lm, ids)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default=None)
    a = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (fn, follow, tensor) in entry_points(Path(tmp)).items():
            if a.only and name not in a.only.split(","):
                continue
            try:
                out[name] = walk(_quiet(fn), follow, tensor)
            except Exception as e:   # an entry point this tree does not have in this form
                out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for name, r in out.items():
            print(name, {k: v for k, v in r.items() if k not in ("files", "model route", "input route")})


if __name__ == "__main__":
    main()
