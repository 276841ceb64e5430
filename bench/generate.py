"""Text generation: an HF causal LM generating `--new` tokens after a `--prompt`-token prompt, per
side: time to first token, decode tokens/s and the share of the memory-bandwidth limit, and the
greedy tokens compared with HF eager's. The generation issue's measure.

    python bench/generate.py [--out bench/results] [--models tinyllama,qwen2-0.5b,gpt2,llama3-8b]
                             (also qwen2-1.5b, gemma-2b, phi3-mini, llama3.2-1b, llama3.2-3b, qwen2.5-3b:
                             not in the default list)
                             [--batches 1,16] [--prompt 512] [--new 256]
    python bench/generate.py --ragged     # prompts of random real lengths (--prompt / 4 .. --prompt), left-padded
    python bench/generate.py --smoke      # a tiny Llama on the CPU, 12 tokens: checks the script runs

Models: random weights at real shapes, fp16 (TinyLlama-1.1B, Qwen2-0.5B, GPT-2 small, a Llama-3-8B
shape). Sides, each timed the same way (host clock around generate(), the GPU synchronised, the
lower median of --rounds after one warm-up generate: with an even count the faster middle one,
so that one stalled round of two does not become half the figure):
  hf_eager          HF's generate, its default dynamic cache;
  hf_static_compile HF's documented fast path: cache_implementation="static", with which
                    generate compiles the decode step (mode="reduce-overhead", fullgraph=True;
                    before transformers 4.50, torch.compile(model.forward) by hand);
  accelc            accelc.optimize(lm, prompt) then opt.generate (accelc's static cache, one step
                    program for prefill and decode);
  accelc_paged      accelc with its paged KV cache (OptimizeConfig(kv_cache="paged")): each sequence
                    takes the cache blocks of its own tokens, attention reads no padding;
  accelc_int8w      the same as accelc with int8 weights (Int8Config(weights_only=True, skip_first_last=False):
                    every linear and gated layer, lm_head included); its share of the limit counts
                    the fp16 bytes, as every side's does (so it may pass 100%);
  accelc_fp8w       the same with fp8 (e4m3) weights (Fp8Config(skip_first_last=False)).
  torchao_fp8w      torchao's fp8 weight-only (Float8WeightOnlyConfig) on HF's static cache + torch.compile path
                    (the fp8 weight-only peer; torchao's wheel travels to the device: bench/e2e.py's torchao_fp8);
  accelc_norms_apart  accelc with the norm_linear pass off: each RMSNorm a kernel of its own, not taken into
                    the projection after it (what that pass gives: accelc / this side); likewise
                    accelc_int8w_norms_apart and accelc_fp8w_norms_apart beside the one-byte weights' sides.
  accelc_qkv_apart  accelc with the qkv_rotary pass off: q / k / v's projection, rotations and cache write as
                    the kernels and glue they were before (what that pass gives: accelc / this side).
  accelc_persistent accelc with OptimizeConfig(decode_step="persistent"): a decode step one persistent kernel
                    (accelc::decode_step, #89 item 3) wherever it checks out, not raced; accelc_chain with "chain":
                    the few-launch chain of kernels (accelc's default "auto" races the two and keeps the faster).
First-token logits: each side's generate(max_new_tokens=1, return_dict_in_generate=True,
output_logits=True), relative L2 error against the model computed in fp32 on the same prompt (fp64 for
the fp32 smoke), beside HF eager fp16's own error (the JSON row's eager_fp16_first_logits_rel_err_vs_fp32):
the numbers check, where random weights' near-tied logits make equal greedy tokens a weak one.
Greedy decoding with min_new_tokens = max_new_tokens (random weights may emit EOS early: every side
generates the same count). Time to first token: generate with max_new_tokens=1; decode tokens/s:
(new - 1) tokens over (total - first-token time), per sequence. Bandwidth limit: the bytes a decode
step reads (every weight but the input embedding table, unless tied, + the KV cache at the mean
context length: real tokens only, with --ragged, as the pads need no reading) over the device's
measured copy bandwidth (a 1 GiB device-to-device copy, read + write bytes over its time).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

SIDES = ["hf_eager", "hf_static_compile", "accelc", "accelc_paged", "accelc_int8w", "accelc_fp8w",   # int8 / fp8 weights
         "accelc_norms_apart", "accelc_int8w_norms_apart", "accelc_fp8w_norms_apart", "torchao_fp8w", "accelc_qkv_apart",
         "accelc_persistent", "accelc_chain"]
DECODE = {"accelc_persistent": "persistent", "accelc_chain": "chain"}   # OptimizeConfig.decode_step, not raced
APART = {"_norms_apart": "norm_linear", "_qkv_apart": "qkv_rotary"}     # an A/B side's suffix: the pass it turns off


def configs(smoke: bool) -> dict:
    """name -> a transformers config (random weights at real shapes)."""
    import transformers as tf

    if smoke:
        return {"tiny-llama": tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                             max_position_embeddings=256)}
    return {
        "tinyllama": tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                    num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                    max_position_embeddings=2048),
        "qwen2-0.5b": tf.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                     num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                     max_position_embeddings=32768, tie_word_embeddings=True),
        "gpt2": tf.GPT2Config(),
        "llama3-8b": tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=8192, rope_theta=500000.0),
        # three more families of 1B-4B parameters (#60's targets): Qwen2-1.5B's, Gemma-2B's and Phi-3-mini's shapes
        "qwen2-1.5b": tf.Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                     num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                     max_position_embeddings=32768, tie_word_embeddings=True),
        "gemma-2b": tf.GemmaConfig(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                                   num_attention_heads=8, num_key_value_heads=1, head_dim=256, vocab_size=256000,
                                   max_position_embeddings=8192),
        "phi3-mini": tf.Phi3Config(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                                   max_position_embeddings=4096, pad_token_id=0),
        # the widths of more common 1B-3B models, for the tuning table's races (#56: a first optimize tunes little)
        "llama3.2-1b": tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True),
        "llama3.2-3b": tf.LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                      num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True),
        "qwen2.5-3b": tf.Qwen2Config(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                     num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                                     max_position_embeddings=32768, tie_word_embeddings=True),
    }


def build(cfg, device, dtype):
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(device):
        try:
            lm = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:       # transformers before `dtype`
            lm = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return lm.eval()


def step_bytes(lm, batch: int, context: float) -> float:
    """Bytes one decode step reads: the weights (the input embedding table only where the output
    head is the same tensor) and every layer's keys and values up to `context` tokens."""
    emb = lm.get_input_embeddings().weight
    head = lm.get_output_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in lm.parameters()
                  if p is not emb or emb.data_ptr() == head.data_ptr())
    cfg = lm.config.get_text_config()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * heads * head_dim * emb.element_size() * context * batch
    return weights + kv


def timed_call(fn, rounds: int, sync) -> tuple[float, object]:
    """(lower median seconds, the last round's result) of fn() over `rounds` after one warm-up call (compiles,
    captures, tunes): of two rounds the faster (a median of two is their mean, and one stalled round of two made half
    a TTFT figure). bench/tp.py times its prefill with it too."""
    out = fn()
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median_low(times), out


def timed_generate(gen, ids, mask, new: int, rounds: int, sync) -> tuple[float, torch.Tensor]:
    """(lower median seconds, the tokens of the last round) of gen(...) generating `new` tokens (timed_call)."""
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return timed_call(lambda: gen(input_ids=ids, attention_mask=mask, **kwargs), rounds, sync)


def fp32_first_logits(lm, ids, mask) -> torch.Tensor:
    """The logits of the first new token, the model computed in fp32 (accelc.numerics.upcast_run: its
    fp16 weights taken in fp32 op by op), positions counted over the real tokens as generate counts them."""
    from accelc.numerics import upcast_run

    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = upcast_run(lm, input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    return out.logits[:, -1].float()


def first_logits_error(gen, ids, mask, reference) -> float | None:
    """Relative L2 error against `reference` of the first new token's logits a side's generate returns
    (return_dict_in_generate, output_logits); None where it returns none."""
    from accelc.numerics import rel_l2

    out = gen(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    logits = getattr(out, "logits", None)
    return None if not logits else float(f"{rel_l2(logits[0].float(), reference):.2e}")


def prompts(vocab: int, batch: int, prompt: int, ragged: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of `batch` prompts of `prompt` columns: all real, or (ragged) each row's real length
    drawn from prompt / 4 .. prompt (seeded by the batch), left-padded as a tokenizer pads for generation."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, vocab, (batch, prompt), generator=g)
    mask = torch.ones_like(ids)
    if ragged:
        real = torch.randint(max(1, prompt // 4), prompt + 1, (batch,), generator=g)
        real[0] = prompt                                # the longest row fills the columns
        for b, n in enumerate(real.tolist()):
            mask[b, :prompt - n] = 0
            ids[b, :prompt - n] = 0
    return ids.to(device), mask.to(device)


def bench_model(name, cfg, batches, prompt, new, rounds, device, dtype, sides, bandwidth, rows,
                save=lambda: None, ragged: bool = False) -> None:
    """Appends a row per batch to rows and fills it side by side, calling save() after each (a run cut
    off by a time limit keeps the sides it finished)."""
    import accelc

    lm = build(cfg, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for batch in batches:
        ids, mask = prompts(cfg.vocab_size, batch, prompt, ragged, device)
        context = mask.float().sum(-1).mean().item() + new / 2         # the mean real context of a decode step
        limit = (bandwidth / step_bytes(lm, batch, context)) if bandwidth else None
        row = {"model": name, "batch": batch, "prompt": prompt, "new_tokens": new,
               **({"ragged": True, "real_prompt_tokens": mask.sum(-1).tolist()} if ragged else {}),
               "params_m": round(sum(p.numel() for p in lm.parameters()) / 1e6, 1),
               "step_mib": round(step_bytes(lm, batch, context) / 2**20, 1),
               "bandwidth_limit_tok_s": None if limit is None else round(limit, 1)}
        rows.append(row)
        reference = fp32_first_logits(lm, ids, mask)
        row["eager_fp16_first_logits_rel_err_vs_fp32"] = first_logits_error(lm.generate, ids, mask, reference)
        tokens_ref = accelc_tokens = None
        for side in sides:
            try:
                torch._dynamo.reset()
                t0 = time.perf_counter()
                if side == "hf_eager":
                    gen = lm.generate
                elif side == "hf_static_compile":
                    compiled = build(cfg, device, dtype)
                    compiled.load_state_dict(lm.state_dict())
                    compiled.generation_config.cache_implementation = "static"
                    if not hasattr(compiled, "get_compiled_call"):   # transformers < 4.50: compiled by hand
                        compiled.forward = torch.compile(compiled.forward, mode="reduce-overhead", fullgraph=True)
                    # else generate compiles the decode step itself (CompileConfig: reduce-overhead, fullgraph);
                    # compiling forward as well would stack two CUDA-graph wrappers
                    gen = compiled.generate
                elif side == "torchao_fp8w":    # the fp8 weight-only peer: torchao's, on HF's compiled static path
                    from torchao.quantization import Float8WeightOnlyConfig, quantize_
                    compiled = build(cfg, device, dtype)
                    compiled.load_state_dict(lm.state_dict())
                    quantize_(compiled, Float8WeightOnlyConfig())
                    compiled.generation_config.cache_implementation = "static"
                    gen = compiled.generate
                else:
                    suffix = next((k for k in APART if side.endswith(k)), None)
                    base = side.removesuffix(suffix) if suffix else side
                    int8 = accelc.Int8Config(weights_only=True, skip_first_last=False) if base == "accelc_int8w" else False
                    fp8 = accelc.Fp8Config(skip_first_last=False) if base == "accelc_fp8w" else False
                    passes = tuple(p for p in accelc.config.PASS_NAMES if p != APART.get(suffix))
                    config = accelc.OptimizeConfig(max_cache_len=prompt + new, max_batch_size=batch, int8=int8, fp8=fp8,
                                                   passes=passes,
                                                   kv_cache="paged" if side == "accelc_paged" else "static",
                                                   decode_step=DECODE.get(side, "auto"))
                    opt = accelc.optimize(lm, {"input_ids": ids, "attention_mask": mask}, config=config)
                    gen = opt.generate
                prepare_s = time.perf_counter() - t0
                # (the step's glue for other shapes compiling after optimize: waited for before anything is timed)
                after_s = _common.other_shapes_wait_s(opt) if side.startswith("accelc") else None
                first, _ = timed_generate(gen, ids, mask, 1, rounds, sync)
                logits_err = first_logits_error(gen, ids, mask, reference)
                total, out = timed_generate(gen, ids, mask, new, rounds, sync)
                tokens = out[:, prompt:].cpu()
                if total <= first:     # (a stall in the 1-token runs: no rate to tell, not an absurd one)
                    raise RuntimeError(f"{new} tokens took {total:.3f} s, the first alone {first:.3f} s")
                decode = (new - 1) / (total - first)
                r = {"prepare_s": round(prepare_s, 1), "ttft_ms": round(first * 1e3, 2), "total_s": round(total, 3),
                     "decode_tok_s": round(decode, 1), "decode_tok_s_all": round(decode * batch, 1),
                     "bandwidth_share": None if limit is None else round(decode / limit, 3),
                     "first_logits_rel_err_vs_fp32": logits_err}
                if after_s is not None:
                    r["other_shapes_after_s"] = after_s
                if side == "accelc":
                    accelc_tokens = tokens
                elif side in DECODE and accelc_tokens is not None:
                    r["same_tokens_as_accelc"] = round((tokens == accelc_tokens).float().mean().item(), 3)
                if tokens_ref is None and side == "hf_eager":
                    tokens_ref = tokens
                if tokens_ref is not None and side != "hf_eager":
                    r["same_tokens_as_eager"] = round((tokens == tokens_ref).float().mean().item(), 3)
                    r["same_prefix_tokens"] = int((tokens == tokens_ref).all(0).long().cumprod(0).sum().item())
                if side.startswith("accelc"):
                    r["summary"] = opt.summary()    # after generating: the runtime lines say how the steps ran
                    r["runtime"] = [ln.strip() for ln in r["summary"].splitlines() if ln.strip().startswith("runtime:")]
                    step = getattr(opt, "step", None)
                    if step is not None:    # the decode step's own layers: which kernels a decoded token runs
                        r["step_summary"] = step.summary()
                    r["optimize_seconds"] = {"program": dict(opt.info.seconds),     # where prepare_s went
                                             "step": dict(step.info.seconds) if step is not None else None}
            except Exception as e:   # a side that cannot run this model: said in its row
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            # this side's model, optimized module and outputs go before the next side builds its own (a
            # bound generate or the step kept the 8B shape's optimized module alive into the next side's
            # optimize, which then ran out of memory)
            gen = opt = compiled = step = out = None
            gc.collect()
            r["date"] = _common.environment()["date"]
            row[side] = r
            print(f"{name} batch {batch} {side}: {_short(r)}", flush=True)
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _short(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (f"TTFT {r['ttft_ms']} ms, decode {r['decode_tok_s']} tok/s per sequence "
            f"({r['bandwidth_share']} of the bandwidth limit), same tokens as eager {r.get('same_tokens_as_eager', '-')}, "
            f"first-token logits err vs fp32 {r.get('first_logits_rel_err_vs_fp32')}"
            + "".join(f"\n  {line}" for line in r.get("runtime", ())))


def _name(r: dict) -> str:
    return r["model"] + (" (ragged prompts)" if r.get("ragged") else "")


def markdown(env, rows) -> str:
    header = ["model", "batch", "side", "TTFT ms", "decode tok/s (per seq)", "tok/s (all)", "% bandwidth limit",
              "same greedy tokens as eager", "1st-token logits err vs fp32", "vs hf_static_compile", "vs hf_eager",
              "vs accelc", "prepare s"]
    table = []
    for r in rows:
        for s in SIDES:
            x = r.get(s)
            if x is None:
                continue
            if "error" in x:
                table.append([_name(r), r["batch"], s, x["error"][:120]] + [""] * 9)
                continue

            def vs(other):
                o = r.get(other, {})
                return f"{x['decode_tok_s'] / o['decode_tok_s']:.2f}x" if o.get("decode_tok_s") and other != s else ""
            share = "" if x["bandwidth_share"] is None else f"{100 * x['bandwidth_share']:.0f}%"
            table.append([_name(r), r["batch"], s, x["ttft_ms"], x["decode_tok_s"], x["decode_tok_s_all"], share,
                          x.get("same_tokens_as_eager", ""), x.get("first_logits_rel_err_vs_fp32", ""),
                          vs("hf_static_compile"), vs("hf_eager"), vs("accelc"), x["prepare_s"]])
    limits = ", ".join(f"{r['model']} b{r['batch']} {r['bandwidth_limit_tok_s']} tok/s" for r in rows)
    return (f"# Text generation\n\n{_common.env_line(env)}\n\n"
            f"Prompt {rows[0]['prompt']} tokens, {rows[0]['new_tokens']} new tokens, greedy, fp16, random weights "
            "at real shapes. Bandwidth limit per row: measured copy bandwidth over the bytes a decode step reads "
            f"(weights + KV cache at the mean context): {limits}. First-token logits: relative L2 error against "
            "the model computed in fp32 on the same prompt; HF eager fp16's own: "
            + (", ".join(f"{r['model']} b{r['batch']} {r['eager_fp16_first_logits_rel_err_vs_fp32']}" for r in rows
                         if r.get("eager_fp16_first_logits_rel_err_vs_fp32") is not None) or "not measured")
            + f". Sides measured on: {_common.dates(rows)} (each side's date in "
            "the json; more than one date: the sides come from separate runs on this device).\n\n"
            + _common.md_table(header, table))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--models", default="tinyllama,qwen2-0.5b,gpt2,llama3-8b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sides", default=",".join(s for s in SIDES if not s.endswith(tuple(APART))     # (A/B sides,
                                                 and s != "torchao_fp8w" and s not in DECODE))   # a peer that may
    #                                                                                  not install)
    ap.add_argument("--ragged", action="store_true", help="prompts of random real lengths, left-padded")
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU, eager and accelc")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows and sides an earlier run on this device wrote to --out that this run does not measure")
    args = ap.parse_args()
    smoke = args.smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    specs = configs(smoke)
    names = list(specs) if smoke else [m for m in args.models.split(",") if m in specs]
    sides = ["hf_eager", "accelc", "accelc_paged", "accelc_int8w"] if smoke else args.sides.split(",")
    sides.sort(key=lambda side: side != "hf_eager")   # eager first: its tokens are every other side's reference
    batches = [2] if smoke else [int(b) for b in args.batches.split(",")]
    prompt, new = (16, 12) if smoke else (args.prompt, args.new)
    env = _common.environment()
    bandwidth = _common.copy_bandwidth(device)
    env["copy_bandwidth_gb_s"] = None if bandwidth is None else round(bandwidth / 1e9, 1)
    print(_common.env_line(env), flush=True)
    rows: list[dict] = []
    key = ("model", "batch", "prompt", "new_tokens", "ragged")

    def save():
        if not smoke:
            table = _common.merged(args.out, "generate", env, rows, key) if args.merge else rows
            _common.write(args.out, "generate", env, table, markdown(env, table))
    for n in names:
        bench_model(n, specs[n], batches, prompt, new, 1 if smoke else args.rounds, device, dtype, sides,
                    bandwidth, rows, save, ragged=args.ragged or smoke)
    if smoke:
        for r in rows:
            assert r["accelc"].get("same_tokens_as_eager") == 1.0, r
            own = r["eager_fp16_first_logits_rel_err_vs_fp32"]      # (fp32 here, against fp64)
            assert r["accelc"]["first_logits_rel_err_vs_fp32"] <= max(1e-4, 2 * own), r
            assert r["accelc_paged"].get("same_tokens_as_eager") == 1.0, r
            assert "error" not in r["accelc_int8w"] and r["accelc_int8w"]["decode_tok_s"] > 0, r   # int8 weights: tokens may differ
        print("smoke: ok")
        return
    print(markdown(env, _common.merged(args.out, "generate", env, rows, key) if args.merge else rows))


if __name__ == "__main__":
    main()
