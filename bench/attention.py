"""FlashAttention forward, fp16 (or --dtype bf16 / fp32), on the GPU: accelc::flash_attention against
F.scaled_dot_product_attention with the FLASH_ATTENTION, CUDNN_ATTENTION and EFFICIENT_ATTENTION
backends (the first two take no fp32: their columns say n/a there), and the naive
eager form softmax(q @ k^T * scale + mask) @ v. The issue's long-sequence shapes and the real
models' (ViT-B, BERT-base with its key padding mask, GPT-2 causal), q / k / v as the models make
them where that matters: BERT's are (B, L, H, D) memory viewed as (B, H, L, D).

Timed like bench/gemm.py: CUDA-graph medians in interleaved rounds, speedups as medians of
per-round ratios. FLOPs counted as 4*B*H*S*S*D (halved for causal); each rate with its share of
the device's dense fp16 peak. accelc tunes every case here (a fresh cache directory); the row
gives the config chosen and the spread of the candidates' tuning times. On sm90 the race has the
warp-specialized Gluon kernel's candidates (kernels/attention_hopper.py) beside the tl kernel's:
the fastest of each family by tuning time is then timed forced in the same rounds ("accelc tl",
"accelc Gluon"), next to the race's pick ("accelc").

    python bench/attention.py [--out bench/results] [--only random,vit,bert,gpt2] [--dtype fp16|bf16|fp32]

(fp32 writes attention-fp32-<device>.md: the tl kernel only, the Gluon one being fp16 / bf16.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

_common.fresh_tuning_cache()   # tune every case here
import accelc  # noqa: E402,F401
from accelc.kernels import attention_fp8, flash_attention as fa  # noqa: E402
from accelc.tuning import config_dict  # noqa: E402

import triton  # noqa: E402

CASES = [  # (B, H, S, D, causal, what: "" random (B, H, S, D) tensors; "bert": (B, S, H, D) memory + padding mask)
    (8, 16, 1024, 64, False, ""), (8, 16, 1024, 64, True, ""),
    (4, 16, 4096, 64, False, ""), (4, 16, 4096, 64, True, ""),
    (4, 16, 4096, 128, False, ""), (4, 16, 4096, 128, True, ""),
    (32, 12, 197, 64, False, "vit"), (8, 12, 384, 64, False, "bert"), (4, 12, 1024, 64, True, "gpt2"),
]
ROUNDS = 5
F = torch.nn.functional


def sdpa_with(backend, q, k, v, causal, mask):
    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return fn


def naive(q, k, v, causal, mask):
    scale = q.shape[-1] ** -0.5
    tril = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril() if causal else None

    def fn():
        s = q @ k.transpose(-2, -1) * scale
        if tril is not None:
            s = s.masked_fill(~tril, float("-inf"))
        if mask is not None:
            s = s + mask
        return torch.softmax(s, dim=-1) @ v
    return fn


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def inputs(B, H, S, D, what, dtype=torch.float16):
    """q, k, v and the additive mask (or None) of a case."""
    if what == "bert":   # one (B, S, 3, H, D) projection output viewed per head, a padded batch
        qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=dtype)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        mask = torch.zeros(B, 1, 1, S, device="cuda", dtype=dtype)
        for b in range(B):
            mask[b, ..., S - 24 * b:] = torch.finfo(dtype).min    # 0 to 168 padded tokens
        return q, k, v, mask
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(3))
    return q, k, v, None


def _forced(cfg: triton.Config, q, k, v, mask, causal, fp8=False):
    """The op with one candidate forced (its compiled call kept: the timing replays a CUDA graph)."""
    with fa.TUNER.force(cfg):
        torch.ops.accelc.flash_attention(q, k, v, mask, causal, fp8=fp8)
        calls = dict(fa.TUNER.calls)

    def fn():
        saved = fa.TUNER.calls
        fa.TUNER.calls = calls
        try:
            return torch.ops.accelc.flash_attention(q, k, v, mask, causal, fp8=fp8)
        finally:
            fa.TUNER.calls = saved
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--only", default="", help="case names (random, vit, bert, gpt2) to run, comma-separated")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp16")
    args = ap.parse_args()
    env = _common.environment()
    print(_common.env_line(env))
    rows = []
    for B, H, S, D, causal, what in CASES:
        if args.only and (what or "random") not in args.only.split(","):
            continue
        q, k, v, mask = inputs(B, H, S, D, what, DTYPES[args.dtype])
        variants = {
            "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION, q, k, v, causal, mask),
            "sdpa_cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, mask),
            "sdpa_efficient": sdpa_with(SDPBackend.EFFICIENT_ATTENTION, q, k, v, causal, mask),
            "naive_eager": naive(q, k, v, causal, mask),
            "accelc": lambda: torch.ops.accelc.flash_attention(q, k, v, mask, causal),
            # Fp8Config(attention=True)'s kernel: both products on e4m3 operands (fp16 / bf16, D a multiple of 32)
            "accelc_fp8": lambda: torch.ops.accelc.flash_attention(q, k, v, mask, causal, fp8=True),
        }
        quantize = (lambda: attention_fp8.quantize_rows(q)[0], lambda: attention_fp8.quantize_rows(k)[0],
                    lambda: attention_fp8.quantize_columns_transposed(v)[0])
        ref = fa.flash_attention_ref(q, k, v, mask, causal)
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        row = dict(B=B, H=H, S=S, D=D, causal=causal, case=what or "random", mask=mask is not None)
        keys_before = set(fa.TUNER.chosen)
        for name, fn in list(variants.items()):
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as e:  # a backend that does not take this case
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                del variants[name]
                continue
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            row[name] = {"rel_l2_vs_fp32": float(f"{err:.2e}")}
        _common.time_rounds(variants, row, ROUNDS, flops)
        added = [key for key in fa.TUNER.chosen if key not in keys_before]
        new = [key for key in added if "fp8" not in key]   # (the fp16 race's)
        cfg, row["spread"] = _common.tuned(fa.TUNER, lambda key: key in new)
        row["config"] = config_dict(cfg) if cfg else None
        # the fastest tl and Gluon candidates by tuning time, of the fp16 race and of the fp8 one, forced, in the
        # same rounds as the races' picks
        family = {}
        for key in added:
            fp8 = "fp8" in key
            row["fp8_candidates_us" if fp8 else "candidates_us"] = fa.TUNER.timings.get(key, [])
            for cand, us in fa.TUNER.timings.get(key, []):
                kind = ("accelc_fp8_" if fp8 else "accelc_") + ("gluon" if cand.get("GLUON") else "tl")
                if us is not None and (kind not in family or us < family[kind][1]):
                    family[kind] = (cand, us)
        forced = {}
        for kind, (cand, _) in family.items():
            match = [c for c in fa.CONFIGS if config_dict(c) == cand]
            if match:
                forced[kind] = _forced(match[0], q, k, v, mask, causal, fp8="fp8" in kind)
                row[kind] = {"config": cand, "tuning_us": family[kind][1]}
        if forced:
            _common.time_rounds(forced, row, ROUNDS, flops)
            for kind in forced:
                out = forced[kind]()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row[kind]["rel_l2_vs_fp32"] = float(f"{err:.2e}")
                row[f"{kind}_vs_cudnn"] = (_common.speedup(row, kind, "sdpa_cudnn")[0]
                                           if "sdpa_cudnn" in variants else None)
        for base in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive_eager"):
            if base in variants:
                row[f"speedup_vs_{base}"] = _common.speedup(row, "accelc", base)[0]
        if "accelc_fp8" in variants:
            row["fp8_vs_accelc"] = _common.speedup(row, "accelc_fp8", "accelc")[0]
            # what of the fp8 call is the operands' quantization (q, K, V to e4m3, before the kernel)
            parts = {"fp8_quantize_q": quantize[0], "fp8_quantize_k": quantize[1], "fp8_quantize_v": quantize[2]}
            _common.time_rounds(parts, row, ROUNDS, flops)
            row["fp8_quantize_us"] = round(sum(row[p]["us"] for p in parts), 1)
        print(f"  {B}x{H}x{S}x{D} causal={causal} {what}: " + ", ".join(
            f"{n} {row[n]['us']:.0f} us {row[n]['tflops']:.0f} TF/s" for n in variants)
            + f" | {row['config']} | {_common.spread_cell(row['spread'])}", flush=True)
        rows.append(row)

    def cell(r, n):
        return f"{r[n]['us']:.1f} us, {_common.rate_cell(env, r[n]['tflops'])}" if "us" in r.get(n, {}) else "n/a"

    def cfg(r):
        c = r.get("config") or {}
        return (f"{c.get('BLOCK_M')}x{c.get('BLOCK_N')}, {c.get('num_stages')} st, {c.get('num_warps')} w"
                + (", TMA" if c.get("TMA") else "")) if c else "n/a"

    def gluon_cfg(r, kind="accelc_gluon"):
        c = r.get(kind, {}).get("config")
        return (f"{c['BLOCK_M']} rows, {c['BLOCK_N']} keys, {c['STAGES']} st"
                f"{', turns' if c.get('PINGPONG') else ''}") if c else "n/a"

    def x(v):
        return f"{v:.2f}x" if v is not None else "n/a"

    header = ["B, H, S, D", "case", "causal", "SDPA flash", "SDPA cuDNN", "SDPA efficient", "naive eager", "accelc",
              "accelc / SDPA flash", "accelc / cuDNN", "accelc / SDPA efficient", "accelc / naive", "accelc config",
              "autotune spread",
              "accelc tl", "accelc Gluon", "tl / cuDNN", "Gluon / cuDNN", "Gluon config", "accelc fp8 (err vs fp32)",
              "fp8 / accelc", "fp8 tl", "fp8 Gluon", "fp8 Gluon config", "fp8: q, K, V quantized us"]
    table = [[f"{r['B']}, {r['H']}, {r['S']}, {r['D']}", r["case"] + (" + padding mask" if r["mask"] else ""),
              r["causal"], cell(r, "sdpa_flash"), cell(r, "sdpa_cudnn"), cell(r, "sdpa_efficient"),
              cell(r, "naive_eager"), cell(r, "accelc")]
             + [f"{r[f'speedup_vs_{b}']:.2f}x" if f"speedup_vs_{b}" in r else "n/a"
                for b in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive_eager")]
             + [cfg(r), _common.spread_cell(r.get("spread")), cell(r, "accelc_tl"), cell(r, "accelc_gluon"),
                x(r.get("accelc_tl_vs_cudnn")), x(r.get("accelc_gluon_vs_cudnn")), gluon_cfg(r),
                cell(r, "accelc_fp8") + (f" ({r['accelc_fp8']['rel_l2_vs_fp32']})" if "accelc_fp8" in r else ""),
                x(r.get("fp8_vs_accelc")), cell(r, "accelc_fp8_tl"), cell(r, "accelc_fp8_gluon"),
                gluon_cfg(r, "accelc_fp8_gluon"), r.get("fp8_quantize_us", "n/a")] for r in rows]
    md = (f"# accelc::flash_attention forward, {args.dtype}\n\n{_common.env_line(env)}\n\n"
          f"Median over captured CUDA graphs, {ROUNDS} interleaved rounds; speedup = other / accelc, median "
          "of per-round ratios (> 1: accelc faster). FLOPs 4*B*H*S*S*D, halved when causal; % of the "
          "dense fp16 peak. vit / bert / gpt2: the shapes of ViT-B/16 at batch 32, BERT-base at 8 x 384 "
          "(q, k, v viewed from (B, S, H, D) memory, an additive key padding mask), GPT-2 at 4 x 1024. "
          "Config: the one the tuner chose (TMA: q / K / V blocks loaded as TMA boxes); spread: "
          "fastest - slowest candidate as the tuner timed them. accelc tl / accelc Gluon: the fastest candidate "
          "of each kernel by tuning time, forced, timed in the same rounds (Gluon: the warp-specialized "
          "kernels/attention_hopper.py: rows a CTA (64 a softmax warpgroup), keys a step, K / V ring slots; "
          "turns: the softmax warpgroups issue their MMAs in turns, FA3's ping-pong). accelc fp8: "
          "Fp8Config(attention=True)'s race's pick (both products on e4m3 operands, q, K and V quantized once before the "
          "kernel, the quantization timed with it; the % of the fp16 peak as the others'), its relative error against "
          "fp32 beside it; fp8 / accelc: accelc's time over its; fp8 tl / fp8 Gluon: the fp8 race's fastest candidate "
          "of each kernel, forced, as for fp16; q, K, V quantized: the three quantization kernels alone, each timed as the "
          "others (in every fp8 time above)."
          + ("" if args.dtype == "fp16" else f" The inputs are {args.dtype}; the % is still of the fp16 peak.")
          + "\n\n" + _common.md_table(header, table))
    _common.write(args.out, "attention" if args.dtype == "fp16" else f"attention-{args.dtype}", env, rows, md)
    print()
    print(md)


if __name__ == "__main__":
    main()
