"""Tensor parallel: a Llama-shaped causal LM sharded with PyTorch's plan (ColwiseParallel q/k/v/gate/up,
RowwiseParallel o/down, the LM head gathered), one process per GPU, optimized by accelc on every rank and generating
greedily; beside it the same sharded model under HF's static cache + torch.compile (decode) and torch.compile
reduce-overhead (prefill). The tensor-parallel issue's measure.

    torchrun --nproc-per-node 2 bench/tp.py --shape llama3-8b [--layers N] [--out DIR]
    torchrun --nproc-per-node 1 bench/tp.py --shape llama3-8b          # one GPU, unsharded: the scaling's base
    torchrun --nproc-per-node 2 bench/tp.py --smoke                    # a tiny Llama, gloo on the CPU
    torchrun --nproc-per-node 2 bench/tp.py --plan hf ...              # sharded by transformers' tp_plan styles

Weights are random at the shape's sizes, fp16 on a GPU. --init full (the default for shapes that fit a rank):
every rank builds the whole model from one seed and the plan cuts it, and rank 0 compares the greedy tokens with the
unsharded model's (a GPU: the unsharded model on rank 0's GPU, where it fits). --init meta (the 70B shape): each
rank builds only its shard on the meta device and fills it with random values (nothing to compare with).

Sides, every rank running each the same number of times (their collectives pair up), timed on rank 0 with the GPU
synchronised:
  accelc        accelc.optimize(sharded model, prompt) then opt.generate (its static cache holds the rank's KV heads);
  accelc_nccl   the same with every all-reduce on NCCL (ACCELC_TP_ALL_REDUCE=nccl; accelc takes the small ones, a
                decode step's, by symmetric memory's one-shot kernel: accelc/fast_all_reduce.py);
  accelc_counted  accelc with the one-shot kernel's senders signalling by counted adds (kernels/all_reduce.py's
                COUNTED_SIGNALS, off by default: this side is its end-to-end A/B);
  hf_compiled   the sharded model's generate with cache_implementation="static" (HF compiles its decode step);
  eager         the sharded model's own generate (dynamic cache).
Decode tokens/s: (new - 1) tokens over (generate(new) - generate(1)); prefill ms: a forward of --prefill rows x
--prefill-len tokens (accelc's optimized forward; torch.compile reduce-overhead of the sharded model's forward).
The decode step's GPU time by kernel (torch.profiler: a generate of 16 tokens less one of 1, the prefill out), its
collectives' per layer.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402
import generate as generate_bench  # noqa: E402  (its generate timer)

SHAPES = {   # name -> LlamaConfig arguments
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=512),
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),   # (one GPU's profile)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
}


def plan(layers: int) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                    p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                    p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                    p + "mlp.down_proj": RowwiseParallel()})
    return out


def hf_plan(cfg) -> dict:
    """transformers' own tp_plan for the model (its base model's styles, the LM head's), as from_pretrained(tp_plan=
    "auto") applies it: each module's style on the module (its forward) and on its weight (the shard)."""
    import transformers as tf

    out = {"lm_head": tf.LlamaForCausalLM._tp_plan["lm_head"]}
    for i in range(cfg.num_hidden_layers):
        out.update({"model." + k.replace("*", str(i)): v for k, v in tf.LlamaConfig.base_model_tp_plan.items()})
    return {**out, **{k + ".weight": v for k, v in out.items()}}


def shard(model, cfg, mesh, which: str):
    """`model` sharded by PyTorch's plan (parallelize_module) or transformers' (its tp_plan styles)."""
    if which == "hf":
        from transformers.integrations.tensor_parallel import apply_tensor_parallelism
        return apply_tensor_parallelism(model, mesh, hf_plan(cfg))
    from torch.distributed.tensor.parallel import parallelize_module
    return parallelize_module(model, mesh, plan(cfg.num_hidden_layers))


def build(cfg, device, dtype, init: str, mesh, world: int, which: str = "torch"):
    """(the whole model or None, this rank's model: sharded by the plan (`which`: torch or hf) where world > 1)."""
    import transformers as tf
    from torch.distributed.tensor.parallel import parallelize_module

    if init == "full":
        torch.manual_seed(0)
        with torch.device(device):
            whole = tf.LlamaForCausalLM(cfg).to(dtype).eval()
        mine = shard(copy.deepcopy(whole), cfg, mesh, which) if world > 1 else whole
        return whole, mine
    if which != "torch":
        raise SystemExit("--plan hf takes --init full (transformers' styles shard weights that exist)")
    with torch.device("meta"):
        lm = tf.LlamaForCausalLM(cfg).to(dtype).eval()
    if world > 1:
        lm = parallelize_module(lm, mesh, plan(cfg.num_hidden_layers))
    lm = lm.to_empty(device=device)
    # a shard's values from its rank's seed; a weight every rank holds whole (the embedding) from one seed for all,
    # as a checkpoint gives every rank the same
    gen = torch.Generator(device=device).manual_seed(1234 + (mesh.get_local_rank() if world > 1 else 0))
    same = torch.Generator(device=device).manual_seed(1233)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=gen if hasattr(p, "to_local") else same)
        rotary = lm.model.rotary_emb                 # its inverse frequencies are computed, not parameters
        with torch.device(device):
            lm.model.rotary_emb = type(rotary)(config=cfg)
    return None, lm


def timed(fn, rounds: int, sync) -> float:
    """Seconds of fn() (every rank calls it as often): the prefill's, counted as bench/generate.py counts a generate."""
    return generate_bench.timed_call(fn, rounds, sync)[0]


def decode_rate(gen, ids, mask, new: int, rounds: int, sync) -> tuple[float, float, torch.Tensor]:
    """(ms to the first token, decode tokens/s, the tokens) timed as bench/generate.py times them."""
    first, _ = generate_bench.timed_generate(gen, ids, mask, 1, rounds, sync)
    total, out = generate_bench.timed_generate(gen, ids, mask, new, rounds, sync)
    if total <= first:     # (a stall in the 1-token runs: no rate to tell, not an absurd one)
        raise RuntimeError(f"{new} tokens took {total * 1e3:.1f} ms, the first alone {first * 1e3:.1f} ms")
    return first * 1e3, (new - 1) / (total - first), out


def collective_us_per_step(gen, ids, mask, new: int, layers: int) -> dict:
    """GPU time a decode step takes, by kernel, and in NCCL / all-reduce kernels per token and per layer (us): two
    profiled generates, of `new` tokens and of one, subtracted kernel by kernel, so that the prompt's prefill (in
    both) drops out and `new - 1` decode steps remain, as decode_rate counts them."""
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0)

    def kernels(n: int) -> tuple:
        spans = kernel_spans(lambda: gen(**kw, max_new_tokens=n, min_new_tokens=n))
        return durations(spans), _common.critical_path(spans)

    (one, (one_own, one_idle)), (many, (many_own, many_idle)) = kernels(1), kernels(new)
    steps = max(new - 1, 1)
    by_name = {k: v - one.get(k, 0.0) for k, v in many.items()}
    comm = sum(v for k, v in by_name.items() if collective(k))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    # each kernel's own time (its part after every kernel before it had ended: a duration under dependent launch
    # holds the wait for the one before) and the idle time, the one-token generate's subtracted the same way
    own = {k: v[1] - one_own.get(k, [0, 0.0])[1] for k, v in many_own.items()}
    own_top = sorted(own.items(), key=lambda kv: -kv[1])[:20]
    return {"collective_us_per_token": round(comm / steps, 1), "collective_us_per_layer": round(comm / steps / layers, 2),
            "gpu_us_per_token": round(sum(by_name.values()) / steps, 1),
            "top_kernels_us_per_token": {k: round(v / steps, 1) for k, v in top},
            "critical_path_us_per_token": {**{k: round(v / steps, 1) for k, v in own_top},
                                           "(idle)": round((many_idle - one_idle) / steps, 1)}}


def collective(kernel: str) -> bool:
    """Whether a kernel's name is a collective's: NCCL's, or an all-reduce's (accelc's one-shot kernel, PyTorch's)."""
    k = kernel.lower()
    return "nccl" in k or "allreduce" in k or "all_reduce" in k or "one_shot" in k


def kernel_spans(fn) -> list:
    """(kernel name (its first 90 characters), start us, end us) of one fn() call's GPU kernels (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name[:90], e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]


def durations(spans: list) -> dict:
    """GPU us by kernel name of kernel_spans' spans."""
    by_name: dict = {}
    for name, start, end in spans:
        by_name[name] = by_name.get(name, 0.0) + end - start
    return by_name


def prefill_kernels(fn) -> dict:
    """Where one prefill call's GPU time goes: its total, the collectives' (NCCL and all-reduce kernels), and the
    top 20 kernels, us."""
    by_name = durations(kernel_spans(fn))
    comm = sum(v for k, v in by_name.items() if collective(k))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    return {"total": round(sum(by_name.values()), 1), "collectives": round(comm, 1),
            "top": {k: round(v, 1) for k, v in top}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (said in the row)")
    ap.add_argument("--init", choices=["full", "meta"], default=None)
    ap.add_argument("--sides", default="accelc,hf_compiled")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prefill", default="2x1024", help="rows x tokens of the prefill timing ('' for none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-profile", action="store_true", help="leave out the decode step's kernel profile")
    ap.add_argument("--plan", choices=["torch", "hf"], default="torch",
                    help="shard by PyTorch's plan (parallelize_module) or transformers' tp_plan styles")
    a = ap.parse_args()
    import torch.distributed as dist
    import transformers as tf
    from torch.distributed.device_mesh import init_device_mesh

    import accelc
    from accelc.kernels import all_reduce as one_shot

    counted_default = one_shot.COUNTED_SIGNALS
    say = lambda line: print(line, flush=True) if int(os.environ.get("RANK", 0)) == 0 else None
    if a.smoke:
        a.shape, a.prompt, a.new, a.prefill, a.rounds = "tiny", 8, 6, "2x16", 1
    on_gpu = torch.cuda.is_available() and not a.smoke
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dtype = torch.float16 if on_gpu else torch.float32
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    args = dict(SHAPES[a.shape])
    if a.layers:
        args["num_hidden_layers"] = a.layers
    cfg = tf.LlamaConfig(**args)
    mesh = init_device_mesh(device.type, (world,))
    init = a.init or ("meta" if a.shape == "llama3-70b" else "full")
    whole, lm = build(cfg, device, dtype, init, mesh, world, a.plan)
    if whole is not None and world > 1 and on_gpu:
        whole = whole.cpu() if rank != 0 else whole      # the unsharded reference on rank 0's GPU only
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (a.batch, a.prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    row = {"shape": a.shape, "layers": cfg.num_hidden_layers, "world": world, "plan": a.plan, "batch": a.batch,
           "prompt": a.prompt,
           "new_tokens": a.new, "init": init, "dtype": str(dtype).removeprefix("torch."),
           "params_b_per_rank": round(sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                                          for p in lm.parameters()) / 1e9, 3)}
    want = None
    if whole is not None and rank == 0:
        with torch.no_grad():
            want = whole.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new, min_new_tokens=a.new,
                                  do_sample=False, pad_token_id=0).cpu()
    del whole
    rows_x, len_x = (int(v) for v in a.prefill.split("x")) if a.prefill else (0, 0)
    pre_ids = torch.randint(1, cfg.vocab_size, (rows_x, len_x), generator=g).to(device) if rows_x else None
    for side in a.sides.split(","):
        r, opt = {}, None
        try:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            if side == "accelc_nccl":      # every all-reduce on NCCL's ring (accelc's small ones by symmetric memory)
                os.environ["ACCELC_TP_ALL_REDUCE"] = "nccl"
            one_shot.COUNTED_SIGNALS = side == "accelc_counted"
            if side in ("accelc", "accelc_nccl", "accelc_counted"):
                config = accelc.OptimizeConfig(max_cache_len=a.prompt + a.new, max_batch_size=a.batch)
                opt = accelc.optimize(lm, {"input_ids": ids, "attention_mask": mask}, config=config)
                gen, forward = opt.generate, opt
            elif side == "hf_compiled":
                lm.generation_config.cache_implementation = "static"
                gen = lm.generate
                forward = torch.compile(lm, mode="reduce-overhead")
            else:
                gen, forward = lm.generate, lm
            r["prepare_s"] = round(time.perf_counter() - t0, 1)
            with torch.no_grad():
                ttft, rate, out = decode_rate(gen, ids, mask, a.new, a.rounds, sync)
                r.update(ttft_ms=round(ttft, 2), decode_tok_s=round(rate, 1))
                say(f"{side}: {r} ({time.perf_counter() - t0:.0f} s)")     # (a run cut later keeps these)
                if want is not None:
                    r["same_tokens_as_unsharded"] = round((out.cpu() == want).float().mean().item(), 3)
                if pre_ids is not None:
                    kw = ({"input_ids": pre_ids} if side.startswith("accelc") else
                          {"input_ids": pre_ids, "use_cache": False})
                    r["prefill_ms"] = round(timed(lambda: forward(**kw), a.rounds * 3, sync) * 1e3, 2)
                    say(f"{side}: prefill {r['prefill_ms']} ms ({time.perf_counter() - t0:.0f} s)")
                if on_gpu and not a.no_profile:
                    r.update(collective_us_per_step(gen, ids, mask, 16, cfg.num_hidden_layers))
                    if pre_ids is not None:
                        r["prefill_kernels_us"] = prefill_kernels(lambda: forward(**kw))
            if opt is not None:
                r["summary"] = opt.summary()
                r["optimize_seconds"] = dict(opt.info.seconds)
        except Exception as e:     # a side that cannot run: said in its row, the other ranks likewise
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if rank == 0:
                print(f"{side}: {type(e).__name__}: {e}", flush=True)      # (the whole message, in the log)
        os.environ.pop("ACCELC_TP_ALL_REDUCE", None)
        one_shot.COUNTED_SIGNALS = counted_default
        if opt is not None:
            opt.release_graphs()        # (its NCCL communicator's destroy waits for graphs that hold it)
        if side == "hf_compiled":
            torch._dynamo.reset()
            from torch._inductor import cudagraph_trees
            cudagraph_trees.reset_cudagraph_trees()
        gen = forward = opt = None
        gc.collect()
        row[side] = r
        if rank == 0:
            print(f"{a.shape} x{world} {side}: " + json.dumps({k: v for k, v in r.items() if k != "summary"}),
                  flush=True)
    if rank == 0:
        env = _common.environment()
        name = f"tp-{a.shape}-x{world}" + (f"-{cfg.num_hidden_layers}layers" if a.layers else "")
        sides = [s for s in a.sides.split(",") if s in row]
        md = _common.md_table(["side", "prepare s", "TTFT ms", "decode tok/s", "prefill ms", "collectives us/token",
                               "same tokens"],
                              [[s, row[s].get("prepare_s"), row[s].get("ttft_ms"), row[s].get("decode_tok_s"),
                                row[s].get("prefill_ms"), row[s].get("collective_us_per_token"),
                                row[s].get("same_tokens_as_unsharded", row[s].get("error", ""))] for s in sides])
        _common.write(a.out, name, env, [row], f"# {name} ({_common.env_line(env)})\n\n" + md)
    dist.barrier()
    # destroy_process_group waits on NCCL communicators a CUDA graph still holds (PyTorch issue 115388): every
    # side's graphs were released above; a destroy that still hangs is said and the process ends anyway
    watchdog = threading.Timer(60, lambda: (print(f"rank {rank}: destroy_process_group hung 60 s", flush=True),
                                            os._exit(3)))
    watchdog.start()
    dist.destroy_process_group()
    watchdog.cancel()


if __name__ == "__main__":
    main()
