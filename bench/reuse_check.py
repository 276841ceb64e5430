"""Does a second process reuse the first one's guard verdicts (accelc.reuse), for the forward and the generation
step of one of bench/optimize_time.py's models? Where a key differs, which of its parts (the debug log's
per-part digests, in accelc.reuse.key's order) differ.

    python bench/reuse_check.py --model tinyllama-lm [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def one(model: str) -> None:
    import logging

    import torch

    import accelc
    import optimize_time

    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(message)s")
    for name in list(logging.root.manager.loggerDict):
        if name != "accelc":
            logging.getLogger(name).setLevel(logging.WARNING)
    m, args, kwargs = optimize_time.build(model)
    opt = accelc.optimize(m, args, example_kwargs=kwargs)
    torch.cuda.synchronize()
    step = getattr(opt, "step", None)
    print(json.dumps({"forward": bool(opt.info.reused), "step": bool(step.info.reused) if step is not None else None}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tinyllama-lm")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", action="store_true")
    a = ap.parse_args()
    if a.one:
        one(a.model)
        return
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, ACCELC_CACHE_DIR=f"{cache}/accelc", TRITON_CACHE_DIR=f"{cache}/triton",
                   TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", ACCELC_REUSE="1")
        for _ in range(2):
            p = subprocess.run([sys.executable, __file__, "--model", a.model, "--one"], env=env, capture_output=True,
                               text=True)
            keys = [line.split("reuse key ", 1)[1] for line in p.stderr.splitlines() if "reuse key " in line]
            out = [line for line in p.stdout.splitlines() if line.startswith("{")]
            runs.append({"reused": json.loads(out[-1]) if out else p.stderr[-2000:], "keys": keys})
    report = {"model": a.model, "runs": runs, "differing_parts": []}
    for i, (k1, k2) in enumerate(zip(runs[0]["keys"], runs[1]["keys"])):
        p1, p2 = k1.split(" of parts ")[1].split(), k2.split(" of parts ")[1].split()
        report["differing_parts"].append({"graph": i, "same_key": k1.split()[0] == k2.split()[0],
                                          "parts": [x for x, y in zip(p1, p2) if x != y][:40],
                                          "counts": [len(p1), len(p2)]})
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"reuse_check-{a.model}.json").write_text(text)


if __name__ == "__main__":
    main()
