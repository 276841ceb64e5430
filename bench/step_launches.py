"""A generation step's kernels a layer, family by family (#89's few-launch step, counted from the step's graph:
accelc/step_launches.py; the same on any machine, so the CPU measures it): tiny configs of the causal LM families
users bring (two layers, their real structure), optimized with eager and with Inductor glue, with the qkv_rotary
pass and without it (the step as it was before: the projection, its rotations and the cache write apart).

    python bench/step_launches.py [--out bench/results] [--only llama,qwen3]

A row: accelc kernels + groups of glue a layer (the glue a floor: a group compiles to one kernel or more), and the
whole step's. Writes step_launches-<device>.json / .md.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402
from accelc.config import PASS_NAMES  # noqa: E402
from accelc.step_launches import count  # noqa: E402

T = __import__("transformers")
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128, max_position_embeddings=256)
FAMILIES = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL)),
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**SMALL, head_dim=16)),
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**SMALL, pad_token_id=0)),
    "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**SMALL, head_dim=16)),
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256)),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**{k: v for k, v in SMALL.items()
                                                                 if k != "num_key_value_heads"})),
}


def measure(name: str, glue: str, fused: bool) -> dict:
    torch.manual_seed(0)
    lm = FAMILIES[name]().eval()
    ids = torch.randint(1, 128, (1, 8))
    passes = PASS_NAMES if fused else tuple(p for p in PASS_NAMES if p != "qkv_rotary")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm, {"input_ids": ids}, accelc.OptimizeConfig(glue=glue, passes=passes))
    c = count(opt.step.graph_module)
    return dict(family=name, glue=glue, qkv_rotary=fused, layers=c.blocks, accelc_a_layer=c.accelc_in_blocks / c.blocks,
                glue_a_layer=c.glue_in_blocks / c.blocks, step_accelc=c.accelc, step_glue=c.glue)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    names = [n for n in FAMILIES if not args.only or n in args.only.split(",")]
    rows = []
    for name in names:
        for glue in ("eager", "inductor"):
            for fused in (False, True):
                rows.append(measure(name, glue, fused))
                r = rows[-1]
                print(f"{name:9s} {glue:8s} qkv_rotary {'on ' if fused else 'off'}: a layer "
                      f"{r['accelc_a_layer']:g} + {r['glue_a_layer']:g}; the step {r['step_accelc']} + {r['step_glue']}",
                      flush=True)
    env = _common.environment()
    lines = [f"# A generation step's kernels a layer ({env['date']}, {env.get('device', 'cpu')}, torch {env['torch']}, "
             f"transformers {T.__version__})", "",
             "`python bench/step_launches.py`: accelc kernels + groups of glue a decoder layer (and the whole step's), "
             "counted from the step's graph (accelc/step_launches.py: the glue a floor), tiny two-layer configs of "
             "each family; `off`: the qkv_rotary pass off (the step before it).", "",
             "| family | glue | qkv_rotary off: a layer | on: a layer | off: the step | on: the step |",
             "|---|---|---|---|---|---|"]
    for i in range(0, len(rows), 2):
        off, on = rows[i], rows[i + 1]
        lines.append(f"| {off['family']} | {off['glue']} | {off['accelc_a_layer']:g} + {off['glue_a_layer']:g} | "
                     f"{on['accelc_a_layer']:g} + {on['glue_a_layer']:g} | {off['step_accelc']} + {off['step_glue']} | "
                     f"{on['step_accelc']} + {on['step_glue']} |")
    _common.write(args.out, "step_launches", env, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
