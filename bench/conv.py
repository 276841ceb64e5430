"""accelc::conv2d, fp16, batch 32, ResNet-50 layer shapes, on the GPU:

  fused:  accelc conv + folded BN + ReLU (NHWC in, as inside a run of rewritten convs)
          vs (a) PyTorch eager conv -> bn -> relu on NCHW tensors, as a user's model runs it
  alone:  accelc conv alone vs (b) cuDNN conv alone on channels-last tensors

    python bench/conv.py [--out bench/results]

Timed like bench/gemm.py: CUDA-graph medians in interleaved rounds, speedups as medians of
per-round ratios. FLOPs 2 * N * OH * OW * K * C * R * S.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401
from accelc.kernels import conv  # noqa: E402
from accelc.passes.fold_bn import fold  # noqa: E402

SHAPES = [(64, 56, 64, 3, 1), (128, 28, 128, 3, 1), (256, 14, 256, 3, 1), (512, 7, 512, 3, 1),
          (256, 56, 64, 1, 1), (3, 224, 64, 7, 2)]  # (C, H, K, R, stride)
BATCH = 32
ROUNDS = 5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    env = _common.environment()
    print(_common.env_line(env))
    rows = []
    for C, H, K, R, st in SHAPES:
        pad = R // 2
        cv = nn.Conv2d(C, K, R, st, pad, bias=False).cuda().half().eval()
        bn = nn.BatchNorm2d(K).cuda().half().eval()
        with torch.no_grad():
            bn.running_mean.uniform_(-0.2, 0.2), bn.running_var.uniform_(0.5, 1.5)
        x = torch.randn(BATCH, C, H, H, device="cuda", dtype=torch.float16)
        x_cl = x.contiguous(memory_format=torch.channels_last)
        cv_cl = nn.Conv2d(C, K, R, st, pad, bias=False).cuda().half().eval().to(memory_format=torch.channels_last)
        cv_cl.weight.data.copy_(cv.weight.data)
        w, b = fold(cv.weight.detach(), None, bn.running_mean, bn.running_var, bn.weight.detach(), bn.bias.detach(),
                    bn.eps)
        packed = conv.pack_weight(w)
        packed_plain = conv.pack_weight(cv.weight.detach())
        geo = ([st, st], [pad] * 4, [1, 1])

        variants = {
            "eager_nchw_conv_bn_relu": lambda: torch.relu(bn(cv(x))),
            "accelc_fused_bn_relu": lambda: torch.ops.accelc.conv2d(x_cl, packed, b, None, *geo, "relu"),
            "cudnn_nhwc_conv": lambda: cv_cl(x_cl),
            "accelc_conv": lambda: torch.ops.accelc.conv2d(x_cl, packed_plain, None, None, *geo),
        }
        OH = (H + 2 * pad - R) // st + 1
        flops = 2 * BATCH * OH * OH * K * C * R * R
        row = dict(C=C, H=H, K=K, R=R, stride=st, batch=BATCH)
        with torch.no_grad():
            ref_fused = torch.relu(bn(cv(x))).float()
            ref_conv = cv(x).float()
            for name, fn in variants.items():
                out = fn().float()
                ref = ref_fused if "relu" in name else ref_conv
                row[name] = {"rel_l2_vs_eager": float(f"{((out - ref).norm() / ref.norm()).item():.2e}")}
            _common.time_rounds(variants, row, ROUNDS, flops)
        for acc, base in (("accelc_fused_bn_relu", "eager_nchw_conv_bn_relu"), ("accelc_conv", "cudnn_nhwc_conv")):
            row[f"{acc}_vs_{base}"] = _common.speedup(row, acc, base)[0]
        print(f"  C{C} H{H} K{K} R{R} s{st}: " + ", ".join(
            f"{n} {row[n]['us']:.0f} us {row[n]['tflops']:.0f} TF/s" for n in variants), flush=True)
        rows.append(row)

    def cell(r, n):
        return f"{r[n]['us']:.1f} us, {r[n]['tflops']:.0f} TF/s"

    header = ["C, H, K, RxR, stride", "eager NCHW conv+bn+relu", "accelc fused bn+relu", "speedup",
              "cuDNN NHWC conv", "accelc conv", "accelc / cuDNN"]
    table = [[f"{r['C']}, {r['H']}, {r['K']}, {r['R']}x{r['R']}, {r['stride']}",
              cell(r, "eager_nchw_conv_bn_relu"), cell(r, "accelc_fused_bn_relu"),
              f"{r['accelc_fused_bn_relu_vs_eager_nchw_conv_bn_relu']:.2f}x",
              cell(r, "cudnn_nhwc_conv"), cell(r, "accelc_conv"), f"{r['accelc_conv_vs_cudnn_nhwc_conv']:.2f}x"]
             for r in rows]
    md = (f"# accelc::conv2d, fp16, batch {BATCH}, ResNet-50 layer shapes\n\n{_common.env_line(env)}\n\n"
          f"Median over captured CUDA graphs, {ROUNDS} interleaved rounds; speedup = other / accelc, median of "
          "per-round ratios (> 1: accelc faster). accelc runs on channels-last input, as inside a run of "
          "rewritten convs; eager on NCHW as a user's model runs it.\n\n" + _common.md_table(header, table))
    _common.write(args.out, "conv", env, rows, md)
    print()
    print(md)


if __name__ == "__main__":
    main()
