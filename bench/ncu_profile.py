"""Profiler evidence: accelc's kernel and the library's (cuBLAS, cuDNN, cuDNN SDPA, torch._int_mm)
at the same shape, one launch each, between cudaProfilerStart / Stop, for Nsight Compute:

    ncu --profile-from-start off --clock-control none --csv --log-file ncu.csv \\
        --metrics $(python bench/ncu_profile.py --metrics) python bench/ncu_profile.py --cases-out cases.json [CASE ...]
    python bench/ncu_profile.py --summary ncu.csv cases.json [--markdown table.md]

Run `python bench/ncu_profile.py --tune [CASE ...]` first, without the profiler: it tunes the cases
into the machine's tuning cache, so the profiled run launches the configs a normal run picks.
(Under the profiler accelc's tuner still tunes what is not cached, for that process only: it
does not write choices timed under a profiler, accelc/tuning.py.)

CASE: gemm:M,K,N[,act][,res][,kn][,lt][,gluon=I] (res: a residual added after the activation; kn: the weight
stored (K, N), as GPT-2's Conv1D; lt: the library side with cuBLASLt's fused bias + GELU epilogue instead of
F.linear alone; I: forces gemm.GLUON_CONFIGS[I])  conv:N,C,H,K,R,stride  attn:B,H,L,D[,causal|bert]
int8:M,K,N  or a group:
models (the real-model GEMM shapes accelc was behind at on 11-22), convs (ResNet-50's 3x3s and the
stem at batch 32), attns (bench/attention.py's shapes), int8s (bench/int8.py's two large ones),
layers (every GEMM layer of bench/gemm_models.py with its epilogue), resnet (every conv of
bench/conv.py at batch 32, the 3x3s also at 1 and 8), or one of the first run's names (gemm512 vitqkv
bertout conv7 attn). attn ...,bert: BERT-base's layout (q, k, v viewed per head from one (B, L, 3, H, D)
projection) and an additive key padding mask, as bench/attention.py's bert case.

METRICS: time, SM / DRAM / L2 throughput and warps active (pct of peak), tensor-pipe cycles active,
L2 hit rate, DRAM bytes read, L2 bytes (every request the SMs made of it), instructions executed, the
launch (registers, grid, block, dynamic shared memory), and every warp-stall reason per issue. Durations
under ncu are longer than in the benchmarks (each kernel is replayed once per metric pass, caches flushed);
compare the two sides of a shape with each other.

Each side of a case runs after a marker kernel (torch.cuda._sleep's spin_kernel), so the summary
gives each kernel to its case and side without reading NVTX ranges.
"""
import ast
import collections
import csv
import gzip
import json
import sys
from pathlib import Path

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
GROUPS["attns"] += ["attn:8,12,384,64,bert", "attn:4,12,1024,64,causal"]
METRICS = ",".join([
    "gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active", "lts__t_sector_hit_rate.pct", "dram__bytes_read.sum",
    "lts__t_bytes.sum", "smsp__inst_executed.sum", "launch__registers_per_thread", "launch__grid_size",
    "launch__block_size", "launch__shared_mem_per_block_dynamic",
    "regex:sm__pipe_tensor_op.*cycles_active.avg.pct_of_peak_sustained_active",
    "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"])


def _bench_list(script: str, name: str) -> list:
    """A list a bench script defines at its top level (bench/conv.py's SHAPES, bench/gemm_models.py's
    LAYERS), read from its source: importing those scripts points the tuning cache at a fresh directory."""
    tree = ast.parse((Path(__file__).parent / script).read_text())
    node = next(n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name)
    return eval(compile(ast.Expression(node), script, "eval"), {})


def _layers_group() -> list[str]:
    """Every GEMM layer of bench/gemm_models.py (not its 1x1 convs) with its activation and residual."""
    return [f"gemm:{M},{K},{N},{act}" + (",res" if res else "") + (",kn" if kind == "conv1d" else "")
            for _, _, M, K, N, act, res, kind in _bench_list("gemm_models.py", "LAYERS")
            if kind in ("linear", "conv1d")]


def _resnet_group() -> list[str]:
    """Every conv of bench/conv.py at batch 32, and its 3x3 ones at batch 1 and 8."""
    shapes = _bench_list("conv.py", "SHAPES")
    return ([f"conv:32,{C},{H},{K},{R},{st}" for C, H, K, R, st, _ in shapes]
            + [f"conv:{n},{C},{H},{K},{R},{st}" for n in (1, 8) for C, H, K, R, st, _ in shapes if R == 3])


GROUPS["layers"], GROUPS["resnet"] = _layers_group(), _resnet_group()


_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
          "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "KB": 1e-3, "MB": 1.0, "GB": 1e3}


def summarize(path, cases_path, markdown=None):
    """Each case's kernels, accelc's side then the library's, as text; with `markdown`, also a table."""
    cases = [c if isinstance(c, dict) else {"case": c, "chosen": []} for c in json.load(open(cases_path))]
    for case in cases:   # (a first version of --cases-out wrote each choice as "tuner: {config}")
        case["chosen"] = [c if isinstance(c, dict) else dict(zip(("tuner", "config"), _split_choice(c)))
                          for c in case["chosen"]]
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        rows = list(csv.reader(f))
    hdr_i = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    hdr, data = rows[hdr_i], rows[hdr_i + 1:]
    ix = {k: hdr.index(k) for k in ["ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"]}
    per = collections.OrderedDict()
    for r in data:
        if len(r) < len(hdr):
            continue
        value = _num(r[ix["Metric Value"]]) * _SCALE.get(r[ix["Metric Unit"]], 1.0)   # times in us, bytes in MB
        per.setdefault((int(r[ix["ID"]]), r[ix["Kernel Name"]]), {})[r[ix["Metric Name"]]] = \
            value if value == value else r[ix["Metric Value"]]
    # kernels between markers: case 0 accelc, case 0 library, case 1 accelc, ...
    sides, cur = [], None
    for (i, name), m in sorted(per.items()):
        if MARKER in name:
            cur = []
            sides.append(cur)
        elif cur is not None:
            cur.append((name, m))
    compare = ["| case | accelc kernels | accelc us | library us | accelc / library time | tensor, its busiest "
               "kernel (accelc / library) | L2 MB (accelc / library) | CTAs x threads, its longest kernel (accelc / "
               "library) | accelc config |", "|" + "---|" * 9]
    table = ["| case | side | kernel | us (ncu) | tensor | SM | DRAM | L2 | L2 hit | DRAM read MB | L2 MB | "
             "instructions (M) | grid x block | regs | smem KB | top stalls (cycles per issue) |", "|" + "---|" * 16]
    for c, case in enumerate(cases):
        print(f"## {case['case']}")
        for chosen in case["chosen"]:
            print(f"  chosen: {chosen['tuner']}: {chosen['config']}")
        ours, lib = (sides[s] if s < len(sides) else [] for s in (2 * c, 2 * c + 1))
        for kernels, label in ((ours, "accelc"), (lib, "library")):
            for name, m in kernels:
                print(f"  {label:7s} {name[:70]}")
                print("          " + _line(m))
                table.append(f"| {case['case']} | {label} | {name[:60]} | " + " | ".join(_cells(m)) + " |")
        if ours and lib:
            compare.append(_compare_row(case, ours, lib))
    if markdown:
        Path(markdown).write_text("\n".join(compare) + "\n\nEvery kernel:\n\n" + "\n".join(table) + "\n")


def _split_choice(text: str) -> tuple:
    tuner, config = text.split(": ", 1)
    return tuner, ast.literal_eval(config)


def _compare_row(case, ours, lib) -> str:
    """One case: each side's kernels summed, and its main (longest) kernel's tensor use, L2 traffic and launch."""
    def side(kernels):
        us = sum(_us(m) for _, m in kernels)
        main = max(kernels, key=lambda k: _us(k[1]))[1]
        l2 = sum(_num(m.get("lts__t_bytes.sum")) for _, m in kernels)
        return us, main, l2, max(_tensor(m) for _, m in kernels)
    (ua, ma, la, ta), (ul, ml, ll, tl) = side(ours), side(lib)
    names = ", ".join(dict.fromkeys(n.split("(")[0].split("<")[0][:40] for n, _ in ours))
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_H", "BLOCK_W", "BLOCK_K", "STAGES", "CONSUMERS", "GLUON", "COOP", "SPLIT",
            "num_warps")
    configs = "; ".join(" ".join(f"{k}={v}" for k, v in c["config"].items() if k in keys) for c in case["chosen"])
    forced = [p for p in case["case"].split(",") if p.startswith("gluon=")]
    return (f"| {case['case']} | {names} | {ua:.1f} | {ul:.1f} | {ua / ul:.2f} | {ta:.0f}% / {tl:.0f}% "
            f"| {la:.0f} / {ll:.0f} | {_launch(ma)} / {_launch(ml)} | "
            f"{configs or ('forced: GLUON_CONFIGS[' + forced[0][6:] + ']' if forced else '')} |")


def _num(v):
    try:
        return float(str(v).replace(",", ""))
    except (TypeError, ValueError):
        return float("nan")


def _us(m) -> float:
    return _num(m.get("gpu__time_duration.sum"))


def _launch(m) -> str:
    return f"{_num(m.get('launch__grid_size')):.0f} x {_num(m.get('launch__block_size')):.0f}"


def _tensor(m) -> float:
    return max((_num(v) for k, v in m.items() if "pipe_tensor" in k and "hmma_type" not in k), default=float("nan"))


def _stalls(m, n=3) -> list:
    return sorted(((_num(v), k.split("stalled_")[1].split("_per_")[0]) for k, v in m.items()
                   if "issue_stalled" in k and _num(v) == _num(v)), reverse=True)[:n]


def _pct(m, key) -> str:
    return f"{_num(m.get(key)):.0f}%"


def _cells(m) -> list[str]:
    return [f"{_us(m):.1f}", f"{_tensor(m):.0f}%",
            _pct(m, "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
            _pct(m, "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
            _pct(m, "lts__throughput.avg.pct_of_peak_sustained_elapsed"), _pct(m, "lts__t_sector_hit_rate.pct"),
            f"{_num(m.get('dram__bytes_read.sum')):.1f}", f"{_num(m.get('lts__t_bytes.sum')):.1f}",
            f"{_num(m.get('smsp__inst_executed.sum')) / 1e6:.2f}",
            _launch(m), f"{_num(m.get('launch__registers_per_thread')):.0f}",
            f"{_num(m.get('launch__shared_mem_per_block_dynamic')) / 1024:.0f}",
            ", ".join(f"{k} {v:.2f}" for v, k in _stalls(m))]


def _line(m) -> str:
    return (f"{_us(m):.1f} us (ncu), tensor {_tensor(m):.0f}%, "
            f"SM {_num(m.get('sm__throughput.avg.pct_of_peak_sustained_elapsed')):.0f}%, "
            f"DRAM {_num(m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed')):.0f}%, "
            f"L2 hit {_num(m.get('lts__t_sector_hit_rate.pct')):.0f}%, "
            f"DRAM read {_num(m.get('dram__bytes_read.sum')):.1f} MB, "
            f"warps active {_num(m.get('sm__warps_active.avg.pct_of_peak_sustained_active')):.1f}%, "
            f"{_num(m.get('launch__registers_per_thread')):.0f} regs, grid {_launch(m)} threads, "
            f"smem {_num(m.get('launch__shared_mem_per_block_dynamic')):.0f} B; "
            "stalls/issue " + ", ".join(f"{k} {v:.2f}" for v, k in _stalls(m, 4)))


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
        flags = {p for p in parts[3:] if p in ("res", "kn", "lt")}
        parts = [p for p in parts if not p.startswith("gluon=") and p not in flags]
        M, K, N = map(int, parts[:3])
        act = parts[3] if len(parts) > 3 else "none"
        x = torch.randn(M, K, device=dev, dtype=h)
        w = torch.randn(K, N, device=dev, dtype=h).t() if "kn" in flags else torch.randn(N, K, device=dev, dtype=h)
        w = w / K ** 0.5
        b = torch.randn(N, device=dev, dtype=h)
        r = torch.randn(M, N, device=dev, dtype=h) if "res" in flags else None
        library = (lambda: F.linear(x, w, b))
        if "lt" in flags:   # the library with its own fused epilogue: cuBLASLt's bias + GELU (its tanh form)
            library = (lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
        if forced:
            def accelc_gemm():
                with gemm.TUNER.force(gemm.GLUON_CONFIGS[forced[0]]):
                    return gemm.linear_launch(x, w, b, r, act)
            return accelc_gemm, library
        return (lambda: torch.ops.accelc.linear(x, w, b, r, act)), library
    if kind == "conv":
        N, C, H, K, R, st = map(int, parts)
        x = torch.randn(N, C, H, H, device=dev, dtype=h).contiguous(memory_format=torch.channels_last)
        w4 = torch.randn(K, C, R, R, device=dev, dtype=h) / (C * R * R) ** 0.5
        wcl, pk, p = w4.contiguous(memory_format=torch.channels_last), conv.pack_weight(w4), R // 2
        return (lambda: torch.ops.accelc.conv2d(x, pk, None, None, [st, st], [p] * 4, [1, 1], "none", False),
                lambda: F.conv2d(x, wcl, None, st, p))
    if kind == "attn":
        B, H, L, D = map(int, parts[:4])
        causal, mask = "causal" in parts[4:], None
        if "bert" in parts[4:]:     # bench/attention.py's bert case
            qkv = torch.randn(B, L, 3, H, D, device=dev, dtype=h)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            mask = torch.zeros(B, 1, 1, L, device=dev, dtype=h)
            for i in range(B):
                mask[i, ..., L - 24 * i:] = torch.finfo(h).min
        else:
            q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=h) for _ in range(3))

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return (lambda: torch.ops.accelc.flash_attention(q, k, v, mask, causal)), sdpa
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
        summarize(argv[1], argv[2], argv[4] if argv[3:4] == ["--markdown"] else None)
        return
    if argv[:1] == ["--metrics"]:
        print(METRICS)
        return
    cases_out, tune_only = None, argv[:1] == ["--tune"]
    if tune_only:
        argv = argv[1:]
    if argv[:1] == ["--cases-out"]:
        cases_out, argv = argv[1], argv[2:]
    specs = [s for a in (argv or ["gemm512", "vitqkv", "bertout", "conv7", "attn"]) for s in GROUPS.get(a, [a])]
    import accelc  # noqa: F401  (registers torch.ops.accelc.*)
    from accelc import tuning

    cases = [(s, *build(s)) for s in specs]
    chosen = []
    for _, a, b in cases:          # warm up: tuning, cuDNN plans; what each case's tuners chose
        before = {(t.name, k) for t in tuning._TUNERS for k in t.chosen}
        for _ in range(3):
            a(), b()
        chosen.append([{"tuner": t.name, "config": tuning.config_dict(c)} for t in tuning._TUNERS
                       for k, c in t.chosen.items() if (t.name, k) not in before])
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
        json.dump([{"case": s, "chosen": c} for s, c in zip(specs, chosen)], open(cases_out, "w"), indent=1)
    print("cases:", specs)


if __name__ == "__main__":
    main(sys.argv[1:])
