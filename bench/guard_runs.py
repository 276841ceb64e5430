"""The guard's verdict across fresh processes, and what its checks cost.

    python bench/guard_runs.py --runs 3 --out bench/results

Optimizes the built-in ResNet-50 (batch 32) and BERT-base (batch 8, sequence 128) in fp16, each
run in a new process with an empty tuning cache (so the autotuner chooses again, as on another
machine or another day), and records which layers the guard reverted and why, and optimize's
phase times: "guard: other inputs" is what the checks on a second draw of the inputs and at a
second batch size add (the repeat run of each kernel is inside the guard's time).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {"resnet50": ("resnet", 32), "bert-base": ("bert", 8)}


def one(name: str) -> dict:
    import torch

    import accelc
    builtin, batch = MODELS[name]
    model = accelc.models.get(builtin, **accelc.models.SIZES[builtin]).cuda().half()
    args = model.example_inputs(batch_size=batch)
    args = tuple(a.cuda() for a in args)
    opt = accelc.optimize(model, args)
    return {"model": name, "batch": batch,
            "rewritten": len(opt.rewritten),
            "reverted": [[r.name, r.reason] for r in opt.layers if r.status == "reverted"],
            "kept": sum(r.status == "kept" for r in opt.layers),
            "end_to_end_rel_error": opt.info.end_to_end_rel_error,
            "seconds": opt.info.seconds, "device": torch.cuda.get_device_name()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args.one)))
        return 0
    from _common import env_line, environment, md_table, write
    env = environment()
    rows = []
    for name in args.models.split(","):
        for i in range(args.runs if name == "resnet50" else 1):
            with tempfile.TemporaryDirectory() as cache:
                proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                                      env={**os.environ, "ACCELC_CACHE_DIR": cache})
            line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")]
            if not line:
                print(proc.stderr[-3000:])
                raise SystemExit(f"{name} run {i + 1} failed")
            row = json.loads(line[0][7:])
            row["run"] = i + 1
            rows.append(row)
            print(name, i + 1, row["rewritten"], row["reverted"], row["seconds"], flush=True)
    table = md_table(
        ["model", "run", "rewritten", "reverted", "kept (PyTorch faster)", "end-to-end rel. error", "guard s",
         "of it: other inputs s", "optimize s"],
        [[r["model"], r["run"], r["rewritten"], len(r["reverted"]), r["kept"], f"{r['end_to_end_rel_error']:.1e}",
          r["seconds"].get("guard (kernel tuning included)"), r["seconds"].get("guard: other inputs"),
          round(sum(v for k, v in r["seconds"].items() if k in ("capture", "passes", "guard (kernel tuning included)",
                                                               "warmup")), 1)] for r in rows])
    text = (f"# The guard across fresh processes (empty tuning cache each run)\n\n{env_line(env)}\n\n{table}\n"
            + "".join(f"- {r['model']} run {r['run']}: reverted {name}: {why}\n"
                      for r in rows for name, why in r["reverted"]))
    print(text)
    if args.out:
        write(args.out, "guard_runs", env, rows, text)
    return 1 if any(r["reverted"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
