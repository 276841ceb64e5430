"""Time to a fast model: how long `accelc.optimize` takes, against torch.compile's first call, cold and
warm, and what the time goes to. The optimize-time issue's measure.

    python bench/optimize_time.py --out DIR [--models bert,resnet50,tinyllama-lm] [--sides ...] [--profile]
    python bench/optimize_time.py --render DIR      # the markdown table of DIR's JSON files

Every side runs in its own process on the same GPU, the models built as bench/e2e.py builds them
(fp16, random weights, the realistic batch), causal LMs as bench/generate.py builds them (an LM head,
generation: optimize also builds the step program). Cold: empty accelc, Triton and Inductor caches
(new folders for the process). Sides:
  compile_ro     torch.compile(mode="reduce-overhead"): its first call, compile included, cold;
  compile_max    torch.compile(mode="max-autotune"): likewise;
  accelc_cold    accelc.optimize, cold; its phases (the summary's time breakdown) beside it;
  accelc_warm_checked  accelc.optimize again in a new process with the caches accelc_cold left, the guard and
                 the capture run again (ACCELC_REUSE=0: Triton's, Inductor's and the tuning caches warm, no verdict
                 reused, no kept graph read back);
  accelc_warm    likewise with the verdicts and the captured graphs accelc_cold kept reused (accelc.reuse,
                 accelc.capture.stored; the default);
  (each compile and accelc side also times the model it made: call_ms, the median of plain calls)
  With ACCELC_OTHER_SHAPES=background (OptimizeConfig.other_shapes) an accelc side also waits for the glue for
  other shapes, compiling after optimize returned, before anything else: other_shapes_after_s, the table's
  "(+N in the background)".
  load           accelc.save of the warm optimize's module, then in a new process accelc.load and the
                 first call served (the caches left as they are).
--profile adds cProfile's top functions of the cold and the warm optimize (cumulative time) to their rows, and
writes each profile whole to the out folder (profile-MODEL-SIDE.pstats, for pstats' callers and callees). Under
cProfile (a profiler set) no captured graph is kept or read back: a profiled warm side exports again; py-spy
(bench/steps.sh lanes) samples from outside and leaves it as it is.
Each accelc row holds Inductor's and AOT autograd's counters (cache hits, misses, bypasses).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SIDES = ("compile_ro", "accelc_cold", "accelc_warm_checked", "accelc_warm", "load", "compile_max")
LM_CONFIGS = {   # causal LMs with generation (bench/generate.py's shapes), prompt 2 x 128 (NAME-b1: 1 x 128, a batch-1
                 # generation's decode keys: one row)
    "qwen2-0.5b-lm": "qwen2-0.5b", "tinyllama-lm": "tinyllama", "llama3-8b-lm": "llama3-8b", "gpt2-lm": "gpt2",
    "qwen2-1.5b-lm": "qwen2-1.5b", "gemma-2b-lm": "gemma-2b", "phi3-mini-lm": "phi3-mini",     # (#60's families)
    "llama3.2-1b-lm": "llama3.2-1b", "llama3.2-3b-lm": "llama3.2-3b", "qwen2.5-3b-lm": "qwen2.5-3b",
}


def build(name):
    """(model, args, kwargs) on the GPU in fp16."""
    import torch

    lm_name, batch = (name[:-3], 1) if name.endswith("-b1") else (name, 2)
    if lm_name in LM_CONFIGS:
        import generate

        cfg = generate.configs(False)[LM_CONFIGS[lm_name]]
        lm = generate.build(cfg, "cuda", torch.float16)
        ids = torch.randint(1, cfg.vocab_size, (batch, 128), device="cuda")
        return lm, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    import e2e

    model, inputs = e2e.build(name, e2e.MODELS[name][1][0])
    return model, inputs, {}


def _timed(fn, digits: int = 1):
    """(fn(), its seconds, the GPU synchronised after it)."""
    import torch

    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, round(time.perf_counter() - t0, digits)


def run_side(name: str, side: str, workdir: str, profile: bool, pstats_dir: str | None = None) -> dict:
    """One side in this process (its caches are the environment's)."""
    import torch

    t0 = time.perf_counter()
    model, args, kwargs = build(name)
    row = {"build_s": round(time.perf_counter() - t0, 1)}
    if side.startswith("compile"):
        mode = {"compile_ro": "reduce-overhead", "compile_max": "max-autotune"}[side]
        compiled = torch.compile(model, mode=mode)
        with torch.no_grad():
            _, row["first_call_s"] = _timed(lambda: compiled(*args, **kwargs))
            from accelc.latency import median_ms

            row["call_ms"] = round(median_ms(lambda: compiled(*args, **kwargs)), 3)
        return row
    import accelc

    row["accelc_file"] = accelc.__file__     # which accelc ran (an A/B of two trees by PYTHONPATH)
    if side == "load":
        def load_and_call():
            loaded = accelc.load(os.path.join(workdir, "model.pt2"))
            row["load_s"] = round(time.perf_counter() - t0, 2)
            with torch.no_grad():
                loaded.cuda()(*args, **kwargs)
        t0 = time.perf_counter()
        _, row["first_call_s"] = _timed(load_and_call, 2)
        return row
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    captures = _capture_lines()      # (a warm side that captured again says why: accelc.capture.stored's lines)
    opt, row["optimize_s"] = _timed(lambda: accelc.optimize(model, args, example_kwargs=kwargs))
    row["capture_log"] = captures[:12]
    if prof is not None:
        prof.disable()
        row["profile"] = _top(prof)
        if pstats_dir:
            prof.dump_stats(os.path.join(pstats_dir, f"profile-{name}-{side}.pstats"))
    import _common

    after = _common.other_shapes_wait_s(opt)     # (its glue for other shapes compiling after it)
    if after is not None:
        row["other_shapes_after_s"] = after
    row["phases_s"] = opt.info.seconds
    row["verdicts_reused"] = bool(opt.info.reused)
    row["capture_kept"] = bool(getattr(opt.info, "capture_kept", False))    # read back (accelc.capture.stored)
    from torch._dynamo.utils import counters    # Inductor's cache hits / misses / bypasses, AOT autograd's

    row["compile_counters"] = {k: dict(counters[k]) for k in ("inductor", "aot_autograd") if counters.get(k)}
    row["rewritten"] = sum(r.status == "rewritten" for r in opt.layers)
    from accelc import tuning

    row["tuning"] = tuning.stats()
    step = getattr(opt, "step", None)
    if step is not None:
        row["step_phases_s"] = step.info.seconds
        row["step_capture_kept"] = bool(getattr(step.info, "capture_kept", False))
    # the optimized model's own speed beside the time it took (nothing lost): median of plain calls
    from accelc.latency import median_ms

    with torch.no_grad():
        row["call_ms"] = round(median_ms(lambda: opt(*args, **kwargs)), 3)
    if side == "accelc_warm":
        _, row["save_s"] = _timed(lambda: accelc.save(opt, os.path.join(workdir, "model.pt2")))
    return row


def _capture_lines() -> list:
    """accelc's INFO lines about captures kept across processes (read back, dropped, none under a key and its
    parts), collected from here on; the accelc logger at INFO (not DEBUG: that lets torch's own logs through)."""
    import logging

    lines: list = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append(r.getMessage()[:1500]) if "accelc: capture:" in r.getMessage() else None
    logger = logging.getLogger("accelc")
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    return lines


def _top(prof, n: int = 70) -> list:
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(n)
    return [line.rstrip() for line in out.getvalue().splitlines() if line.strip()][-n - 1:]


def measure(name: str, sides: list, out_dir: Path, profile: bool) -> dict:
    """Each side of `name` in a new process; accelc's cold, warm and load share one cache folder."""
    import _common

    row: dict = {"model": name}
    with tempfile.TemporaryDirectory(prefix="accelc-opt-time-") as shared:
        for side in sides:
            fresh = side in ("compile_ro", "compile_max", "accelc_cold")
            cache = tempfile.mkdtemp(prefix=f"{side}-", dir=shared) if fresh and side != "accelc_cold" else shared
            env = dict(os.environ, ACCELC_CACHE_DIR=f"{cache}/accelc", TRITON_CACHE_DIR=f"{cache}/triton",
                       TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor")
            if side == "accelc_warm_checked":
                env["ACCELC_REUSE"] = "0"
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--side", side, "--model", name, "--workdir", shared]
                                  + (["--profile", "--pstats", str(out_dir)] if profile and side.startswith("accelc_")
                                     else []),
                                  env=env, capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            row[side] = json.loads(lines[-1]) if lines else {"error": proc.stderr[-1500:]}
            row[side]["process_s"] = round(time.perf_counter() - t0, 1)
            print(f"{name} {side}: {_brief(row[side])}", flush=True)
            data = {"environment": _common.environment(), "row": row}     # written after each side: a run
            (out_dir / f"optimize_time-{name}.json").write_text(json.dumps(data, indent=1))   # cut short keeps them
    return data


def _brief(side: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in side.items() if k in ("optimize_s", "first_call_s", "load_s", "error", "call_ms",
                                                                  "other_shapes_after_s", "phases_s", "process_s"))


def render(folder: Path) -> str:
    rows, env = [], None
    for path in sorted(folder.glob("optimize_time-*.json")):
        data = json.loads(path.read_text())
        env = env or data["environment"]
        rows.append(data["row"])
    head = ("| model | accelc cold s | reduce-overhead first call s | ratio | max-autotune first call s | ratio | "
            "accelc warm s (guard run again) | load + first call s | ms a call: accelc (cold's) / reduce-overhead | cold phases (s) |")
    lines = [f"Optimize time, {env.get('device')} ({env.get('date')}; torch {env.get('torch')}, "
             f"triton {env.get('triton')})", "", head, "|" + "---|" * 10]

    def get(r, side, key):
        v = r.get(side, {}).get(key)
        return v if isinstance(v, (int, float)) else None

    for r in rows:
        cold, ro, mx = get(r, "accelc_cold", "optimize_s"), get(r, "compile_ro", "first_call_s"), \
            get(r, "compile_max", "first_call_s")
        phases = r.get("accelc_cold", {}).get("phases_s") or {}
        after = get(r, "accelc_cold", "other_shapes_after_s")
        lines.append("| " + " | ".join([
            r["model"], _f(cold) + (f" (+{after:.1f} in the background)" if after is not None else ""), _f(ro),
            f"{cold / ro:.2f}x" if cold and ro else "", _f(mx),
            f"{cold / mx:.2f}x" if cold and mx else "",
            _f(get(r, "accelc_warm", "optimize_s")) + (f" ({_f(get(r, 'accelc_warm_checked', 'optimize_s'))})"
                                                       if get(r, "accelc_warm_checked", "optimize_s") else ""),
            _f(get(r, "load", "first_call_s")), _call_ms(r), ", ".join(f"{k} {v}" for k, v in phases.items())]) + " |")
    return "\n".join(lines) + "\n"


def _call_ms(r) -> str:
    ms = [r.get(side, {}).get("call_ms") for side in ("accelc_cold", "compile_ro")]
    return "" if ms[0] is None else " / ".join("-" if v is None else f"{v:.3f}" for v in ms)


def _f(v) -> str:
    return "" if v is None else f"{v:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,resnet50,tinyllama-lm")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--render", default=None)
    ap.add_argument("--side", default=None)        # (one side, in the process measure() starts)
    ap.add_argument("--model", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--pstats", default=None)       # (--profile's whole profiles: the folder)
    a = ap.parse_args()
    if a.render:
        print(render(Path(a.render)))
        return
    if a.side:
        print(json.dumps(run_side(a.model, a.side, a.workdir, a.profile, a.pstats), default=str))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in a.models.split(","):
        measure(name, a.sides.split(","), out, a.profile)
    (out / "optimize_time.md").write_text(render(out))
    print(render(out))


if __name__ == "__main__":
    main()
