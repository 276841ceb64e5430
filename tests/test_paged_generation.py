"""accelc/paged_cache.py: generate() over the paged KV cache (OptimizeConfig(kv_cache="paged")):
ragged prompts, long ones (the prompt path) and short ones, give the original model's tokens; a
sequence takes the blocks it needs and no more, so a pool smaller than batch x max_cache_len serves
what fits and refuses what does not in one line; fp16 steps run flash_decoding's paged kernel.
(The families' tokens through the paged cache: test_generation's family test.)"""
import warnings

import pytest
import torch

import accelc
from accelc.errors import InputError
from accelc.kernels import flash_decoding
from conftest import DEVICE
from test_generation import _lm, _prompt

T = pytest.importorskip("transformers")


def _optimize(lm, example, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelc.optimize(lm, example, config=accelc.OptimizeConfig(kv_cache="paged", **config))


def _ragged(b, n, pads, seed=1):
    torch.manual_seed(seed)
    return _prompt(b, n, left_pad=pads)


def test_long_ragged_prompts_and_a_small_pool():
    lm = _lm("llama")
    # a pool of 4 blocks of 16 tokens: less than the cache's 3 sequences x 96 positions (18 blocks)
    opt = _optimize(lm, _ragged(3, 6, (0, 2, 4)), max_batch_size=3, kv_cache_tokens=64)
    assert "paged KV cache of 4 blocks of 16 tokens" in opt.summary()
    # prompts of 20 and 9 real tokens (a step of more than 16 columns: the prompt path) + 12 new: 2 + 2 blocks
    prompt = _ragged(2, 20, (0, 11))
    with torch.no_grad():
        want = lm.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        got = opt.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert opt.last_loop == "accelc" and torch.equal(got, want)
        # HF's loop over the same cache (a logits processor asks for it)
        want = lm.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, repetition_penalty=1.3)
        got = opt.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, repetition_penalty=1.3)
        assert opt.last_loop == "hf" and torch.equal(got, want)
        # two rows of 21 + 12 tokens need 3 blocks each: refused in one line
        with pytest.raises(InputError, match=r"needs 6 blocks of 16 tokens, and the paged cache holds 4") as e:
            opt.generate(**_ragged(2, 21, (0, 0)), max_new_tokens=12, do_sample=False)
        assert "\n" not in str(e.value)
        # the cache is whole after a refusal: the first request again gives its tokens
        assert torch.equal(opt.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0),
                           lm.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0))


def test_fp16_steps_run_the_paged_kernel(monkeypatch):
    lm = _lm("llama").half()
    ref = _lm("llama")                      # fp32 weights, the same values
    calls = []
    real = flash_decoding.paged

    def spy(q, *args, **kwargs):
        calls.append(q.shape)
        return real(q, *args, **kwargs)
    monkeypatch.setattr(flash_decoding, "paged", spy)
    opt = _optimize(lm, _ragged(2, 6, (0, 2)), cuda_graphs=False)    # on a GPU: every step a call the spy sees
    prompt = _ragged(2, 7, (0, 3), seed=4)
    with torch.no_grad():
        got = opt(**prompt).logits.float()  # the optimized model itself: logits of every position, as the original's
        torch.testing.assert_close(got, ref(**prompt).logits, atol=2e-2, rtol=2e-2)
        calls.clear()
        tokens = opt.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    # the 7-token prompt and every decode step: the kernel over the cache
    assert [s[2] for s in calls] == [7] + [1] * 5, calls
    first = ref(**prompt).logits[:, -1].argmax(-1)
    margin = ref(**prompt).logits[:, -1].topk(2).values.diff().abs().squeeze(-1)
    assert all(t == f for t, f, m in zip(tokens[:, 7].tolist(), first.tolist(), margin.tolist()) if m > 0.05)


def test_rows_the_request_leaves_unused_take_no_block():
    lm = _lm("gpt2")
    # a pool of 3 blocks of 16 tokens: one sequence of 6 + 18 tokens takes 2; the cache has 4 rows
    opt = _optimize(lm, _ragged(1, 6, ()), max_batch_size=4, kv_cache_tokens=48, passes=())   # the cache's concern
    prompt = _ragged(1, 6, ())
    with torch.no_grad():
        want = lm.generate(**prompt, max_new_tokens=18, do_sample=False, pad_token_id=0)
        assert torch.equal(opt.generate(**prompt, max_new_tokens=18, do_sample=False, pad_token_id=0), want)
        with pytest.raises(InputError, match="needs 4 blocks of 16 tokens, and the paged cache holds 3"):
            opt.generate(**_ragged(2, 6, ()), max_new_tokens=18, do_sample=False)


def test_what_the_paged_cache_cannot_take_is_said():
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        accelc.OptimizeConfig(kv_cache="pages")
    for page in (12, 0, True):
        with pytest.raises(ValueError, match="kv_page_size must be a power of two"):
            accelc.OptimizeConfig(kv_page_size=page)
    with pytest.raises(ValueError, match="kv_cache_tokens must be a positive int"):
        accelc.OptimizeConfig(kv_cache_tokens=0)
    # a window shorter than the cache: generate() stays the original model's, with the reason
    torch.manual_seed(0)
    lm = T.MistralForCausalLM(T.MistralConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              num_key_value_heads=1, intermediate_size=64, vocab_size=100,
                                              max_position_embeddings=96, sliding_window=8)).to(DEVICE).eval()
    opt = _optimize(lm, _ragged(1, 6, ()))
    assert opt.step is None and "sliding window of 8 tokens" in opt.info.generation
