"""kernels/greedy.py: the greedy loop's bookkeeping kernels do what the PyTorch ops they replace do,
step after step (stop tokens, pads of finished rows, all-finished flags, the static cache's next
inputs), and hand inputs they do not take to those ops."""
import pytest
import torch

from accelc.kernels import greedy
from conftest import DEVICE


def _pick_ref(token, finished, eos, pad, out, done, i):
    if eos is not None:
        token.copy_(torch.where(finished, pad, token))
        finished |= torch.isin(token, eos)
        done[i] = finished.all()
    out[:, i] = token


@pytest.mark.parametrize("B", [1, 3, 20])
@pytest.mark.parametrize("eos", [None, [3], [3, 1, 1000]])       # 1000: a stop id past the vocabulary
def test_pick_matches_the_pytorch_it_replaces_over_steps(B, eos):
    gen = torch.Generator().manual_seed(B)
    steps = 12
    eos_t = None if eos is None else torch.tensor(eos, device=DEVICE)
    state = {k: (torch.zeros(B, dtype=torch.bool, device=DEVICE), torch.full((B, steps), -5, device=DEVICE),
                 torch.zeros(steps, dtype=torch.bool, device=DEVICE)) for k in ("kernel", "ref")}
    if B > 1:                                  # a row finished before the first step
        state["kernel"][0][B // 2] = True
        state["ref"][0][B // 2] = True
    saw_stop = False
    for i in range(steps):
        token = torch.randint(0, 4, (B,), generator=gen).to(DEVICE)    # small ids: stop tokens come up
        got, want = token.clone(), token.clone()
        greedy.pick(got, *state["kernel"][:1], eos_t, 0, state["kernel"][1], state["kernel"][2], i)
        _pick_ref(want, state["ref"][0], eos_t, 0, state["ref"][1], state["ref"][2], i)
        assert torch.equal(got, want), i
        saw_stop |= eos is not None and bool(torch.isin(token, eos_t).any())
        for a, b in zip(state["kernel"], state["ref"]):
            assert torch.equal(a, b), i
    assert eos is None or saw_stop          # the case met a stop token
    if eos is not None:
        assert state["kernel"][2].any() or B > 3        # all finished at some step, where rows are few


def test_pick_takes_an_output_it_cannot_write_through_pytorch():
    B, steps = 3, 4
    token = torch.tensor([7, 1, 2], device=DEVICE)
    eos = torch.tensor([7], device=DEVICE)
    finished = torch.zeros(B, dtype=torch.bool, device=DEVICE)
    out = torch.full((steps, B), -1, device=DEVICE).t()       # columns strided: not the kernel's
    done = torch.zeros(steps, dtype=torch.bool, device=DEVICE)
    greedy.pick(token, finished, eos, 0, out, done, 1)
    assert out[:, 1].tolist() == [7, 1, 2] and finished.tolist() == [True, False, False] and not done[1]


@pytest.mark.parametrize("B", [1, 5])
def test_static_inputs_writes_what_the_loop_wrote_before(B):
    L, n = 24, 6
    token = torch.randint(0, 50, (B,), device=DEVICE)
    count = torch.randint(1, n + 1, (B,), device=DEVICE)
    keys = torch.zeros(B, L, dtype=torch.long, device=DEVICE)
    keys[:, :n] = 1
    ids = torch.full((B, 1), -1, device=DEVICE)
    positions = torch.full((B, 1), -1, device=DEVICE)
    start = torch.tensor(0, device=DEVICE)
    want_keys = keys.clone()
    for i in range(3):
        greedy.static_inputs(token + i, ids, keys, positions, count, start, n + i, i)
        want_keys[:, n + i] = 1
        assert torch.equal(ids[:, 0], token + i)
        assert torch.equal(keys, want_keys)
        assert torch.equal(positions[:, 0], count + i)
        assert start.item() == n + i


def test_the_loops_kernels_are_one_binary_for_every_step_and_call():
    """The integers that change from step to step (the step index, the cache column) and from call to call (the
    rows, the stop tokens, the pad, the output's width) are not specialized: Triton tells 1, multiples of 16 and
    other integers apart, and the loop's first steps compiled _pick_kernel four times and _inputs_kernel three
    (1.7 s of a cold LM optimize's first generate on the GPU host). Read from the kernels as Triton builds them
    (a process without the interpreter)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import importlib.util, json, sys\n"
            "spec = importlib.util.spec_from_file_location('greedy_jit', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(json.dumps({k.fn.__name__: [p.name for p in k.params if p.do_not_specialize]\n"
            "                  for k in (m._pick_kernel, m._inputs_kernel)}))")
    out = subprocess.run([sys.executable, "-c", code, greedy.__file__], capture_output=True, text=True, check=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}).stdout
    unspecialized = json.loads(out.strip().splitlines()[-1])
    assert {"B", "E", "pad", "i", "out_stride"} <= set(unspecialized["_pick_kernel"]), unspecialized
    assert {"B", "column", "i", "keys_stride"} <= set(unspecialized["_inputs_kernel"]), unspecialized


LOOP_AHEAD_SCRIPT = r"""
import torch
from accelc import compile_workers, runtime
from accelc.kernels import greedy
from accelc.kernels.argmax import argmax_rows
runtime.can_run_on = lambda device: True       # (CPU tensors stand in for the GPU's: nothing launches here)
handed = []
compile_workers.active = lambda: True
compile_workers.submit = lambda jobs: handed.append(jobs) or "pending"
B, V, long = 3, 1000, torch.int64
print("ahead", greedy.loop_ahead(torch.randn(B, V).half(), stops=2))
ahead = sorted(data for _, data in handed[0])
# what the loop itself launches: a step's logits (the last position of (B, 1, V)), two stop tokens, a cache of
# 96 columns, at step 5
with compile_workers.handing_over() as found:
    logits = torch.randn(B, 1, V).half()[:, -1]
    token = argmax_rows(logits)
    greedy.pick(token, torch.zeros(B, dtype=torch.bool), torch.tensor([7, 9]), 0, torch.empty(B, 40, dtype=long),
                torch.zeros(40, dtype=torch.bool), 5)
    greedy.static_inputs(token, torch.empty(B, 1, dtype=long), torch.zeros(B, 96, dtype=long),
                         torch.empty(B, 1, dtype=long), torch.full((B,), 11), torch.zeros((), dtype=long), 17, 5)
loop = sorted(data for _, data in found)
print("kernels", sorted(name.rsplit(".", 1)[-1] for name, _ in handed[0]))
print("same", ahead == loop, len(ahead))
print("paged", sorted(n.rsplit(".", 1)[-1] for n, _ in (greedy.loop_ahead(torch.randn(B, V).half(), 0, static=False)
                                                        and handed[1])))
"""


def test_the_loops_kernels_are_handed_to_the_workers_at_the_specializations_the_loop_meets():
    """kernels/greedy.py loop_ahead (api.attach_generation, before the step's optimize): the greedy loop's kernels
    (the argmax's two, pick, static_inputs) collected on stand-in tensors of the generation's sizes are the very
    specializations the loop's own launches compile (a step's logits, the stop tokens, another cache width, step
    and column), handed to the workers in one batch; without stop tokens pick's other variant, and no
    static_inputs for a paged cache. Read from the kernels as Triton builds them (a process without the
    interpreter, sm90 through the stand-in driver)."""
    from conftest import run_for_sm90
    lines = run_for_sm90(LOOP_AHEAD_SCRIPT).strip().splitlines()
    assert lines[0] == "ahead pending", lines
    assert lines[1] == "kernels ['_chunk_kernel', '_inputs_kernel', '_pick_kernel', '_rows_kernel']", lines
    assert lines[2] == "same True 4", lines
    assert lines[3] == "paged ['_chunk_kernel', '_pick_kernel', '_rows_kernel']", lines


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_a_causal_lms_optimize_hands_its_loops_kernels_ahead_at_its_sizes(monkeypatch, kv_cache):
    """api.attach_generation (generation.loop_ahead) hands the loop's kernels over before the step's optimize, with the step's logits at
    capture (rows, vocabulary, dtype) and the model's stop tokens; the inputs' kernel only for a static cache."""
    import warnings

    import accelc
    T = pytest.importorskip("transformers")
    calls = []
    monkeypatch.setattr(greedy, "loop_ahead", lambda logits, stops, static=True: calls.append(
        (tuple(logits.shape), logits.dtype, stops, static)))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              num_key_value_heads=1, intermediate_size=64, vocab_size=100,
                                              max_position_embeddings=96, eos_token_id=[2, 5])).to(DEVICE).eval()
        ids = torch.randint(6, 100, (2, 6), device=DEVICE)
        opt = accelc.optimize(lm, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                              config=accelc.OptimizeConfig(kv_cache=kv_cache, passes=()))
    assert opt.step is not None, opt.info.generation
    assert calls == [((2, 100), torch.float32, 2, kv_cache == "static")], calls
