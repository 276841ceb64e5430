"""The warp-specialized Gluon GEMM (kernels/gemm_hopper.py) against cuBLAS and accelc's tl kernel, fp16,
at the shapes of bench/gemm_models.py whose layers are GEMMs (nn.Linear and GPT-2's Conv1D; the 1x1
convs run the conv kernel) and the #32 target shape 4096 x 4096 x 16384 without epilogue.

    python bench/gemm_hopper.py [--out bench/results] [--layers SUBSTRING]

Per layer: library = the cuBLAS call with its bias (F.linear / addmm: no activation, no residual);
eager = the layer as eager PyTorch runs it (library + separate activation / residual kernels);
tl = accelc's tl kernel, tuned over its own candidates; gluon = the fastest Gluon candidate (each
timed alone first, then the fastest in the interleaved rounds); race = what accelc.linear runs now
that the tuner races both. Every candidate's error against the fp32 reference is checked first.
Timed like bench/gemm_models.py: CUDA-graph medians, ROUNDS interleaved rounds, speedups the
median of per-round ratios.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

_common.fresh_tuning_cache()

import accelc  # noqa: E402,F401
from accelc.kernels import gemm  # noqa: E402
from accelc.latency import median_ms  # noqa: E402
from accelc.tuning import NotACandidate, config_dict  # noqa: E402
from gemm_models import LAYERS, layer_variants  # noqa: E402

ROUNDS = 5
EXTRA = [("issue #32", "4096x4096x16384 no epilogue", 4096, 4096, 16384, "none", False, "linear")]


def tl_only():
    """accelc.linear with the Gluon candidates out of the race (the tl kernel as before). The launcher
    remembers each call signature's kernel (TUNER.calls), so switching forgets those."""
    saved = gemm.gluon_problem
    gemm.gluon_problem = lambda *a: "bench: tl only"
    gemm.TUNER.calls.clear()
    return saved


def restore(saved):
    gemm.gluon_problem = saved
    gemm.TUNER.calls.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--markdown", metavar="JSON", help="only rewrite the .md beside a results JSON")
    ap.add_argument("--layers", default="", help="only rows whose model or layer name contains one of these (comma-separated)")
    args = ap.parse_args()
    if args.markdown:
        data = json.loads(Path(args.markdown).read_text())
        Path(args.markdown).with_suffix(".md").write_text(markdown(data["environment"], data["rows"]))
        return
    env = _common.environment()
    print(_common.env_line(env), flush=True)
    print("gluon:", gemm._hopper_import()[1] or "builds", flush=True)
    rows = []
    for model, name, M, K, N, act, residual, kind in EXTRA + LAYERS:
        if kind.startswith("1x1") or (args.layers and not any(p in f"{model} {name}" for p in args.layers.split(","))):
            continue
        row = {"model": model, "layer": name, "M": M, "K": K, "N": N, "activation": act, "residual": residual,
               "kind": kind}
        try:
            fns, ref, _ = layer_variants(M, K, N, act, residual, kind)
            library, eager, fused = fns["library"], fns["eager"], fns["fused"]
            # every Gluon candidate alone: error, time
            row["gluon_candidates"] = []
            for cfg in gemm.GLUON_CONFIGS:
                entry = {"config": config_dict(cfg)}
                try:
                    with gemm.TUNER.force(cfg):
                        entry["rel_err"] = _common.rel_l2(fused(), ref)
                        entry["us"] = round(median_ms(fused, device="cuda", cuda_graph=True, rep_ms=40) * 1e3, 2)
                except NotACandidate:
                    entry["skipped"] = "not a candidate for this shape"
                except Exception as e:   # a compile or launch failure is a result too
                    entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                row["gluon_candidates"].append(entry)
            timed = [(e["us"], gemm.GLUON_CONFIGS[i]) for i, e in enumerate(row["gluon_candidates"]) if "us" in e]
            best_cfg = min(timed, key=lambda t: t[0])[1] if timed else None

            def gluon():
                with gemm.TUNER.force(best_cfg):
                    return fused()

            saved = tl_only()
            try:
                tl_out = fused()          # tunes the tl candidates (their own key)
                tl_cfg, row["tl_spread"] = _common.tuned(gemm.TUNER, lambda k: k[1:3] == (N, K) and "gluon" not in k)
                row["tl_config"] = config_dict(tl_cfg) if tl_cfg else None
            finally:
                restore(saved)
            row["rel_err"] = {"tl": _common.rel_l2(tl_out, ref), "eager": _common.rel_l2(eager(), ref)}

            def tl():
                saved = tl_only()
                try:
                    return fused()
                finally:
                    restore(saved)

            variants = {"library": library, "eager": eager, "tl": tl, "race": fused}
            if best_cfg is not None:
                variants["gluon"] = gluon
                row["gluon_config"] = config_dict(best_cfg)
            row["rel_err"]["race"] = _common.rel_l2(fused(), ref)
            race_cfg, row["race_spread"] = _common.tuned(gemm.TUNER, lambda k: k[1:3] == (N, K) and "gluon" in k)
            row["race_config"] = config_dict(race_cfg) if race_cfg else None
            _common.time_rounds(variants, row, ROUNDS, flops=2 * M * N * K)
            for fast in ("gluon", "race"):
                if fast in variants:
                    _common.ratios(row, fast, ("library", "eager", "tl"))
                    row[f"{fast}_ratios"] = {b: row.pop(f"vs_{b}") for b in ("library", "eager", "tl")}
            g = row.get("gluon", {}).get("us")
            print(f"{model} {name}: library {row['library']['us']:.1f} us, eager {row['eager']['us']:.1f}, "
                  f"tl {row['tl']['us']:.1f}, gluon {g}, race {row['race']['us']:.1f}"
                  + (f"; gluon {row['gluon_ratios']['library'][0]}x library" if g else ""), flush=True)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"{model} {name}: {row['error']}", flush=True)
        rows.append(row)
    _common.write(args.out, "gemm_hopper", env, rows, markdown(env, rows))
    print(markdown(env, rows))


def markdown(env, rows) -> str:
    header = ["model", "layer", "M x K x N", "cuBLAS + bias", "eager", "accelc tl", "accelc Gluon", "Gluon / cuBLAS",
              "Gluon / eager", "Gluon / tl", "race (tl + Gluon)", "race / eager", "race picks", "Gluon config"]
    table = []
    for r in rows:
        shape = f"{r['M']} x {r['K']} x {r['N']}"
        if "error" in r:
            table.append([r["model"], r["layer"], shape] + [r["error"]] + [""] * 10)
            continue

        def cell(k):
            return f"{r[k]['us']:.1f} us, {_common.rate_cell(env, r[k]['tflops'])}" if k in r else "-"
        gr = r.get("gluon_ratios", {})
        cfg = r.get("gluon_config") or {}
        race = r.get("race_config") or {}
        table.append([r["model"], r["layer"], shape, cell("library"), cell("eager"), cell("tl"), cell("gluon"),
                      _common.ratio_cell(gr["library"]) if gr else "-", _common.ratio_cell(gr["eager"]) if gr else "-",
                      _common.ratio_cell(gr["tl"]) if gr else "-", cell("race"),
                      _common.ratio_cell(r["race_ratios"]["eager"]), "Gluon" if race.get("GLUON") else "tl",
                      f"{cfg.get('BLOCK_M')}x{cfg.get('BLOCK_N')}x{cfg.get('BLOCK_K')} st{cfg.get('STAGES')} "
                      f"c{cfg.get('CONSUMERS')}" if cfg else "-"])
    ok = [r for r in rows if "gluon_ratios" in r]
    wins = sum(r["gluon_ratios"]["library"][0] >= 1.0 for r in ok)
    picked = sum(bool((r.get("race_config") or {}).get("GLUON")) for r in rows if "error" not in r)
    faster = sum(r["race"]["us"] < r["tl"]["us"] for r in rows if "error" not in r)
    return (f"# Warp-specialized Gluon GEMM vs cuBLAS and accelc's tl kernel, fp16\n\n{_common.env_line(env)}\n\n"
            "cuBLAS + bias: F.linear / addmm alone (no activation, no residual: the library's own work); eager: "
            "the layer as eager PyTorch runs it; accelc tl: the tl kernel tuned over its candidates; accelc Gluon: "
            "the fastest Gluon candidate (kernels/gemm_hopper.py); race: what accelc.linear picks among both. "
            f"Times: CUDA-graph medians, median of {ROUNDS} interleaved rounds; ratios: median of per-round "
            "ratios (range); % of the dense fp16 peak in brackets.\n\n"
            + _common.md_table(header, table)
            + f"\nGluon at or above cuBLAS + bias (without its epilogue): {wins} of {len(ok)} layers. The race picks "
            f"Gluon on {picked} of {sum('error' not in r for r in rows)} layers; race faster than tl alone on {faster}.\n")


if __name__ == "__main__":
    main()
