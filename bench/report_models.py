"""accelc.report on every built-in model at a realistic size, on the GPU: per-layer eager /
ONNX Runtime (CUDA provider) / torch.compile / accelc, every side timed by one function
(accelc.latency.side_ms), committed as Markdown + JSON under bench/results/.

    source .ort/install.sh && python bench/report_models.py [--models vit,bert] [--out bench/results]
    python bench/report_models.py --int8 --models mlp,gpt       # W8A8 linear layers (Int8Config defaults)
    python bench/report_models.py --summary bench/results      # the 1.5x-vs-ORT table, from the JSONs

Layer widths, sequence lengths, image sizes and batch sizes are the real models'; the transformer
stacks are cut to DEPTH blocks and ResNet-50 to one block per stage, so that a model fits in one
device call (every block of a stack has the same layer shapes, so the per-layer rows are the
same as the full model's; the end-to-end row is then the shortened model's).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402
from accelc import models  # noqa: E402

DEPTH = 2
# name -> (constructor kwargs, batch size)
MODELS = {
    "mlp": (dict(n_features=256, hidden=4096, depth=3), 4096),
    "transformer_mlp": (dict(dim=768, hidden=3072, depth=DEPTH, seq_len=512), 8),
    "vit": ({**models.SIZES["vit"], "depth": DEPTH}, 32),
    "bert": ({**models.SIZES["bert"], "depth": DEPTH}, 8),
    "gpt": ({**models.SIZES["gpt"], "depth": DEPTH}, 4),
    "resnet": ({**models.SIZES["resnet"], "layers": (1, 1, 1, 1)}, 32),
    "cnn_small": (dict(width=64, image_size=128), 64),
}
PROMISE = 1.5   # every rewritten layer at least this much faster than ONNX Runtime's CUDA provider


def run(names: list[str], out: str, rep_ms: float, int8: bool = False) -> None:
    env = _common.environment()
    print(_common.env_line(env))
    for name in names:
        kwargs, batch = MODELS[name]
        t0 = time.time()
        model = models.get(name, **kwargs).cuda()
        inputs = model.example_inputs(batch)
        rep = accelc.report(model, inputs, accelc.OptimizeConfig(dtype="fp16", int8=int8), rep_ms=rep_ms,
                            model_name=f"{name} ({', '.join(f'{k}={v}' for k, v in kwargs.items())}; batch {batch})")
        kind = "report-int8" if int8 else "report"
        rep.write(out, ("json", "md"), stem=f"{kind}-{name}-{_common.slug(env['device'])}")
        t, e = rep.totals, rep.end_to_end
        print(f"{name}: {t['rewritten']} rewritten, {t['faster_than_ort_1_5x']} >= {PROMISE}x ORT; layers "
              f"{_x(t['speedup_vs_ort'])} vs ORT, {_x(t['speedup_vs_eager'])} vs eager; end to end "
              f"{_x(e.speedup_vs_ort)} vs ORT, {_x(e.speedup_vs_eager)} vs eager, {_x(e.speedup_vs_compile)} vs "
              f"torch.compile (eager {e.eager_ms:.3f} / ORT {e.ort_ms or 0:.3f} / compile {e.compile_ms or 0:.3f}, "
              f"reduce-overhead {e.compile_ro_ms or 0:.3f} / accelc {e.accelc_ms:.3f} ms) ({time.time() - t0:.0f} s)",
              flush=True)
        del model, rep
        torch.cuda.empty_cache()


def _x(v):
    return "n/a" if v is None else f"{v:.2f}x"


def summary(folder: str) -> str:
    """One table over every report-*.json in `folder`: which rewritten layers meet the promise."""
    lines = ["# accelc vs ONNX Runtime (CUDA provider), every built-in model", "",
             f"The promise: every rewritten layer at least {PROMISE}x faster than ONNX Runtime's CUDA "
             "provider running the same layer. Per-model tables: report-<model>-<device>.md.", "",
             "| model | rewritten layers | >= 1.5x ORT | 1.0-1.5x | < 1.0x | no ORT number | layers total vs ORT | "
             "vs eager | end to end vs ORT | end to end vs eager |", "|" + "---|" * 10]
    misses = []
    env = ""
    for path in sorted(p for p in Path(folder).glob("report-*.json") if not p.name.startswith("report-int8-")):
        d = json.loads(path.read_text())
        env = env or f"{d['header']['device']}, {d['header']['date']}, " + ", ".join(
            f"{k} {v}" for k, v in d["header"]["versions"].items() if v)
        rows = [r for r in d["layers"] if r["status"] == "rewritten"]
        sp = [r["speedup_vs_ort"] for r in rows]
        meet = sum(s is not None and s >= PROMISE for s in sp)
        mid = sum(s is not None and 1.0 <= s < PROMISE for s in sp)
        low = sum(s is not None and s < 1.0 for s in sp)
        none = sum(s is None for s in sp)
        t, e = d["totals"], d["end_to_end"]
        lines.append(f"| {d['header']['model'].split(' (')[0]} | {len(rows)} | {meet} | {mid} | {low} | {none} | "
                     f"{_x(t['speedup_vs_ort'])} | {_x(t['speedup_vs_eager'])} | {_x(e['speedup_vs_ort'])} | "
                     f"{_x(e['speedup_vs_eager'])} |")
        misses += [f"{d['header']['model'].split(' (')[0]}: {r['layer']} ({r['kernel']}, {r['input_shape']}): "
                   f"{_x(r['speedup_vs_ort'])}" + (f" [{r['ort_error'][:120]}]" if r["ort_error"] else "")
                   for r in rows if r["speedup_vs_ort"] is None or r["speedup_vs_ort"] < PROMISE]
    lines[2:2] = [env, ""]
    lines += ["", f"## Layers under {PROMISE}x ONNX Runtime", ""] + [f"- {m}" for m in misses]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--rep-ms", type=float, default=50)
    ap.add_argument("--int8", action="store_true", help="with int8 (W8A8) linear layers")
    ap.add_argument("--summary", metavar="DIR", help="only write DIR/report-summary.md from the JSONs there")
    args = ap.parse_args()
    if args.summary:
        text = summary(args.summary)
        (Path(args.summary) / "report-summary.md").write_text(text)
        print(text)
        return
    run([m.strip() for m in args.models.split(",") if m.strip()], args.out, args.rep_ms, args.int8)


if __name__ == "__main__":
    main()
