"""Why a tiny Llama's generation step is or is not cut into regions (regions.plan) on this machine's device: for the
static and the paged cache and 3 / 4 layers, each level's segments (label, nodes), the kinds met, the nodes compiled
against regions.PAYS of the graph's, and whether plan() cuts it.
    python bench/results/runs/lanes-2026-12-01/diag_plan.py"""
import warnings

import torch
import transformers as T

import accelc
from accelc import regions
from accelc.regions import _build, _compute, _segments

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny(layers):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return T.LlamaForCausalLM(cfg).to(DEVICE).eval()


for kv in ("static", "paged"):
    for layers in (3, 4):
        ids = torch.randint(1, 100, (1, 6), device=DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = accelc.optimize(tiny(layers), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                  accelc.OptimizeConfig(passes=("linear_act",), only_if_faster=False,
                                                        other_shapes="now", kv_cache=kv))
        gm = opt.step.graph_module
        total = sum(_compute(n) for n in gm.graph.nodes)
        users = {n: set(n.users) for n in gm.graph.nodes}
        for level in (1, 2):
            segs = _segments(gm, level)
            for s in segs:
                _build(s, gm, users)
            kinds = {}
            for s in segs:
                kinds.setdefault(s.key, len(s.nodes))
            print(f"{DEVICE.type} {kv} {layers} layers, level {level}: {total} nodes, segments "
                  f"{[(s.label, len(s.nodes)) for s in segs]}, {len(kinds)} kinds, {sum(kinds.values())} compiled "
                  f"(pays at most {regions.PAYS * total:.0f})")
        print(f"{DEVICE.type} {kv} {layers} layers: plan {'cuts' if regions.plan(gm) is not None else 'None'}")
