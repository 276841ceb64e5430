"""How the guard's speed race times a decode-step projection, side by side with the kernel's GPU time: for each
(shape, kind), accelc's call at one row (fp16; weight-only fp8 and int8; the RMSNorm taken in or not) timed by
latency.layer_ms (the race's timer: over a CUDA graph, plain calls where capture fails) and by latency.kernel_ms
(CUPTI's GPU time), with whether the graph was taken and why not.

    python bench/race_probe.py [--shapes 4096x6144,4096x4096] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import traceback

import torch

from accelc import latency
from accelc.kernels import fp8_weight, int8_weight  # noqa: F401  (registers accelc::linear_w8a16)
from _common import environment, md_table, write


def _graph_error(fn):
    try:
        latency.median_ms(fn, "cuda", cuda_graph=True, rep_ms=20)
        return ""
    except Exception as e:    # what refused the capture
        torch.cuda.synchronize()
        return f"{type(e).__name__}: {e}".splitlines()[0][:300] + " | " + traceback.format_exc().splitlines()[-3][:200]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x6144,4096x4096,2048x2560")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    env = environment()
    print(json.dumps(env))
    rows = []
    for shape in a.shapes.split(","):
        K, N = map(int, shape.split("x"))
        x = torch.randn(1, 1, K, device="cuda", dtype=torch.float16)
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) / K ** 0.5
        nw = torch.rand(K, device="cuda", dtype=torch.float16) + 0.5
        f8, s8 = fp8_weight.quantize_weight(w)
        si = w.float().abs().amax(1) / 127
        i8 = (w.float() / si[:, None]).round().clamp(-127, 127).to(torch.int8)
        calls = {
            "fp16": lambda: torch.ops.accelc.linear(x, w),
            "fp16+norm": lambda: torch.ops.accelc.linear(x, w, norm_weight=nw, norm_eps=1e-5),
            "fp8w": lambda: torch.ops.accelc.linear_fp8w(x, f8, s8),
            "fp8w+norm": lambda: torch.ops.accelc.linear_fp8w(x, f8, s8, norm_weight=nw, norm_eps=1e-5),
            "cublas fp16": lambda: torch.nn.functional.linear(x, w),
        }
        calls["int8w+norm"] = lambda: torch.ops.accelc.linear_w8a16(x, i8, si, norm_weight=nw, norm_eps=1e-5)
        for name, fn in calls.items():
            row = {"K": K, "N": N, "call": name}
            try:
                ms, graph = latency.layer_ms(fn, "cuda", rep_ms=20)
                row.update(race_us=round(ms * 1e3, 2), graph=graph, graph_error=_graph_error(fn) if not graph else "",
                           kernel_us=round(latency.kernel_ms(fn, "cuda", rep_ms=50) * 1e3, 2))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    cols = ["K", "N", "call", "race_us", "graph", "kernel_us", "graph_error", "error"]
    md = (f"# The guard's race timer against the kernels' GPU time, one row\n\n{env}\n\n"
          + md_table(cols, [[r.get(c, "") for c in cols] for r in rows]) + "\n")
    write(a.out, "race_probe", env, rows, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
