"""What every bench script shares: the environment line, and writing results."""
from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import accelc  # noqa: F401  (before triton: accelc decides interpreter or GPU before any kernel is defined)
import triton
from accelc.latency import per_call_us  # noqa: F401  (the benches' host-time timer, one for all)
from accelc.numerics import rel_l2  # noqa: F401  (one relative L2 for benches, reports and tests)


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, sms=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1))
        try:   # one line per GPU of the host: the driver is the host's
            lines = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=20).stdout.split()
            if lines:
                env["driver"] = lines[0]
            if len(lines) > 1:
                env["gpus_on_host"] = len(lines)
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        env["device"] = "cpu"
    # where the processes' Python bytecode goes (bench/steps.sh keeps it: without it each process compiles the
    # heavy modules' sources again, seconds of every side's first call or optimize)
    env["bytecode"] = ("not written" if sys.dont_write_bytecode
                       else f"under {sys.pycache_prefix}" if sys.pycache_prefix else "beside the sources")
    return env


def other_shapes_wait_s(opt) -> float | None:
    """Seconds waited for the glue an optimize left compiling in the background (ACCELC_OTHER_SHAPES=background,
    OptimizeConfig.other_shapes), before anything of the model is timed; None where it compiled inside optimize."""
    if opt.config.other_shapes != "background":
        return None
    t0 = time.perf_counter()
    opt.wait_for_other_shapes()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 1)


def copy_bandwidth(device) -> float | None:
    """Bytes/s of a device-to-device copy (read + write bytes of 1 GiB), the median of 10; None off
    a GPU. The decode benches' yardstick (bench/generate.py's limit, bench/decode.py's shares)."""
    if torch.device(device).type != "cuda":
        return None
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * 2**30 / statistics.median(times[2:])


def fresh_tuning_cache() -> None:
    """Point accelc's tuning cache at a new empty directory (accelc reads ACCELC_CACHE_DIR when it
    tunes), so that a benchmark times every key itself and reports its own candidates' spread."""
    os.environ["ACCELC_CACHE_DIR"] = tempfile.mkdtemp(prefix="accelc-bench-")


def tuned(tuner, match):
    """(config, spread) of the last key the tuner chose for that match(key) accepts: the
    triton.Config and accelc.tuning.Tuner.spread's numbers (None where the key was not timed);
    (None, None) when no key matches."""
    keys = [k for k in tuner.chosen if match(k)]
    return (tuner.chosen[keys[-1]], tuner.spread(keys[-1])) if keys else (None, None)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def write(out_dir: str, name: str, env: dict, rows: list[dict], markdown: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{slug(env['device'])}"
    (out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(f"wrote {out / stem}.json and .md")


def merged(out_dir: str, name: str, env: dict, rows: list[dict], key: tuple[str, ...]) -> list[dict]:
    """rows with the sides an earlier run on the same device wrote to out_dir/name-<device>.json kept
    where this run did not measure them (a row is matched by its `key` fields; a side this run measured
    replaces the earlier one). For benches whose sides do not fit one device command: every side
    records its own date, and the table says the sides come from more than one run."""
    path = Path(out_dir) / f"{name}-{slug(env['device'])}.json"
    if not path.exists():
        return rows
    old = json.loads(path.read_text())
    if old.get("environment", {}).get("device") != env["device"]:
        return rows
    fresh = {tuple(r.get(k) for k in key): r for r in rows}    # a key field a row lacks: None
    out = []
    for r in old["rows"]:
        k = tuple(r.get(f) for f in key)
        out.append({**r, **fresh.pop(k)} if k in fresh else r)
    return out + list(fresh.values())


def dates(rows: list[dict]) -> str:
    """The dates the sides of merged rows were measured on (each side's dict records its own)."""
    return ", ".join(sorted({x["date"] for r in rows for x in r.values() if isinstance(x, dict) and "date" in x}))


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def time_rounds(variants: dict, row: dict, rounds: int, flops: float, rep_ms: float = 40,
                device: str = "cuda", settle_s: float = 0.0) -> None:
    """Time every variant `rounds` times, round-robin (the GPUs here drift 5-8% over a minute of
    load, so the variants being compared share each round's conditions). Per variant, row[name]
    gets rounds_us (CUDA-graph medians, us), us (their median) and tflops. settle_s: an idle pause
    before each variant's timing, so that none starts in the lowered clocks the one before left
    (after 50 ms of an H100's fp16 GEMM at 660 TF/s the next 500 us kernel ran 10% slower:
    bench/results/int8-power-state-nvidia-h100-80gb-hbm3.txt)."""
    from accelc.latency import median_ms

    for name in variants:
        row.setdefault(name, {})["rounds_us"] = []
    for _ in range(rounds):
        for name, fn in variants.items():
            if settle_s:
                torch.cuda.synchronize()
                time.sleep(settle_s)
            t = median_ms(fn, device=device, cuda_graph=device == "cuda", rep_ms=rep_ms)
            row[name]["rounds_us"].append(round(t * 1e3, 2))
    for name in variants:
        us = statistics.median(row[name]["rounds_us"])
        row[name].update(us=us, tflops=round(flops / us / 1e6, 1))


def bench_main(name: str, rows_for, markdown, variants: dict | None = None) -> None:
    """The command line of a kernel benchmark: `--out DIR` runs rows_for() and writes
    DIR/<name>-<device>.json and .md; `--markdown JSON` only rewrites the .md beside a results JSON.
    variants: {flag: (results name, rows function)} for extra row sets (`--rms`)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--markdown", metavar="JSON", help="only rewrite the .md beside a results JSON")
    for flag, (result_name, _) in (variants or {}).items():
        ap.add_argument(f"--{flag}", action="store_true", help=f"these rows instead (results file {result_name}-*)")
    args = ap.parse_args()
    if args.markdown:
        data = json.loads(Path(args.markdown).read_text())
        Path(args.markdown).with_suffix(".md").write_text(markdown(data["environment"], data["rows"]))
        return
    for flag, (result_name, fn) in (variants or {}).items():
        if getattr(args, flag):
            name, rows_for = result_name, fn
    env = environment()
    print(env_line(env))
    rows = rows_for()
    write(args.out, name, env, rows, markdown(env, rows))
    print(markdown(env, rows))


def measure_row(row: dict, variants: dict, ref: torch.Tensor, rounds: int, flops: float = 0,
                moved: int | None = None, label: str = "") -> dict:
    """One row of a kernel benchmark: each variant's relative L2 error against `ref` (its first
    call, which also compiles it), then time_rounds; GB/s where the bytes `moved` are given; accelc's
    speedups over eager and torch.compile; a one-line summary printed. Returns row."""
    row["rel_err"] = {k: rel_l2(f(), ref) for k, f in variants.items() if k in ("eager", "compile", "accelc")}
    time_rounds(variants, row, rounds, flops=flops)
    if moved is not None:
        for k in variants:
            row[k]["gbs"] = round(moved / row[k]["us"] / 1e3, 1)
    ratios(row)
    rate = f"{row['accelc']['gbs']} GB/s" if moved is not None else f"{row['accelc']['tflops']} TF/s"
    print(f"{label}: eager {row['eager']['us']:.1f} us, compile {row['compile']['us']:.1f}, accelc "
          f"{row['accelc']['us']:.1f} ({rate}); {row['vs_eager'][0]}x eager, {row['vs_compile'][0]}x compile",
          flush=True)
    return row


def ratios(row: dict, fast: str = "accelc", against=("eager", "compile")) -> None:
    """row[f"vs_{base}"] = speedup(row, fast, base) for each base."""
    for base in against:
        row[f"vs_{base}"] = speedup(row, fast, base)


HBM_TBS = {"H100 80GB HBM3": 3.35, "H200": 4.8}    # dense HBM bandwidth, TB/s


def _for_device(table: dict, env: dict):
    """The entry of a per-device table (keyed by a part of the device's name) for env's device, or None."""
    return next((v for k, v in table.items() if k in env["device"]), None)


def gbs_cell(env: dict, gbs: float) -> str:
    """A memory-bound kernel's GB/s with its share of the device's HBM bandwidth: 2598.9 (78%)."""
    peak = _for_device(HBM_TBS, env)
    return f"{gbs} ({100 * gbs / (peak * 1e3):.0f}%)" if peak else f"{gbs}"


# dense tensor-core peaks (no sparsity), TF/s for fp16 / bf16 and fp8, TOPS for int8: NVIDIA's H100 SXM
# and H200 datasheets (the same SXM5 tensor cores and clocks)
DENSE_PEAK = {"H100 80GB HBM3": {"fp16": 989.4, "int8": 1978.9, "fp8": 1978.9},
              "H200": {"fp16": 989.4, "int8": 1978.9, "fp8": 1978.9}}


def rate_cell(env: dict, rate: float, kind: str = "fp16") -> str:
    """A compute-bound kernel's TF/s (TOPS for int8) with its share of the device's dense peak:
    598 TF/s (60%)."""
    top = (_for_device(DENSE_PEAK, env) or {}).get(kind)
    unit = "TOPS" if kind == "int8" else "TF/s"
    return f"{rate:.0f} {unit} ({100 * rate / top:.0f}%)" if top else f"{rate:.0f} {unit}"


def spread_cell(spread: dict | None) -> str:
    """accelc.tuning.Tuner.spread as a cell: fastest-slowest us over the candidates that ran."""
    if not spread:
        return "not tuned"
    return f"{spread['fastest_us']:.1f}-{spread['slowest_us']:.1f} us ({spread['ran']}/{spread['candidates']} ran)"


def ratio_cell(r: tuple) -> str:
    """A speedup tuple as a table cell: 1.1x (1.05-1.2)."""
    return f"{r[0]}x ({r[1]}-{r[2]})"


def compiled(fn, **kwargs):
    """torch.compile(fn) for one row of a benchmark: dynamo's caches reset first and shapes static.
    A bench defines the same function (one code object) for row after row; without the reset the
    second shape recompiles it with dynamic shapes (automatic_dynamic_shapes), a slower generic
    kernel, and past recompile_limit (8) dynamo silently runs it eagerly."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, **kwargs)


def speedup(row: dict, fast: str, base: str) -> tuple[float, float, float]:
    """base time / fast time per round: (median, min, max)."""
    ratios = [tb / tf for tf, tb in zip(row[fast]["rounds_us"], row[base]["rounds_us"])]
    return round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3)


def env_line(env: dict) -> str:
    # (a driver read on a host of several GPUs before environment() kept one line: one per GPU)
    return ", ".join(f"{k} {' / '.join(dict.fromkeys(str(v).split())) if k == 'driver' else v}" for k, v in env.items())


os.environ.setdefault("PYTHONUNBUFFERED", "1")


def critical_path(spans: list) -> tuple[dict, float]:
    """Where a stream's time went, kernel by kernel: ({name: [calls, own us]}, idle us) of spans (name, start, end)
    of one stream's kernels. A kernel's own time is how far it moved the stream's end: the part of it after every
    kernel before it had ended (under programmatic dependent launch a kernel starts while the one before it runs and
    waits inside, so its duration holds that wait: the profiler's durations overlap and sum to more than the wall).
    Idle: the GPU time with no kernel running. Own times and idle sum to the last end less the first start."""
    by_name: dict = {}
    idle, frontier = 0.0, None
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        if frontier is None:
            frontier = start
        idle += max(0.0, start - frontier)
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
    return by_name, idle
