"""Differential fuzzer, long runs: random models (bench/fuzz_models.py: FuzzNet) optimized and
compared with eager against fp64, on new inputs and another batch size. Every crash and every
mismatch is a bug; refusals (AccelcError) are counted apart.

    python bench/fuzz.py --count 1000 --workers 8 --size gpu --out bench/results

Seeds start..start+count, the dtype cycling fp16 / bf16 / fp32 by seed (fp32 only on the CPU).
Kernel configs are the kernels' defaults (ACCELC_AUTOTUNE=0: every candidate config has its own
sweep, tests/test_candidates.py), layers rewritten whatever their speed (only_if_faster off).
Writes fuzz-<device>.json (every record) and .md (counts, failing seeds, what each model held).
Draws eager itself cannot run ("invalid") are listed apart and are not tests of accelc. After a
CUDA error a worker's context is lost: its later seeds are "not run", and the error is the crash
of the seed that raised it.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DTYPES = ("float16", "bfloat16", "float32")


_lost = None   # the seed whose CUDA error broke this worker's CUDA context
REUSE_EVERY = 10    # one seed in so many runs the reuse class (fuzz_calls.Restated: two optimizes, state changed)


def _work(task):
    global _lost
    seed, size, device = task
    if _lost is not None:
        return dict(seed=seed, size=size, status="not run", model="", dtype="",
                    reason=f"this worker's CUDA context was lost at seed {_lost}")
    import torch

    from accelc.errors import short_error
    from fuzz_models import run_case
    dtype = getattr(torch, DTYPES[seed % 3]) if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    try:
        rec = run_case(seed, size, device, dtype, reuse=seed % REUSE_EVERY == REUSE_EVERY - 1)
    except Exception as e:   # outside run_case's own checks: a CUDA error left by an earlier model
        rec = dict(seed=seed, size=size, status="crash", model="", dtype=str(dtype), where="setup",
                   reason=short_error(e))
    if rec["status"] == "crash" and "CUDA error" in rec["reason"]:
        _lost = seed
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size", default="gpu", choices=["tiny", "gpu"])
    ap.add_argument("--minutes", type=float, default=8.0, help="stop taking new seeds after this long")
    ap.add_argument("--out", default=None, help="folder for fuzz-<device>.json / .md")
    args = ap.parse_args(argv)
    os.environ.setdefault("ACCELC_AUTOTUNE", "0")

    import torch

    from _common import env_line, environment, slug
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tasks = [(s, args.size, device) for s in range(args.start, args.start + args.count)]
    records, t0 = [], time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers, maxtasksperchild=200) as pool:
        for rec in pool.imap_unordered(_work, tasks):
            records.append(rec)
            if rec["status"] in ("crash", "mismatch"):
                print(f"{rec['status']}: {rec['model']}\n    {rec.get('where', '')}: {rec['reason']}", flush=True)
            if time.perf_counter() - t0 > args.minutes * 60:
                pool.terminate()
                break
    records.sort(key=lambda r: r["seed"])
    counts = collections.Counter(r["status"] for r in records)
    env = environment()
    label = slug(env["device"])
    lines = [f"# Differential fuzzer: {len(records)} random models ({args.size} sizes)", "",
             env_line(env), "", f"seeds {args.start}..{args.start + args.count - 1} (ran {len(records)}), "
             f"{args.workers} workers, {time.perf_counter() - t0:.0f} s, default kernel configs (ACCELC_AUTOTUNE=0), "
             "only_if_faster off", "",
             "| status | models |", "|---|---|"]
    lines += [f"| {k} | {counts.get(k, 0)} |" for k in ("ok", "refused", "crash", "mismatch", "invalid", "not run")]
    kinds = collections.Counter()
    for r in records:
        kinds.update(r.get("kinds", {}))
    rewritten = sum(r.get("rewritten", 0) for r in records)
    reverted = sum(r.get("reverted", 0) for r in records)
    lines += ["", f"layers rewritten: {rewritten} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}); "
                  f"reverted by the guard: {reverted}", ""]
    bad = [r for r in records if r["status"] in ("crash", "mismatch")]
    if bad:
        lines += ["## Crashes and mismatches", ""]
        lines += [f"- {r['status']} {r['dtype']} {r['model']}: {r.get('where', '')}: {r['reason']}" for r in bad]
    refused = collections.Counter(r["reason"][:120] for r in records if r["status"] == "refused")
    if refused:
        lines += ["", "## Refusals", ""] + [f"- {n} x {reason}" for reason, n in refused.most_common()]
    invalid = [r for r in records if r["status"] == "invalid"]
    if invalid:
        lines += ["", "## Draws eager cannot run (not counted)", ""] + [f"- {r['model']}: {r['reason'][:100]}"
                                                                      for r in invalid]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"fuzz-{label}.json").write_text(json.dumps({"environment": env, "records": records}, indent=1))
        (out / f"fuzz-{label}.md").write_text(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
