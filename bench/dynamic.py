"""Serving requests of every shape: a trace of requests whose (batch, length) are drawn at random, run
by each side after a warm-up pass over the same trace; total time, per-request p50 / p99 (and the first pass's
requests: the longest, how many over 1 s and over 50 ms, each one's ms), the GPU
memory high-water mark, how many compiles and CUDA-graph captures each side made, and every output
checked against eager's. The any-shape issue's measure.

    python bench/dynamic.py [--out bench/results] [--models bert,gpt2,vit,llama] [--requests 300]
    python bench/dynamic.py --smoke        # tiny models, CPU, 6 requests: checks the script runs

Sides: eager; torch.compile(dynamic=True); torch.compile(mode="reduce-overhead") (a CUDA graph per
shape it meets); ONNX Runtime (dynamo export with dynamic axes, CUDA provider, IO binding; with
`source .ort/install.sh`); accelc's default call (any shape: calls padded up to bucket sizes, a CUDA
graph per bucket), accelc_auto (padding="auto": the same, and a GPU-bound call at its own size
where its bucket graph's times say the padding costs more) and accelc_exact (padding=False: a CUDA
graph per exact size, captured at its second call), the runner designs measured side by side over
one optimized graph; accelc_buckets: the default call optimized with warmup_shapes="buckets" (every bucket's
graph captured at optimize). Requests: batch 1-32, length 8-512
(ViT: batch only, 224 x 224 images), seed 0; fp16, random weights at real shapes (BERT-base, GPT-2
small without cache, ViT-B/16, a Llama-style 1.1B with GQA). The reference memory:
reduce-overhead's high-water mark at one shape, the trace's largest request.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

from accelc.numerics import rel_l2  # noqa: E402

TOL = 2e-2      # fp16 whole model against eager fp16 (tracks accumulation-order differences)


def models(smoke: bool) -> dict:
    """name -> (build() -> model, make(batch, length) -> kwargs, text?)."""
    import transformers as tf

    def text(model_fn, vocab):
        def make(b, n):
            return {"input_ids": torch.randint(0, vocab, (b, n)), "attention_mask": torch.ones(b, n, dtype=torch.long)}
        return model_fn, make, True

    def image(model_fn, size):
        return model_fn, (lambda b, n: {"pixel_values": torch.randn(b, 3, size, size)}), False

    if smoke:
        small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
                     max_position_embeddings=128)
        return {"bert": text(lambda: tf.BertModel(tf.BertConfig(**small)), 100),
                "vit": image(lambda: tf.ViTModel(tf.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                               intermediate_size=64, image_size=16, patch_size=8)), 16)}
    return {
        "bert": text(lambda: tf.BertModel(tf.BertConfig()), 30522),
        "gpt2": text(lambda: tf.GPT2Model(tf.GPT2Config(use_cache=False)), 50257),
        "vit": image(lambda: tf.ViTModel(tf.ViTConfig()), 224),
        "llama": text(lambda: tf.LlamaModel(tf.LlamaConfig(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
            num_key_value_heads=4, vocab_size=32000, use_cache=False, max_position_embeddings=4096)), 32000),
    }


def trace(n: int, text: bool, smoke: bool, seed: int = 0) -> list[tuple[int, int]]:
    """(batch, length) per request: batch 1-32 and length 8-512, uniform (ViT: length unused)."""
    g = torch.Generator().manual_seed(seed)
    hi_b, hi_n = (3, 40) if smoke else (32, 512)
    b = torch.randint(1, hi_b + 1, (n,), generator=g).tolist()
    lengths = torch.randint(8, hi_n + 1, (n,), generator=g).tolist() if text else [0] * n
    return list(zip(b, lengths))


def _hidden(out):
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


class OrtSide:
    """The model exported once with dynamic axes, run by ONNX Runtime's CUDA provider with IO binding:
    inputs bound from the request's tensors, outputs allocated by ORT on the device."""

    def __init__(self, model, example: dict, device, workdir):
        import onnxruntime as ort_rt

        from accelc.baselines import ort

        names = list(example)
        batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=1, max=1024)
        dyn = {k: ({0: batch, 1: seq} if v.dim() == 2 else {0: batch}) for k, v in example.items()}
        path = str(Path(workdir) / "model.onnx")
        with torch.no_grad():
            torch.onnx.export(model, (), path, kwargs=example, dynamo=True, dynamic_shapes=dyn,
                              external_data=True, input_names=names)
        self.sess = ort.session(path, device)
        self.names, self.device, self.model, self.shapes = names, device, model, {}
        if "CUDAExecutionProvider" not in self.sess.get_providers():
            raise RuntimeError(f"no CUDA provider in this onnxruntime ({ort_rt.get_available_providers()})")

    def __call__(self, **inputs):
        binding = self.sess.io_binding()
        for name in self.names:
            t = inputs[name].contiguous()
            binding.bind_input(name, "cuda", self.device.index or 0, _np(t.dtype), tuple(t.shape), t.data_ptr())
        outs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._out_shapes(inputs)]
        for o, t in zip(self.sess.get_outputs(), outs):     # outputs written in place into torch tensors
            binding.bind_output(o.name, "cuda", self.device.index or 0, _np(t.dtype), tuple(t.shape), t.data_ptr())
        self.sess.run_with_iobinding(binding)
        return outs

    def _out_shapes(self, inputs):
        """The outputs' (shape, dtype) at these input shapes: learnt from one eager call per shape
        (in the warm-up pass, untimed)."""
        key = tuple((k, tuple(v.shape)) for k, v in inputs.items())
        if key not in self.shapes:
            with torch.no_grad():
                out = self.model(**inputs)
            leaves = [v for v in (out.values() if hasattr(out, "values") else out) if isinstance(v, torch.Tensor)]
            if len(leaves) != len(self.sess.get_outputs()):
                raise RuntimeError(f"{len(leaves)} eager outputs, {len(self.sess.get_outputs())} ONNX outputs")
            self.shapes[key] = [(tuple(v.shape), v.dtype) for v in leaves]
        return self.shapes[key]


def _np(dtype):
    import numpy as np

    return {torch.float16: np.float16, torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32,
            torch.bool: np.bool_}[dtype]


def run_side(call, feeds, device, eager_outputs=None, check_every=10, settle=None):
    """Warm-up pass over the whole trace, then the timed pass: per-request ms, peak memory, errors. settle(): after
    the warm-up pass, waits for what optimize left compiling in the background and says whether it was still
    running (then the warm-up pass runs again, untimed: the shapes it met meanwhile ran uncompiled, no graph kept)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first = []
    with torch.no_grad():
        for f in feeds:                 # warm-up: every shape the trace holds (compiles, captures, tuning)
            t0 = time.perf_counter()
            call(**f)
            sync()
            first.append((time.perf_counter() - t0) * 1e3)
        if settle is not None and settle():
            for f in feeds:
                call(**f)
            sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, errors, outputs = [], [], []
        for i, f in enumerate(feeds):
            t0 = time.perf_counter()
            out = call(**f)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
            if i % check_every == 0:     # kept on the host: no side's memory counts the bench's copies
                h = _hidden(out).float().cpu()
                outputs.append(h)
                if eager_outputs is not None:
                    errors.append(rel_l2(h, eager_outputs[len(outputs) - 1]))
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(device) / 2**20 if device.type == "cuda" else None
    return {"total_ms": round(sum(times), 2), "p50_ms": round(statistics.median(times), 3),
            "peak_reserved_mib": reserved,
            "p99_ms": round(sorted(times)[max(0, int(len(times) * 0.99) - 1)], 3), "peak_mib": peak,
            "max_rel_err_vs_eager": max(errors) if errors else None, "per_request_ms": [round(t, 3) for t in times],
            # the first pass: each request as a user's first of its shape meets it (compiles, captures, tuning)
            "first_pass_max_ms": round(max(first), 1) if first else None,
            "first_pass_over_1s": sum(t > 1000 for t in first), "first_pass_over_50ms": sum(t > 50 for t in first),
            "first_pass_ms": [round(t, 1) for t in first]}, outputs


def bench_model(name, spec, n_requests, device, dtype, smoke, sides, rows, save=lambda: None):
    """Appends the model's row to rows and fills it side by side, calling save() after each (a run cut
    off by a time limit keeps the sides it finished)."""
    import accelc

    build, make, text = spec
    torch.manual_seed(0)
    model = build().to(device).eval()
    model = model.to(dtype) if dtype != torch.float32 else model
    requests = trace(n_requests, text, smoke)
    example = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
               for k, v in make(2, 64 if text else 0).items()}

    def cast(f):
        return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in f.items()}

    torch.manual_seed(1)       # the same requests for every side
    feeds = [{k: v.to(device) for k, v in cast(make(b, n)).items()} for b, n in requests]
    row = {"model": name, "requests": n_requests, "shapes": len(set(requests)),
           "weights_mib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, 1)}
    rows.append(row)
    opt = optimize_s = None
    start = _memory_start(device)
    eager, eager_out = run_side(lambda **f: model(**f), feeds, device)
    row["eager"] = {**eager, **_over_start(eager, start, row), "date": _common.environment()["date"]}
    save()
    if device.type == "cuda" and ("compile_ro" in sides or "accelc" in sides):   # accelc's memory yardstick
        row.update(ro_one_shape(model, feeds, device, row))
    for side in sides:
        try:
            torch._dynamo.reset()
            call = None
            start = _memory_start(device)
            counters = torch._dynamo.utils.counters
            counters.clear()
            t0 = time.perf_counter()
            if side == "compile_dynamic":
                call = torch.compile(model, dynamic=True)
            elif side == "compile_ro":
                call = torch.compile(model, mode="reduce-overhead")
            elif side == "ort":
                workdir = tempfile.mkdtemp()
                call = OrtSide(model, example, device, workdir)
            elif side in ("accelc_exact", "accelc_auto") and opt is not None:   # the same graph, another runner
                opt = other_runner(opt, False if side == "accelc_exact" else "auto")
                call = opt
                if device.type == "cuda":     # the default call's graphs and pool go with its runner
                    start = _memory_start(device)
                    own = own_weights_mib(opt, model) * 2**20     # held already, and this side's own
                    start = (start[0] - own, start[1] - own)
            else:
                padding = {"accelc": True, "accelc_auto": "auto", "accelc_exact": False, "accelc_buckets": True}[side]
                extra = {"warmup_shapes": "buckets"} if side == "accelc_buckets" else {}
                opt = accelc.optimize(model, example, config=accelc.OptimizeConfig(padding=padding, **extra))
                call = opt
            own_optimize = side in ("accelc", "accelc_buckets")
            prepare_s = time.perf_counter() - t0 + (optimize_s if not own_optimize and optimize_s else 0)
            if side == "accelc":
                optimize_s = prepare_s
            # (an accelc side's glue for other shapes compiling after optimize: met by the first pass, as a user's
            # first requests meet it, and ended before the timed one)
            settle = (lambda: not opt.wait_for_other_shapes(0) and opt.wait_for_other_shapes()) \
                if side.startswith("accelc") else None
            result, _ = run_side(call, feeds, device, eager_out, settle=settle)
            result.update(_over_start(result, start, row))
            result["prepare_s"] = round(prepare_s, 1)
            pairs = list(zip(result["per_request_ms"], eager["per_request_ms"]))
            result["slower_than_eager"] = sum(t > e for t, e in pairs)
            result["worst_vs_eager"] = round(max(t / e for t, e in pairs), 2)
            result["compiles"] = int(counters["stats"].get("unique_graphs", 0))
            if side.startswith("accelc"):
                result["own_weights_mib"] = own_weights_mib(opt, model)
                result["captures"] = getattr(opt.runner, "captures", 0) if opt.runner is not None else 0
                # calls over both passes (warm-up and timed): padded to a bucket; run at their own size
                result["padded_calls"] = getattr(opt.runner, "padded", 0)
                result["exact_calls"] = getattr(opt.runner, "exact", 0)
                result["summary_shapes"] = opt.info.shapes
                result["runtime"] = opt.runner.status() if opt.runner is not None else ""
            row[side] = result
        except Exception as e:   # a side that cannot run this model: said in its row
            row[side] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        row[side]["date"] = _common.environment()["date"]
        print(f"{name} {side}: {_short(row[side])}", flush=True)
        save()


def _memory_start(device) -> tuple | None:
    """(allocated, reserved) bytes as a side starts, what earlier sides left freed first."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def _over_start(result: dict, start, row: dict) -> dict:
    """The side's peaks as if it ran alone in a process that holds the model: its timed pass's
    high-water marks less what was allocated (reserved) as it started, plus the model's weights.
    What earlier sides left alive (a compiled module's CUDA-graph trees) is no side's memory but its own."""
    if start is None or result.get("peak_mib") is None:
        return {}
    return {"peak_mib": round(result["peak_mib"] - start[0] / 2**20 + row["weights_mib"], 1),
            "peak_reserved_mib": round(result["peak_reserved_mib"] - start[1] / 2**20 + row["weights_mib"], 1)}


def ro_one_shape_peaks(model, feeds, device) -> tuple[dict, dict]:
    """(the trace's largest request, {"peak_mib", "peak_reserved_mib"}): torch.compile reduce-overhead
    at that one shape, three calls, then the process's high-water marks over a fourth."""
    torch._dynamo.reset()
    one = torch.compile(model, mode="reduce-overhead")
    largest = max(feeds, key=lambda f: max(t.numel() for t in f.values()))
    with torch.no_grad():
        for _ in range(3):
            one(**largest)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        one(**largest)
        torch.cuda.synchronize(device)
    peaks = {"peak_mib": torch.cuda.max_memory_allocated(device) / 2**20,
             "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20}
    del one
    torch._dynamo.reset()
    return largest, peaks


def ro_one_shape(model, feeds, device, row) -> dict:
    """The reference memory: reduce-overhead at one shape (ro_one_shape_peaks), measured as every
    side is (_over_start)."""
    start = _memory_start(device)
    largest, peaks = ro_one_shape_peaks(model, feeds, device)
    peaks = _over_start(peaks, start, row)
    return {"compile_ro_one_shape_peak_mib": peaks["peak_mib"],
            "compile_ro_one_shape_reserved_mib": peaks["peak_reserved_mib"],
            "compile_ro_one_shape_request": [list(t.shape) for t in largest.values()][0]}


def own_weights_mib(opt, model) -> float:
    """MiB of the optimized module's parameters, buffers and constants that are not the model's
    own tensors: its copy of the weights (optimize works on a copy: the caller's model, dropped,
    gives its share back)."""
    theirs = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen, total = set(), 0
    gm = opt.graph_module
    tensors = [*gm.parameters(), *gm.buffers()] + [v for v in vars(gm).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if t.device.type == "cuda" and ptr not in theirs and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return round(total / 2**20, 1)


def other_runner(opt, padding):
    """opt (accelc's default call) with the runner of another padding choice (False: exact sizes;
    "auto": GPU-bound calls at their own size where it pays): the graph accelc optimized once, the runner
    designs compared over it."""
    import copy
    import dataclasses

    other = copy.copy(opt)
    other.config = dataclasses.replace(opt.config, padding=padding)
    other.runner = None        # made at its first call, from the config
    return other


def _short(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (f"total {r['total_ms']:.0f} ms, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, peak {r['peak_mib']} MiB, "
            f"compiles {r.get('compiles')}, captures {r.get('captures', '-')}, max err {r['max_rel_err_vs_eager']}")


def markdown(env, rows) -> str:
    sides = ["eager", "compile_dynamic", "compile_ro", "ort", "accelc", "accelc_auto", "accelc_exact"]
    header = ["model", "side", "total ms", "p50 ms", "p99 ms", "peak MiB (reserved)", "compiles", "captures", "max rel err vs eager",
              "requests slower than eager (worst)", "side / accelc (total)"]
    table = []
    for r in rows:
        acc = r.get("accelc", {})
        for s in sides:
            x = r.get(s)
            if x is None:
                continue
            if "error" in x:
                table.append([r["model"], s, x["error"]] + [""] * 8)
                continue
            ratio = (f"{x['total_ms'] / acc['total_ms']:.2f}x" if acc.get("total_ms") and s != "accelc" else "")
            if s.startswith("accelc") and r.get("compile_ro_one_shape_reserved_mib") and x.get("peak_reserved_mib"):
                # reserved, not allocated: reduce-overhead's CUDA-graph trees hold their memory as pool segments
                ratio += f" (reserved memory {x['peak_reserved_mib'] / r['compile_ro_one_shape_reserved_mib']:.2f}x RO at one shape"
                if x.get("own_weights_mib") and r.get("weights_mib"):    # the caller's model given up
                    dropped = (x["peak_reserved_mib"] - r["weights_mib"]) / r["compile_ro_one_shape_reserved_mib"]
                    ratio += f"; {dropped:.2f}x with the caller's model dropped"
                ratio += ")"
            table.append([r["model"], s, f"{x['total_ms']:.0f}", x["p50_ms"], x["p99_ms"],
                          "" if x["peak_mib"] is None else f"{x['peak_mib']:.0f} ({x.get('peak_reserved_mib') or 0:.0f})",
                          x.get("compiles", ""),
                          x.get("captures", ""), "" if x["max_rel_err_vs_eager"] is None else f"{x['max_rel_err_vs_eager']:.1e}",
                          "" if s == "eager" else f"{x.get('slower_than_eager')} ({x.get('worst_vs_eager')}x)", ratio])
    return (f"# Requests of every shape (any-shape serving)\n\n{_common.env_line(env)}\n\n"
            "A trace of requests with random (batch, length), run once to warm up, then timed request by "
            "request (host clock around each call, the GPU synchronised); every 10th output compared with "
            "eager's. compiles: Dynamo graphs compiled; captures: accelc's CUDA graphs captured. Peak MiB: the "
            "timed pass's high-water mark of torch's allocated memory (reserved: what its caching allocator held, CUDA-graph "
            "pools included; ONNX Runtime's own arena is in neither), less what was allocated (reserved) as the side "
            "started, plus the model's weights: each side as if alone in a process that holds the model (rows "
            "dated before 2026-11-26 08:00 UTC: the process's marks, earlier sides' leftovers and the bench's "
            "copies of outputs included). accelc optimizes a copy of the model: \"with the caller's model dropped\" "
            "takes the caller's weights out (`del model` after optimize gives them back). accelc: the default "
            "call (padded to buckets); accelc_auto: OptimizeConfig(padding=\"auto\") (GPU-bound calls at their own "
            "size where the bucket graph's times say it pays); accelc_exact: padding=False (a graph per exact size). "
            f"Sides measured on: {_common.dates(rows)} (each side's date in the json; more than one date: the sides "
            "come from separate runs on this device, each with its own eager row).\n\n"
            + _common.md_table(header, table))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--models", default="bert,gpt2,vit,llama")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--sides", default="compile_dynamic,compile_ro,ort,accelc,accelc_auto,accelc_exact")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU, a few requests, eager and accelc")
    ap.add_argument("--merge", action="store_true",
                    help="keep the sides an earlier run on this device wrote to --out that this run does not measure")
    args = ap.parse_args()
    smoke = args.smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    specs = models(smoke)
    names = [m for m in args.models.split(",") if m in specs] if not smoke else list(specs)
    sides = ["accelc", "accelc_auto", "accelc_exact"] if smoke else args.sides.split(",")
    env = _common.environment()
    print(_common.env_line(env), flush=True)
    rows: list[dict] = []

    def save():
        if not smoke:
            table = _common.merged(args.out, "dynamic", env, rows, ("model",)) if args.merge else rows
            _common.write(args.out, "dynamic", env, table, markdown(env, table))
    for n in names:
        bench_model(n, specs[n], 6 if smoke else args.requests, device, dtype, smoke, sides, rows, save)
    if smoke:
        for r in rows:
            for side in sides:
                assert r[side].get("max_rel_err_vs_eager") is not None and r[side]["max_rel_err_vs_eager"] < 1e-4, r
        print("smoke: ok")
        return
    print(markdown(env, _common.merged(args.out, "dynamic", env, rows, ("model",)) if args.merge else rows))


if __name__ == "__main__":
    main()
