"""A model sharded with PyTorch's tensor parallelism, as this rank's plain modules (accelc.tensor_parallel.localize):
two processes on the gloo backend (torch.distributed.run), a two-layer Llama sharded by PyTorch's plan
(ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down, the LM head gathered). Each rank's localized model gives
the unsharded model's logits and greedy tokens in fp32, holds no DTensor, and exports with its collectives in the
graph (an all-reduce after each row-wise layer, an all-gather for the head). Layouts accelc does not take are
refused in one line naming the layer. accelc.optimize takes the sharded model itself (localizing its own copy), each
rank's optimized module giving the unsharded logits; a sharded causal LM's generation is refused (not built yet)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

SCRIPT = r"""
import copy, json
import torch, torch.distributed as dist
import transformers as T
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from accelc import tensor_parallel
from accelc.errors import InputError

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=100, max_position_embeddings=96)).eval()
ids = torch.randint(0, 100, (2, 9))
mesh = init_device_mesh("cpu", (world,))
plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
for i in range(2):
    p = f"model.layers.{i}."
    plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                 p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                 p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                 p + "mlp.down_proj": RowwiseParallel()})
local = tensor_parallel.localize(parallelize_module(copy.deepcopy(lm), mesh, plan))

class Logits(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm
    def forward(self, ids):
        return self.lm(ids, use_cache=False).logits

with torch.no_grad():
    ref, got = lm(ids).logits, local(ids).logits
    ep = torch.export.export(Logits(local), (ids,), strict=False)
    exported = ep.module()(ids)
    want = lm.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    gen = local.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
class LogitsOf(nn.Module):           # a sharded model optimized as it is: localized inside optimize
    def __init__(self, lm):
        super().__init__()
        self.lm = lm
    def forward(self, ids):
        return self.lm(ids, use_cache=False).logits

import accelc
sharded = parallelize_module(copy.deepcopy(lm), mesh, plan)
opt = accelc.optimize(LogitsOf(sharded).eval(), (ids,))
other = torch.randint(0, 100, (3, 5))       # another batch and length than the example's
with torch.no_grad():
    optimized = opt(ids)
    other_diff = (opt(other) - lm(other).logits).abs().max().item()
try:
    accelc.optimize(sharded, (ids,))
    lm_refusal = "taken"
except InputError as e:
    lm_refusal = str(e)
refusals = []
for name, style in (("embed", {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}),
                    ("dtensor out", {"model.layers.0.mlp.up_proj": ColwiseParallel(use_local_output=False)}),
                    ("sequence parallel", {"model.layers.0.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})):
    try:
        tensor_parallel.localize(parallelize_module(copy.deepcopy(lm), mesh, style))
        refusals.append(f"{name}: taken")
    except InputError as e:
        refusals.append(f"{name}: {e}")
print("RESULT " + json.dumps({
    "rank": rank, "local_vs_ref": (got - ref).abs().max().item(), "exported_vs_ref": (exported - ref).abs().max().item(),
    "all_reduce": sum("all_reduce" in str(n.target) for n in ep.graph.nodes),
    "all_gather": sum("all_gather" in str(n.target) for n in ep.graph.nodes),
    "tokens_equal": bool(torch.equal(gen, want)), "dtensors_left": tensor_parallel.is_sharded(local),
    "q_shard": list(local.model.layers[0].self_attn.q_proj.weight.shape), "refusals": refusals,
    "optimized_vs_ref": (optimized - ref).abs().max().item(), "rewritten": len(opt.rewritten),
    "other_shape_vs_ref": other_diff,
    "caller_still_sharded": tensor_parallel.is_sharded(sharded), "lm_refusal": lm_refusal}))
dist.destroy_process_group()
"""


def test_a_sharded_llama_localized_on_two_gloo_ranks(tmp_path):
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    decoder, results = json.JSONDecoder(), []     # (the two ranks' lines may interleave)
    for part in out.stdout.split("RESULT ")[1:]:
        results.append(decoder.raw_decode(part)[0])
    assert out.returncode == 0 and len(results) == 2, out.stderr[-4000:]
    for r in results:
        assert r["local_vs_ref"] < 1e-5 and r["exported_vs_ref"] < 1e-5, r
        assert r["tokens_equal"] and not r["dtensors_left"], r
        assert (r["all_reduce"], r["all_gather"]) == (4, 1), r       # o_proj and down_proj of 2 layers; the head
        assert r["q_shard"] == [16, 32], r                           # 2 of the 4 heads (head dim 8) a rank
        assert r["optimized_vs_ref"] < 1e-5 and r["rewritten"] > 0 and r["caller_still_sharded"], r  # on a copy
        assert r["other_shape_vs_ref"] < 1e-5, r                              # 3 x 5, not the example's 2 x 9
        assert r["lm_refusal"].startswith("a tensor-parallel causal LM: its generation across ranks is not built"), r
        embed, out_dtensor, seq = r["refusals"]
        assert embed.startswith("embed: model.embed_tokens (Embedding) holds DTensor parameters"), embed
        assert out_dtensor.startswith("dtensor out: model.layers.0.mlp.up_proj: its output stays a DTensor"), out_dtensor
        assert seq.startswith("sequence parallel: model.layers.0.mlp.down_proj: RowwiseParallel with its output "
                              "S(1) (sequence parallelism)"), seq
