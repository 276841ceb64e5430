"""The tensor-parallel all-reduce alone: NCCL's against the one-shot kernels over symmetric memory
(accelc/fast_all_reduce.py: PyTorch's where it takes the dtype, accelc's kernels/all_reduce.py), at a decode step's
sizes (one to 16 rows of a 2048-8192-wide model) and up to the one-shot's limit, fp16 and bf16. Each side is 32
all-reduces captured in one CUDA graph, replayed; microseconds a call, the median of rounds, every rank in step
(a barrier before each round). The decode A/B (bench/tp.py --sides accelc,accelc_nccl) says what it is worth in a
step; this says what each call costs, waits for the other rank included; accelc's kernel each way its senders
signal (compare-and-swap; exchange, kernels/all_reduce.py's SIGNAL_BY_STORE; counted adds, its COUNTED_SIGNALS),
at every size up to MAX_BYTES (its own limit, where it beat NCCL, lifted here). (Sums equal to NCCL's: exactly on
two ranks; over more, the one-shot kernels add in another order.)

    torchrun --nproc-per-node 2 bench/all_reduce.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

CALLS = 32
SIDES = ("nccl", "one_shot", "one_shot_store", "one_shot_counted")   # (the kernel's three ways to signal)


def graph_of(fn, x, scale: float):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x
        for _ in range(CALLS):
            y = fn(y) * scale        # (each call on the last one's result: the calls cannot overlap)
    return g


def time_graph(g, rounds: int) -> float:
    import torch.distributed as dist
    times = []
    for _ in range(rounds):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    import torch.distributed as dist

    from accelc import fast_all_reduce, tensor_parallel
    from accelc.kernels import all_reduce as kernel

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    name = dist.group.WORLD.group_name

    def nccl(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    fast_all_reduce._TritonOneShot.max_bytes = fast_all_reduce.MAX_BYTES     # (the kernel at every size)
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for rows_, width in ((1, 2048), (1, 4096), (1, 8192), (16, 4096), (16, 8192)):
            x = torch.randn(rows_, width, device="cuda", dtype=dtype) * 0.01
            if x.numel() * x.element_size() > fast_all_reduce.MAX_BYTES:
                continue
            row = {"dtype": str(dtype)[6:], "shape": f"{rows_}x{width}", "kb": x.numel() * x.element_size() / 1024,
                   "world": world}
            for side in SIDES:
                os.environ["ACCELC_TP_ALL_REDUCE"] = "nccl" if side == "nccl" else "symm"
                kernel.SIGNAL_BY_STORE = side == "one_shot_store"   # (accelc's kernel only: fp16 on PyTorch 2.11)
                kernel.COUNTED_SIGNALS = side == "one_shot_counted"
                fn = (lambda t: tensor_parallel.all_reduce(t, name))
                got = fn(x)
                row[side + "_equal_nccl"] = bool(torch.equal(got, nccl(x)))
                g = graph_of(fn, x, 1.0 / world)
                row[side + "_us"] = round(time_graph(g, a.rounds), 2)
                g = None
            kind = fast_all_reduce._buffers.get((name, dtype, x.device))
            row["one_shot_kernel"] = type(kind).__name__ if kind else "none"
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    os.environ.pop("ACCELC_TP_ALL_REDUCE", None)
    if rank == 0:
        env = _common.environment()
        md = [f"# All-reduce alone, {world} GPUs\n", _common.env_line(env) + "\n",
              _common.md_table(["dtype", "shape", "KB", "NCCL us", "one-shot us", "one-shot, signals by exchange us",
                                "one-shot, counted signals us", "one-shot kernel", "sums as NCCL"],
                               [[r["dtype"], r["shape"], r["kb"], r["nccl_us"], r["one_shot_us"], r["one_shot_store_us"],
                                 r["one_shot_counted_us"], r["one_shot_kernel"],
                                 all(r[s + "_equal_nccl"] for s in SIDES)] for r in rows])]
        _common.write(a.out, f"all_reduce-x{world}", env, rows, "\n".join(md))
    fast_all_reduce.forget()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
