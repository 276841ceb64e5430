"""Where one whole-model call's time goes, on the GPU: the optimized model called back to back (the
e2e timer's method), the host's time per call alone, one call's GPU time from events around it, and
its kernels from the profiler (their sum, the idle time between them, the longest ones).

    python bench/call_breakdown.py --model bert --out DIR [--tag NAME]

Self-contained (torch, transformers and accelc.optimize only), so it runs against an older accelc
checked out elsewhere: run it from inside that checkout so that its `accelc` is imported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch


def build(name: str):
    import transformers as tf

    torch.manual_seed(0)
    if name == "bert":
        model, vocab, shape = tf.BertModel(tf.BertConfig()), 30522, (8, 384)
    elif name == "gpt2":
        model, vocab, shape = tf.GPT2Model(tf.GPT2Config(use_cache=False)), 50257, (4, 1024)
    else:
        raise SystemExit(f"unknown model {name!r} (bert, gpt2)")
    return model.cuda().half().eval(), (torch.randint(0, vocab, shape, device="cuda"),)


def per_call_ms(fn, n: int, wait: bool, rounds: int = 7) -> float:
    """ms per call of n back-to-back calls, median of rounds: the GPU's work included (wait: synchronised
    before the clock stops, the e2e timer's method), or the host's time alone (n small enough that
    launches do not block)."""
    per = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if wait:
            torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) * 1e3 / n)
        torch.cuda.synchronize()
    return statistics.median(per)


def isolated_gpu_ms(fn, rounds=21) -> float:
    """Events around one call on an idle GPU: its kernels and the gaps the host leaves between them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end))
    return statistics.median(per)


def profile(fn, calls=5):
    from torch.profiler import ProfilerActivity, profile as prof_

    torch.cuda.synchronize()
    with prof_(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) if kernels else 0
    by_name: dict = {}
    for e in kernels:
        s = by_name.setdefault(e.name[:120], [0, 0.0])
        s[0] += 1
        s[1] += e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    cpu = sorted(((e.key, e.cpu_time_total / calls) for e in p.key_averages()), key=lambda kv: -kv[1])[:25]
    return {"kernels_per_call": len(kernels) / calls, "kernel_us_per_call": busy / calls,
            "span_us_per_call": span / calls,
            "top_kernels": [{"name": k, "count_per_call": c / calls, "us_per_call": t / calls} for k, (c, t) in top],
            "top_cpu_ops_us_per_call": [{"name": n, "us": round(t, 1)} for n, t in cpu]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    import accelc

    model, inputs = build(args.model)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    row = {"model": args.model, "tag": args.tag, "git": rev, "accelc": str(Path(accelc.__file__).parent),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with torch.no_grad():
        fn = lambda: model(*inputs)  # noqa: E731
        row["eager"] = {"back_to_back_ms": per_call_ms(fn, 200, True), "host_ms": per_call_ms(fn, 20, False)}
        t0 = time.perf_counter()
        opt = accelc.optimize(model, inputs)
        row["optimize_s"] = round(time.perf_counter() - t0, 1)
        opt.wait_for_other_shapes()  # (the glue for other shapes compiling after optimize: nothing timed beside it)
        fn = lambda: opt(*inputs)  # noqa: E731
        for _ in range(5):
            fn()
        row["accelc"] = {"back_to_back_ms": per_call_ms(fn, 200, True), "host_ms": per_call_ms(fn, 20, False),
                         "isolated_gpu_ms": isolated_gpu_ms(fn), "profile": profile(fn)}
        row["runtime"] = opt.info.runtime
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"breakdown-{args.model}-{args.tag or rev}.json"
    (out / name).write_text(json.dumps(row, indent=1))
    a = row["accelc"]
    print(f"{args.tag or rev}: accelc {a['back_to_back_ms']:.3f} ms back to back, host {a['host_ms']:.3f}, "
          f"isolated GPU {a['isolated_gpu_ms']:.3f}, kernels {a['profile']['kernel_us_per_call']:.0f} us in "
          f"{a['profile']['kernels_per_call']:.0f}, span {a['profile']['span_us_per_call']:.0f} us; eager "
          f"{row['eager']['back_to_back_ms']:.3f}; optimize {row['optimize_s']} s", flush=True)


if __name__ == "__main__":
    main()
