"""What a kernel's batch-following sizes declared do_not_specialize cost in speed. Triton specializes an int
argument on 1 and on divisibility by 16; accelc's kernels take their rows (GEMM, norms, rotary, conv) and their
query / key lengths (attention) unspecialized, so that a new batch size or length compiles no new binary. Here
each kernel as shipped is timed against a twin compiled from the same source with Triton's default
specialization, at the e2e models' shapes (rows divisible by 16, where the twin gains most) and at a decode
step's one row, with the configs its tuner ranks first (tuned here, fresh cache, every candidate), round-robin
in one process.

    python bench/specialization.py [--out DIR] [--rounds 7] [--top 3] [--cases SUBSTRING]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("ACCELC_TUNE", "all")     # every candidate raced (no shipped shortlist)
import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

_common.fresh_tuning_cache()

import accelc  # noqa: E402,F401
from accelc.kernels import flash_attention, gemm  # noqa: E402
from accelc.latency import median_ms  # noqa: E402
from accelc.tuning import config_dict  # noqa: E402

GEMMS = [   # (name, M, K, N)
    ("BERT b8 QKV", 3072, 768, 2304), ("BERT b8 FFN up", 3072, 768, 3072), ("BERT b8 FFN down", 3072, 3072, 768),
    ("BERT b8 out", 3072, 768, 768), ("Llama b2 q/o", 2048, 2048, 2048), ("Llama b2 down", 2048, 5632, 2048),
    ("GPT-2 b4 FFN up", 4096, 768, 3072), ("decode 1 row, 2048 -> 5632", 1, 2048, 5632),
    ("decode 1 row, 4096 -> 4096", 1, 4096, 4096), ("decode 16 rows, 4096 -> 4096", 16, 4096, 4096),
]
ATTENTION = [("BERT b8 384 attention", 8, 12, 384, 64), ("GPT-2 b4 1024 causal attention", 4, 12, 1024, 64),
             ("Llama b2 1024 causal attention", 2, 32, 1024, 64),
             # BERT's padding mask as HF builds it: additive, (B, 1, 1, S) broadcast over heads and rows
             ("BERT b8 384 attention, padding mask", 8, 12, 384, 64)]   # (name, B, H, L = S, D)


def _twin(kernel):
    """The kernel compiled from its own source with Triton's default specialization."""
    if type(kernel).__module__.startswith("triton.experimental.gluon"):
        from triton.experimental import gluon
        return gluon.jit(kernel.fn)
    return triton.jit(kernel.fn)


def _swapped(slots):
    """{variant: callable(fn) running fn with that variant's kernels in place}: 'shipped', 'specialized'."""
    shipped = {(m, a): getattr(m, a) for m, a in slots}
    twins = {k: _twin(v) for k, v in shipped.items()}

    def runner(kernels):
        def run(fn):
            for (m, a), k in kernels.items():
                setattr(m, a, k)
            try:
                return fn()
            finally:
                for (m, a), k in shipped.items():
                    setattr(m, a, k)
        return run
    return {"shipped": runner(shipped), "specialized": runner(twins)}


def _time(case, tuner, top, launch, variants, rounds):
    """Tune with the shipped kernels, then time the `top` configs under each variant, round-robin."""
    launch()
    torch.cuda.synchronize()
    key = list(tuner.timings)[-1] if tuner.timings else None
    ranked = sorted((us, i) for i, (_, us) in enumerate(tuner.timings.get(key, [])) if us is not None)
    cfgs = [tuner.timings[key][i][0] for _, i in ranked[:top]]
    by_dict = {str(config_dict(c)): c for c in tuner.configs}
    rows = []
    for cd in cfgs:
        cfg = by_dict[str(cd)]
        us = {v: [] for v in variants}
        for _ in range(rounds):
            for v, run in variants.items():
                def fn(cfg=cfg, run=run):
                    with tuner.force(cfg):
                        run(launch)
                us[v].append(median_ms(fn, cuda_graph=True, rep_ms=30) * 1e3)
        med = {v: statistics.median(x) for v, x in us.items()}
        rows.append({"case": case, "config": cd, **{f"{v}_us": round(m, 2) for v, m in med.items()},
                     "specialized_over_shipped": round(med["specialized"] / med["shipped"], 4)})
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--cases", default="", help="only the cases whose name contains this")
    a = ap.parse_args()
    env = _common.environment()
    print(_common.env_line(env), flush=True)
    from accelc.kernels import gemm_hopper
    gemm_vars = _swapped([(gemm, "linear_kernel"), (gemm, "gemv_kernel"), (gemm_hopper, "linear_ws_kernel"),
                          (gemm_hopper, "linear_coop_kernel")])
    rows = []
    for name, m, k, n in [g for g in GEMMS if a.cases in g[0]]:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=torch.float16)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        rows += _time(name, gemm.TUNER, a.top, lambda: gemm.launch(x, w, b, None, out, "gelu"), gemm_vars, a.rounds)
    from accelc.kernels import attention_hopper
    attn_vars = _swapped([(flash_attention, "_flash_fwd_kernel"), (attention_hopper, "attention_ws_kernel")])
    for name, bsz, h, length, d in [c for c in ATTENTION if a.cases in c[0]]:
        torch.manual_seed(0)
        q, kk, v = (torch.randn(bsz, h, length, d, device="cuda", dtype=torch.float16) for _ in range(3))
        causal = "causal" in name
        mask = None
        if "mask" in name:
            mask = torch.zeros(bsz, 1, 1, length, device="cuda", dtype=torch.float16)
            mask[: bsz // 2, ..., length * 3 // 4:] = torch.finfo(torch.float16).min
        rows += _time(name, flash_attention.TUNER, a.top,
                      lambda: flash_attention.flash_attention_launch(q, kk, v, mask, is_causal=causal), attn_vars,
                      a.rounds)
    table = [[r["case"], r["config"], r["shipped_us"], r["specialized_us"], f"{r['specialized_over_shipped']:.3f}"]
             for r in rows]
    best = {}
    for r in rows:
        c = best.setdefault(r["case"], [float("inf"), float("inf")])
        c[0], c[1] = min(c[0], r["shipped_us"]), min(c[1], r["specialized_us"])
    ratios = [s / u for u, s in best.values()]
    md = (f"# Batch-following sizes unspecialized: the speed ({env['device']})\n\n{_common.env_line(env)}\n\n"
          f"us per launch (CUDA-graph medians, {a.rounds} rounds round-robin, median), the top {a.top} configs of "
          "each case's tuning; `specialized`: the same source with Triton's default specialization of ints.\n\n"
          + _common.md_table(["case", "config", "shipped us", "specialized us", "specialized / shipped"], table)
          + "\nBest config per case, specialized / shipped: "
          + ", ".join(f"{c} {s / u:.3f}" for c, (u, s) in best.items())
          + f"\n\nGeometric mean over the cases: {statistics.geometric_mean(ratios):.3f}\n")
    _common.write(a.out, "specialization", env, rows, md)
    print(md)


if __name__ == "__main__":
    main()
