"""Profiler evidence: accelc's kernel and the library's (cuBLAS, cuDNN, cuDNN SDPA, torch._int_mm)
at the same shape, one launch each, between cudaProfilerStart / Stop, for Nsight Compute:

    ncu --profile-from-start off --clock-control none --csv --log-file ncu.csv --metrics M \\
        python bench/ncu_profile.py --cases-out cases.json [CASE ...]
    python bench/ncu_profile.py --summary ncu.csv cases.json

Run `python bench/ncu_profile.py --tune [CASE ...]` first, without the profiler: it tunes the cases
into the machine's tuning cache, so the profiled run launches the configs a normal run picks.
(Under the profiler accelc's tuner still tunes what is not cached, for that process only: it
does not write choices timed under a profiler, accelc/tuning.py.)

CASE: gemm:M,K,N[,act][,gluon=I] (I: forces gemm.GLUON_CONFIGS[I])  conv:N,C,H,K,R,stride  attn:B,H,L,D[,causal]  int8:M,K,N  or a group:
models (the real-model GEMM shapes accelc is behind at), convs (ResNet-50's 3x3s and the stem at
batch 32), attns (bench/attention.py's shapes), int8s (bench/int8.py's two large ones), or one of
the first run's names (gemm512 vitqkv bertout conv7 attn).

M: gpu__time_duration.sum, sm__throughput / dram__throughput / sm__warps_active (pct of peak),
launch__registers_per_thread, launch__grid_size, launch__block_size,
launch__shared_mem_per_block_dynamic, regex:sm__pipe_tensor_op.*cycles_active.avg.pct_of_peak_sustained_active,
regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio. Durations under ncu are
longer than in the benchmarks (each kernel is replayed once per metric pass); compare the two
sides of a shape with each other.

Each side of a case runs after a marker kernel (torch.cuda._sleep's spin_kernel), so the summary
gives each kernel to its case and side without reading NVTX ranges.
"""
import collections
import csv
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MARKER = "spin_kernel"
GROUPS = {
    "models": ["gemm:4096,4096,16384,gelu", "gemm:512,4096,4096,gelu", "gemm:6304,768,2304", "gemm:6304,768,768",
               "gemm:6304,3072,768", "gemm:3072,768,768", "gemm:3072,3072,768", "gemm:4096,768,2304",
               "gemm:4096,3072,768", "gemm:2048,2048,256", "gemm:6272,1536,384", "gemm:1568,3072,768",
               "gemm:1568,512,2048", "gemm:100352,144,24"],
    "convs": ["conv:32,3,224,64,7,2", "conv:32,64,56,64,3,1", "conv:32,128,28,128,3,1", "conv:32,256,14,256,3,1",
              "conv:32,512,7,512,3,1", "conv:32,128,56,128,3,2", "conv:32,256,28,256,3,2",
              "conv:32,512,14,512,3,2", "conv:1,64,56,64,3,1", "conv:8,256,14,256,3,1"],
    "attns": ["attn:8,16,1024,64", "attn:8,16,1024,64,causal", "attn:4,16,4096,64", "attn:4,16,4096,128",
              "attn:4,16,4096,128,causal", "attn:32,12,197,64", "attn:8,12,384,64"],
    "int8s": ["int8:4096,4096,16384", "int8:512,4096,4096"],
    "gemm512": ["gemm:512,4096,4096,gelu"], "vitqkv": ["gemm:6304,768,2304"], "bertout": ["gemm:3072,3072,768"],
    "conv7": ["conv:32,512,7,512,3,1"], "attn": ["attn:4,16,4096,128"],
}


def summarize(path, cases_path):
    cases = json.load(open(cases_path))
    rows = list(csv.reader(open(path)))
    hdr_i = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    hdr, data = rows[hdr_i], rows[hdr_i + 1:]
    ix = {k: hdr.index(k) for k in ["ID", "Kernel Name", "Metric Name", "Metric Value"]}
    per = collections.OrderedDict()
    for r in data:
        if len(r) < len(hdr):
            continue
        per.setdefault((int(r[ix["ID"]]), r[ix["Kernel Name"]]), {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
    # kernels between markers: case 0 accelc, case 0 library, case 1 accelc, ...
    sides, cur = [], None
    for (i, name), m in sorted(per.items()):
        if MARKER in name:
            cur = []
            sides.append(cur)
        elif cur is not None:
            cur.append((name, m))
    for c, case in enumerate(cases):
        print(f"## {case}")
        for s, label in ((2 * c, "accelc"), (2 * c + 1, "library")):
            for name, m in (sides[s] if s < len(sides) else []):
                print(f"  {label:7s} {name[:70]}")
                print("          " + _line(m))


def _num(v):
    try:
        return float(str(v).replace(",", ""))
    except (TypeError, ValueError):
        return float("nan")


def _line(m) -> str:
    tensor = max((_num(v) for k, v in m.items() if "pipe_tensor" in k and "hmma_type" not in k), default=float("nan"))
    stalls = sorted(((_num(v), k.split("stalled_")[1].split("_per_")[0]) for k, v in m.items()
                     if "issue_stalled" in k and _num(v) == _num(v)), reverse=True)[:4]
    return (f"{_num(m.get('gpu__time_duration.sum')) / 1e3:.1f} us (ncu), tensor {tensor:.0f}%, "
            f"SM {_num(m.get('sm__throughput.avg.pct_of_peak_sustained_elapsed')):.0f}%, "
            f"DRAM {_num(m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed')):.0f}%, "
            f"warps active {_num(m.get('sm__warps_active.avg.pct_of_peak_sustained_active')):.1f}%, "
            f"{m.get('launch__registers_per_thread')} regs, grid {m.get('launch__grid_size')} x "
            f"{m.get('launch__block_size')} threads, smem {m.get('launch__shared_mem_per_block_dynamic')} B; "
            "stalls/issue " + ", ".join(f"{k} {v:.2f}" for v, k in stalls))


def build(spec):
    """(accelc callable, library callable) for one case."""
    from accelc.kernels import conv, int8_gemm
    from accelc.kernels.int8_gemm import quantize_weight
    from accelc.kernels.quantize import quantize_launch

    dev, h = "cuda", torch.float16
    kind, _, rest = spec.partition(":")
    parts = rest.split(",")
    if kind == "gemm":
        from accelc.kernels import gemm
        forced = [int(p.split("=")[1]) for p in parts if p.startswith("gluon=")]
        parts = [p for p in parts if not p.startswith("gluon=")]
        M, K, N = map(int, parts[:3])
        act = parts[3] if len(parts) > 3 else "none"
        x = torch.randn(M, K, device=dev, dtype=h)
        w = torch.randn(N, K, device=dev, dtype=h) / K ** 0.5
        b = torch.randn(N, device=dev, dtype=h)
        if forced:
            def accelc_gemm():
                with gemm.TUNER.force(gemm.GLUON_CONFIGS[forced[0]]):
                    return gemm.linear_launch(x, w, b, None, act)
            return accelc_gemm, (lambda: F.linear(x, w, b))
        return (lambda: torch.ops.accelc.linear(x, w, b, None, act)), (lambda: F.linear(x, w, b))
    if kind == "conv":
        N, C, H, K, R, st = map(int, parts)
        x = torch.randn(N, C, H, H, device=dev, dtype=h).contiguous(memory_format=torch.channels_last)
        w4 = torch.randn(K, C, R, R, device=dev, dtype=h) / (C * R * R) ** 0.5
        wcl, pk, p = w4.contiguous(memory_format=torch.channels_last), conv.pack_weight(w4), R // 2
        return (lambda: torch.ops.accelc.conv2d(x, pk, None, None, [st, st], [p] * 4, [1, 1], "none", False),
                lambda: F.conv2d(x, wcl, None, st, p))
    if kind == "attn":
        B, H, L, D = map(int, parts[:4])
        causal = len(parts) > 4 and parts[4] == "causal"
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=h) for _ in range(3))

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return (lambda: torch.ops.accelc.flash_attention(q, k, v, None, causal)), sdpa
    if kind == "int8":
        M, K, N = map(int, parts)
        x = torch.randn(M, K, device=dev, dtype=h)
        w_q, w_s = quantize_weight(torch.randn(N, K, device=dev) / K ** 0.5)
        b = torch.randn(N, device=dev, dtype=h)
        qx, a_s = quantize_launch(x)
        w_qt = w_q.t()
        return (lambda: int8_gemm.int8_gemm_launch(qx, a_s, w_q, w_s, b, activation="gelu"),
                lambda: torch._int_mm(qx, w_qt))
    raise SystemExit(f"unknown case {spec!r}")


def main(argv):
    if argv[:1] == ["--summary"]:
        summarize(argv[1], argv[2])
        return
    cases_out, tune_only = None, argv[:1] == ["--tune"]
    if tune_only:
        argv = argv[1:]
    if argv[:1] == ["--cases-out"]:
        cases_out, argv = argv[1], argv[2:]
    specs = [s for a in (argv or ["gemm512", "vitqkv", "bertout", "conv7", "attn"]) for s in GROUPS.get(a, [a])]
    import accelc  # noqa: F401  (registers torch.ops.accelc.*)
    cases = [(s, *build(s)) for s in specs]
    for _, a, b in cases:          # warm up: tuning, cuDNN plans
        for _ in range(3):
            a(), b()
    torch.cuda.synchronize()
    if tune_only:
        print("tuned:", specs)
        return
    torch.cuda.cudart().cudaProfilerStart()
    for _, a, b in cases:
        torch.cuda._sleep(100)
        a()
        torch.cuda._sleep(100)
        b()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    if cases_out:
        json.dump(specs, open(cases_out, "w"))
    print("cases:", specs)


if __name__ == "__main__":
    main(sys.argv[1:])
