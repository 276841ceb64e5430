"""What every bench script shares: the environment line, and writing results."""
from __future__ import annotations

import datetime
import json
import os
import re
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


def env_line(env: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in env.items())


os.environ.setdefault("PYTHONUNBUFFERED", "1")
