"""A model sharded with PyTorch's tensor parallelism, as this rank's plain modules (accelc.tensor_parallel.localize):
two processes on the gloo backend (torch.distributed.run), a two-layer Llama sharded by PyTorch's plan
(ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down, the LM head gathered). Each rank's localized model gives
the unsharded model's logits and greedy tokens in fp32, holds no DTensor, and exports with its collectives in the
graph (an all-reduce after each row-wise layer, an all-gather for the head). Layouts accelc does not take are
refused in one line naming the layer. accelc.optimize takes the sharded model itself (localizing its own copy), each
rank's optimized module giving the unsharded logits (a tiny BERT likewise); the sharded causal LM itself optimized, its generation (accelc's
step over a cache of the rank's KV heads) giving the unsharded tokens, also where the ranks' verdicts differ."""
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
from accelc.errors import InputError, ModelFileError

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=100, max_position_embeddings=96)).eval()
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
# saved per rank under one name, each rank's shard beside it named by its rank (as the command line writes them: the
# ranks overwrote each other's), each rank loading its own shard (and refused another rank's)
saved_to = str(accelc.save(opt, "tp.pt2"))
dist.barrier()
with torch.no_grad():
    loaded_diff = (accelc.load(f"tp.rank{rank}-of-2.pt2")(other) - lm(other).logits).abs().max().item()
try:
    accelc.load(f"tp.rank{1 - rank}-of-2.pt2")
    wrong_rank = "taken"
except ModelFileError as e:
    wrong_rank = str(e)
# the sharded causal LM itself: its forward and its generation step optimized on each rank, accelc's step with
# the rank's KV heads in its cache generating the unsharded model's tokens
opt_lm = accelc.optimize(sharded, (ids,))
with torch.no_grad():
    lm_tokens = opt_lm.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    lm_more = opt_lm.generate(other, max_new_tokens=4, do_sample=False, pad_token_id=0)
    lm_more_want = lm.generate(other, max_new_tokens=4, do_sample=False, pad_token_id=0)
step_collectives = [str(n.target) for n in opt_lm.step.graph_module.graph.nodes
                    if tensor_parallel.is_collective(n.target)]
# verdicts that differ between the ranks: rank 1's checks fail every layer, so it alone demotes, checks again
# and reverts; its graph runs more often while optimize decides, which its collectives (standing in locally
# there) must not pair with rank 0's
import dataclasses, os
from accelc import guard
os.environ["ACCELC_REUSE"] = "0"
real_compare = guard.compare
guard.compare = lambda *a, **k: (dataclasses.replace(real_compare(*a, **k), passed=False, reason="forced on rank 1")
                                 if rank == 1 else real_compare(*a, **k))
apart = accelc.optimize(parallelize_module(copy.deepcopy(lm), mesh, plan), (ids,),
                        config=accelc.OptimizeConfig(kv_cache="paged"))     # (and the paged cache of the rank's heads)
guard.compare = real_compare
with torch.no_grad():
    apart_tokens = apart.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
refusals = []
for name, style in (("embed", {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}),
                    ("dtensor out", {"model.layers.0.mlp.up_proj": ColwiseParallel(use_local_output=False)}),
                    ("sequence parallel", {"model.layers.0.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})):
    try:
        tensor_parallel.localize(parallelize_module(copy.deepcopy(lm), mesh, style))
        refusals.append(f"{name}: taken")
    except InputError as e:
        refusals.append(f"{name}: {e}")
# an encoder too: a tiny BERT sharded by the same styles (q / k / v / intermediate column-wise, the two output
# projections row-wise), optimized, against the unsharded model at the example's and another shape
bert = T.BertModel(T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                vocab_size=100, max_position_embeddings=64), add_pooling_layer=False).eval()
bert_plan = {}
for i in range(2):
    p = f"encoder.layer.{i}."
    bert_plan.update({p + "attention.self.query": ColwiseParallel(), p + "attention.self.key": ColwiseParallel(),
                      p + "attention.self.value": ColwiseParallel(), p + "attention.output.dense": RowwiseParallel(),
                      p + "intermediate.dense": ColwiseParallel(), p + "output.dense": RowwiseParallel()})

class Hidden(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
    def forward(self, ids):
        return self.m(ids).last_hidden_state

opt_bert = accelc.optimize(Hidden(parallelize_module(copy.deepcopy(bert), mesh, bert_plan)), (ids,))
with torch.no_grad():
    bert_diff = max((opt_bert(t) - bert(t).last_hidden_state).abs().max().item() for t in (ids, other))
from torch.distributed.tensor import distribute_tensor
hand = copy.deepcopy(lm)           # a DTensor weight without parallelize_module's hooks (another library's style)
up = hand.model.layers[0].mlp.up_proj
up.weight = nn.Parameter(distribute_tensor(up.weight.detach(), mesh, [Shard(0)]), requires_grad=False)
try:
    tensor_parallel.localize(hand)
    refusals.append("unreadable: taken")
except InputError as e:
    refusals.append(f"unreadable: {e}")
# the same model sharded by transformers' own tp_plan styles (what from_pretrained(tp_plan="auto") applies: Llama's
# plan, the LM head colwise_gather_output), read from the styles that replaced the layers' forwards
from transformers.integrations.tensor_parallel import apply_tensor_parallelism
hf_plan = {"lm_head": "colwise_gather_output"}
for i in range(2):
    hf_plan.update({"model." + k.replace("*", str(i)): v for k, v in T.LlamaConfig.base_model_tp_plan.items()})
# (a module's name installs its style's forward, its weight's name shards the weight: from_pretrained does both)
hf_plan.update({k + ".weight": v for k, v in hf_plan.items()})
hf_local = tensor_parallel.localize(apply_tensor_parallelism(copy.deepcopy(lm), mesh, hf_plan))
opt_hf = accelc.optimize(LogitsOf(apply_tensor_parallelism(copy.deepcopy(lm), mesh, hf_plan)).eval(), (ids,))
with torch.no_grad():
    hf_own_diff = (apply_tensor_parallelism(copy.deepcopy(lm), mesh, hf_plan)(ids).logits - ref).abs().max().item()
    hf_diff = (hf_local(ids).logits - ref).abs().max().item()
    hf_tokens_equal = bool(torch.equal(hf_local.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), want))
    hf_opt_diff = max((opt_hf(t) - lm(t).logits).abs().max().item() for t in (ids, other))
try:
    tensor_parallel.localize(apply_tensor_parallelism(copy.deepcopy(lm), mesh, {
        "model.layers.0.mlp.up_proj": "packed_colwise", "model.layers.0.mlp.up_proj.weight": "packed_colwise"}))
    refusals.append("hf packed: taken")
except InputError as e:
    refusals.append(f"hf packed: {e}")
try:                                 # 99 output features in unequal shards, gathered: refused (accelc gathers equal)
    tensor_parallel.localize(parallelize_module(nn.Sequential(nn.Linear(64, 99)), mesh,
                                                {"0": ColwiseParallel(output_layouts=Replicate())}))
    refusals.append("uneven: taken")
except InputError as e:
    refusals.append(f"uneven: {e}")
print("RESULT " + json.dumps({
    "rank": rank, "local_vs_ref": (got - ref).abs().max().item(), "exported_vs_ref": (exported - ref).abs().max().item(),
    "all_reduce": sum("all_reduce" in str(n.target) for n in ep.graph.nodes),
    "all_gather": sum("all_gather" in str(n.target) for n in ep.graph.nodes),
    "tokens_equal": bool(torch.equal(gen, want)), "dtensors_left": tensor_parallel.is_sharded(local),
    "q_shard": list(local.model.layers[0].self_attn.q_proj.weight.shape), "refusals": refusals,
    "optimized_vs_ref": (optimized - ref).abs().max().item(), "rewritten": len(opt.rewritten),
    "other_shape_vs_ref": other_diff,
    "caller_still_sharded": tensor_parallel.is_sharded(sharded),
    "lm_tokens_equal": bool(torch.equal(lm_tokens, want)), "lm_other_equal": bool(torch.equal(lm_more, lm_more_want)),
    "lm_step": opt_lm.step is not None, "lm_rewritten": len(opt_lm.rewritten), "step_collectives": step_collectives,
    "apart_tokens_equal": bool(torch.equal(apart_tokens, want)), "apart_rewritten": len(apart.rewritten),
    "apart_paged": apart.step is not None and "paged" in apart.info.generation,
    "ranks": tensor_parallel.on_every_rank(opt_lm.graph_module, rank), "loaded_vs_ref": loaded_diff,
    "wrong_rank": wrong_rank, "saved_to": saved_to, "bert_vs_ref": bert_diff, "bert_rewritten": len(opt_bert.rewritten),
    "hf_own_vs_ref": hf_own_diff, "hf_vs_ref": hf_diff, "hf_tokens_equal": hf_tokens_equal, "hf_dtensors_left": tensor_parallel.is_sharded(hf_local),
    "hf_optimized_vs_ref": hf_opt_diff, "hf_rewritten": len(opt_hf.rewritten)}))
dist.barrier()      # (the README's order: a barrier before the destroy; gloo's teardown under a live program aborted)
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
        assert r["q_shard"] == [32, 64], r                           # 2 of the 4 heads (head dim 16) a rank
        assert r["optimized_vs_ref"] < 1e-5 and r["rewritten"] > 0 and r["caller_still_sharded"], r  # on a copy
        assert r["other_shape_vs_ref"] < 1e-5, r                              # 3 x 5, not the example's 2 x 9
        assert r["lm_tokens_equal"] and r["lm_other_equal"] and r["lm_step"] and r["lm_rewritten"] > 0, r
        assert r["step_collectives"].count("accelc.tp_all_reduce.default") == 4, r    # the step's, as the forward's
        assert r["step_collectives"].count("accelc.tp_all_gather.default") == 1, r
        assert r["apart_tokens_equal"] and r["apart_paged"] and r["ranks"] == [0, 1], r
        assert (r["apart_rewritten"] == 0) == (r["rank"] == 1), r         # rank 1 reverted all, rank 0 kept its own
        assert r["loaded_vs_ref"] < 1e-5 and r["saved_to"] == f"tp.rank{r['rank']}-of-2.pt2", r
        assert r["bert_vs_ref"] < 1e-5 and r["bert_rewritten"] > 0, r
        assert r["wrong_rank"] == (f"'tp.rank{1 - r['rank']}-of-2.pt2' is rank {1 - r['rank']} of a 2-rank tensor-parallel "
                                   f"program, and this process is rank {r['rank']} of 2: each rank loads the program it "
                                   "saved (its own shard of the weights)"), r
    import accelc                                     # a process outside any process group
    from accelc.errors import ModelFileError
    with pytest.raises(ModelFileError, match=r"^'.*tp.rank0-of-2.pt2' is rank 0 of a 2-rank tensor-parallel program: "
                                             r"load it in that rank of 2 processes with the process group initialized"):
        accelc.load(tmp_path / "tp.rank0-of-2.pt2")
    for r in results:    # (these checks sat inside the pytest.raises block above, after the raising call: never run)
        embed, out_dtensor, seq, unreadable, hf_packed, uneven = r["refusals"]
        assert uneven == ("uneven: 0: its 99 output features gathered from 2 ranks in unequal shards; accelc "
                          "gathers equal ones"), uneven
        assert unreadable.startswith("unreadable: model.layers.0.mlp.up_proj: sharded by a tensor-parallel style "
                                     "whose layouts accelc cannot read"), unreadable
        assert embed.startswith("embed: model.embed_tokens (Embedding) holds DTensor parameters"), embed
        assert out_dtensor.startswith("dtensor out: model.layers.0.mlp.up_proj: its output stays a DTensor"), out_dtensor
        assert seq.startswith("sequence parallel: model.layers.0.mlp.down_proj: RowwiseParallel with its output "
                              "S(1) (sequence parallelism)"), seq
        assert hf_packed.startswith("hf packed: model.layers.0.mlp.up_proj: sharded by transformers' "
                                    "PackedColwiseParallel; accelc takes"), hf_packed
        # transformers' tp_plan styles (Llama's plan): the unsharded logits and tokens, no DTensor left, optimized
        assert r["hf_own_vs_ref"] < 1e-5, r                 # (the plan as transformers applies it: its own forward)
        assert r["hf_vs_ref"] < 1e-5 and r["hf_tokens_equal"] and not r["hf_dtensors_left"], r
        assert r["hf_optimized_vs_ref"] < 1e-5 and r["hf_rewritten"] > 0, r


def _sharded_graph():
    import torch
    from torch import fx

    from accelc import tensor_parallel   # noqa: F401  (registers accelc::tp_all_reduce / tp_all_gather)

    def f(x):
        y = torch.ops.accelc.tp_all_reduce(x * 2, "group0")
        return torch.ops.accelc.tp_all_gather(y, 3, "group0")
    return fx.symbolic_trace(f)


def test_collectives_stand_in_locally_while_optimize_decides():
    """Inside local_collectives (no process group at all here): the all-reduce is the rank's own tensor, the
    all-gather its tensor `world` times; a graph's group is read from its collectives."""
    import torch

    from accelc import tensor_parallel

    gm = _sharded_graph()
    x = torch.randn(2, 5)
    with tensor_parallel.local_collectives():
        out = gm(x)
    assert torch.equal(out, torch.cat([x * 2] * 3, dim=-1))
    assert tensor_parallel.group_of(gm) == "group0"
    assert tensor_parallel.on_every_rank(_plain_graph(), "v") == ["v"]       # no collectives: no group asked


def _plain_graph():
    import torch
    from torch import fx
    return fx.symbolic_trace(lambda x: torch.relu(x))


def test_a_sharded_graph_pads_every_call_alike():
    """padding="auto" runs a padded call at its own size where its measured times say so: per rank, so a
    tensor-parallel graph's calls are padded alike (their collectives take the same shapes on every rank)."""
    import torch

    from accelc import runner
    from accelc.config import OptimizeConfig

    config = OptimizeConfig(padding="auto")
    assert runner.make_runner(_plain_graph(), config, torch.device("cpu"))[0].exact_calls
    assert not runner.make_runner(_sharded_graph(), config, torch.device("cpu"))[0].exact_calls


def test_a_counted_timer_calls_exactly_so_often():
    """median_ms(calls=n): three warm-up calls and n timed ones, whatever they take (a tensor-parallel program's
    ranks call it equally often)."""
    from accelc.latency import median_ms

    seen = []
    ms = median_ms(lambda: seen.append(1), "cpu", calls=7)
    assert len(seen) == 10 and ms >= 0


BUILDER = r"""
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).eval()


def build():       # what a user's builder does under torchrun: the model, sharded by PyTorch's plan
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
"""

LOAD = r"""
import json, torch, torch.distributed as dist
import accelc
from tpmodel import mlp

dist.init_process_group("gloo")
gen = torch.Generator().manual_seed(1)
prog = accelc.load("out.pt2")         # this rank's file, found by its rank
with torch.no_grad():                 # the example's batch (3) and another (5)
    diff = max((prog(x) - mlp()(x)).abs().max().item() for x in (torch.randn(3, 16, generator=gen),
                                                                  torch.randn(5, 16, generator=gen)))
print("RESULT " + json.dumps({"rank": dist.get_rank(), "diff": diff,
                              "shard": prog.accelc_summary.get("tensor_parallel")}))
dist.barrier()      # (as the README says: without it, a rank destroying the gloo group while the other still holds
dist.destroy_process_group()    # its loaded program aborted that one at exit in about 1 run in 4)
"""


def test_the_command_line_converts_a_sharded_model_rank_by_rank(tmp_path):
    """`torchrun --nproc-per-node 2 -m accelc convert pkg:build -o out.pt2`: the command creates the launcher's
    process group (gloo here) before the builder shards the model on it; each rank optimizes its shard and
    writes its own program beside the name (out.rank0-of-2.pt2, out.rank1-of-2.pt2), rank 0 printing the
    summary; accelc.load("out.pt2") in each rank of two processes reads its rank's file and gives the unsharded
    model's output. `accelc optimize` likewise prints rank 0's summary. --report and `accelc report` under torchrun
    are refused in one line, before any work."""
    (tmp_path / "tpmodel.py").write_text(BUILDER)
    (tmp_path / "load.py").write_text(LOAD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run(run + ["-m", "accelc", "convert", "tpmodel:build", "-o", "out.pt2", "--input-shape", "3x16",
                                "--device", "cpu"], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "unwaited collective" not in out.stderr     # (the sharded model's own check call: its output waited for)
    assert sorted(p.name for p in tmp_path.glob("out*.pt2")) == ["out.rank0-of-2.pt2", "out.rank1-of-2.pt2"]
    assert "wrote out.rank0-of-2.pt2" in out.stdout and "wrote out.rank1-of-2.pt2" in out.stdout, out.stdout
    assert out.stdout.count("layer(s) rewritten") == 2 and "rank 1 of 2:" in out.stdout, out.stdout
    loaded = subprocess.run(run + ["load.py"], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    results = [json.JSONDecoder().raw_decode(p)[0] for p in loaded.stdout.split("RESULT ")[1:]]
    assert loaded.returncode == 0 and len(results) == 2, loaded.stderr[-4000:]
    for r in results:
        assert r["diff"] < 1e-5 and r["shard"]["rank"] == r["rank"] and r["shard"]["world"] == 2, r
    optimized = subprocess.run(run + ["-m", "accelc", "optimize", "tpmodel:build", "--input-shape", "3x16", "--device",
                                      "cpu"], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert optimized.returncode == 0 and optimized.stdout.count("end-to-end relative L2 error vs eager") == 1, \
        optimized.stderr[-4000:]
    assert "accelc: rank 1 of 2: 2 layer(s) rewritten (rank 0 prints its summary)" in optimized.stdout
    refused = subprocess.run(run + ["-m", "accelc", "convert", "tpmodel:build", "-o", "o2.pt2", "--input-shape",
                                    "3x16", "--device", "cpu", "--report", "rep"], env=env, capture_output=True,
                             text=True, timeout=600, cwd=tmp_path)
    assert refused.returncode != 0 and not (tmp_path / "rep").exists() and not list(tmp_path.glob("o2*"))
    assert "accelc: error: --report times one process's model layer by layer: under torchrun" in refused.stderr
    report = subprocess.run(run + ["-m", "accelc", "report", "tpmodel:build", "-o", "rep", "--input-shape", "3x16",
                                   "--device", "cpu"], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert report.returncode != 0 and not (tmp_path / "rep").exists()
    assert "accelc: error: accelc report times one process's model layer by layer: run it without torchrun" \
        in report.stderr, report.stderr[-2000:]


SYMM_SCRIPT = r"""
import json, os
import torch, torch.distributed as dist
from accelc import fast_all_reduce, tensor_parallel

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
name = dist.group.WORLD.group_name
torch.manual_seed(rank)
def nccl(t):
    t = t.clone()
    dist.all_reduce(t)
    return t
from accelc.kernels import all_reduce as kernel
r = {"rank": rank}
for dtype, by_store, counted in ((torch.float16, False, False), (torch.bfloat16, False, False),
                                 (torch.float16, True, False), (torch.float16, True, True)):
    kernel.SIGNAL_BY_STORE, kernel.COUNTED_SIGNALS = by_store, counted   # (accelc's kernel: fp16 on 2.11)
    k = str(dtype)[6:] + (" counted" if counted else " by store" if by_store else "")
    x = torch.randn(3, 4096, device="cuda", dtype=dtype)
    r[k + " equal"] = torch.equal(tensor_parallel.all_reduce(x, name), nccl(x))
    r[str(dtype)[6:] + " kernel"] = type(fast_all_reduce._buffers.get((name, dtype, x.device))).__name__
    static = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tensor_parallel.all_reduce(static, name)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tensor_parallel.all_reduce(static, name)
        out2 = tensor_parallel.all_reduce(out * 0.5, name)          # two in a row on one buffer
    static.copy_(x * 3)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    r[k + " graph equal"] = torch.equal(out, nccl(x * 3)) and torch.equal(out2, nccl(nccl(x * 3) * 0.5))
    big = torch.randn(1024, 1024, device="cuda", dtype=dtype)               # 2 MB: past MAX_BYTES, NCCL's
    r[k + " big equal"] = torch.equal(tensor_parallel.all_reduce(big, name), nccl(big))
    g = None
os.environ["ACCELC_TP_ALL_REDUCE"] = "nccl"
r["forced equal"] = torch.equal(tensor_parallel.all_reduce(x, name), nccl(x))
print("RESULT " + json.dumps(r), flush=True)
fast_all_reduce.forget()
dist.destroy_process_group()
"""


def test_small_all_reduces_by_symmetric_memory_on_two_gpus(tmp_path):
    """On two GPUs (NCCL): one-row-sized all-reduces go to a one-shot kernel over symmetric memory (fp16 to
    accelc's Triton kernel, PyTorch 2.11's taking fp32 and bf16 only; bf16 to PyTorch's) and sum as NCCL does (two
    addends: one rounding either way), also two in a row replayed twice from a CUDA graph with new inputs, accelc's
    with its senders signalling by compare-and-swap, by exchange (SIGNAL_BY_STORE) and by counted adds
    (COUNTED_SIGNALS); a 2 MB one, and every one
    under ACCELC_TP_ALL_REDUCE=nccl, NCCL's."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    script = tmp_path / "symm.py"
    script.write_text(SYMM_SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(p)[0] for p in out.stdout.split("RESULT ")[1:]]
    assert out.returncode == 0 and len(results) == 2, out.stderr[-4000:]
    for r in results:
        assert r["float16 kernel"] == "_TritonOneShot" and r["bfloat16 kernel"] in ("_TorchOneShot", "_TritonOneShot")
        assert all(v for k, v in r.items() if k.endswith("equal")), r


def test_all_reduces_off_the_gpu_or_switched_off_are_not_one_shot(monkeypatch):
    """fast_all_reduce takes CUDA tensors only (a CPU / gloo tensor: None, the caller's NCCL or gloo all-reduce),
    and none under ACCELC_TP_ALL_REDUCE=nccl; nothing is rendezvoused for them."""
    import torch

    from accelc import fast_all_reduce

    assert fast_all_reduce.all_reduce(torch.randn(1, 4096), "group0") is None
    assert fast_all_reduce.wanted()
    monkeypatch.setenv("ACCELC_TP_ALL_REDUCE", "NCCL")
    assert not fast_all_reduce.wanted()
    assert not fast_all_reduce._buffers


def test_each_one_shot_kernel_takes_the_sizes_it_is_faster_at(monkeypatch):
    """A group's one-shot kernel takes all-reduces up to its own size (accelc's Triton kernel 64 KB, PyTorch's
    256 KB: where each beat NCCL); larger ones, or a tensor of another dtype or alignment, go to NCCL (None)."""
    import torch

    from accelc import fast_all_reduce

    class Fake:
        def __init__(self, max_bytes):
            self.max_bytes, self.calls = max_bytes, []

        def __call__(self, t):
            self.calls.append(t.numel() * t.element_size())
            return t * 2

    monkeypatch.setattr(fast_all_reduce, "on_gpu", lambda t: True)
    monkeypatch.setattr(fast_all_reduce, "_buffers", {})
    triton_like, torch_like = (Fake(k.max_bytes) for k in (fast_all_reduce._TritonOneShot,
                                                               fast_all_reduce._TorchOneShot))
    fast_all_reduce._buffers[("g", torch.float16, torch.device("cpu"))] = triton_like
    fast_all_reduce._buffers[("g", torch.bfloat16, torch.device("cpu"))] = torch_like
    for dtype, fake in ((torch.float16, triton_like), (torch.bfloat16, torch_like)):
        for rows in (1, 8, 16, 32):               # 8, 64, 128, 256 KB of a 4096-wide row
            x = torch.randn(rows, 4096).to(dtype)
            got = fast_all_reduce.all_reduce(x, "g")
            assert (got is not None) == (rows * 4096 * 2 <= fake.max_bytes), (dtype, rows)
            if got is not None:
                assert torch.equal(got, x * 2)
    assert triton_like.calls == [8192, 65536] and torch_like.calls == [8192, 65536, 131072, 262144]
    assert fast_all_reduce.all_reduce(torch.randn(1, 4097).to(torch.float16), "g") is None     # not 16-byte rows
    assert fast_all_reduce.all_reduce(torch.randn(1, 4096, dtype=torch.float64), "g") is None


def test_the_one_shot_kernel_on_one_rank_in_the_interpreter(monkeypatch):
    """kernels/all_reduce.py over a group of one (the interpreter runs one process): the input back, for launches
    of several sizes on one flag array, its senders signalling each way. The reset flags back to 0 after each call;
    the counted ones at each program's count of its calls, the counts one more a call, and from a count about to
    wrap past int32's largest the calls still meet (the flags compared by their difference)."""
    import torch

    from accelc.kernels import all_reduce as kernel

    buf = torch.empty(8192, dtype=torch.float16)
    flags = torch.zeros(kernel.flags_needed(buf.numel(), 1), dtype=torch.int32)
    programs = kernel._programs(buf.numel())
    reset, counted, counts = flags[: 2 * programs], flags[2 * programs: 4 * programs], flags[4 * programs:]
    buf_ptrs, flag_ptrs = (torch.tensor([t.data_ptr()], dtype=torch.int64) for t in (buf, flags))
    calls = torch.zeros(programs, dtype=torch.int32)
    for mode in ("compare-and-swap", "exchange", "counted", "counted past int32"):
        monkeypatch.setattr(kernel, "SIGNAL_BY_STORE", mode == "exchange")
        monkeypatch.setattr(kernel, "COUNTED_SIGNALS", mode.startswith("counted"))
        if mode == "counted past int32":
            start = 2 ** 31 - 2
            counts.fill_(start)
            counted.fill_(start)
            calls.fill_(start)
        for n in (5000, 64, 8192):
            x = torch.randn(n, dtype=torch.float16)
            out = torch.empty_like(x)
            kernel.launch(x, out, buf_ptrs, flag_ptrs, 0, 1, buf.numel())
            assert torch.equal(out, x) and not reset.any(), (mode, n)
            if mode.startswith("counted"):
                ran = (torch.arange(programs) < -(-n // kernel.BLOCK)).int()
                calls = (calls.long() + ran).to(torch.int32)          # (int64 to int32: wraps, as the kernel's)
                assert torch.equal(counts, calls), (mode, n, counts, calls)
                assert torch.equal(counted.view(2, programs), torch.stack([calls, calls])), (mode, n)
    assert (counts < 0).any(), counts          # the last mode's counts did wrap


RANK_ALONE = r"""
import json, warnings
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
import accelc
from accelc import numerics
from accelc.capture import check

warnings.simplefilter("ignore")
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 8)).eval()
sharded = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel()})
asked = []
if rank == 1:      # this rank alone sees the captured graph's output past the floor, once
    def rel_l2(out, ref, calls=[]):
        calls.append(1)
        return 1.0 if len(calls) == 1 else numerics.rel_l2(out, ref)
    check.rel_l2 = rel_l2
real_upcast = numerics.upcast_run
import accelc.capture.trace as trace
trace.upcast_run = lambda *a, **k: asked.append("reference") or real_upcast(*a, **k)
x = torch.randn(4, 16)
with torch.no_grad():
    want = sharded(x)
try:
    opt = accelc.optimize(sharded, (x,), accelc.OptimizeConfig(passes=(), only_if_faster=False))
    with torch.no_grad():
        outcome = f"optimized, max diff {float((opt(x) - want).abs().max()):.1e}"
except Exception as e:
    outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
print("RESULT " + json.dumps({"rank": rank, "outcome": outcome, "asked": asked, "shard": list(want.shape)}))
dist.barrier()
dist.destroy_process_group()
"""


def test_a_rank_alone_past_the_floor_does_not_run_collectives_the_others_do_not(tmp_path):
    """The capture check asks for the model in higher precision (and a rerun) by its own outputs; a tensor-parallel
    model's output can be the rank's shard (a colwise last layer, no gather), so one rank may ask and another not,
    and the collectives of that run would pair with nothing on the other rank. Every rank asks both and refuses alike
    (check.checked): here rank 1 alone sees the graph's output past the floor, and both ranks capture, with the
    same numbers as the sharded model, the reference asked on both."""
    script = tmp_path / "alone.py"
    script.write_text(RANK_ALONE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    decoder, results = json.JSONDecoder(), []
    for part in out.stdout.split("RESULT ")[1:]:
        results.append(decoder.raw_decode(part)[0])
    assert out.returncode == 0 and len(results) == 2, out.stderr[-3000:]
    for r in results:
        assert r["shard"] == [4, 4] and r["outcome"].startswith("optimized, max diff "), r
        assert float(r["outcome"].split()[-1]) < 1e-5 and "reference" in r["asked"], r


def test_a_cpu_collectives_tensors_stay_referenced_until_exit():
    """gloo's worker thread drops a finished collective's tensors after the caller's wait; were that the last
    reference while the interpreter exits, freeing needs the GIL and the process aborts after its last line ("terminate
    called without an active exception": two ranks' scripts here, about one run in ten beside a loaded CPU). The last
    CPU collectives' tensors stay referenced by the module, freed by the main thread at exit."""
    import torch
    import torch.distributed as dist

    from accelc import tensor_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        name = dist.group.WORLD.group_name
        x = torch.randn(3, 4)
        summed = torch.ops.accelc.tp_all_reduce(x, name)
        kept = [t for ts in tensor_parallel._KEPT for t in ts]
        assert torch.equal(summed, x) and any(t.data_ptr() == summed.data_ptr() for t in kept)
        gathered = torch.ops.accelc.tp_all_gather(x, 1, name)
        kept = [t for ts in tensor_parallel._KEPT for t in ts]
        assert torch.equal(gathered, x) and len(kept) == 3     # the gather's input and output beside the sum's
        for _ in range(8):
            torch.ops.accelc.tp_all_reduce(x, name)
        assert len(tensor_parallel._KEPT) == tensor_parallel._KEPT.maxlen     # a few, not every one
    finally:
        dist.destroy_process_group()


def test_a_decision_compared_across_gloo_ranks_keeps_its_collectives_tensors():
    """on_every_rank on a gloo group gathers each rank's value with collectives whose tensors stay referenced (a
    sibling of the CPU collectives' abort at exit: all_gather_object's own tensors, dropped last by gloo's worker
    thread, aborted a rank of a two-rank optimize in CI); the values come back as given, any picklable value."""
    import torch
    import torch.distributed as dist
    from torch import fx

    from accelc import tensor_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        name = dist.group.WORLD.group_name
        gm = fx.symbolic_trace(lambda x: torch.ops.accelc.tp_all_reduce(x, name))
        assert tensor_parallel.group_of(gm) == name
        for value in (None, "no padding", {"plan": (1, 2, 4)}):
            tensor_parallel._KEPT.clear()
            assert tensor_parallel.on_every_rank(gm, value) == [value]
        kept = [t for ts in tensor_parallel._KEPT for t in ts]     # (the last one's: its sizes, its bytes)
        assert len(tensor_parallel._KEPT) == 2 and all(t.dtype in (torch.int64, torch.uint8) for t in kept)
    finally:
        dist.destroy_process_group()
