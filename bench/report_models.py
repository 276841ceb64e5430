"""accelc.report on every built-in model at a realistic size, on the GPU: per-layer eager /
ONNX Runtime (CUDA provider) / torch.compile / accelc, every side timed by one function
(accelc.latency.side_ms), committed as Markdown + JSON under bench/results/.

    source .ort/install.sh && python bench/report_models.py [--models vit,bert] [--out bench/results]
    python bench/report_models.py --int8 --models mlp,gpt       # W8A8 linear layers (Int8Config defaults)
    python bench/report_models.py --summary bench/results      # report-summary.md, from the JSONs

Layer widths, sequence lengths, image sizes and batch sizes are the real models'; the transformer
stacks are cut to DEPTH blocks and ResNet-50 to one block per stage, so that a model fits in one
device call (every block of a stack has the same layer shapes, so the per-layer rows are the
same as the full model's; the end-to-end row is then the shortened model's).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402
from accelc import models  # noqa: E402

SCHEMA_VERSION = importlib.import_module("accelc.report").SCHEMA_VERSION

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
        e = rep.end_to_end.to_dict()
        print(f"{name}: {rep.totals['rewritten']} rewritten; " + " / ".join(
            f"{k} {_ms(e[c])}" for k, c in SIDES) + f" ms; accelc {_x(e['speedup_vs_ort'])} vs the faster ORT, "
            f"{_x(e['speedup_vs_compile'])} vs the faster torch.compile ({time.time() - t0:.0f} s)", flush=True)
        del model, rep
        torch.cuda.empty_cache()


# the whole-model columns: (label, report field)
SIDES = (("eager", "eager_ms"), ("ORT", "ort_ms"), ("ORT optimizer", "ort_opt_ms"), ("compile", "compile_ms"),
         ("compile reduce-overhead", "compile_ro_ms"), ("accelc", "accelc_ms"))


def _x(v):
    return "n/a" if v is None else f"{v:.2f}x"


def _ms(v):
    return "n/a" if v is None else f"{v:.3f}"


def summary(folder: str) -> str:
    """One table over every report-*.json in `folder` of one schema: the whole model on every
    side, and how the rewritten layers' GPU time compares."""
    lines = ["# Every built-in model, whole model and per layer (accelc.report)", ""]
    head = ("| model | " + " | ".join(k + " ms" for k, _ in SIDES) + " | accelc vs faster ORT | accelc vs faster "
            "compile | accelc vs eager | rewritten layers | their GPU time vs eager | vs ORT | vs compile |")
    table, envs, notes = [head, "|" + "---|" * (len(SIDES) + 8)], set(), []
    for path in sorted(p for p in Path(folder).glob("report-*.json") if not p.name.startswith("report-int8-")):
        d = json.loads(path.read_text())
        if d.get("schema_version") != SCHEMA_VERSION:
            continue
        h, t, e = d["header"], d["totals"], d["end_to_end"]
        envs.add(f"{h['device']}, " + ", ".join(f"{k} {v}" for k, v in h["versions"].items() if v))
        name = h["model"].split(" (")[0]
        table.append(f"| {name} | " + " | ".join(_ms(e[c]) for _, c in SIDES) + f" | {_x(e['speedup_vs_ort'])} | "
                     f"{_x(e['speedup_vs_compile'])} | {_x(e['speedup_vs_eager'])} | {t['rewritten']} | "
                     f"{_x(t['speedup_vs_eager'])} | {_x(t['speedup_vs_ort'])} | {_x(t.get('speedup_vs_compile'))} |")
        notes.append(f"- {name} ({h['date']}): {e.get('ort_opt_method') or e.get('ort_opt_error') or 'n/a'}")
    timer = ("Timer (accelc.latency.side_ms, the same for every side): whole model, plain calls as a user "
             "makes them (CUDA events, L2 flushed, median); per layer, GPU time per call from CUPTI. "
             "'faster ORT': the faster of plain ORT and ORT with its transformer optimizer; 'faster compile': "
             "of torch.compile's default and reduce-overhead modes.")
    return "\n".join(lines + [f"Devices and versions: {'; '.join(sorted(envs))}", "", timer, ""] + table
                     + ["", "ORT's transformer optimizer, per model (the candidate kept, or why none):", ""]
                     + notes) + "\n"


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
