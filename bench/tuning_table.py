"""Kernel races of real models, and the tuning table accelc ships from them.

    python bench/tuning_table.py collect --models bert,resnet50 --out DIR   # on the GPU
    python bench/tuning_table.py build DIR [DIR ...] [--table accelc/tuning_table.json]

collect: each model optimized cold in a process of its own (new accelc / Triton / Inductor caches),
every candidate of every kernel timed (ACCELC_TUNE=all: the shipped table not consulted), and every
race written to races-<model>.json (kernel, key, each candidate's microseconds) with the optimize's
seconds and phases. Models are built as bench/optimize_time.py builds them (bench/e2e.py's realistic
batches, causal LMs with generation).

build: from the races, the table (accelc.tuning_table): per kernel and GPU, each raced key's configs
within the margin of its fastest. It also says what the table gives a model nobody raced, each model left
out in turn: its races whose key another model raced, and the fastest config the others' table keeps
against the race's own fastest (--eval writes it as markdown).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def collect_one(name: str) -> dict:
    """Optimize `name` in this process and return its races."""
    import torch

    import accelc
    import optimize_time
    from accelc import tuning

    model, args, kwargs = optimize_time.build(name)
    t0 = time.perf_counter()
    opt = accelc.optimize(model, args, example_kwargs=kwargs)
    torch.cuda.synchronize()
    seconds = round(time.perf_counter() - t0, 1)
    races = []
    for tuner in tuning.all_tuners():
        for key, timed in tuner.timings.items():
            races.append({"kernel": tuner.name, "key": [str(k) for k in key],
                          "timings_us": [[cfg, us] for cfg, us in timed]})
    name_, cap = tuning.device_identity()
    return {"model": name, "device": name_, "capability": cap, "optimize_s": seconds,
            "phases_s": opt.info.seconds, "races": races}


def collect(models: list, out: Path) -> None:
    import _common

    out.mkdir(parents=True, exist_ok=True)
    env = _common.environment()
    for name in models:
        with tempfile.TemporaryDirectory(prefix="accelc-races-") as cache:
            env_vars = dict(os.environ, ACCELC_TUNE="all", ACCELC_CACHE_DIR=f"{cache}/accelc",
                            TRITON_CACHE_DIR=f"{cache}/triton", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor")
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "one", name], env=env_vars, capture_output=True,
                                  text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if not lines:
                print(f"{name}: failed: {proc.stderr[-1500:]}", flush=True)
                continue
            data = json.loads(lines[-1])
            data["environment"] = env
            data["process_s"] = round(time.perf_counter() - t0, 1)
            (out / f"races-{name}.json").write_text(json.dumps(data))
            print(f"{name}: optimize {data['optimize_s']} s, {len(data['races'])} races", flush=True)


def offered_today() -> dict:
    """Per kernel, the configs (dicts) its tuner offers in this tree: what the shipped table may keep (a race run
    before a config list changed holds configs no longer offered)."""
    import accelc.kernels.conv  # noqa: F401  (every kernel module: their tuners)
    import accelc.kernels.depthwise_conv  # noqa: F401
    import accelc.kernels.flash_attention  # noqa: F401
    import accelc.kernels.gated_linear  # noqa: F401
    import accelc.kernels.gemm  # noqa: F401
    from accelc import tuning

    return {t.name: [tuning.config_dict(c) for c in t.configs] for t in tuning.all_tuners()}


def load_races(folders: list) -> list:
    runs = []
    for folder in folders:
        for path in sorted(Path(folder).glob("races-*.json")):
            runs.append(json.loads(path.read_text()))
    return runs


def evaluate(runs: list) -> tuple[list, str]:
    """Each model left out of the table that decides its races: the races whose key another model raced on
    the same GPU (a shared layer shape), the candidates those race with the table, and the fastest kept
    over the fastest of all (1.0: the table's pick is the race's own)."""
    from accelc import tuning_table

    rows = []
    for left in runs:
        others = tuning_table.build([r for r in runs if r is not left])
        hits, losses, timed_all, timed_kept = 0, [], 0, 0
        for race in left["races"]:
            ran = [(cfg, us) for cfg, us in race["timings_us"] if us is not None]
            if len(ran) < 2:
                continue
            kept = tuning_table.shortlist_in(others, race["kernel"], left["device"], race["key"],
                                             [cfg for cfg, _ in race["timings_us"]])
            timed_all += len(race["timings_us"])
            timed_kept += len(race["timings_us"]) if kept is None else len(kept)
            if kept is None:
                continue
            hits += 1
            kept_us = [us for cfg, us in ran if cfg in kept]
            losses.append((min(kept_us) if kept_us else math.inf) / min(us for _, us in ran))
        rows.append((left["model"], len(left["races"]), hits, timed_all, timed_kept,
                     max(losses) if losses else None))
    lines = ["| model left out | races | keys another model raced | candidates raced, all | with the others' "
             "table | worst fastest kept / fastest |", "|---|---|---|---|---|---|"]
    for m, n, h, a, k, w in rows:
        lines.append(f"| {m} | {n} | {h} | {a} | {k} ({k / max(a, 1):.0%}) | {'' if w is None else f'{w:.3f}'} |")
    return rows, "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--models", required=True)
    c.add_argument("--out", required=True)
    o = sub.add_parser("one")
    o.add_argument("model")
    b = sub.add_parser("build")
    b.add_argument("folders", nargs="+")
    b.add_argument("--table", default=str(Path(__file__).resolve().parents[1] / "accelc" / "tuning_table.json"))
    b.add_argument("--eval", default=None, help="where to write the left-out evaluation (markdown)")
    a = ap.parse_args()
    if a.cmd == "one":
        print(json.dumps(collect_one(a.model)), flush=True)
    elif a.cmd == "collect":
        collect(a.models.split(","), Path(a.out))
    else:
        from accelc import tuning_table

        runs = load_races(a.folders)
        _, table_md = evaluate(runs)
        print(table_md)
        if a.eval:
            Path(a.eval).write_text(table_md)
        table = tuning_table.build(runs, offered_today())
        Path(a.table).write_text(json.dumps(table, sort_keys=True, separators=(",", ":")) + "\n")
        print(f"wrote {a.table}")


if __name__ == "__main__":
    main()
