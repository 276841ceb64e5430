"""A decode step's matrix products, and where a decode step's time goes (GPU).

    python bench/decode.py [--out bench/results]             # the projections at M = 1 / 16 rows
    python bench/decode.py --profile [--model llama3-8b] [--layers 4]   # an optimized LM's decode step by kernel
    python bench/decode.py --attention                     # decode attention: flash-decoding's split plans

Rows: the projections of a decode step (TinyLlama-1.1B, Llama-3-8B, GPT-2 shapes; one token per
sequence, batch 1 and 16), fp16, each side timed like bench/gemm.py (CUDA-graph medians, L2 flushed
between replays, interleaved rounds): eager (cuBLAS, the epilogue and the gating as separate ops, as
HF runs them), accelc (the tuned launch: gemv_kernel's candidates race the tensor-core tiles), and
accelc's fastest tensor-core tile alone (what the race picked before gemv_kernel), and accelc with
int8 weights (weight-only int8, kernels/int8_weight.py: half the bytes). GB/s is the
weight's bytes over the time; "% copy" its share of the device's measured copy bandwidth (the same
yardstick as bench/generate.py's limit).

--profile: an LM of bench/generate.py's shapes (`--model`, TinyLlama by default; random weights,
`--layers` of its layers: each layer's kernels are the same) optimized by accelc, greedy generate()
of --new tokens under torch.profiler: each kernel's GPU time per generated token, their sum, and
the wall time per token (the rest is host time or gaps between kernels).
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401
from accelc.kernels import gated_linear, gemm, int8_weight  # noqa: E402
from accelc.kernels.int8_gemm import quantize_weight  # noqa: E402
from accelc.runner import inductor_options  # noqa: E402
from accelc.kernels.epilogue import activation_ref  # noqa: E402
from accelc.tuning import config_dict  # noqa: E402

ROUNDS = 3
# (model, layer, M, K, N, activation, residual, kind): kind "linear" (N, K) weight, "gated" a gate and
# up projection pair of N each (accelc: one interleaved weight), "conv1d" x @ W with W (K, N)
LAYERS = [
    ("TinyLlama-1.1B b1", "q+k+v_proj", 1, 2048, 2560, "none", False, "linear"),
    ("TinyLlama-1.1B b1", "o_proj + residual", 1, 2048, 2048, "none", True, "linear"),
    ("TinyLlama-1.1B b1", "gate+up_proj, SiLU gating", 1, 2048, 5632, "silu", False, "gated"),
    ("TinyLlama-1.1B b1", "down_proj + residual", 1, 5632, 2048, "none", True, "linear"),
    ("TinyLlama-1.1B b1", "lm_head", 1, 2048, 32000, "none", False, "linear"),
    ("TinyLlama-1.1B b16", "q+k+v_proj", 16, 2048, 2560, "none", False, "linear"),
    ("TinyLlama-1.1B b16", "gate+up_proj, SiLU gating", 16, 2048, 5632, "silu", False, "gated"),
    ("TinyLlama-1.1B b16", "down_proj + residual", 16, 5632, 2048, "none", True, "linear"),
    ("Llama-3-8B b1", "q+k+v_proj", 1, 4096, 6144, "none", False, "linear"),
    ("Llama-3-8B b1", "o_proj + residual", 1, 4096, 4096, "none", True, "linear"),
    ("Llama-3-8B b1", "gate+up_proj, SiLU gating", 1, 4096, 14336, "silu", False, "gated"),
    ("Llama-3-8B b1", "down_proj + residual", 1, 14336, 4096, "none", True, "linear"),
    ("Llama-3-8B b1", "lm_head", 1, 4096, 128256, "none", False, "linear"),
    ("Llama-3-8B b4", "gate+up_proj, SiLU gating", 4, 4096, 14336, "silu", False, "gated"),
    # a rank's share under tensor parallelism (bench/tp.py's plan: q/k/v and gate/up by output columns, o/down by
    # input columns, their partial sums all-reduced before the residual add; the LM head by columns)
    ("Llama-3-8B b1, a rank of 2", "q+k+v_proj", 1, 4096, 3072, "none", False, "linear"),
    ("Llama-3-8B b1, a rank of 2", "o_proj", 1, 2048, 4096, "none", False, "linear"),
    ("Llama-3-8B b1, a rank of 2", "gate+up_proj, SiLU gating", 1, 4096, 7168, "silu", False, "gated"),
    ("Llama-3-8B b1, a rank of 2", "down_proj", 1, 7168, 4096, "none", False, "linear"),
    ("Llama-3-8B b1, a rank of 2", "lm_head", 1, 4096, 64128, "none", False, "linear"),
    ("Llama-3-70B b1, a rank of 4", "q+k+v_proj", 1, 8192, 2560, "none", False, "linear"),
    ("Llama-3-70B b1, a rank of 4", "o_proj", 1, 2048, 8192, "none", False, "linear"),
    ("Llama-3-70B b1, a rank of 4", "gate+up_proj, SiLU gating", 1, 8192, 7168, "silu", False, "gated"),
    ("Llama-3-70B b1, a rank of 4", "down_proj", 1, 7168, 8192, "none", False, "linear"),
    ("GPT-2 b1", "attn.c_attn (Conv1D)", 1, 768, 2304, "none", False, "conv1d"),
    ("GPT-2 b1", "mlp.c_fc (Conv1D) + GELU tanh", 1, 768, 3072, "gelu_tanh", False, "conv1d"),
]


def _row(model, layer, M, K, N, act, has_res, kind, bandwidth):
    h = torch.float16
    x = torch.randn(M, K, device="cuda", dtype=h)
    r = torch.randn(M, N, device="cuda", dtype=h) if has_res else None
    row = {"model": model, "layer": layer, "M": M, "K": K, "N": N, "activation": act, "residual": has_res,
           "kind": kind}
    if kind == "gated":
        wg, wu = (torch.randn(N, K, device="cuda", dtype=h) / K ** 0.5 for _ in range(2))
        packed, _ = gated_linear.pack(wg, wu)
        weight_bytes = 2 * N * K * 2
        out = torch.empty(M, N, device="cuda", dtype=h)

        def eager():
            return activation_ref(act, F.linear(x, wg)) * F.linear(x, wu)

        def accelc_():
            return gated_linear.gated_linear_launch(x, packed, None, N, act)

        def forced(cfg):
            return lambda: gemm.launch(x, packed, None, None, out, act, config=cfg, tuner=gated_linear.TUNER,
                                       gated=True) or out
        tuner = gated_linear.TUNER
        ref = (activation_ref(act, x.float() @ wg.float().t()) * (x.float() @ wu.float().t()))
        w_q, w_scale = quantize_weight(packed)

        def int8w():
            return int8_weight.gated_linear_w8a16_launch(x, w_q, w_scale, None, N, act)
    else:
        w = torch.randn(N, K, device="cuda", dtype=h) / K ** 0.5
        weight = w.t().contiguous().t() if kind == "conv1d" else w   # (K, N) row-major, read as (N, K)
        weight_bytes = N * K * 2
        out = torch.empty(M, N, device="cuda", dtype=h)

        def eager():
            y = torch.addmm(r, x, weight.t()) if r is not None else x @ weight.t()
            return activation_ref(act, y)

        def accelc_():
            return gemm.linear_launch(x, weight, None, r, act)

        def forced(cfg):
            return lambda: gemm.launch(x, weight, None, r, out, act, config=cfg) or out
        tuner = gemm.TUNER
        ref = gemm.linear_ref(x.float(), w.float(), None, None if r is None else r.float(), act)
        w_q, w_scale = quantize_weight(w)

        def int8w():
            return int8_weight.linear_w8a16_launch(x, w_q, w_scale, None, r, act)
    accelc_()   # tunes
    rows_w = packed.shape[0] if kind == "gated" else N
    key = [k for k in tuner.chosen if k[:3] == (triton.next_power_of_2(M), rows_w, K)][-1]
    picked = config_dict(tuner.chosen[key])
    timings = tuner.timings.get(key, [])
    tiles = [(c, us) for c, us in timings if us is not None and not c.get("GEMV")]
    gemvs = [(c, us) for c, us in timings if us is not None and c.get("GEMV")]
    variants = {"eager": eager, "accelc": accelc_, "accelc_int8w": int8w}   # int8w: weight-only int8
    moved = {k: weight_bytes for k in variants}
    moved["accelc_int8w"] = w_q.numel() + 4 * w_scale.numel()
    if tiles:
        best_tile = min(tiles, key=lambda t: t[1])[0]
        cfg = next(c for c in tuner.configs if config_dict(c) == best_tile)
        variants["accelc_tiles"] = forced(cfg)
        row["best_tile"] = best_tile
    row.update(picked=picked, tuning_us={"tiles": min((u for _, u in tiles), default=None),
                                          "gemv": min((u for _, u in gemvs), default=None)})
    row["rel_err"] = {k: _common.rel_l2(f().float(), ref) for k, f in variants.items()}
    _common.time_rounds(variants, row, ROUNDS, flops=2 * M * N * K * (2 if kind == "gated" else 1))
    for k in variants:
        gbs = moved.get(k, weight_bytes) / row[k]["us"] / 1e3
        row[k]["gbs"] = round(gbs, 1)
        row[k]["copy_share"] = round(gbs / bandwidth, 3)
    _common.ratios(row, against=("eager",) + (("accelc_tiles",) if tiles else ()))
    _common.ratios(row, fast="accelc_int8w", against=("accelc",))
    print(f"{model} {layer}: eager {row['eager']['us']:.1f} us ({row['eager']['copy_share']:.0%} copy), accelc "
          f"{row['accelc']['us']:.1f} ({row['accelc']['copy_share']:.0%}; {'gemv' if picked.get('GEMV') else 'tile'})"
          + (f", tiles alone {row['accelc_tiles']['us']:.1f}" if tiles else ""), flush=True)
    return row


def rows_for(bandwidth, only: str = ""):
    return [_row(*layer, bandwidth) for layer in LAYERS if only in layer[0]]


def markdown(env, rows) -> str:
    head = ["model", "layer", "M x K x N", "eager us", "accelc us", "accelc GB/s", "% copy bw", "eager % copy",
            "vs eager", "tiles alone us", "vs tiles", "picked", "int8 weights us", "int8 GB/s", "int8 vs accelc fp16"]
    body = []
    for r in rows:
        tiles = r.get("accelc_tiles")
        p = r["picked"]
        body.append([r["model"], r["layer"], f"{r['M']}x{r['K']}x{r['N']}", r["eager"]["us"], r["accelc"]["us"],
                     r["accelc"]["gbs"], f"{r['accelc']['copy_share']:.0%}", f"{r['eager']['copy_share']:.0%}",
                     _common.ratio_cell(r["vs_eager"]), tiles["us"] if tiles else "",
                     _common.ratio_cell(r["vs_accelc_tiles"]) if tiles else "",
                     ("gemv flat " if p.get("FLAT") else "gemv " if p.get("GEMV") else "tile ")
                     + f"{p['BLOCK_M']}x{p['BLOCK_N']}x{p['BLOCK_K']}",
                     r.get("accelc_int8w", {}).get("us", ""), r.get("accelc_int8w", {}).get("gbs", ""),
                     _common.ratio_cell(r["vs_accelc"]) if "vs_accelc" in r else ""])
    return ("# Decode-step projections (fp16)\n\n" + _common.env_line(env)
            + f"\n\ncopy bandwidth {env.get('copy_gbs')} GB/s (read + write bytes of a 1 GiB device copy); "
            "GB/s: the weight's bytes over the time (int8 weights: their bytes and scales); speedups: median of per-round ratios [min, max]\n\n"
            + _common.md_table(head, body))


# decode attention: (model, batch, query heads, K/V heads, head dim, cache slots, keys attended)
ATTENTION = [
    ("Llama-3-8B", 1, 32, 8, 128, 768, 640),
    ("Llama-3-8B", 16, 32, 8, 128, 768, 640),
    ("Llama-3-8B long", 1, 32, 8, 128, 4096, 4000),
    ("TinyLlama-1.1B", 1, 32, 4, 64, 768, 640),
    ("TinyLlama-1.1B", 16, 32, 4, 64, 768, 640),
    ("Qwen2-0.5B", 1, 14, 2, 64, 768, 640),
    ("Qwen2-0.5B", 1, 14, 2, 64, 640, 576),     # the step of runs/decode/profile5-qwen2-h100 (7.0 us a layer there)
    ("Qwen2-1.5B", 1, 12, 2, 128, 640, 576),    # (12.5 us a layer there)
]
# flash-decoding's split plans raced here: (PROGRAMS_PER_SM, WIDE_BLOCKS[, MIN_KEYS_PER_SPLIT]); None: the default
SPLIT_PLANS = [None, (2, 0), (2, 4), (1, 0), (1, 8), (2, 8), (1, 4, 128), (1, 4, 256), (1, 8, 512), (1, 8, 4096)]
CACHES = 32     # layers' caches a timed call cycles through (more bytes than L2 holds, as in a model)


def attention_rows(plans=SPLIT_PLANS):
    from accelc.kernels import flash_decoding as fd

    rows = []
    for model, B, H, Hkv, D, S, live in ATTENTION:
        h = torch.float16
        q = torch.randn(B, H, 1, D, device="cuda", dtype=h)
        layer_kv = lambda: torch.randn(B, Hkv, S, D, device="cuda", dtype=h)     # noqa: E731
        caches = [(layer_kv(), layer_kv()) for _ in range(CACHES)]
        mask = (torch.arange(S, device="cuda") < live).expand(B, 1, 1, S)
        row = {"model": model, "batch": B, "heads": H, "kv_heads": Hkv, "head_dim": D, "cache_slots": S,
               "keys": live, "sms": torch.cuda.get_device_properties(0).multi_processor_count}

        def eager():
            for k, v in caches:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return out

        def planned(setting, fn):
            """fn() with flash-decoding's plan settings set (None: as they are)."""
            saved = fd.PROGRAMS_PER_SM, fd.WIDE_BLOCKS, fd.MIN_KEYS_PER_SPLIT
            if setting is not None:
                fd.PROGRAMS_PER_SM, fd.WIDE_BLOCKS, fd.MIN_KEYS_PER_SPLIT = (*setting, 0)[:3]
            try:
                return fn()
            finally:
                fd.PROGRAMS_PER_SM, fd.WIDE_BLOCKS, fd.MIN_KEYS_PER_SPLIT = saved

        def attend():
            for k, v in caches:
                out = torch.ops.accelc.flash_attention(q, k, v, mask, False, None, False, False)
            return out
        variants = {"eager": eager}
        for setting in plans:
            name = "accelc" if setting is None else (f"accelc_{setting[0]}sm_wide{setting[1]}"
                                                     + (f"_min{setting[2]}" if len(setting) > 2 else ""))
            variants[name] = functools.partial(planned, setting, attend)
            row.setdefault("plans", {})[name] = planned(setting, lambda: fd.split_plan(B, Hkv, S, row["sms"], False))
        k0, v0 = caches[-1]
        ref = F.scaled_dot_product_attention(q.float(), k0.float(), v0.float(), attn_mask=mask, enable_gqa=True)
        row["rel_err"] = {name: _common.rel_l2(fn().float(), ref) for name, fn in variants.items()}
        _common.time_rounds(variants, row, ROUNDS, flops=0)
        kv_bytes = 2 * B * Hkv * live * D * 2
        for name in variants:
            row[name]["us"] = round(row[name]["us"] / CACHES, 2)       # a call's time
            row[name]["gbs"] = round(kv_bytes / row[name]["us"] / 1e3, 1)
        best = min((n for n in variants if n != "eager"), key=lambda n: row[n]["us"])
        row["best_plan"] = best
        print(f"{model} b{B} S {S} ({live} keys): eager {row['eager']['us']} us, accelc {row['accelc']['us']} us "
              f"(plan {row['plans']['accelc']}), best {best} {row[best]['us']} us (plan {row['plans'][best]})",
              flush=True)
        rows.append(row)
    return rows


def attention_markdown(env, rows) -> str:
    names = list(rows[0]["plans"])
    head = ["model", "batch", "heads / kv", "D", "slots / keys", "eager us",
            *[f"{n} us (splits x keys, block)" for n in names],
            "best"]
    body = [[r["model"], r["batch"], f"{r['heads']} / {r['kv_heads']}", r["head_dim"],
             f"{r['cache_slots']} / {r['keys']}", r["eager"]["us"],
             *[f"{r[n]['us']} ({r['plans'][n][1]} x {r['plans'][n][2]}, {r['plans'][n][0]})" for n in names],
             r["best_plan"]]
            for r in rows]
    return (f"# Decode attention (fp16): flash-decoding's split plans\n\n{_common.env_line(env)}\n\n"
            f"One query position a sequence over a static cache of `slots` (the first `keys` attended, a boolean "
            f"mask); each call over a different layer's cache of {CACHES} (more than L2 holds); us a call, CUDA-graph "
            f"medians of {ROUNDS} interleaved rounds. eager: F.scaled_dot_product_attention (enable_gqa). "
            f"accelc_Psm_wideW[_minK]: PROGRAMS_PER_SM P, WIDE_BLOCKS W (0: never wide), MIN_KEYS_PER_SPLIT K.\n\n" + _common.md_table(head, body))


def profile(model: str, layers: int, prompt: int, new: int, out_dir: str) -> None:
    from torch.profiler import ProfilerActivity

    import generate

    cfg = generate.configs(smoke=False)[model]
    full = cfg.num_hidden_layers
    layers = layers or full
    cfg.num_hidden_layers = layers
    lm = generate.build(cfg, torch.device("cuda"), torch.float16)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), device="cuda")
    mask = torch.ones_like(ids)
    t0 = time.perf_counter()
    opt = accelc.optimize(lm, {"input_ids": ids, "attention_mask": mask},
                          config=accelc.OptimizeConfig(max_cache_len=prompt + new, max_batch_size=1))
    prepare = time.perf_counter() - t0
    opt.wait_for_other_shapes()  # (the glue for other shapes compiling after optimize: nothing timed beside it)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    opt.generate(**kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.generate(**kw)          # (one generate without the profiler: its host costs inflate the profiled wall)
    torch.cuda.synchronize()
    plain = time.perf_counter() - t0
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        opt.generate(**kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    total = sum(t for _, t in kernels.values())
    sequence = _one_token(prof)
    own, idle, tokens = _decode_critical_path(prof)
    lines = [f"# Decode-step profile: {model} shape, {layers} of {full} layers, prompt {prompt}, {new} new tokens, "
             f"batch 1, fp16", "", _common.env_line(_common.environment()), "",
             f"the glue's Inductor options: {inductor_options()}", "",
             f"prepare (optimize) {prepare:.1f} s; generate wall {wall * 1e3:.1f} ms = {wall / new * 1e6:.1f} us a token "
             f"(the prefill included); kernels' GPU time {total / 1e3:.1f} ms = {total / new:.1f} us a token", "",
             "| kernel | calls | GPU us | us per token | share |", "|---|---|---|---|---|"]
    for name, (calls, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]:
        lines.append(f"| {name[:90]} | {calls} | {t:.0f} | {t / new:.1f} | {t / total:.1%} |")
    if tokens:
        span = sum(v for _, v in own.values()) + idle
        launches = sum(c for c, _ in own.values()) / tokens
        context = prompt + new / 2
        step = generate.step_bytes(lm, 1, context)
        copy = _common.copy_bandwidth("cuda")
        lines += ["", f"A decode step on the GPU: {launches:.1f} kernels a token = {launches / layers:.1f} a layer "
                  f"({layers} layers, the head and the pick included); {span / tokens:.1f} us a token from argmax to "
                  f"argmax, of it {idle / tokens:.1f} us idle; the step reads {step / 2**20:.1f} MiB (weights + KV "
                  f"cache at the mean context {context:.0f}) = {step / (span / tokens) / 1e3:.0f} GB/s over the GPU "
                  f"span = {step / (span / tokens) / (copy / 1e6):.1%} of the measured copy bandwidth "
                  f"({copy / 1e9:.0f} GB/s); over the wall ({wall / new * 1e6:.1f} us a token, prefill included) "
                  f"{step / (wall / new) / copy:.1%}; without the profiler {plain / new * 1e6:.1f} us a token, "
                  f"{step / (plain / new) / copy:.1%}"]
        from accelc.step_launches import count
        lines += ["", f"The step's graph, counted (the summary's line, a floor): {count(opt.step.graph_module).line()}"]
        lines += ["", f"The decode steps' critical path ({tokens} tokens, the prefill left out): each kernel's own time, "
                  "the part of it after every kernel before it had ended (a kernel launched with dependent launch "
                  "waits inside for the one before: its duration above holds that wait), and the idle GPU time; "
                  f"they sum to {span / tokens:.1f} us a token", "",
                  "| kernel | calls a token | own us a token | share |", "|---|---|---|---|"]
        for name, (calls, t) in sorted(own.items(), key=lambda kv: -kv[1][1])[:25]:
            lines.append(f"| {name[:90]} | {calls / tokens:.1f} | {t / tokens:.1f} | {t / span:.1%} |")
        lines.append(f"| (idle: no kernel running) | | {idle / tokens:.1f} | {idle / span:.1%} |")
    lines += ["", "One decode step, kernel by kernel (the GPU work between two tokens' argmax, in the middle of the "
              "generation): start and length in us; gap: idle GPU time before the kernel; own: its part after "
              "every kernel before it had ended", "",
              "| start | us | gap | own | kernel |", "|---|---|---|---|---|"] + sequence
    runtime = [line.strip() for line in opt.summary().splitlines() if line.strip().startswith("runtime:")]
    lines += ["", "After generate(): " + " | ".join(runtime), "", "Host time of one generate() (cProfile, top 30 by "
              "cumulative time):", "", "```"]
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    opt.generate(**kw)
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
    lines += [ln for ln in buf.getvalue().splitlines() if ln.strip()][:60] + ["```"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    dev = _common.slug(torch.cuda.get_device_name())
    stem = "decode_profile" if model == "tinyllama" else f"decode_profile_{model}"
    (Path(out_dir) / f"{stem}-{dev}.md").write_text(text)


def _token_marks(prof) -> tuple[list, list]:
    """(the profile's GPU kernels in start order, the indices of those that end a token): a token ends at its
    argmax, torch's reduction or accelc's (kernels/argmax.py, its second kernel)."""
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    return events, [i for i, e in enumerate(events) if "ArgMax" in e.name or e.name.startswith("_rows_kernel")]


def _one_token(prof) -> list:
    """Markdown rows of the GPU work of one generated token (from one argmax over the vocabulary to
    the next, halfway through the profile), in start order."""
    events, marks = _token_marks(prof)
    if len(marks) < 3:
        return ["| | | | (fewer than three argmax kernels in the profile) |"]
    a, b = marks[len(marks) // 2], marks[len(marks) // 2 + 1]
    t0, end, rows = events[a].time_range.start, events[a].time_range.end, []
    for e in events[a + 1:b + 1]:
        r = e.time_range
        rows.append(f"| {r.start - t0:.1f} | {r.elapsed_us():.1f} | {max(r.start - end, 0):.1f} | "
                    f"{max(0.0, r.end - max(r.start, end)):.1f} | {e.name[:100]} |")
        end = max(end, r.end)
    return rows


def _decode_critical_path(prof) -> tuple[dict, float, int]:
    """(own us by kernel, idle us, tokens) of the GPU work from the first token's argmax to the last's
    (_common.critical_path): the decode steps, the prefill before them left out."""
    events, marks = _token_marks(prof)
    if len(marks) < 2:
        return {}, 0.0, 0
    window = events[marks[0]:marks[-1] + 1]
    own, idle = _common.critical_path([(e.name[:90], e.time_range.start, e.time_range.end) for e in window])
    first = own.get(window[0].name[:90])
    if first is not None:      # (the window opens at the first argmax's end: its own time is the prefill's)
        first[0] -= 1
        first[1] -= window[0].time_range.elapsed_us()
    return own, idle, len(marks) - 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--attention", action="store_true", help="decode attention rows (flash-decoding's split plans)")
    ap.add_argument("--rows", default="", help="the projections: only the rows whose model contains this")
    ap.add_argument("--plans", choices=["all", "default"], default="all", help="--attention: the split plans timed")
    ap.add_argument("--model", default="tinyllama", help="--profile: a model of bench/generate.py")
    ap.add_argument("--layers", type=int, default=4, help="--profile: 0 for all of the model's layers")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    if args.profile:
        profile(args.model, args.layers, args.prompt, args.new, args.out)   # tuned as accelc.optimize tunes
        return
    _common.fresh_tuning_cache()   # the projections: every key tuned here
    env = _common.environment()
    if args.attention:
        rows = attention_rows(SPLIT_PLANS if args.plans == "all" else SPLIT_PLANS[:1])
        _common.write(args.out, "decode_attention", env, rows, attention_markdown(env, rows))
        print(attention_markdown(env, rows))
        return
    env["copy_gbs"] = round(_common.copy_bandwidth("cuda") / 1e9, 1)
    print(_common.env_line(env), f"copy {env['copy_gbs']} GB/s", flush=True)
    rows = rows_for(env["copy_gbs"], args.rows)
    _common.write(args.out, "decode", env, rows, markdown(env, rows))
    print(markdown(env, rows))


if __name__ == "__main__":
    main()
