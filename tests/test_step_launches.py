"""accelc/step_launches.py: the generation step's launches a token, counted from its graph (#89's few-launch target
is checked here): accelc's kernel calls, and the groups of glue between them (one kernel or more each) within a
decoder layer or outside the layers. A tiny Llama's step under both glues, and hand-made graphs for the grouping."""
import operator
import warnings

import pytest
import torch
from torch import fx, nn

import accelc
from accelc.step_launches import count
from conftest import DEVICE

T = pytest.importorskip("transformers")


@pytest.mark.parametrize("glue", ["eager", "inductor"])
def test_a_tiny_llamas_step_and_its_summary_line(glue):
    """Under either glue, #89's five launches a layer: the q / k / v projection with its norm, rotations and cache
    write (accelc::qkv_rotary), attention, o-proj + residual, norm + gate / up, down + residual; no glue left in a
    layer (the write's positions computed once a step, the rotations in the projection's kernel). Before: 7 + 1
    under eager glue, 5 + 2 under Inductor's, as the H100 profile of Qwen2-0.5B's step showed them
    (runs/decode/profile5-qwen2-h100: 7.7 kernels a layer)."""
    per_layer = (5, 0)
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=100)
    lm = T.LlamaForCausalLM(cfg).to(DEVICE).eval()
    ids = torch.randint(1, 100, (1, 8), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm, {"input_ids": ids}, accelc.OptimizeConfig(glue=glue))
    got = count(opt.step.graph_module)
    assert (got.blocks, got.accelc_in_blocks / 2, got.glue_in_blocks / 2) == (2, *per_layer), got
    assert got.accelc > got.accelc_in_blocks and got.glue > got.glue_in_blocks    # the embedding, the head, the mask
    # every weight read once a token (the stacked q/k/v and gate/up in place of the originals), the embedding table
    # gathered, not read whole (its lm_head is a weight of its own here), the cache written and not counted
    table = lm.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in lm.parameters() if p is not table)
    assert weights <= got.weight_bytes <= weights + 1024 and got.table_bytes == table.numel() * table.element_size()
    a, g = per_layer
    assert f"launches a token: at least {got.accelc + got.glue} " in opt.summary()
    assert f"a layer (of 2): {a} + {g}" in opt.summary()


def test_groups_join_through_views_and_stay_within_a_layer():
    """Two layers of: glue (sin, add), one accelc kernel, views, glue (mul, add) joined with an exp of a value from
    outside the layers; a size's arithmetic launches nothing. Outside: cos (one group); a layer: two groups."""
    from accelc import meta
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    shared = g.call_function(torch.cos, (x,))
    size = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    g.call_function(operator.add, (size, 1))
    for i in range(2):
        nodes = [g.call_function(torch.sin, (shared,))]
        nodes.append(g.call_function(operator.add, (nodes[-1], 1)))
        nodes.append(g.call_function(torch.ops.accelc.rms_norm.default, (nodes[-1], w, None, 1e-6)))
        nodes.append(g.call_function(torch.ops.aten.view.default, (nodes[-1], [-1, 4, 2])))
        nodes.append(g.call_function(torch.transpose, (nodes[-1], 1, 2)))
        nodes.append(g.call_function(operator.mul, (nodes[-1], 3)))
        nodes.append(g.call_function(torch.exp, (shared,)))
        nodes.append(g.call_function(operator.add, (nodes[-2], nodes[-1])))
        for n in nodes:
            n.meta[meta.PATH] = f"model.layers.{i}.attn"
        x = nodes[-1]
    g.output(x)
    gm = fx.GraphModule({"w": nn.Parameter(torch.ones(8))}, g)
    got = count(gm)
    assert (got.accelc, got.glue, got.blocks, got.accelc_in_blocks, got.glue_in_blocks) == (2, 5, 2, 2, 4), got
    assert got.weight_bytes == 8 * 4 and got.line().endswith("a layer (of 2): 1 + 2; it reads 0.00 MiB of weights a "
                                                             "token, and the KV cache up to its context")
