"""A warm start across processes, as bench/optimize_time.py's accelc_warm and a user's second run see it: a causal
LM's two captures (the forward and the generation step) kept by one process are read back by the next, at the
default settings (Inductor glue compiled in the background, CUDA graphs, the compile workers). On the device the
Llama-3-8B shape's second process had captured both again (bench/results/runs/optimize_time/run43-h200-8b), where every CPU test
of the kept captures passed in one process; a key part one process tells apart from another is named in the log."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = '''
import logging, sys, torch, transformers as tf
import accelc
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
logging.getLogger("accelc").setLevel(logging.DEBUG)
torch.manual_seed(0)
cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
with torch.device("cuda"):
    lm = tf.LlamaForCausalLM(cfg).to(torch.float16).eval()
ids = torch.randint(1, 256, (2, 32), device="cuda")
opt = accelc.optimize(lm, (), example_kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
print("kept", bool(opt.info.capture_kept), bool(opt.step.info.capture_kept), bool(opt.info.reused))
'''


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the default GPU path (a CPU run: test_capture_kept.py)")
def test_a_second_process_reads_both_captures_of_a_causal_lm_back(tmp_path):
    # (the cache folder not named accelc: the scripts run in tmp_path, where `import accelc` would find that folder)
    env = dict(os.environ, ACCELC_CACHE_DIR=str(tmp_path / "cache"), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("ACCELC_REUSE", None)
    runs = [subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    keys = ["\n".join(line[:1500] for line in r.stderr.splitlines() if "accelc: capture" in line or "kept" in line)
            for r in runs]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    assert "kept False False False" in runs[0].stdout, runs[0].stdout
    assert "kept True True True" in runs[1].stdout, f"first:\n{keys[0]}\nsecond:\n{keys[1]}"
