"""Whole real models, called the way a user calls them, on the GPU: eager PyTorch,
torch.compile (default and mode="reduce-overhead"), ONNX Runtime's CUDA provider (whole model),
accelc's default call (and with CUDA graphs off, and with int8), plus accelc's optimize time.

    source .ort/install.sh    # onnxruntime-gpu on the device machine (../shared/tools/README.md)
    python bench/e2e.py --models resnet50,bert --out DIR          # one JSON per model into DIR
    python bench/e2e.py --optimize-seconds resnet50               # one optimize, in this process
    python bench/e2e.py --merge DIR --out bench/results           # the table of every model (DIR's
                                                                  # subfolders in name order: later runs' sides win;
                                                                  # times nothing, takes no run options)

Models are built by timm and HF transformers with random weights, fp16, eval, at realistic batch
and sequence sizes (and at batch 1). Every side is timed the same way: back-to-back calls of the
callable a user would hold (`model(x)`, `compiled(x)`, `opt(x)`, ORT's run with IO binding), the
GPU synchronised after each round; the median of ROUNDS rounds of per-call time. Optimize time
is measured cold (empty accelc tuning cache, Triton and Inductor caches: a fresh process with
fresh cache folders) and warm (a second process with the same folders).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

from accelc.latency import back_to_back_ms  # noqa: E402
from accelc.numerics import rel_l2  # noqa: E402

ROUNDS = 7


# ---------------------------------------------------------------------------------------------
# models

def _timm(name, batch):
    import timm

    model = timm.create_model(name, pretrained=False)
    return model, (torch.randn(batch, 3, 224, 224),)


def _hf(kind, batch, seq):
    import transformers as tf

    if kind == "bert":
        model = tf.BertModel(tf.BertConfig())
        vocab = 30522
    elif kind == "gpt2":
        model = tf.GPT2Model(tf.GPT2Config(use_cache=False))
        vocab = 50257
    elif kind == "whisper":   # Whisper-base's encoder: a Conv1d stem (two convs + GELU), 6 layers, 1500 frames
        from transformers.models.whisper.modeling_whisper import WhisperEncoder
        model = WhisperEncoder(tf.WhisperConfig(d_model=512, encoder_layers=6, encoder_attention_heads=8,
                                                encoder_ffn_dim=2048, num_mel_bins=80, max_source_positions=1500))
        return model, (torch.randn(batch, 80, seq),)
    else:   # a Llama-style decoder with grouped-query attention (TinyLlama-1.1B's shape)
        model = tf.LlamaModel(tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                             use_cache=False, max_position_embeddings=4096))
        vocab = 32000
    return model, (torch.randint(0, vocab, (batch, seq)),)


# name -> (builder(batch) -> (model, inputs), batch sizes: realistic first, then 1, family)
MODELS = {
    "resnet50": (lambda b: _timm("resnet50", b), (32, 1), "CNN (timm)"),
    "convnext_tiny": (lambda b: _timm("convnext_tiny", b), (32, 1), "ConvNeXt (timm)"),
    "mobilenetv2": (lambda b: _timm("mobilenetv2_100", b), (32, 1), "MobileNetV2 (timm): depthwise convs, ReLU6"),
    "vit_base": (lambda b: _timm("vit_base_patch16_224", b), (32, 1), "ViT-B/16 (timm)"),
    "regnety_016": (lambda b: _timm("regnety_016", b), (32, 1),
                    "RegNetY-1.6GF (timm): BatchNormAct2d, grouped convs (24 channels a group), SE"),
    "whisper_base": (lambda b: _hf("whisper", b, 3000), (8, 1),
                     "Whisper-base encoder (HF): Conv1d stem, 1500 frames"),
    "bert": (lambda b: _hf("bert", b, 384), (8, 1), "BERT-base encoder (HF), 384 tokens"),
    "gpt2": (lambda b: _hf("gpt2", b, 1024), (4, 1), "GPT-2 small decoder (HF), 1024 tokens"),
    "llama": (lambda b: _hf("llama", b, 1024), (2, 1), "Llama-style GQA decoder, 1.1B (HF), 1024 tokens"),
}


def build(name, batch):
    torch.manual_seed(0)
    model, inputs = MODELS[name][0](batch)
    model = model.cuda().half().eval()
    return model, tuple(t.cuda().half() if t.is_floating_point() else t.cuda() for t in inputs)


# ---------------------------------------------------------------------------------------------
# timing: one method for every side

def per_call_ms(fn) -> float:
    """ms per call, the one whole-model timer (accelc.latency.back_to_back_ms), every side alike."""
    return back_to_back_ms(fn, ROUNDS)


def _first_tensor(out):
    from torch.utils import _pytree as pytree

    return next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


def _rel(out, ref) -> float:
    return rel_l2(_first_tensor(out), _first_tensor(ref))


def _reset():
    torch._dynamo.reset()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# the sides

def side_eager(model, inputs, row):
    row["eager_ms"] = per_call_ms(lambda: model(*inputs))


def side_compile(model, inputs, row, mode):
    key = {None: "compile", "reduce-overhead": "compile_ro", "max-autotune": "compile_max"}[mode]
    compiled = torch.compile(model, mode=mode)
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(*inputs)
        torch.cuda.synchronize()
    row[f"{key}_first_call_s"] = round(time.perf_counter() - t0, 1)
    row[f"{key}_ms"] = per_call_ms(lambda: compiled(*inputs))


def side_accelc(model, inputs, row, key, **config):
    import accelc

    t0 = time.perf_counter()
    opt = accelc.optimize(model, inputs, accelc.OptimizeConfig(**config))
    row[f"{key}_optimize_s"] = round(time.perf_counter() - t0, 1)
    after = _common.other_shapes_wait_s(opt)        # (timed once its background glue compiles are done)
    if after is not None:
        row[f"{key}_other_shapes_after_s"] = after
    row[f"{key}_ms"] = per_call_ms(lambda: opt(*inputs))
    with torch.no_grad():
        row[f"{key}_rel_err_vs_eager"] = _rel(opt(*inputs), model(*inputs))
    if config.get("int8") or config.get("fp8"):    # quantized: the error that counts is against the fp32 model
        _errors_vs_fp32(model, inputs, opt(*inputs), row, key)
    rows = opt.layers
    row[f"{key}_sqnr_db"] = {r.name: round(r.sqnr_db, 1) for r in rows       # the quantized layers' SQNR
                             if r.status == "rewritten" and any(q in (r.kernel or "") for q in ("fp8", "w8a"))}
    row[f"{key}_layers"] = {s: sum(r.status == s for r in rows) for s in ("rewritten", "reverted", "kept")}
    row[f"{key}_runtime"] = opt.info.runtime
    row[f"{key}_summary"] = opt.summary()
    # the share of the model's matmul / conv / attention FLOPs that runs in accelc kernels after the race
    row[f"{key}_flop_share"] = round(opt.info.accelc_flops / opt.info.flops, 4) if opt.info.flops else None


def _errors_vs_fp32(model, inputs, out, row, key) -> None:
    """row[key_rel_err_vs_fp32] (the side's output) and row[eager_rel_err_vs_fp32] (eager in the model's dtype),
    against a copy of the model in fp32 on the same inputs (float inputs in fp32)."""
    import copy

    m32 = copy.deepcopy(model).float()
    ins = tuple(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)
    with torch.no_grad():
        ref = m32(*ins)
        row[f"{key}_rel_err_vs_fp32"] = _rel(out, ref)
        row["eager_rel_err_vs_fp32"] = _rel(model(*inputs), ref)
    del m32, ref
    torch.cuda.empty_cache()


def side_torchao_fp8(model, inputs, row, name="torchao_fp8", mode="max-autotune"):
    """torchao's float8 (Float8DynamicActivationFloat8WeightConfig: each activation row and each weight channel scaled
    to e4m3, cuBLAS's fp8 GEMM, where the weights are bf16; torchao 0.18 takes row-wise scales from bf16 weights only,
    so an fp16 model gets one scale per tensor, and the row names which) on a copy of the model, then
    torch.compile(mode="max-autotune") as torchao's float8 inference recipe runs it (torchao_fp8_ro:
    mode="reduce-overhead", no GEMM autotuning, for where max-autotune's does not finish: one fp8 scaled_mm's took
    161 s on an H200); its error against the model in fp32 beside accelc_fp8's. Where
    torchao does not install or import, the row says why. (The device image has no torchao: its wheel travels,
    `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
    manylinux_2_28_x86_64 -d .whl torchao==0.18.0`, installed there with --target and PYTHONPATH; 0.18.0 imports
    beside torch 2.13 here, its C++ extension aside, which the float8 path does not use.)"""
    import copy

    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_
    except Exception as e:   # (the row says so)
        row[f"{name}_error"] = f"torchao not available: {type(e).__name__}: {str(e)[:200]}"
        return
    import torchao

    q = copy.deepcopy(model)
    per_row = next(model.parameters()).dtype == torch.bfloat16
    row[f"{name}_granularity"] = "row" if per_row else "tensor"
    quantize_(q, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if per_row else PerTensor()))
    compiled = torch.compile(q, mode=mode)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = _first_tensor(compiled(*inputs)).clone()   # (reduce-overhead's later calls overwrite its output)
        torch.cuda.synchronize()
    row[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 1)
    row[f"{name}_version"] = torchao.__version__
    row[f"{name}_ms"] = per_call_ms(lambda: compiled(*inputs))
    with torch.no_grad():
        row[f"{name}_rel_err_vs_eager"] = _rel(out, model(*inputs))
    _errors_vs_fp32(model, inputs, out, row, name)


def side_ort(model, inputs, row):
    """Plain ORT: the model exported as the report exports a layer (accelc.baselines.ort.export:
    dynamo first, weights beside the file for models over 2 GB), run with IO binding and ORT's own
    CUDA graph where the session takes it (OrtRunner), timed as the other sides are."""
    from accelc.baselines import ort

    if not ort.has_cuda():
        row["ort_error"] = "onnxruntime has no CUDAExecutionProvider here"
        return
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as d, torch.no_grad():
        t0 = time.perf_counter()
        exp = ort.export(model, list(inputs), os.path.join(d, "m.onnx"), device)
        row["ort_export_s"] = round(time.perf_counter() - t0, 1)
        if exp.path is None:
            row["ort_error"] = f"ONNX export failed: {exp.error}"[:600]
            return
        runner = ort.OrtRunner(exp.path, list(inputs), device)
        row["ort_ms"], row["ort_cuda_graph"], row["ort_export"] = per_call_ms(runner.run), runner.cuda_graph, exp.method
        row["ort_rel_err_vs_eager"] = _rel(runner.run()[0].clone(), model(*inputs))


class _WithMask(torch.nn.Module):
    """An HF text model called with an attention mask, as ORT's users export it (HF Optimum)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(ids, attention_mask=mask)


def side_ort_opt(model, inputs, row, max_timed=3):
    """ORT at its best: the candidates of ORT's transformer optimizer (accelc.baselines.ort:
    exporters x model types, the model's attention in its exportable form; for HF text models
    also exported with an all-ones attention mask input), each checked against eager and timed
    as the other sides are; the fastest kept."""
    import onnxruntime as ort_rt

    from accelc.baselines import ort

    if "CUDAExecutionProvider" not in ort_rt.get_available_providers():
        row["ort_opt_error"] = "onnxruntime has no CUDAExecutionProvider here"
        return
    variants = []
    if hasattr(getattr(model, "config", None), "model_type") and not inputs[0].is_floating_point():
        m2, label = ort.exportable_attention(model)
        mask = torch.ones_like(inputs[0])
        variants.append(((label + ", " if label else "") + "attention mask input", _WithMask(m2).eval(),
                         [inputs[0], mask]))
    with tempfile.TemporaryDirectory() as d, torch.no_grad():
        t0 = time.perf_counter()
        cands, errors = ort.optimized_candidates(model, list(inputs), d, torch.device("cuda"), variants)
        row["ort_opt_prepare_s"] = round(time.perf_counter() - t0, 1)
        ref = model(*inputs)

        def judge(outs):   # a fusion that changed the numbers: not a baseline
            rel = _rel(outs[0], ref)
            return rel, "" if rel < 2e-2 else f"relative error {rel:.2e} vs eager"

        timed, refused = ort.time_candidates(cands, torch.device("cuda"), judge,
                                             lambda runner: per_call_ms(runner.run), max_timed)
        errors += refused
        row["ort_opt_candidates"] = [{"method": t.candidate.method + (" +cuda graph" if t.cuda_graph else ""),
                                      "ms": t.ms, "rel_err_vs_eager": t.rel_error} for t in timed]
        if errors:
            row["ort_opt_notes"] = errors
        if timed:
            best = min(row["ort_opt_candidates"], key=lambda t: t["ms"])
            row["ort_opt_ms"], row["ort_opt_method"] = best["ms"], best["method"]
            row["ort_opt_rel_err_vs_eager"] = best["rel_err_vs_eager"]
        else:
            row["ort_opt_error"] = "; ".join(errors)[:600] or "no candidate"


# compile_max: torch.compile(mode="max-autotune") (Triton GEMM templates + CUDA graphs), the strongest
# torch.compile mode; accelc_nopasses: accelc with every pass off (capture, Inductor glue and CUDA graphs
# only), so that accelc / accelc_nopasses is what accelc's kernels add
# accelc_static: dynamic=False (the example's shapes only: the glue compiled for them, as before the
# any-shape work), so that accelc / accelc_static is what taking every shape costs at the example's
SIDES = ("eager", "compile", "compile_ro", "compile_max", "ort", "ort_opt", "accelc", "accelc_nopasses",
         "accelc_static", "accelc_nograph", "accelc_int8", "accelc_fp8", "accelc_fp8w", "accelc_nonorms",
         "accelc_nogated", "torchao_fp8", "torchao_fp8_ro")


def run_model(name, sides, out_dir, batches="all"):
    sizes = MODELS[name][1]
    for batch in {"all": sizes, "first": sizes[:1], "last": sizes[-1:]}[batches]:
        row = {"model": name, "family": MODELS[name][2], "batch": batch}
        model, inputs = build(name, batch)
        row["input_shapes"] = [list(t.shape) for t in inputs]
        todo = sides if batch == sizes[0] else [s for s in sides if s in ("eager", "compile_ro", "accelc")]
        for side in todo:
            t0 = time.perf_counter()
            try:
                if side == "eager":
                    side_eager(model, inputs, row)
                elif side == "compile":
                    side_compile(model, inputs, row, None)
                elif side == "compile_ro":
                    side_compile(model, inputs, row, "reduce-overhead")
                elif side == "compile_max":
                    side_compile(model, inputs, row, "max-autotune")
                elif side == "accelc_nopasses":
                    side_accelc(model, inputs, row, "accelc_nopasses", passes=())
                elif side == "accelc_static":
                    side_accelc(model, inputs, row, "accelc_static", dynamic=False)
                elif side == "ort":
                    side_ort(model, inputs, row)
                elif side == "ort_opt":
                    side_ort_opt(model, inputs, row)
                elif side == "accelc":
                    side_accelc(model, inputs, row, "accelc")
                elif side == "accelc_nograph":
                    side_accelc(model, inputs, row, "accelc_nograph", cuda_graphs=False)
                elif side == "accelc_int8":
                    side_accelc(model, inputs, row, "accelc_int8", int8=True)
                elif side in ("accelc_fp8", "accelc_fp8w"):    # fp8 weights and activations / weights only
                    import accelc
                    side_accelc(model, inputs, row, side, fp8=accelc.Fp8Config(weights_only=side == "accelc_fp8w"))
                elif side == "torchao_fp8":      # the fp8 peer: torchao's float8 dynamic quantization + compile
                    side_torchao_fp8(model, inputs, row)
                elif side == "torchao_fp8_ro":   # the same under reduce-overhead (no GEMM autotuning)
                    side_torchao_fp8(model, inputs, row, side, mode="reduce-overhead")
                elif side == "accelc_nonorms":   # A/B of the norms pass: its LayerNorms left to the glue
                    from accelc.pipeline import PASS_NAMES
                    side_accelc(model, inputs, row, "accelc_nonorms", passes=tuple(p for p in PASS_NAMES if p != "norms"))
                elif side == "accelc_nogated":   # A/B of the gated_mlp pass: gate and up as two linears
                    from accelc.pipeline import PASS_NAMES
                    side_accelc(model, inputs, row, "accelc_nogated",
                                passes=tuple(p for p in PASS_NAMES if p != "gated_mlp"))
            except Exception as e:
                row[f"{side}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc()
            _reset()
            print(f"{name} b{batch} {side}: {row.get(side + '_ms', row.get(side + '_error'))} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            with open(Path(out_dir) / f"e2e-{name}-b{batch}.json", "w") as f:   # after every side: a cut-off run keeps them
                json.dump({"environment": _common.environment(), "row": row}, f, indent=1, default=str)
        del model
        _reset()


def optimize_seconds(name):
    """One optimize of `name` at its realistic batch in this process (the caches are the
    environment's): prints {"optimize_s": ...}."""
    import accelc

    model, inputs = build(name, MODELS[name][1][0])
    t0 = time.perf_counter()
    opt = accelc.optimize(model, inputs)
    s = time.perf_counter() - t0
    print(json.dumps({"optimize_s": round(s, 1), "rewritten": len(opt.rewritten), "phases_s": opt.info.seconds}))


def cold_warm(name, out_dir):
    """Optimize seconds in a fresh process with empty caches, then in a second one with them."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, ACCELC_CACHE_DIR=f"{d}/accelc", TRITON_CACHE_DIR=f"{d}/triton",
                   TORCHINDUCTOR_CACHE_DIR=f"{d}/inductor")
        res = {}
        for phase in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--optimize-seconds", name], env=env,
                                 capture_output=True, text=True)
            line = [x for x in out.stdout.splitlines() if x.startswith("{")]
            data = json.loads(line[-1]) if line else {}
            res[phase] = data.get("optimize_s", f"failed: {out.stderr[-300:]}")
            res[f"{phase}_phases_s"] = data.get("phases_s")
            print(f"{name} optimize {phase}: {res[phase]} {res[f'{phase}_phases_s']}", flush=True)
    with open(Path(out_dir) / f"e2e-{name}-optimize.json", "w") as f:
        json.dump({"environment": _common.environment(), "row": {"model": name, **res}}, f, indent=1)


# ---------------------------------------------------------------------------------------------
# the table

def _x(a, b):
    return f"{a / b:.2f}x" if a and b else ""


_SPEED = re.compile(r"^(\S+)\s+kept\s+accelc::(\S+)\s.*accelc::\S+ ([\d.]+) us vs PyTorch (?:\([^)]*\) )?([\d.]+) us")
_REVERTED = re.compile(r"^(\S+)\s+reverted\s+accelc::(\S+)\s.*?(error .*)$")


def gap_table(rows) -> str:
    """Per model and kernel: the layers the guard left to PyTorch because PyTorch's kernel was
    the faster on the example inputs (accelc's and PyTorch's summed times), and the reverted ones."""
    lines = []
    for r in rows:
        speed, reverted = {}, {}
        for line in r.get("accelc_summary", "").splitlines():
            m = _SPEED.match(line)
            if m:
                k = speed.setdefault(m.group(2), [0, 0.0, 0.0])
                k[0] += 1
                k[1] += float(m.group(3))
                k[2] += float(m.group(4))
            m = _REVERTED.match(line)
            if m:
                reverted.setdefault(m.group(2), []).append(m.group(1))
        for kernel, (n, ours, theirs) in sorted(speed.items()):
            lines.append([r["model"], r["batch"], kernel, n, f"{ours:.0f}", f"{theirs:.0f}", f"{theirs / ours:.2f}x", ""])
        for kernel, names in sorted(reverted.items()):
            lines.append([r["model"], r["batch"], kernel, len(names), "", "", "", "reverted (numbers): " + ", ".join(names)])
    return ("Layers left to PyTorch, per model and accelc kernel: where PyTorch's kernel was the faster on the "
            "example inputs (OptimizeConfig.only_if_faster; summed us of the accelc kernel and of the PyTorch layer), "
            "and layers the guard reverted for their numbers:\n\n"
            + _common.md_table(["model", "batch", "accelc kernel", "layers", "accelc us", "PyTorch us",
                                "accelc speed", "note"], lines))


NO_FUSIONS = "has no fusions for this model"


def _drop_empty(head, table):
    """The columns some row has a value in (e.g. no nograph column when that side was not run)."""
    keep = [i for i in range(len(head)) if any(str(row[i]) for row in table)]
    return [head[i] for i in keep], [[row[i] for i in keep] for row in table]


def merge(in_dir, out_dir):
    by_key, opt_s, env, dates = {}, {}, None, set()
    for p in sorted(Path(in_dir).glob("**/e2e-*.json")):     # runs in name order: a later run's sides win
        data = json.loads(p.read_text())
        if "row" not in data:     # a merged table kept beside its runs (its "rows"): not a run
            continue
        env = env or data["environment"]
        dates.add(data["environment"]["date"])
        if p.stem.endswith("-optimize"):
            opt_s.setdefault(data["row"]["model"], {}).update(data["row"])
        else:
            row = data["row"]
            by_key.setdefault((row["model"], row["batch"]), {}).update(row)
    rows = list(by_key.values())
    order = list(MODELS)
    rows.sort(key=lambda r: (order.index(r["model"]), -r["batch"]))

    def ms(r, k):
        v = r.get(f"{k}_ms")
        if not v and NO_FUSIONS in r.get(f"{k}_error", ""):
            return "n/a"      # not a model ORT's transformer optimizer has fusions for
        return f"{v:.3f}" if v else ("error" if f"{k}_error" in r else "")

    table = []
    head = ["model", "batch", "eager", "compile", "compile_ro", "compile_max", "ORT", "ORT optimizer", "accelc",
            "accelc no passes", "accelc static", "accelc nograph", "accelc int8", "accelc fp8", "accelc fp8 weights",
            "fp8 vs accelc", "err vs fp32: eager / accelc fp8", "torchao fp8", "accelc fp8 vs torchao fp8",
            "err vs fp32: torchao fp8", "torchao fp8 reduce-overhead", "accelc vs compile_ro", "accelc vs compile_max",
            "accelc vs faster ORT", "accelc vs eager", "kernels' gain (no passes / accelc)", "FLOPs in accelc kernels",
            "layers"]
    for r in rows:
        best_ort = min((r[k] for k in ("ort_ms", "ort_opt_ms") if r.get(k)), default=None)
        share = r.get("accelc_flop_share")
        table.append([r["model"], r["batch"], ms(r, "eager"), ms(r, "compile"), ms(r, "compile_ro"), ms(r, "compile_max"),
                      ms(r, "ort"), ms(r, "ort_opt"), ms(r, "accelc"), ms(r, "accelc_nopasses"), ms(r, "accelc_static"), ms(r, "accelc_nograph"),
                      ms(r, "accelc_int8"), ms(r, "accelc_fp8"), ms(r, "accelc_fp8w"),
                      _x(r.get("accelc_ms"), r.get("accelc_fp8_ms")),
                      (f"{r['eager_rel_err_vs_fp32']:.2e} / {r['accelc_fp8_rel_err_vs_fp32']:.2e}"
                       if "accelc_fp8_rel_err_vs_fp32" in r else ""),
                      ms(r, "torchao_fp8"), _x(r.get("torchao_fp8_ms"), r.get("accelc_fp8_ms")),
                      (f"{r['torchao_fp8_rel_err_vs_fp32']:.2e}" if "torchao_fp8_rel_err_vs_fp32" in r else ""),
                      ms(r, "torchao_fp8_ro"),
                      _x(r.get("compile_ro_ms"), r.get("accelc_ms")),
                      _x(r.get("compile_max_ms"), r.get("accelc_ms")), _x(best_ort, r.get("accelc_ms")),
                      _x(r.get("eager_ms"), r.get("accelc_ms")), _x(r.get("accelc_nopasses_ms"), r.get("accelc_ms")),
                      f"{share:.1%}" if share is not None else "",
                      "{rewritten}/{reverted}/{kept}".format(**r["accelc_layers"]) if "accelc_layers" in r else ""])
    gm = [r["compile_ro_ms"] / r["accelc_ms"] for r in rows if r.get("compile_ro_ms") and r.get("accelc_ms")]
    geo = statistics.geometric_mean(gm) if gm else None
    gm_max = [r["compile_max_ms"] / r["accelc_ms"] for r in rows if r.get("compile_max_ms") and r.get("accelc_ms")]
    geo_max = statistics.geometric_mean(gm_max) if gm_max else None
    md = (f"# Whole models, called as a user calls them ({env['device'] if env else '?'})\n\n"
          + (_common.env_line(env) if env else "") + "\n\n"
          + (f"Runs: {', '.join(sorted(dates))}.\n\n" if len(dates) > 1 else "")
          + "ms per call, median of rounds of back-to-back calls, fp16, random weights. compile_ro: "
          "torch.compile(mode=\"reduce-overhead\"); ORT: onnxruntime-gpu CUDA provider, whole model exported by the "
          "dynamo exporter, IO binding, NHWC convs, cuDNN exhaustive search, its CUDA graph where the session takes "
          "it; ORT optimizer: the same with ORT's transformer optimizer and its fp16 converter (the fastest "
          "correct candidate; which one, below). accelc: the default call "
          "(Inductor glue, CUDA graph replay); no passes: passes=() (capture, Inductor glue, CUDA graphs: what is "
          "left without accelc's kernels); static: dynamic=False (the example's shapes only); nograph: cuda_graphs=False; int8: Int8Config defaults; fp8: "
          "Fp8Config(weights_only=False) (weights and activations in e4m3), fp8 weights: Fp8Config() (weights only), "
          "err vs fp32: the relative L2 error of the output against the model in fp32; torchao fp8: torchao's "
          "Float8DynamicActivationFloat8WeightConfig (row-wise scales where the weights are bf16, one scale a "
          "tensor for fp16: the json row's torchao_fp8_granularity) under torch.compile(mode=\"max-autotune\"); "
          "torchao fp8 reduce-overhead: the same under mode=\"reduce-overhead\" (no GEMM autotuning). compile_max: "
          "torch.compile(mode=\"max-autotune\"). FLOPs in accelc kernels: the share of the model's matmul / conv / "
          "attention FLOPs the default call runs in accelc kernels after the guard's speed race. "
          "layers: rewritten / reverted / kept as PyTorch.\n\n"
          + _common.md_table(*_drop_empty(head, table))
          + (f"\nGeometric mean, accelc vs compile_ro: {geo:.2f}x\n" if geo else "")
          + (f"\nGeometric mean, accelc vs compile_max: {geo_max:.2f}x\n" if geo_max else "")
          + ("\nOptimize seconds (accelc.optimize, realistic batch; cold: empty caches in a fresh process, warm: "
             "a second process):\n\n"
             + _common.md_table(["model", "cold s", "warm s"], [[m, v.get("cold"), v.get("warm")] for m, v in opt_s.items()])
             if opt_s else ""))
    opt_rows = [[r["model"], r["batch"], r.get("ort_opt_method") or r.get("ort_opt_error", "")[:300]]
                for r in rows if "ort_opt_method" in r or "ort_opt_error" in r]
    if opt_rows:
        md += ("\nORT's transformer optimizer, the candidate kept (or why none):\n\n"
               + _common.md_table(["model", "batch", "candidate"], opt_rows))
    md += "\n" + gap_table(rows)
    errors = [f"- {r['model']} b{r['batch']} {k}: {v}" for r in rows for k, v in r.items()
              if k.endswith("_error") and NO_FUSIONS not in str(v)]
    if errors:
        md += "\nErrors:\n\n" + "\n".join(errors) + "\n"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    stem = f"e2e-{_common.slug(env['device']) if env else 'unknown'}"
    (Path(out_dir) / f"{stem}.md").write_text(md)
    (Path(out_dir) / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows,
                                                            "optimize_seconds": opt_s}, indent=1, default=str))
    print(md)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--out", default="e2e-out")
    ap.add_argument("--cold-warm", default="", help="models whose cold / warm optimize seconds to measure")
    ap.add_argument("--batches", default="all", choices=["all", "first", "last"],
                    help="first: the realistic batch only; last: batch 1 only")
    ap.add_argument("--optimize-seconds", default=None)
    ap.add_argument("--merge", default=None, metavar="DIR",
                    help="only merge DIR's result folders into --out's table (times nothing)")
    args = ap.parse_args()
    if args.optimize_seconds:
        return optimize_seconds(args.optimize_seconds)
    if args.merge:
        timed = [f"--{f.replace('_', '-')}" for f in ("models", "sides", "batches", "cold_warm")
                 if getattr(args, f) != ap.get_default(f)]
        if timed:   # a run's options with the merge mode: it would time nothing and say nothing
            ap.error(f"--merge DIR only merges result folders and times nothing; {', '.join(timed)} "
                     "ask for a run: drop them, or drop --merge")
        return merge(args.merge, args.out)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(_common.env_line(_common.environment()), flush=True)
    for name in [m for m in args.cold_warm.split(",") if m]:
        cold_warm(name, args.out)
    for name in [m for m in args.models.split(",") if m]:
        run_model(name, args.sides.split(","), args.out, args.batches)


if __name__ == "__main__":
    main()
