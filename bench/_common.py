"""What every bench script shares: the environment line, and writing results."""
from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
from pathlib import Path

import torch
import triton


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
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        env["device"] = "cpu"
    return env


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def write(out_dir: str, name: str, env: dict, rows: list[dict], markdown: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{slug(env['device'])}"
    (out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(f"wrote {out / stem}.json and .md")


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def time_rounds(variants: dict, row: dict, rounds: int, flops: float, rep_ms: float = 40,
                device: str = "cuda") -> None:
    """Time every variant `rounds` times, round-robin (the GPUs here drift 5-8% over a minute of
    load, so the variants being compared share each round's conditions). Per variant, row[name]
    gets rounds_us (CUDA-graph medians, us), us (their median) and tflops."""
    from accelc.latency import median_ms

    for name in variants:
        row.setdefault(name, {})["rounds_us"] = []
    for _ in range(rounds):
        for name, fn in variants.items():
            t = median_ms(fn, device=device, cuda_graph=device == "cuda", rep_ms=rep_ms)
            row[name]["rounds_us"].append(round(t * 1e3, 2))
    for name in variants:
        us = statistics.median(row[name]["rounds_us"])
        row[name].update(us=us, tflops=round(flops / us / 1e6, 1))


def speedup(row: dict, fast: str, base: str) -> tuple[float, float, float]:
    """base time / fast time per round: (median, min, max)."""
    ratios = [tb / tf for tf, tb in zip(row[fast]["rounds_us"], row[base]["rounds_us"])]
    return round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3)


def per_call_us(fn, n: int, rounds: int = 5, wall: bool = False, warmup: int = 100) -> float:
    """Median over `rounds` of microseconds per call of `n` back-to-back calls of fn: host time only
    (wall=False: the GPU is synchronised between rounds, not inside one; on shapes where the GPU
    keeps up this is the host's cost), or the GPU's work included (wall=True: synchronised at the
    end of each round)."""
    import time

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if wall:
            torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def env_line(env: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in env.items())


os.environ.setdefault("PYTHONUNBUFFERED", "1")
