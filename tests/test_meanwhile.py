"""accelc/meanwhile.py: work offered to the main thread's waits for the compile workers is done once, in the first
such wait or where its result is asked for, in the offering thread, its exception raised where the result is used;
a causal LM's generation step is captured in its forward's first wait, the forward's warm-up done in the step's, and
it generates the same tokens. (CPU: a wait made by a compile worker that sleeps.)"""
import threading
import time
import uuid
import warnings

import pytest
import torch

import accelc
from accelc import api, compile_workers, guard, layer_compiles, meanwhile, runtime, warmup
from accelc.errors import InputError
from conftest import DEVICE


class _SlowWorker:
    """A compile worker whose compile takes a moment and makes nothing (no record is written)."""

    def compile(self, job):
        time.sleep(0.3)
        return False

    def ended(self):
        return ""


def _a_wait(fill: bool = True) -> int:
    """A wait for the compile workers, as the guard's first (fill): one job in a (slow) worker."""
    return compile_workers.Pending([("test.kernel", f"test-{uuid.uuid4()}", {})], [_SlowWorker()]).wait(fill=fill)


def test_offered_work_runs_once_in_the_first_wait():
    calls = []
    with meanwhile.offered(lambda: calls.append(1) or 42, "test") as work:
        _a_wait()
        assert calls == [1] and work.ran_early
        _a_wait()                                  # (not again)
        assert work.result() == 42 and calls == [1]


def test_work_no_wait_took_runs_at_result():
    calls = []
    with meanwhile.offered(lambda: calls.append(1) or "v", "test") as work:
        compile_workers.Pending([], []).wait(fill=True)     # nothing in flight: not a wait
        _a_wait(fill=False)                                 # a wait inside a tuner's or Triton's hooks
        assert calls == []
        assert work.result() == "v" and calls == [1] and not work.ran_early
        _a_wait()
    assert calls == [1]


def test_the_works_exception_is_raised_where_its_result_is_used():
    def fails():
        raise InputError("the cache holds no token beyond the example's")

    with meanwhile.offered(fails, "test") as work:
        _a_wait()                                  # the wait itself goes on
        with pytest.raises(InputError, match="holds no token"):
            work.result()


def test_work_is_withdrawn_when_its_block_ends_first():
    calls = []
    with pytest.raises(RuntimeError):
        with meanwhile.offered(lambda: calls.append(1), "test"):
            raise RuntimeError("the optimize failed before any wait")
    _a_wait()
    assert calls == [] and meanwhile._offered == []


def test_work_is_done_only_in_the_thread_that_offered_it():
    calls = []
    with meanwhile.offered(lambda: calls.append(threading.current_thread()), "test") as work:
        other = threading.Thread(target=_a_wait)
        other.start()
        other.join()
        assert calls == []
        work.result()
    assert calls == [threading.current_thread()]


def test_not_enabled_offers_nothing():
    with meanwhile.offered(lambda: 1, "test", enabled=False) as work:
        assert work is None and meanwhile._offered == []


T = pytest.importorskip("transformers")


def _lm():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=64, vocab_size=100, max_position_embeddings=96)
        return T.LlamaForCausalLM(cfg).to(DEVICE).eval()


def _optimize(lm, ids, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelc.optimize(lm, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                               config=accelc.OptimizeConfig(**config))


def _events(monkeypatch, waits: bool) -> list:
    """The captures, the guard's ends and the warm-ups of the example in their order; with waits, each guard's
    first check waits for a worker (a warm-up does nothing on the CPU: its call is what is recorded); without,
    no wait does the offered work, on the GPU either (where the guard's first hand-over is a real wait)."""
    events = []
    capture_job, settle, ahead, example = api.capture_job, guard.settle, layer_compiles.candidates_ahead, warmup.example

    def captured(job):
        events.append(f"capture {type(job.model).__name__}")
        return capture_job(job)

    def warmed(opt, *args):
        events.append(f"warm-up {type(opt).__name__}")
        return example(opt, *args)

    def settled(gm, ctx):
        out = settle(gm, ctx)
        events.append("guard done")
        return out

    def waiting(gm, args, only, fill=False):
        ahead(gm, args, only, fill=fill)
        _a_wait(fill=fill)

    def not_filling(gm, args, only, fill=False):
        ahead(gm, args, only, fill=False)

    monkeypatch.setattr(api, "capture_job", captured)
    monkeypatch.setattr(warmup, "example", warmed)
    monkeypatch.setattr(guard, "settle", settled)
    monkeypatch.setattr(layer_compiles, "candidates_ahead", waiting if waits else not_filling)
    return events


def _step_warm_up() -> list:
    """The generation step's own warm-up (warmup.example after its guard), where CUDA graphs run: on the CPU
    warmup.run returns before it (the forward's is called in the step's wait on both)."""
    return ["warm-up OptimizedModule"] if runtime.can_time(torch.device(DEVICE)) else []


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_a_causal_lms_step_is_captured_in_its_forwards_first_wait(monkeypatch, kv_cache):
    lm = _lm()
    ids = torch.randint(1, 100, (1, 6), device=DEVICE)
    events = _events(monkeypatch, waits=True)
    # (the paged step's layers as PyTorch: its cache is what differs here; test_paged_generation runs its kernels)
    opt = _optimize(lm, ids, kv_cache=kv_cache, **({"passes": ()} if kv_cache == "paged" else {}))
    step = {"static": "CacheStep", "paged": "PagedStep"}[kv_cache]
    assert events == ["capture LlamaForCausalLM", f"capture {step}", "guard done", "warm-up OptimizedLM",
                      "guard done", *_step_warm_up()]
    assert "capture (during the forward's compiles)" in opt.step.info.seconds, opt.step.info.seconds
    with torch.no_grad():
        want = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(opt.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8), want)
    assert meanwhile._offered == []


def test_without_a_wait_the_step_is_captured_after_the_forward(monkeypatch):
    events = _events(monkeypatch, waits=False)
    opt = _optimize(_lm(), torch.randint(1, 100, (1, 6), device=DEVICE))
    assert events == ["capture LlamaForCausalLM", "guard done", "capture CacheStep", "guard done",
                      *_step_warm_up(), "warm-up OptimizedLM"]
    assert "capture" in opt.step.info.seconds


@pytest.mark.parametrize("waits", [True, False])
def test_a_step_that_fails_early_is_said_as_before(monkeypatch, waits):
    """The step's failure (a cache too small for the example) met in the forward's wait: the forward optimizes,
    generate() falls back, the summary names the cause, as when it is met after the forward."""
    _events(monkeypatch, waits=waits)
    opt = _optimize(_lm(), torch.randint(1, 100, (1, 6), device=DEVICE), max_cache_len=4)
    assert opt.step is None
    assert "max_cache_len 4 holds no token beyond the example's 6" in opt.info.generation


def test_an_lm_whose_step_was_captured_early_serves_other_batches_and_lengths(monkeypatch):
    """The early path's program at shapes other than its example's: a forward at another batch and length gives the
    model's logits, generate() on a left-padded batch of two gives the model's greedy tokens."""
    lm = _lm()
    _events(monkeypatch, waits=True)
    opt = _optimize(lm, torch.randint(1, 100, (1, 6), device=DEVICE), max_batch_size=2)
    assert "capture (during the forward's compiles)" in opt.step.info.seconds
    ids = torch.randint(1, 100, (2, 9), device=DEVICE)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0                    # a tokenizer's left padding
    with torch.no_grad():
        got, want = opt(input_ids=ids, attention_mask=mask), lm(input_ids=ids, attention_mask=mask)
        got = got.logits if hasattr(got, "logits") else got[0]
        assert torch.allclose(got[1], want.logits[1], atol=1e-4, rtol=1e-4)
        tokens = lm.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(opt.generate(ids, attention_mask=mask, max_new_tokens=6), tokens)
