"""Grouped 2-D convs and 1-D convs on the GPU at real models' shapes: accelc::conv2d (a group per
program slice) and accelc::conv1d (the height-1 conv), bias and activation fused, against eager
PyTorch (cuDNN's conv + the activation) and torch.compile of the same function.

    python bench/conv_grouped_1d.py [--out bench/results]

Inputs as accelc's pipeline hands them on: grouped 2-D convs channels-last on every side (as
bench/conv.py); 1-D convs channels-innermost for accelc (what an accelc conv1d writes) and also
row-major ("accelc, row-major x": the first conv of a stem, which copies its input once), row-major
for eager and torch.compile (what eager's convs write). Timing as bench/gemm.py: CUDA-graph
medians, ROUNDS interleaved rounds, speedups the median of per-round ratios. Accuracy: relative L2
error against fp64.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401
from accelc.kernels import conv, conv1d  # noqa: E402

# 2-D grouped: (batch, channels in, channels out, size, kernel, stride, groups, activation, where)
GROUPED = [(32, 128, 128, 56, 3, 1, 32, "relu", "ResNeXt-50 32x4d stage 1"),
           (32, 256, 256, 56, 3, 2, 32, "relu", "ResNeXt-50 stage 2 first (s2)"),
           (32, 256, 256, 28, 3, 1, 32, "relu", "ResNeXt-50 stage 2"),
           (32, 512, 512, 14, 3, 1, 32, "relu", "ResNeXt-50 stage 3"),
           (32, 1024, 1024, 7, 3, 1, 32, "relu", "ResNeXt-50 stage 4"),
           (32, 120, 120, 28, 3, 1, 5, "relu", "RegNetY-1.6GF stage 2 (24 a group)"),
           (32, 336, 336, 14, 3, 1, 14, "relu", "RegNetY-1.6GF stage 3"),
           (32, 888, 888, 7, 3, 1, 37, "relu", "RegNetY-1.6GF stage 4"),
           (1, 512, 512, 14, 3, 1, 32, "relu", "ResNeXt-50 stage 3 b1")]
# 1-D: (batch, channels in, channels out, length, kernel, stride, padding, groups, activation, where)
ONE_D = [(1, 80, 512, 3000, 3, 1, 1, 1, "gelu", "Whisper-base conv1 b1"),
         (8, 80, 512, 3000, 3, 1, 1, 1, "gelu", "Whisper-base conv1 b8"),
         (8, 512, 512, 3000, 3, 2, 1, 1, "gelu", "Whisper-base conv2 b8"),
         (1, 1280, 1280, 3000, 3, 2, 1, 1, "gelu", "Whisper-large conv2 b1"),
         (4, 512, 512, 3199, 3, 2, 0, 1, "gelu", "wav2vec2-base feature conv 2 b4"),
         (4, 512, 512, 99, 2, 2, 0, 1, "gelu", "wav2vec2-base feature conv 7 b4"),
         (1, 4096, 4096, 2048, 4, 1, 3, 4096, "silu", "Mamba-1.4B causal depthwise conv b1")]
ROUNDS = 5


def _act(name):
    return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[name]


def _grouped_rows(dtype) -> list[dict]:
    rows = []
    for N, C, K, S, R, st, g, act, where in GROUPED:
        pad = R // 2
        x = torch.randn(N, C, S, S, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
        w = torch.randn(K, C // g, R, R, device="cuda", dtype=dtype) / (C // g * R * R) ** 0.5
        b = torch.randn(K, device="cuda", dtype=dtype)
        packed, fn = conv.pack_weight(w), _act(act)

        def eager(x=x, w=w, b=b, fn=fn, st=st, pad=pad, g=g):
            return fn(F.conv2d(x, w, b, st, pad, 1, g))

        def ours(x=x, packed=packed, b=b, st=st, pad=pad, act=act):
            return torch.ops.accelc.conv2d(x, packed, b, None, [st, st], [pad] * 4, [1, 1], act)

        ref = fn(F.conv2d(x.double(), w.double(), b.double(), st, pad, 1, g))
        row = {"kind": "grouped 2-D", "shape": f"{N}x{C}x{S}x{S} -> {K} k{R} s{st} g{g}", "where": where,
               "activation": act, "dtype": str(dtype).replace("torch.", "")}
        rows.append(_common.measure_row(row, {"eager": eager, "compile": _common.compiled(eager), "accelc": ours},
                                        ref, ROUNDS, flops=2 * ref.numel() * R * R * (C // g),
                                        label=f"{row['shape']:>34}"))
    return rows


def _one_d_rows(dtype) -> list[dict]:
    rows = []
    for N, C, K, L, R, st, pad, g, act, where in ONE_D:
        x = torch.randn(N, C, L, device="cuda", dtype=dtype)
        x_cl = x.transpose(1, 2).contiguous().transpose(1, 2)     # channels innermost, as accelc::conv1d writes
        w = torch.randn(K, C // g, R, device="cuda", dtype=dtype) / (C // g * R) ** 0.5
        b = torch.randn(K, device="cuda", dtype=dtype)
        depthwise = g != 1 and g == C == K
        packed, fn = conv1d.pack_weight(w, depthwise), _act(act)

        def eager(x=x, w=w, b=b, fn=fn, st=st, pad=pad, g=g):
            return fn(F.conv1d(x, w, b, st, pad, 1, g))

        def ours(x=x_cl, packed=packed, b=b, st=st, pad=pad, act=act, depthwise=depthwise):
            return torch.ops.accelc.conv1d(x, packed, b, None, st, [pad, pad], 1, act, False, False, depthwise)

        def ours_row_major(x=x, packed=packed, b=b, st=st, pad=pad, act=act, depthwise=depthwise):
            return torch.ops.accelc.conv1d(x, packed, b, None, st, [pad, pad], 1, act, False, False, depthwise)

        ref = fn(F.conv1d(x.double(), w.double(), b.double(), st, pad, 1, g))
        row = {"kind": "1-D", "shape": f"{N}x{C}x{L} -> {K} k{R} s{st}" + (f" g{g}" if g > 1 else ""),
               "where": where, "activation": act, "dtype": str(dtype).replace("torch.", "")}
        _common.measure_row(row, {"eager": eager, "compile": _common.compiled(eager), "accelc": ours,
                                  "accelc_row_major": ours_row_major}, ref, ROUNDS,
                            flops=2 * ref.numel() * R * (C // g), label=f"{row['shape']:>34}")
        row["row_major_vs_eager"] = _common.speedup(row, "accelc_row_major", "eager")
        rows.append(row)
    return rows


def rows_for(dtype=torch.float16) -> list[dict]:
    return _grouped_rows(dtype) + _one_d_rows(dtype)


def markdown(env, rows) -> str:
    table = []
    for r in rows:
        rm = r.get("accelc_row_major")
        table.append([r["where"], r["shape"], r["activation"], r["eager"]["us"], r["compile"]["us"], r["accelc"]["us"],
                      _common.rate_cell(env, r["accelc"]["tflops"]), _common.ratio_cell(r["vs_eager"]),
                      _common.ratio_cell(r["vs_compile"]),
                      f"{rm['us']} ({_common.ratio_cell(r['row_major_vs_eager'])})" if rm else "",
                      f"{r['rel_err']['accelc']:.1e} / {r['rel_err']['eager']:.1e}"])
    return (f"# Grouped and 1-D convs + bias + activation, fp16 ({env['device']})\n\n{_common.env_line(env)}\n\n"
            "us: CUDA-graph median per call, median of rounds; speedups: median (min-max) of per-round ratios; "
            "inputs: channels-last (2-D, every side); 1-D: accelc channels-innermost, eager and torch.compile "
            "row-major, and accelc on the row-major input in its own column (its speedup vs eager beside it); "
            "error: relative L2 vs fp64, accelc / eager.\n\n"
            + _common.md_table(["model", "shape", "act", "eager (cuDNN) us", "torch.compile us", "accelc us",
                                "accelc TF/s", "accelc vs eager", "accelc vs compile", "accelc, row-major x: us (vs eager)",
                                "error accelc / eager"], table))


def main():
    _common.bench_main("conv_grouped_1d", rows_for, markdown)


if __name__ == "__main__":
    main()
