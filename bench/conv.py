"""accelc::conv2d, fp16, every distinct conv of ResNet-50 (torchvision, 224 x 224) at batch 1, 8
and 32, on the GPU:

  alone:  accelc conv alone vs cuDNN conv alone on channels-last tensors (every row)
  fused:  accelc conv + folded BN + ReLU (NHWC in, as inside a run of rewritten convs)
          vs PyTorch eager conv -> bn -> relu on NCHW tensors, as a user's model runs it
          (batch 32, the 3x3 convs and the stem)

    python bench/conv.py [--out bench/results] [--batches 1,8,32]

Timed like bench/gemm.py: CUDA-graph medians in interleaved rounds, speedups as medians of
per-round ratios. FLOPs 2 * N * OH * OW * K * C * R * S, each rate with its share of the dense
fp16 peak. accelc tunes every shape here (a fresh cache directory); the row gives the tuner's spread.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

_common.fresh_tuning_cache()   # tune every shape here
import accelc  # noqa: E402,F401
from accelc.kernels import conv, gemm  # noqa: E402
from accelc.passes.fold_bn import fold  # noqa: E402
from accelc.tuning import config_dict  # noqa: E402

SHAPES = [  # (C, H, K, R, stride, where): every distinct conv of ResNet-50, H the input size
    (3, 224, 64, 7, 2, "stem"),
    (64, 56, 64, 3, 1, "layer1 3x3"), (128, 28, 128, 3, 1, "layer2 3x3"), (256, 14, 256, 3, 1, "layer3 3x3"),
    (512, 7, 512, 3, 1, "layer4 3x3"),
    (128, 56, 128, 3, 2, "layer2.0 3x3 s2"), (256, 28, 256, 3, 2, "layer3.0 3x3 s2"),
    (512, 14, 512, 3, 2, "layer4.0 3x3 s2"),
    (64, 56, 64, 1, 1, "layer1.0 conv1"), (256, 56, 64, 1, 1, "layer1 conv1"), (64, 56, 256, 1, 1, "layer1 conv3"),
    (256, 56, 128, 1, 1, "layer2.0 conv1"), (256, 56, 512, 1, 2, "layer2.0 downsample"),
    (512, 28, 128, 1, 1, "layer2 conv1"), (128, 28, 512, 1, 1, "layer2 conv3"),
    (512, 28, 256, 1, 1, "layer3.0 conv1"), (512, 28, 1024, 1, 2, "layer3.0 downsample"),
    (1024, 14, 256, 1, 1, "layer3 conv1"), (256, 14, 1024, 1, 1, "layer3 conv3"),
    (1024, 14, 512, 1, 1, "layer4.0 conv1"), (1024, 14, 2048, 1, 2, "layer4.0 downsample"),
    (2048, 7, 512, 1, 1, "layer4 conv1"), (512, 7, 2048, 1, 1, "layer4 conv3"),
]
ROUNDS = 5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--render", metavar="JSON", help="only write the table again from a run's JSON (times nothing)")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        for r in data["rows"]:
            r["path"] = path_of(r["config"], r["path"].startswith("GEMM"), rows=r["path"].startswith("conv ROWS"))
        md = markdown(data["environment"], data["rows"], ",".join(dict.fromkeys(str(r["batch"]) for r in data["rows"])))
        Path(args.render).with_suffix(".md").write_text(md)
        print(md)
        return
    env = _common.environment()
    print(_common.env_line(env))
    rows = []
    for BATCH in [int(b) for b in args.batches.split(",")]:
        for shape in SHAPES:
            rows.append(conv_row(BATCH, *shape))
    md = markdown(env, rows, args.batches)
    _common.write(args.out, "conv", env, rows, md)
    print()
    print(md)


def path_of(cfg: dict, gemm_path: bool, rows: bool = False) -> str:
    """The kernel and config a row ran: the GEMM's tile, the Gluon conv's (pixel rectangle, channels, MMA
    warpgroups, ring), or the tl conv kernel's (RECT: TMA rectangles of BLOCK_H x BLOCK_W pixels; ROWS: the
    padded-rows stem path, its K step the kernel row; split: the reduction in that many slices)."""
    if gemm_path:
        return f"GEMM {cfg.get('BLOCK_M')}x{cfg.get('BLOCK_N')}x{cfg.get('BLOCK_K')}"
    if rows:
        return (f"conv ROWS {cfg.get('BLOCK_M')}x{cfg.get('BLOCK_N')} {cfg.get('num_warps')}w "
                f"{cfg.get('num_stages')}st, {cfg.get('ROW_STEP')} row(s) a K step")
    if cfg.get("GLUON"):    # the warp-specialized Gluon conv (kernels/conv_hopper.py)
        return (f"Gluon conv {cfg.get('BLOCK_H')}x{cfg.get('BLOCK_W')} x {cfg.get('BLOCK_N')} channels, "
                f"{cfg.get('CONSUMERS')} MMA warpgroup(s), {cfg.get('STAGES')} stages")
    rect = f"RECT {cfg.get('BLOCK_H')}x{cfg.get('BLOCK_W')} " if cfg.get("RECT") else ""
    split = f", split {cfg['SPLIT']}" if cfg.get("SPLIT", 1) > 1 else ""
    return f"conv {rect}{cfg.get('BLOCK_M')}x{cfg.get('BLOCK_N')}x{cfg.get('BLOCK_K')} {cfg.get('num_warps')}w{split}"


def markdown(env, rows, batches) -> str:
    def cell(r, n):
        return f"{r[n]['us']:.1f} us, {_common.rate_cell(env, r[n]['tflops'])}" if n in r else "n/a"

    def ratio(r, k):
        return f"{r[k]:.2f}x" if k in r else "n/a"

    header = ["batch", "layer", "C, H, K, RxR, stride", "cuDNN NHWC conv", "accelc conv", "accelc / cuDNN",
              "accelc path", "autotune spread", "eager NCHW conv+bn+relu", "accelc fused bn+relu", "speedup"]
    table = [[r["batch"], r["where"], f"{r['C']}, {r['H']}, {r['K']}, {r['R']}x{r['R']}, {r['stride']}",
              cell(r, "cudnn_nhwc_conv"), cell(r, "accelc_conv"), ratio(r, "accelc_conv_vs_cudnn_nhwc_conv"),
              r["path"], _common.spread_cell(r.get("spread")),
              cell(r, "eager_nchw_conv_bn_relu"), cell(r, "accelc_fused_bn_relu"),
              ratio(r, "accelc_fused_bn_relu_vs_eager_nchw_conv_bn_relu")] for r in rows]
    wins = sum(r["accelc_conv_vs_cudnn_nhwc_conv"] >= 1 for r in rows)
    md = (f"# accelc::conv2d, fp16, ResNet-50's convs at batch {batches}\n\n{_common.env_line(env)}\n\n"
          f"Median over captured CUDA graphs, {ROUNDS} interleaved rounds; speedup = other / accelc, median of "
          "per-round ratios (> 1: accelc faster); rates with their % of the dense fp16 peak. accelc runs on "
          "channels-last input, as inside a run of rewritten convs; eager on NCHW as a user's model runs it "
          "(the fused columns: batch 32, 3x3 convs and the stem). accelc path: the GEMM kernel for a 1x1 "
          "stride-1 conv, else the warp-specialized Gluon conv (sm90: a rectangle of output pixels x output "
          "channels, its MMA warpgroups and ring stages) or the tl implicit-GEMM conv kernel and its config "
          "(RECT: TMA rectangles; ROWS: the "
          "stem's padded rows, after a padding kernel that is part of its time; split: the "
          "reduction in slices summed by a second kernel). Spread: "
          "fastest - slowest candidate as the tuner timed them.\n\n"
          f"accelc conv at or above cuDNN at {wins} of {len(rows)} rows.\n\n" + _common.md_table(header, table))
    return md


def conv_row(BATCH, C, H, K, R, st, where) -> dict:
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
    fused = BATCH == 32 and R > 1

    variants = {
        "cudnn_nhwc_conv": lambda: cv_cl(x_cl),
        "accelc_conv": lambda: torch.ops.accelc.conv2d(x_cl, packed_plain, None, None, *geo),
    }
    if fused:
        variants.update({
            "eager_nchw_conv_bn_relu": lambda: torch.relu(bn(cv(x))),
            "accelc_fused_bn_relu": lambda: torch.ops.accelc.conv2d(x_cl, packed, b, None, *geo, "relu")})
    OH = (H + 2 * pad - R) // st + 1
    flops = 2 * BATCH * OH * OH * K * C * R * R
    row = dict(C=C, H=H, K=K, R=R, stride=st, batch=BATCH, where=where)
    tuner = gemm.TUNER if conv.is_patchify((K, R, R, C), (st, st), [pad] * 4, (1, 1)) else conv.TUNER
    with torch.no_grad():
        ref_fused = torch.relu(bn(cv(x))).float()
        ref_conv = cv(x).float()
        for name, fn in variants.items():
            out = fn().float()
            ref = ref_fused if "relu" in name else ref_conv
            row[name] = {"rel_l2_vs_eager": float(f"{((out - ref).norm() / ref.norm()).item():.2e}")}
        _common.time_rounds(variants, row, ROUNDS, flops, rep_ms=25)
    M = BATCH * OH * OH
    prefix = (triton.next_power_of_2(M), K, C) if tuner is gemm.TUNER else (triton.next_power_of_2(M), K, C, R * R)
    cfg, row["spread"] = _common.tuned(tuner, lambda k: k[:len(prefix)] == prefix
                                       and (tuner is gemm.TUNER or k[6] == st))
    cfg = config_dict(cfg) if cfg else {}
    row["config"] = cfg
    row["path"] = path_of(cfg, tuner is gemm.TUNER, rows=C < 16)
    for acc, base in (("accelc_fused_bn_relu", "eager_nchw_conv_bn_relu"), ("accelc_conv", "cudnn_nhwc_conv")):
        if acc in variants:
            row[f"{acc}_vs_{base}"] = _common.speedup(row, acc, base)[0]
    print(f"  b{BATCH} {where} C{C} H{H} K{K} R{R} s{st}: " + ", ".join(
        f"{n} {row[n]['us']:.0f} us {row[n]['tflops']:.0f} TF/s" for n in variants)
        + f" | {row['path']} | {_common.spread_cell(row['spread'])}", flush=True)
    return row


if __name__ == "__main__":
    main()
