"""accelc::conv2d's ROWS path (an RGB stem) with one and with two warpgroups: each config forced, run many times
on the same inputs; a run whose output differs bit for bit from the first is a race. Also each config's time
(median of CUDA-event timings), so that the 4-warp tiles that replaced the 8-warp ones are seen at the stem's
batches. kernels/conv_configs.py's rows_config refuses 8 warps: those are built here directly.

    python bench/conv_rows_race.py [--runs 50] [--out DIR]     # on a GPU; writes DIR/conv_rows_race.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from _common import environment
from accelc.kernels import conv, conv_configs
from determinism import repeated

STEMS = [(2, 3, 64, 64, 64, 7, 7, 2, 3), (32, 3, 224, 224, 64, 7, 7, 2, 3), (8, 3, 224, 224, 64, 7, 7, 2, 3)]
TWO_WARPGROUPS = [conv_configs.config(256, 64, 16, 3, 8), conv_configs.config(128, 128, 16, 3, 8),
                  conv_configs.config(256, 64, 16, 3, 8, row_step=2)]


def describe(cfg) -> str:
    k = cfg.kwargs
    return f"{k['BLOCK_M']}x{k['BLOCK_N']} row_step {k['ROW_STEP']}, {cfg.num_stages} stages, {cfg.num_warps} warps"


def one(shape, cfg, runs: int) -> dict:
    N, C, H, W, K, R, S, st, p = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, C, H, W, device="cuda", dtype=torch.float16, generator=g).contiguous(
        memory_format=torch.channels_last)
    w = conv.pack_weight(torch.randn(K, C, R, S, device="cuda", dtype=torch.float16, generator=g) / (C * R * S) ** 0.5)
    b = torch.randn(K, device="cuda", dtype=torch.float16, generator=g)
    args = ((st, st), (p, p, p, p), (1, 1), "relu", True)
    ref = conv.conv2d_ref(x.float(), w.float(), b.float(), None, *args)
    got = repeated(conv.TUNER, cfg, lambda: conv.conv2d_launch(x, w, b, None, *args), ref, runs)
    if got is None:       # (a tile wider than the stem's 64 channels)
        return None
    differ, worst = got
    with conv.TUNER.force(cfg):
        times = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            conv.conv2d_launch(x, w, b, None, *args)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
    return {"shape": list(shape), "config": describe(cfg), "warps": cfg.num_warps, "runs": runs,
            "runs_differing": differ, "worst_rel_l2": worst, "median_ms": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    extra = [c for c in TWO_WARPGROUPS]
    conv_configs.ROWS_CONFIGS.extend(extra)       # offered to the prune as ROWS candidates for this run only
    conv.TUNER.configs = list(conv.TUNER.configs) + extra
    rows = []
    for shape in STEMS:
        for cfg in list(conv_configs.ROWS_CONFIGS):
            r = one(shape, cfg, a.runs)
            if r is None:
                continue
            rows.append(r)
            print(f"{'x'.join(map(str, shape))}  {r['config']:40s} differing {r['runs_differing']:3d}/{a.runs}  "
                  f"worst rel L2 {r['worst_rel_l2']:.1e}  {r['median_ms']:.4f} ms", flush=True)
    with open(os.path.join(a.out, "conv_rows_race.json"), "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
