"""Depthwise convs on the GPU at real models' shapes: accelc::conv2d_depthwise (bias of the folded
BatchNorm and the activation fused) against eager PyTorch (cuDNN's depthwise conv + the
activation, channels-last, as accelc's pipeline feeds it) and torch.compile of the same function
(default mode: Inductor calls the conv and fuses the activation into a Triton kernel after it).

    python bench/depthwise.py [--out bench/results]

Timing as bench/gemm.py: CUDA-graph medians, ROUNDS interleaved rounds, speedups the median of
per-round ratios. A depthwise conv is memory-bound: GB/s counts x, y and the weights once.
Accuracy: relative L2 error against fp64.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401
from accelc.kernels.depthwise_conv import pack_weight  # noqa: E402

# (batch, channels, size, kernel, stride, activation, where)
SHAPES = [(32, 96, 56, 7, 1, "none", "ConvNeXt-T stage 1 b32"), (32, 192, 28, 7, 1, "none", "ConvNeXt-T stage 2"),
          (32, 384, 14, 7, 1, "none", "ConvNeXt-T stage 3"), (32, 768, 7, 7, 1, "none", "ConvNeXt-T stage 4"),
          (32, 144, 56, 3, 1, "silu", "EfficientNet-B0 3x3 b32"), (32, 144, 56, 3, 2, "silu", "EfficientNet-B0 3x3 s2"),
          (32, 480, 14, 5, 1, "silu", "EfficientNet-B0 5x5"), (32, 96, 112, 3, 2, "relu", "MobileNetV2 3x3 s2"),
          (1, 96, 56, 7, 1, "none", "ConvNeXt-T stage 1 b1")]
ROUNDS = 5



def _act(name):
    return {"none": lambda t: t, "silu": F.silu, "relu": F.relu}[name]


def rows_for(dtype=torch.float16) -> list[dict]:
    rows = []
    for N, C, S, R, st, act, where in SHAPES:
        pad = R // 2
        x = torch.randn(N, C, S, S, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
        w = torch.randn(C, 1, R, R, device="cuda", dtype=dtype) / R
        b = torch.randn(C, device="cuda", dtype=dtype)
        packed = pack_weight(w)
        fn = _act(act)

        def eager(x=x, w=w, b=b, fn=fn, st=st, pad=pad, C=C):
            return fn(F.conv2d(x, w, b, st, pad, 1, C))

        compiled = _common.compiled(eager)

        def accelc_dw(x=x, packed=packed, b=b, st=st, pad=pad, act=act):
            return torch.ops.accelc.conv2d_depthwise(x, packed, b, None, [st, st], [pad] * 4, [1, 1], act)

        ref = _act(act)(F.conv2d(x.double(), w.double(), b.double(), st, pad, 1, C))
        row = {"shape": f"{N}x{C}x{S}x{S} k{R} s{st}", "where": where, "activation": act,
               "dtype": str(dtype).replace("torch.", "")}
        rows.append(_common.measure_row(row, {"eager": eager, "compile": compiled, "accelc": accelc_dw}, ref, ROUNDS,
                                        flops=2 * ref.numel() * R * R,
                                        moved=(x.numel() + ref.numel() + w.numel()) * x.element_size(),
                                        label=f"{row['shape']:>24} {act}"))
    return rows


def markdown(env, rows) -> str:
    table = []
    for r in rows:
        table.append([r["where"], r["shape"], r["activation"], r["eager"]["us"], r["compile"]["us"], r["accelc"]["us"],
                      _common.gbs_cell(env, r['accelc']['gbs']), r["eager"]["gbs"],
                      _common.ratio_cell(r["vs_eager"]),
                      _common.ratio_cell(r["vs_compile"]),
                      f"{r['rel_err']['accelc']:.1e} / {r['rel_err']['eager']:.1e}"])
    return (f"# Depthwise conv + bias + activation, fp16, channels-last ({env['device']})\n\n{_common.env_line(env)}\n\n"
            "us: CUDA-graph median per call, median of rounds; GB/s: x, y and weights once over the time (% of the "
            "device's HBM bandwidth); speedups: median (min-max) of per-round ratios; error: relative L2 vs fp64, "
            "accelc / eager.\n\n"
            + _common.md_table(["model", "shape", "act", "eager (cuDNN) us", "torch.compile us", "accelc us",
                                "accelc GB/s", "eager GB/s", "accelc vs eager", "accelc vs compile",
                                "error accelc / eager"], table))


def main():
    _common.bench_main("depthwise", rows_for, markdown)


if __name__ == "__main__":
    main()
