"""Profiler evidence: accelc's kernel and the library's (cuBLAS, cuDNN, cuDNN SDPA) at the same
shape, one launch each, between cudaProfilerStart / Stop, for Nsight Compute:

    ncu --profile-from-start off --clock-control none --csv --log-file ncu.csv --metrics M \
        python bench/ncu_profile.py [gemm512 vitqkv bertout conv7 attn]
    python bench/ncu_profile.py --summary ncu.csv

M: gpu__time_duration.sum, sm__throughput / dram__throughput / sm__warps_active (pct of peak),
launch__registers_per_thread, launch__grid_size, launch__block_size,
launch__shared_mem_per_block_dynamic, regex:sm__pipe_tensor_op.*cycles_active.avg.pct_of_peak_sustained_active,
regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio. Durations under ncu are
longer than in the benchmarks (each kernel is replayed once per metric pass); compare the two
kernels of a shape with each other.
"""
import collections
import csv
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import accelc  # noqa: F401
from accelc.kernels import conv


def summarize(path):
    rows = list(csv.reader(open(path)))
    hdr_i = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    hdr = rows[hdr_i]; data = rows[hdr_i + 1:]
    ix = {k: hdr.index(k) for k in ["ID", "Kernel Name", "Metric Name", "Metric Value", "Metric Unit"]}
    per = collections.OrderedDict()
    for r in data:
        if len(r) < len(hdr): continue
        per.setdefault((r[ix["ID"]], r[ix["Kernel Name"]][:60]), {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
    keys = ["gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__warps_active.avg.pct_of_peak_sustained_active",
            "launch__registers_per_thread", "launch__grid_size", "launch__block_size", "launch__shared_mem_per_block_dynamic"]
    for (i, name), m in per.items():
        print(f"== {i} {name}")
        print("   " + ", ".join(f"{k.split('.')[0].replace('__', '_').replace('gpu_', '').replace('launch_', '')}={m.get(k)}"
                                for k in keys))
        tensor = {k: v for k, v in m.items() if "pipe_tensor" in k}
        print("   tensor:", ", ".join(f"{k.replace('sm__pipe_tensor_op_','').replace('.avg.pct_of_peak_sustained_active','')}={v}" for k, v in tensor.items()))
        st = sorted(((float(v.replace(',', '')), k) for k, v in m.items() if "issue_stalled" in k and v.replace(',', '').replace('.', '', 1).isdigit()), reverse=True)[:6]
        print("   stalls/issue:", ", ".join(f"{k.split('stalled_')[1].split('_per_')[0]}={v:.2f}" for v, k in st))


if len(sys.argv) == 3 and sys.argv[1] == "--summary":
    summarize(sys.argv[2])
    sys.exit()

which = sys.argv[1:] or ["gemm512", "vitqkv", "bertout", "conv7", "attn"]
dev, h = "cuda", torch.float16
cases = []
def lin(M, K, N, act):
    x = torch.randn(M, K, device=dev, dtype=h); w = torch.randn(N, K, device=dev, dtype=h) / K**.5
    b = torch.randn(N, device=dev, dtype=h)
    return (lambda: torch.ops.accelc.linear(x, w, b, None, act)), (lambda: F.linear(x, w, b))
if "gemm512" in which: cases.append(("gemm 512x4096x4096 gelu",) + lin(512, 4096, 4096, "gelu"))
if "vitqkv" in which: cases.append(("gemm ViT qkv 6304x768x2304",) + lin(6304, 768, 2304, "none"))
if "bertout" in which: cases.append(("gemm BERT out 3072x3072x768",) + lin(3072, 3072, 768, "none"))
if "conv7" in which:
    x = torch.randn(32, 512, 7, 7, device=dev, dtype=h).contiguous(memory_format=torch.channels_last)
    w4 = torch.randn(512, 512, 3, 3, device=dev, dtype=h) / 48
    wcl = w4.contiguous(memory_format=torch.channels_last); pk = conv.pack_weight(w4)
    cases.append(("conv 3x3 512@7x7 b32", lambda: torch.ops.accelc.conv2d(x, pk, None, None, [1, 1], [1, 1, 1, 1], [1, 1], "none", False),
                  lambda: F.conv2d(x, wcl, None, 1, 1)))
if "attn" in which:
    q, k, v = (torch.randn(4, 16, 4096, 128, device=dev, dtype=h) for _ in range(3))
    def sd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    cases.append(("attention 4x16x4096x128", lambda: torch.ops.accelc.flash_attention(q, k, v), sd))
for name, a, b in cases:          # warm up: tuning, cuDNN plans
    for _ in range(3): a(); b()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for name, a, b in cases:
    torch.cuda.nvtx.range_push(name); a(); b(); torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("cases:", [c[0] for c in cases])
