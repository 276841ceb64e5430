"""Real model families at real size, as HF transformers and timm build them (random init, fp16):
does accelc capture each, which layers does it rewrite, revert or keep, what share of the FLOPs
runs in its kernels, and the end-to-end error against an fp32 run of the same model.

    python bench/families.py --out bench/results [--only bert,gpt2]

Layers are rewritten whatever their speed (only_if_faster off: the coverage of what accelc's
kernels take; bench/e2e.py times whole models with the default, speed-checked choice) and kernels
run their default configs (ACCELC_AUTOTUNE=0), so the run measures capture and coverage, not
tuning. Writes families-<device>.json / .md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("ACCELC_AUTOTUNE", "0")
os.environ.setdefault("ACCELC_ONLY_IF_FASTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import accelc  # noqa: E402
from _common import environment, md_table, write  # noqa: E402
from accelc.models.real import reinit  # noqa: E402
from accelc.numerics import rel_l2  # noqa: E402


def _hf(name):
    import transformers as T
    text = lambda cls, cfg, b, s: (cls(cfg), (torch.randint(0, cfg.vocab_size, (b, s)),), {})  # noqa: E731
    image = lambda cls, cfg, b, size=224: (cls(cfg), (torch.randn(b, 3, size, size),), {})  # noqa: E731
    llama = T.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=32000)
    return {
        "hf bert-base": lambda: text(T.BertModel, T.BertConfig(), 8, 384),
        "hf roberta-base": lambda: text(T.RobertaModel, T.RobertaConfig(vocab_size=50265, max_position_embeddings=514), 8, 384),
        "hf distilbert": lambda: text(T.DistilBertModel, T.DistilBertConfig(), 8, 384),
        "hf gpt2": lambda: text(T.GPT2LMHeadModel, T.GPT2Config(), 4, 512),
        "hf llama (TinyLlama shape, 8 layers, GQA 32/4)": lambda: text(T.LlamaForCausalLM, llama, 2, 512),
        "hf t5-base encoder": lambda: text(T.T5EncoderModel, T.T5Config(), 8, 256),
        "hf vit-base": lambda: image(T.ViTModel, T.ViTConfig(), 32),
        "hf deit-base": lambda: image(T.DeiTModel, T.DeiTConfig(), 32),
        "hf resnet-50": lambda: image(T.ResNetModel, T.ResNetConfig(), 32),
        "hf convnext-tiny": lambda: image(T.ConvNextModel, T.ConvNextConfig(), 32),
        "hf mobilenet_v2": lambda: image(T.MobileNetV2Model, T.MobileNetV2Config(), 32),
        "hf efficientnet-b0": lambda: image(T.EfficientNetModel, T.EfficientNetConfig(), 32),
    }[name]()


def _timm(name):
    import timm
    return timm.create_model(name, pretrained=False), (torch.randn(32, 3, 224, 224),), {}


FAMILIES = ["hf bert-base", "hf roberta-base", "hf distilbert", "hf gpt2", "hf llama (TinyLlama shape, 8 layers, GQA 32/4)",
            "hf t5-base encoder", "hf vit-base", "hf deit-base", "hf resnet-50", "hf convnext-tiny",
            "hf mobilenet_v2", "hf efficientnet-b0",
            "timm vit_base_patch16_224", "timm resnet50", "timm convnext_tiny", "timm efficientnet_b0"]


def _leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def run(name: str, device: str) -> dict:
    torch.manual_seed(0)
    build = _timm(name.split(" ", 1)[1]) if name.startswith("timm ") else _hf(name)
    model, args, kwargs = build
    model = reinit(model).to(device)
    args = tuple(a.to(device) for a in args)
    with torch.no_grad():
        ref = _leaves(model(*args, **kwargs))          # fp32
    model = model.half()
    args16 = tuple(a.half() if a.is_floating_point() else a for a in args)
    row = dict(model=name, input="x".join(map(str, args[0].shape)))
    t0 = time.perf_counter()
    opt = accelc.optimize(model, args16, example_kwargs=kwargs)
    row["optimize_s"] = round(time.perf_counter() - t0, 1)
    with torch.no_grad():
        got, eager = _leaves(opt(*args16, **kwargs)), _leaves(model(*args16, **kwargs))
    statuses = [r.status for r in opt.layers]
    row.update(capture=opt.info.capture_method, rewritten=statuses.count("rewritten"),
               reverted=statuses.count("reverted"), kept=statuses.count("kept"),
               coverage_pct=round(100 * opt.info.accelc_flops / max(opt.info.flops, 1), 2),
               gflop=round(opt.info.flops / 1e9, 1),
               accelc_vs_fp32=max(rel_l2(g.float(), r) for g, r in zip(got, ref)),
               eager_fp16_vs_fp32=max(rel_l2(e.float(), r) for e, r in zip(eager, ref)),
               kernels=sorted({r.kernel for r in opt.rewritten}),
               left=[f"{r.name} ({r.kind}) {100 * r.flops / max(opt.info.flops, 1):.2f}%: {r.reason}"
                     for r in sorted(opt.layers, key=lambda r: -r.flops) if r.status != "rewritten" and r.flops][:6],
               reverted_layers=[f"{r.name}: {r.reason}" for r in opt.layers if r.status == "reverted"])
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated names (substrings) of FAMILIES")
    ap.add_argument("--out", default=None)
    ap.add_argument("--into", default=None, metavar="JSON",
                    help="a results JSON whose rows of the same models this run replaces (the others kept, each "
                         "row saying the date of its run)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()
    names = [f for f in FAMILIES if not args.only or any(s in f for s in args.only.split(","))]
    rows = []
    for name in names:
        try:
            rows.append(run(name, device))
        except Exception as e:
            rows.append(dict(model=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else
                             type(e).__name__, trace=traceback.format_exc(limit=-3)))
        rows[-1]["run"] = env.get("date", "")
        print(rows[-1], flush=True)
        torch.cuda.empty_cache() if device == "cuda" else None
    if args.into:
        old = json.loads(Path(args.into).read_text())
        fresh = {r["model"]: r for r in rows}
        rows = [fresh.pop(r["model"], None) or dict(r, run=r.get("run", old["environment"].get("date", "")))
                for r in old["rows"]] + list(fresh.values())
    table = md_table(["model", "input", "capture", "rewritten / reverted / kept", "coverage % FLOPs", "GFLOP",
                      "accelc vs fp32", "eager fp16 vs fp32", "optimize s", "run (UTC)"],
                     [[r["model"], r.get("input", ""), r.get("capture", r.get("error", "")),
                       f"{r['rewritten']} / {r['reverted']} / {r['kept']}" if "rewritten" in r else "",
                       r.get("coverage_pct", ""), r.get("gflop", ""),
                       f"{r['accelc_vs_fp32']:.1e}" if "accelc_vs_fp32" in r else "",
                       f"{r['eager_fp16_vs_fp32']:.1e}" if "eager_fp16_vs_fp32" in r else "", r.get("optimize_s", ""),
                       r.get("run", "")]
                      for r in rows])
    left = "\n".join(f"- {r['model']}: " + ("; ".join(r.get("left", [])) or "nothing") for r in rows if "left" in r)
    md = (f"# Real model families ({env.get('device', 'cpu')})\n\n" + " ".join(f"{k} {v}," for k, v in env.items())
          + "\n\nfp16, random init (rescaled: accelc.models.real.reinit), layers rewritten whatever their speed "
            "(only_if_faster off), default kernel configs (no tuning). coverage: the share of the model's "
            "matmul / conv / attention FLOPs in accelc kernels (accelc.flops). Errors: relative L2 of the "
            "worst output tensor against the same model in fp32.\n\n" + table
          + "\n\nWhat is left to PyTorch (the biggest layers by FLOPs):\n\n" + left + "\n")
    print(md)
    if args.out:
        write(args.out, "families", env, rows, md)


if __name__ == "__main__":
    main()
