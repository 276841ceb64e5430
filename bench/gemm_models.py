"""accelc's GEMMs at the shapes of the real models bench/e2e.py runs, fp16, against what those
models run instead: each layer as eager PyTorch runs it (cuBLAS, or cuDNN for the 1x1 convs, with
the bias / activation / residual as separate kernels where cuBLAS / cuDNN do not fuse them), the
library call alone, and torch.compile of the eager code (default mode: the kernels that
torch.compile(mode="reduce-overhead") replays, cuBLAS / cuDNN with Inductor's fused epilogue).

    python bench/gemm_models.py [--out bench/results] [--layers SUBSTRING]

Timed like bench/gemm.py: CUDA-graph medians (L2 flushed between replays) in ROUNDS interleaved
rounds, speedups the median of per-round ratios. Each row gives accelc's TF/s and its share of
the device's dense fp16 peak, and the autotuner's spread for the layer (fastest and slowest
candidate; tuning runs in a fresh cache directory so that every key is timed here).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

_common.fresh_tuning_cache()   # tune every key here

import accelc  # noqa: E402,F401
from accelc.kernels import conv, gemm  # noqa: E402
from accelc.kernels.epilogue import activation_ref  # noqa: E402
from accelc.tuning import config_dict  # noqa: E402

ROUNDS = 3
# (model, layer, M (rows: batch x tokens, or pixels), K, N, activation, residual, kind)
# kind "linear": nn.Linear's (N, K) weight; "conv1d": x @ W + b with W (K, N), GPT-2's Conv1D
# (torch.addmm in eager); "1x1@HxW": a 1x1 conv over a batch of 32 HxW channels-last images
LAYERS = [
    ("issue #16", "4096x4096x16384 + GELU", 4096, 4096, 16384, "gelu", False, "linear"),
    ("issue #16", "512x4096x4096 + GELU", 512, 4096, 4096, "gelu", False, "linear"),
    ("issue #16", "16x4096x4096 + GELU", 16, 4096, 4096, "gelu", False, "linear"),
    ("ViT-B/16 b32", "attn.qkv", 32 * 197, 768, 2304, "none", False, "linear"),
    ("ViT-B/16 b32", "attn.proj + residual", 32 * 197, 768, 768, "none", True, "linear"),
    ("ViT-B/16 b32", "mlp.fc1 + GELU", 32 * 197, 768, 3072, "gelu", False, "linear"),
    ("ViT-B/16 b32", "mlp.fc2 + residual", 32 * 197, 3072, 768, "none", True, "linear"),
    ("BERT-base 8x384", "attention.self.query", 8 * 384, 768, 768, "none", False, "linear"),
    ("BERT-base 8x384", "intermediate + GELU", 8 * 384, 768, 3072, "gelu", False, "linear"),
    ("BERT-base 8x384", "output.dense + residual", 8 * 384, 3072, 768, "none", True, "linear"),
    ("GPT-2 4x1024", "attn.c_attn (Conv1D)", 4 * 1024, 768, 2304, "none", False, "conv1d"),
    ("GPT-2 4x1024", "attn.c_proj (Conv1D) + residual", 4 * 1024, 768, 768, "none", True, "conv1d"),
    ("GPT-2 4x1024", "mlp.c_fc (Conv1D) + GELU tanh", 4 * 1024, 768, 3072, "gelu_tanh", False, "conv1d"),
    ("GPT-2 4x1024", "mlp.c_proj (Conv1D) + residual", 4 * 1024, 3072, 768, "none", True, "conv1d"),
    ("TinyLlama 1.1B 2x1024", "q_proj", 2 * 1024, 2048, 2048, "none", False, "linear"),
    ("TinyLlama 1.1B 2x1024", "k_proj", 2 * 1024, 2048, 256, "none", False, "linear"),
    ("TinyLlama 1.1B 2x1024", "down_proj + residual", 2 * 1024, 5632, 2048, "none", True, "linear"),
    ("ConvNeXt-T b32", "stage 2 mlp.fc2", 32 * 14 * 14, 1536, 384, "none", False, "linear"),
    ("ConvNeXt-T b32", "stage 3 mlp.fc2", 32 * 7 * 7, 3072, 768, "none", False, "linear"),
    ("ResNet-50 b32", "layer1 conv1 + ReLU", 32 * 56 * 56, 256, 64, "relu", False, "1x1@56"),
    ("ResNet-50 b32", "layer1 conv3 + residual, ReLU", 32 * 56 * 56, 64, 256, "relu", True, "1x1@56"),
    ("ResNet-50 b32", "layer3 conv1 + ReLU", 32 * 14 * 14, 1024, 256, "relu", False, "1x1@14"),
    ("ResNet-50 b32", "layer4 conv3 + residual, ReLU", 32 * 7 * 7, 512, 2048, "relu", True, "1x1@7"),
    ("MobileNetV2 b32", "blocks.0.0.conv_pw", 32 * 112 * 112, 32, 16, "none", False, "1x1@112"),
    ("MobileNetV2 b32", "blocks.1.0.conv_pw + ReLU6", 32 * 112 * 112, 16, 96, "relu6", False, "1x1@112"),
    ("MobileNetV2 b32", "blocks.1.0.conv_pwl", 32 * 56 * 56, 96, 24, "none", False, "1x1@56"),
    ("MobileNetV2 b32", "blocks.1.1.conv_pw + ReLU6", 32 * 56 * 56, 24, 144, "relu6", False, "1x1@56"),
    ("MobileNetV2 b32", "blocks.1.1.conv_pwl + residual", 32 * 56 * 56, 144, 24, "none", True, "1x1@56"),
    ("MobileNetV2 b32", "conv_head + ReLU6", 32 * 7 * 7, 320, 1280, "relu6", False, "1x1@7"),
]


def layer_variants(M, K, N, act, residual, kind):
    """{eager, library, compile, accelc} callables for one layer, its fp32 reference, and the
    accelc tuner key whose spread the row reports."""
    dev, h = "cuda", torch.float16
    b = torch.randn(N, device=dev, dtype=h)
    if kind.startswith("1x1@"):
        hw = int(kind[4:])
        x = torch.randn(M // (hw * hw), K, hw, hw, device=dev, dtype=h).contiguous(memory_format=torch.channels_last)
        w4 = (torch.randn(N, K, 1, 1, device=dev) / K**0.5).to(h)
        r = (torch.randn(M // (hw * hw), N, hw, hw, device=dev, dtype=h).contiguous(memory_format=torch.channels_last)
             if residual else None)
        packed = conv.pack_weight(w4)

        def library():
            return F.conv2d(x, w4, b)

        def eager():   # ResNet's order: relu(conv + bias + identity)
            y = F.conv2d(x, w4, b)
            return activation_ref(act, y + r if r is not None else y)

        def fused():
            return torch.ops.accelc.conv2d(x, packed, b, r, [1, 1], [0, 0, 0, 0], [1, 1], act, True)

        ref = activation_ref(act, F.conv2d(x.float(), w4.float(), b.float()) + (r.float() if r is not None else 0))
        return dict(eager=eager, library=library, fused=fused), ref, (triton.next_power_of_2(M), N, K)

    x = torch.randn(M, K, device=dev, dtype=h)
    r = torch.randn(M, N, device=dev, dtype=h) if residual else None
    if kind == "conv1d":
        W = (torch.randn(K, N, device=dev) / K**0.5).to(h)
        weight = W.t()

        def library():
            return torch.addmm(b, x, W)
    else:
        weight = (torch.randn(N, K, device=dev) / K**0.5).to(h)

        def library():
            return F.linear(x, weight, b)

    def eager():   # transformer order: act(linear) + residual
        y = activation_ref(act, library())
        return y + r if r is not None else y

    def fused():
        return torch.ops.accelc.linear(x, weight, b, r, act)

    ref = gemm.linear_ref(x.float(), weight.float(), b.float(), None if r is None else r.float(), act)
    return dict(eager=eager, library=library, fused=fused), ref, (triton.next_power_of_2(M), N, K)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", default="", help="only rows whose model or layer name contains this")
    args = ap.parse_args()
    env = _common.environment()
    print(_common.env_line(env), flush=True)
    rows = []
    for model, layer, M, K, N, act, residual, kind in LAYERS:
        if args.layers and args.layers not in model + " " + layer:
            continue
        fns, ref, key = layer_variants(M, K, N, act, residual, kind)
        variants = {"eager": fns["eager"], "library": fns["library"],
                    "compile": _common.compiled(fns["eager"]), "accelc": fns["fused"]}
        row = {"model": model, "layer": layer, "M": M, "K": K, "N": N, "activation": act,
               "residual": residual, "kind": kind}
        try:
            _common.measure_row(row, variants, ref, ROUNDS, flops=2 * M * N * K, label=f"{model} {layer}")
        except Exception as e:  # one layer's failure is reported, the others still run
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"{model} {layer}: {row['error']}", flush=True)
            rows.append(row)
            continue
        cfg, row["spread"] = _common.tuned(gemm.TUNER, lambda k: k[:3] == key)
        row["config"] = config_dict(cfg) if cfg else None
        rows.append(row)
    _common.write(args.out, "gemm_models", env, rows, markdown(env, rows))
    print(markdown(env, rows))


def markdown(env, rows) -> str:
    header = ["model", "layer", "M x K x N", "eager", "library alone", "torch.compile", "accelc",
              "accelc / eager", "accelc / compile", "autotune spread"]
    table = []
    for r in rows:
        shape = f"{r['M']} x {r['K']} x {r['N']}"
        if "error" in r:
            table.append([r["model"], r["layer"], shape, "", "", "", r["error"], "", "", ""])
            continue

        def cell(k):
            return f"{r[k]['us']:.1f} us, {_common.rate_cell(env, r[k]['tflops'])}"
        table.append([r["model"], r["layer"], shape, cell("eager"), cell("library"), cell("compile"), cell("accelc"),
                      _common.ratio_cell(r["vs_eager"]), _common.ratio_cell(r["vs_compile"]),
                      _common.spread_cell(r.get("spread"))])
    wins = sum(r["vs_compile"][0] >= 1.0 for r in rows if "error" not in r)
    return (f"# accelc GEMMs at real models' layer shapes, fp16\n\n{_common.env_line(env)}\n\n"
            "eager: the layer as eager PyTorch runs it (cuBLAS addmm / linear, or cuDNN's channels-last "
            "conv for the 1x1 convs, then separate activation and residual kernels); library alone: "
            "that cuBLAS / cuDNN call with its bias; torch.compile: the eager code compiled (default "
            "mode: what reduce-overhead replays); accelc: one fused kernel. Times: median over a "
            f"captured CUDA graph (L2 flushed), median of {ROUNDS} interleaved rounds; speedups: "
            "median of per-round ratios (range); % of the dense fp16 peak in brackets. Autotune "
            "spread: fastest - slowest candidate as the tuner timed them.\n\n"
            + _common.md_table(header, table)
            + f"\naccelc at or above torch.compile: {wins} of {sum('error' not in r for r in rows)} layers.\n")


if __name__ == "__main__":
    main()
