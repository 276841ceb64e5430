"""The optimized causal LM as a drop-in for HF's: generate() calls HF accepts (no length given, a
keyword at its default, more sequences than the cache holds, seeded sampling of fewer rows), copies,
dtype conversions, a saved program, and several threads generating at once. Tiny Llama, CPU, fp32."""
import copy
import threading
import warnings

import pytest
import torch

import accelc
from accelc.errors import InputError
from conftest import DEVICE

T = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                num_key_value_heads=1, intermediate_size=64, vocab_size=100,
                                                max_position_embeddings=48)).to(DEVICE).eval()


@pytest.fixture(scope="module")
def lm_and_opt():
    lm = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = torch.randint(3, 100, (2, 6), device=DEVICE)
        opt = accelc.optimize(lm, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert opt.step is not None, opt.info.generation
    return lm, opt


def _ids(b, n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (b, n), generator=g).to(DEVICE)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_no_length_given_generates_hfs_default(lm_and_opt):
    lm, opt = lm_and_opt
    p = _ids(2)
    out, ref = _quiet(opt.generate, **p), _quiet(lm.generate, **p)
    assert out.shape == ref.shape == (2, 6 + 20) and torch.equal(out, ref)


def test_keywords_at_their_defaults_are_taken(lm_and_opt):
    lm, opt = lm_and_opt
    p = _ids(2)
    out = _quiet(opt.generate, **p, max_new_tokens=4, past_key_values=None)
    assert torch.equal(out, _quiet(lm.generate, **p, max_new_tokens=4))
    with torch.no_grad():     # a forward keyword left out of the example, given at its default
        got, ref = opt(**p, position_ids=None).logits, lm(**p).logits
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_seeded_sampling_of_fewer_rows_than_the_cache_gives_hfs_tokens(lm_and_opt):
    lm, opt = lm_and_opt
    p = _ids(1)
    torch.manual_seed(5)
    out = _quiet(opt.generate, **p, max_new_tokens=8, do_sample=True, top_k=0)
    torch.manual_seed(5)
    assert torch.equal(out, _quiet(lm.generate, **p, max_new_tokens=8, do_sample=True, top_k=0))
    assert opt.last_loop == "hf"


def test_deep_copy_generates_and_leaves_the_original_alone(lm_and_opt):
    lm, opt = lm_and_opt
    p = _ids(2, seed=3)
    twin = copy.deepcopy(opt)
    ref = _quiet(lm.generate, **p, max_new_tokens=5)
    assert torch.equal(_quiet(twin.generate, **p, max_new_tokens=5), ref)
    assert torch.equal(_quiet(opt.generate, **p, max_new_tokens=5), ref)


def test_half_after_optimize_is_one_line_naming_the_fix(lm_and_opt):
    _, opt = lm_and_opt
    with pytest.raises(InputError, match=r"optimized in float32.*optimize the model in float16 instead"):
        copy.deepcopy(opt).half()


def test_a_saved_program_returns_the_models_output_and_says_it_does_not_generate(lm_and_opt, tmp_path):
    """Its forward gives back what the model returns (the HF output with its cache, as the optimized module does;
    it had come back as a flat tuple of tensors), from the file and from a pickled copy of the loaded program."""
    import pickle
    lm, opt = lm_and_opt
    _quiet(accelc.save, opt, tmp_path / "lm.pt2")
    loaded = accelc.load(tmp_path / "lm.pt2")
    copy_of = pickle.loads(pickle.dumps(loaded))
    for ins in (_ids(2), _ids(1, n=9)):      # the example's shape and another batch and length
        with torch.no_grad():
            want, got, again = opt(**ins), loaded(**ins), copy_of(**ins)
        _same_output(want, got, again)
    with pytest.raises(InputError, match="holds the model's forward only"):
        loaded.generate(**_ids(2))


def _same_output(want, *outs):
    for out in outs:
        assert type(out) is type(want) and list(out.keys()) == list(want.keys()), (type(out), list(want.keys()))
        torch.testing.assert_close(out.logits, want.logits)
        cache, ref = out[list(want.keys())[-1]], want[list(want.keys())[-1]]
        assert type(cache) is type(ref) and len(cache.layers) == len(ref.layers)
        for a, b in zip(cache.layers, ref.layers):
            torch.testing.assert_close((a.keys, a.values), (b.keys, b.values))


def test_two_threads_generating_at_once_get_their_own_tokens(lm_and_opt):
    """Both loops (accelc's greedy one, HF's: a streamer asked) from four threads over one cache."""
    lm, opt = lm_and_opt
    prompts = [_ids(2, seed=10 + i) for i in range(4)]
    refs = [_quiet(lm.generate, **p, max_new_tokens=6) for p in prompts]
    outs, errors = [None] * 4, []

    def run(i):
        try:
            outs[i] = _quiet(opt.generate, **prompts[i], max_new_tokens=6, **({"streamer": None} if i % 2 else {}))
        except Exception as e:     # collected: a thread's exception would not fail the test
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(torch.equal(o, r) for o, r in zip(outs, refs))


def test_more_sequences_than_the_cache_holds_grow_it_with_one_warning(monkeypatch):
    from accelc import api

    released = []    # optimize gives the device memory its checks used back once (the step's inside the forward's)
    monkeypatch.setattr(api, "release_cached_memory", lambda device: released.append(device))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100,
                                            n_positions=32)).to(DEVICE).eval()
        opt = accelc.optimize(lm, _ids(1))
    assert opt.step is not None and len(released) == 1
    p = _ids(3, seed=4)
    with pytest.warns(UserWarning, match=r"generate\(\) of 3 sequences, past the 1 the cache held: the step program "
                                         r"was optimized again for 3 \(\d+\.\d s\)"):
        out = opt.generate(**p, max_new_tokens=5)
    assert torch.equal(out, _quiet(lm.generate, **p, max_new_tokens=5))
    assert "static KV cache for 3 sequence(s)" in opt.summary()
    assert len(released) == 2       # the step optimized again, alone: its own release


def test_an_optimized_inner_model_under_hfs_generate_points_to_opt_generate():
    lm = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = _ids(2)
        lm.model = accelc.optimize(lm.model, {"input_ids": p["input_ids"]})
        with pytest.raises(InputError, match=r"'(past_key_values|cache)'.*optimize the causal LM itself.*opt\.generate"):
            lm.generate(**p, max_new_tokens=3)


def test_generate_from_embeddings_runs_the_original_and_says_so():
    """generate(inputs_embeds=...) was refused (input_ids required) where HF generates from embeddings."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                          max_position_embeddings=64)).to(DEVICE).eval()
    ids = torch.randint(0, 100, (1, 6), device=DEVICE)
    opt = accelc.optimize(lm, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    embeds = lm.get_input_embeddings()(ids)
    with pytest.warns(UserWarning, match="runs the original model \\(inputs_embeds"):
        got = opt.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(got, lm.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, pad_token_id=0))
