"""Run-to-run determinism of the tl kernels whose dot operand is changed in registers after a pipelined load (the
construction that raced with two warpgroups on the conv's TMA-rectangle and ROWS paths): every candidate forced,
many runs on the same inputs at sizes large enough for a warpgroup to run ahead; a run that differs bit for bit
from the first is counted.

  - linear_w8a16 tiles: the int8 weight tile converted to fp16 (QUANT 3) before the dot
  - flash attention with int8 q @ k^T: the key tile quantized in registers before the dot
  - conv ROWS (an RGB stem): the input run zeroed past S (bench/conv_rows_race.py reads it in more detail)

    python bench/determinism.py [--runs 30] [--out DIR]      # on a GPU; writes DIR/determinism.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from _common import environment
from accelc.kernels import conv, flash_attention, int8_gemm, int8_weight
from accelc.numerics import rel_l2
from accelc.tuning import NotACandidate, out_of_resources


def cases():
    """(name, tuner, run() -> output, fp32 reference)"""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.float16):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    for M, K, N in ((4096, 4096, 4096), (512, 2048, 5632)):
        x, b = randn(M, K), randn(N)
        w_q, w_scale = int8_gemm.quantize_weight(randn(N, K, dtype=torch.float32) / K ** 0.5)
        ref = int8_weight.linear_w8a16_ref(x.float(), w_q, w_scale, b.float(), None, "silu")
        yield (f"linear_w8a16 {M}x{K}x{N}", int8_weight.TUNER,
               lambda x=x, w_q=w_q, w_scale=w_scale, b=b: int8_weight.linear_w8a16_launch(x, w_q, w_scale, b, None,
                                                                                         "silu"), ref)
    for B, H, L, D in ((4, 16, 1024, 64), (2, 16, 2048, 128)):
        q, k, v = randn(B, H, L, D), randn(B, H, L, D), randn(B, H, L, D)
        ref = flash_attention.flash_attention_ref(q.float(), k.float(), v.float(), None, True, qk_int8=True)
        yield (f"flash_attention qk_int8 {B}x{H}x{L}x{D} causal", flash_attention.TUNER,
               lambda q=q, k=k, v=v: flash_attention.flash_attention_launch(q, k, v, None, True, None, True), ref)
    x = randn(32, 3, 224, 224).contiguous(memory_format=torch.channels_last)
    w = conv.pack_weight(randn(64, 3, 7, 7) / 147 ** 0.5)
    b = randn(64)
    args = ((2, 2), (3, 3, 3, 3), (1, 1), "relu", True)
    yield ("conv ROWS stem 32x3x224x224", conv.TUNER, lambda: conv.conv2d_launch(x, w, b, None, *args),
           conv.conv2d_ref(x.float(), w.float(), b.float(), None, *args))


def repeated(tuner, cfg, run, ref, runs: int) -> tuple[int, float] | None:
    """cfg forced, run() `runs` times on the same inputs: (runs whose output differs bit for bit from the first,
    the worst rel L2 against ref), or None where cfg is not a candidate for the call or does not fit the GPU."""
    try:
        with tuner.force(cfg):
            first = run()
            differ, worst = 0, rel_l2(first.float(), ref)
            for _ in range(runs - 1):
                out = run()
                if not torch.equal(out, first):
                    differ += 1
                    worst = max(worst, rel_l2(out.float(), ref))
    except NotACandidate:
        return None
    except Exception as e:     # out of shared memory for this dtype: the tuner skips it too
        if out_of_resources(e):
            return None
        raise
    torch.cuda.synchronize()
    return differ, worst


def sweep(name, tuner, run, ref, runs):
    rows = []
    for cfg in tuner.configs:
        got = repeated(tuner, cfg, run, ref, runs)
        if got is None:
            continue
        differ, worst = got
        kw = {k: v for k, v in cfg.kwargs.items() if k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GLUON", "TMA",
                                                            "USE_TMA", "ROW_STEP", "CONSUMERS", "STAGES")}
        rows.append({"case": name, "config": kw, "warps": cfg.num_warps, "stages": cfg.num_stages, "runs": runs,
                     "runs_differing": differ, "worst_rel_l2": worst})
        print(f"{name:45s} {cfg.num_warps} warps {kw}  differing {differ}/{runs}  worst rel L2 {worst:.1e}",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    rows = []
    for name, tuner, run, ref in cases():
        rows += sweep(name, tuner, run, ref, a.runs)
    bad = [r for r in rows if r["runs_differing"]]
    print(f"{len(rows)} configs, {len(bad)} with runs differing", flush=True)
    with open(os.path.join(a.out, "determinism.json"), "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
