"""Where an any-shape model's GPU memory goes: bench/dynamic.py's trace, one model, accelc's default
call and torch.compile reduce-overhead at the trace's largest request, each phase's allocated and
reserved bytes, and the live allocations grouped by the code that made them.

Phases (MiB above the process's baseline; the model's weights are the first row): after optimize;
after the warm-up pass over the trace (every bucket captured); the timed pass's peak. Then the
snapshot: every caching-allocator segment by memory pool (the default pool, or a CUDA-graph pool),
reserved and allocated; the live blocks by the innermost frame of accelc / transformers / torch
code that allocated them (torch.cuda.memory._record_memory_history, python stacks). Last, in the
same process after accelc's module is dropped: reduce-overhead at the largest request alone (three
calls, then the peak of a fourth). The bench's own copies of outputs are kept on the host, so no
side is charged for them.

    python bench/dynamic_memory.py --models gpt2,llama --requests 100 --out $OUT
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402
import dynamic  # noqa: E402

MIB = 2**20


def _mib(x) -> float:
    return round(x / MIB, 1)


def _now(device) -> dict:
    torch.cuda.synchronize(device)
    return {"allocated": _mib(torch.cuda.memory_allocated(device)),
            "reserved": _mib(torch.cuda.memory_reserved(device))}


def _site(frames) -> str:
    """The innermost frame in the project's or a library's code, as file:line function."""
    for want in ("/accelc/", "/kernels/", "/passes/", "transformers/", "torch/"):
        for f in frames:
            name = f.get("filename", "")
            if want in name and "memory.py" not in name and "contextlib" not in name:
                return f"{name.split('site-packages/')[-1].split('/work/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


def snapshot_summary(top: int = 25) -> dict:
    snap = torch.cuda.memory._snapshot()
    pools = collections.defaultdict(lambda: [0, 0, 0])
    sites = collections.Counter()
    counts = collections.Counter()
    for seg in snap["segments"]:
        key = str(tuple(seg.get("segment_pool_id", (0, 0))))
        pools[key][0] += seg["total_size"]
        pools[key][1] += seg["allocated_size"]
        pools[key][2] += 1
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                s = f"{'graph pool' if key != '(0, 0)' else 'default'} | {_site(b.get('frames', []))}"
                sites[s] += b["size"]
                counts[s] += 1
    return {"pools": {k: {"reserved_mib": _mib(v[0]), "allocated_mib": _mib(v[1]), "segments": v[2]}
                      for k, v in sorted(pools.items(), key=lambda kv: -kv[1][0])},
            "live_by_site": [{"site": s, "mib": _mib(n), "blocks": counts[s]} for s, n in sites.most_common(top)]}


def one_model(name: str, n_requests: int, out: Path, reference: bool = True) -> dict:
    import accelc

    device = torch.device("cuda")
    build, make, text = dynamic.models(False)[name]
    torch.manual_seed(0)
    base = _now(device)
    model = build().to(device).half().eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.empty_cache()       # the fp32 model's blocks, cached as it was converted
    requests = dynamic.trace(n_requests, text, False)
    example = {k: (v.to(device=device, dtype=torch.float16) if v.is_floating_point() else v.to(device))
               for k, v in make(2, 64 if text else 0).items()}
    torch.manual_seed(1)
    feeds = [{k: (v.half() if v.is_floating_point() else v).to(device) for k, v in make(b, n).items()}
             for b, n in requests]
    row = {"model": name, "requests": n_requests, "weights_mib": _mib(weights), "baseline": base,
           "after_model": _now(device)}
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=200000)
    t0 = time.perf_counter()
    opt = accelc.optimize(model, example)
    row["optimize_s"] = round(time.perf_counter() - t0, 1)
    opt.wait_for_other_shapes()  # (its glue for other shapes compiling after optimize, on copies of any state)
    row["after_optimize"] = _now(device)
    row["optimized_module_own_tensors_mib"] = dynamic.own_weights_mib(opt, model)
    with torch.no_grad():
        for f in feeds:
            opt(**f)
    row["after_warmup"] = _now(device)
    row["after_warmup_snapshot"] = snapshot_summary()
    runner = opt.runner
    if runner is not None:
        row["arena_mib"] = _mib(runner.arena.numel()) if runner.arena is not None else 0
        row["input_buffers_mib"] = _mib(sum(b.numel() * b.element_size() for e in runner.entries.values()
                                            for b in e.inputs if b is not None))
        row["graphs"] = sum(e.graph is not None for e in runner.entries.values())
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        for f in feeds:
            opt(**f)
    torch.cuda.synchronize(device)
    row["timed_peak"] = {"allocated": _mib(torch.cuda.max_memory_allocated(device)),
                         "reserved": _mib(torch.cuda.max_memory_reserved(device))}
    torch.cuda.memory._record_memory_history(enabled=None)
    del opt, runner
    gc.collect()
    torch.cuda.empty_cache()
    row["after_accelc_dropped"] = _now(device)
    if not reference:
        (out / f"dynamic_memory-{name}.json").write_text(json.dumps(row, indent=1))
        return row
    largest, peaks = dynamic.ro_one_shape_peaks(model, feeds, device)
    row["largest_request"] = {k: list(v.shape) for k, v in largest.items()}
    row["compile_ro_one_shape_peak"] = {"allocated": round(peaks["peak_mib"], 1),
                                        "reserved": round(peaks["peak_reserved_mib"], 1)}
    (out / f"dynamic_memory-{name}.json").write_text(json.dumps(row, indent=1))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip reduce-overhead's one-shape reference (a minute of compiling per model)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        row = one_model(args.one, args.requests, out, reference=not args.no_reference)
        print(json.dumps({k: v for k, v in row.items() if k != "after_warmup_snapshot"}, indent=1))
        for k, v in row["after_warmup_snapshot"]["pools"].items():
            print("pool", k, v)
        for s in row["after_warmup_snapshot"]["live_by_site"]:
            print(f"  {s['mib']:9.1f} MiB {s['blocks']:5d} blocks  {s['site']}")
        return
    print(_common.env_line(_common.environment()), flush=True)
    for m in args.models.split(","):       # each model in its own process: no side's memory left to the next
        subprocess.run([sys.executable, __file__, "--one", m, "--requests", str(args.requests), "--out", str(out)]
                       + (["--no-reference"] if args.no_reference else []))


if __name__ == "__main__":
    main()
