"""accelc/generation.py: an optimized causal LM generates with HF's generate semantics over accelc's
static KV cache and one optimized step program: the same tokens as the original model (greedy and
sampled, left-padded prompts), its features (stop tokens, streamers, fewer rows than the cache),
what it cannot serve falls back with the reason, and requests past the cache fail in one line.
(CPU, fp32, tiny configs of the decoder families users bring.)"""
import warnings

import pytest
import torch

import accelc
from accelc import meta, runtime
from accelc.errors import InputError
from accelc.numerics import rel_l2
from conftest import DEVICE

T = pytest.importorskip("transformers")
SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
             max_position_embeddings=96)


def _families():
    return {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=1)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, num_key_value_heads=1)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, num_key_value_heads=1)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**SMALL, num_key_value_heads=1, pad_token_id=0)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=16)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100,
                                                       n_positions=96)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**SMALL)),
    }


FAMILIES = _families()


def _lm(name):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FAMILIES[name]().to(DEVICE).eval()


def _prompt(b, n, left_pad=()):
    ids = torch.randint(1, 100, (b, n), device=DEVICE)
    mask = torch.ones(b, n, dtype=torch.long, device=DEVICE)
    for row, k in enumerate(left_pad):       # a tokenizer's left padding, as for generation
        mask[row, :k] = 0
        ids[row, :k] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _optimize(lm, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelc.optimize(lm, _prompt(2, 6, left_pad=(0, 2)), config=accelc.OptimizeConfig(**config))


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_generates_the_original_models_tokens(name, kv_cache):
    lm = _lm(name)
    # the paged rows test the cache and its attention in each family, the static rows the step's layers
    # in accelc's kernels too (with every pass over the paged cache's step: test_paged_generation)
    opt = _optimize(lm, kv_cache=kv_cache, **({"passes": ()} if kv_cache == "paged" else {}))
    assert isinstance(opt, accelc.generation.OptimizedLM) and opt.step is not None, opt.info.generation
    summary = {"static": "generation: static KV cache for 2 sequence(s) of 96 tokens",
               "paged": "generation: paged KV cache of 12 blocks of 16 tokens"}
    assert summary[kv_cache] in opt.summary()
    # grouped-query attention reads the cache's K/V heads as they are: no copy of the cache per query head
    # (the paged cache's pool: (blocks, page, Hkv, D))
    cfg = lm.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    op, kv_dim = {"static": (torch.ops.accelc.flash_attention.default, 1),
                  "paged": (torch.ops.accelc.paged_attention.default, 2)}[kv_cache]
    attention = [n for n in opt.step.graph_module.graph.nodes if n.target is op]
    assert attention and all(meta.tensor_meta(n.args[1 + 2 * (kv_cache == "paged")]).shape[kv_dim] == kv_heads
                             for n in attention)
    if kv_cache == "static":
        # a layer writes its keys and values once: one index_copy_, or in the kernel of its q / k / v projection
        # and rotations (accelc::qkv_rotary, where the model rotates them as Llama does), and the cache's one
        # length is set once a step (accelc.static_cache)
        nodes = list(opt.step.graph_module.graph.nodes)
        writes = [n for n in nodes if n.target in (torch.ops.aten.index_copy_.default,
                                                   torch.ops.accelc.qkv_rotary.default)]
        sets = [n for n in nodes if n.target is torch.ops.aten.copy_.default]
        assert len(writes) == len(opt.cache_step.cache.layers) and len(sets) == 1, (writes, sets)
    prompt = _prompt(2, 9, left_pad=(3, 0))
    with torch.no_grad():   # 41 tokens: the paged cache's pages of 16 crossed twice
        want = lm.generate(**prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)
        got = opt.generate(**prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert got.shape == (2, 41) and torch.equal(got, want)
        # the step's cache writes are replayable: its runner may use CUDA graphs and Inductor (a runner made
        # before the mark was set, by optimize's own calls, ran decode as eager plain calls on the GPU)
        assert "updates module state in place" not in opt.step.info.runtime, opt.step.info.runtime
        # HF's sampling loop over the step: a few tokens, each an interpreted attention kernel
        sampling = dict(max_new_tokens=8, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, pad_token_id=0)
        torch.manual_seed(5)
        want = lm.generate(**prompt, **sampling)
        torch.manual_seed(5)
        assert torch.equal(opt.generate(**prompt, **sampling), want)


@pytest.fixture(scope="module")
def llama():
    lm = _lm("llama")
    return lm, _optimize(lm)


def test_stop_tokens_streamers_and_fewer_rows_than_the_cache(llama):
    lm, opt = llama
    prompt = _prompt(1, 7)
    with torch.no_grad():
        free = lm.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        eos = int(free[0, 7 + 4])                   # a token the model generates: a stop token
        want = lm.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos)

        class Collect:
            def __init__(self):
                self.seen = []

            def put(self, value):
                self.seen.append(value.tolist())

            def end(self):
                self.seen.append("end")
        streamer = Collect()
        got = opt.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos,
                           streamer=streamer)
    assert torch.equal(got, want) and got.shape[1] < 7 + 12      # one row of the cache's two, stopped early
    assert streamer.seen[-1] == "end" and sum(len(v) if isinstance(v[0], int) else len(v[0])
                                              for v in streamer.seen[:-1]) == got.shape[1]


def test_what_the_step_cannot_serve_falls_back_with_the_reason(llama):
    lm, opt = llama
    prompt = _prompt(2, 5)
    with torch.no_grad():
        want = lm.generate(**prompt, max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
        with pytest.warns(UserWarning, match=r"runs the original model \(num_beams=2 is not served"):
            got = opt.generate(**prompt, max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_logits_and_scores_come_back_from_the_step_program(llama):
    """return_dict_in_generate with output_logits / output_scores (what a user reads the first token's
    logits from, and bench/generate.py compares against fp32): served by HF's loop over the step
    program, not the original model, for one row of the cache's two; the original's values in fp32."""
    lm, opt = llama
    prompt = _prompt(1, 7)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
              output_scores=True)
    with torch.no_grad():
        want = lm.generate(**prompt, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")       # no fallback to the original model
            got = opt.generate(**prompt, **kw)
    assert opt.last_loop == "hf" and torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(got.scores) == 5 and got.logits[0].shape == want.logits[0].shape == (1, 100)
    assert all(rel_l2(g, w) < 1e-4 for g, w in zip(got.logits, want.logits))       # the guard's fp32 tolerance
    assert all(rel_l2(g, w) < 1e-4 for g, w in zip(got.scores, want.scores))


def test_requests_past_the_cache_are_one_line(llama):
    _, opt = llama
    with pytest.raises(InputError, match=r"prompt 40 \+ 60 new tokens = 100 positions, past the 96"):
        opt.generate(**_prompt(1, 40), max_new_tokens=60)
    with pytest.raises(InputError, match="takes input_ids"):
        opt.generate()


def test_cache_size_from_the_config_and_the_forward_unchanged():
    lm = _lm("gpt2")
    opt = _optimize(lm, max_cache_len=32, max_batch_size=3)
    assert "static KV cache for 3 sequence(s) of 32 tokens" in opt.summary()
    prompt = _prompt(3, 4, left_pad=(0, 1, 3))
    with torch.no_grad():
        want = lm.generate(**prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert torch.equal(opt.generate(**prompt, max_new_tokens=20, do_sample=False, pad_token_id=0), want)
        logits = opt(**prompt).logits           # the optimized forward: logits of every token
        assert torch.allclose(logits, lm(**prompt).logits, atol=1e-4)
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        accelc.OptimizeConfig(max_cache_len=0)


def test_a_model_that_is_no_causal_lm_gets_no_generate():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = T.BertModel(T.BertConfig(**SMALL)).to(DEVICE).eval()
        opt = accelc.optimize(bert, _prompt(2, 6))
    assert not isinstance(opt, accelc.generation.OptimizedLM) and not hasattr(opt, "generate")


def test_greedy_runs_accelcs_loop_with_stop_tokens_min_tokens_and_ragged_stops():
    """Greedy decoding without streamers or processors takes accelc's loop (no host sync per
    token): rows stopping at different steps get HF's padding, the output ends where HF's does
    (also when the stop falls inside a chunk of STOP_CHECK_EVERY tokens), min_new_tokens holds
    the stop tokens back; sampling and streamers keep HF's loop. The loop's concern: its step
    program without rewrites (the steps' kernels: the family tests; 250 interpreted steps took
    100 s of CI)."""
    lm = _lm("llama")
    opt = _optimize(lm, passes=())
    prompt = _prompt(2, 7, left_pad=(2, 0))
    with torch.no_grad():
        free = lm.generate(**prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
        cases = [dict(eos_token_id=int(free[0, 7 + 3])),                       # row 0 stops early
                 dict(eos_token_id=[int(free[0, 7 + 20]), int(free[1, 7 + 5])]),
                 dict(eos_token_id=int(free[0, 7 + 3]), min_new_tokens=10),
                 dict(eos_token_id=int(free[1, 7 + 17]), pad_token_id=5),
                 # a stop id past the vocabulary (GPT-2's 50256 in a small config) is never produced
                 # and bans nothing (indexing the scores with it: a device-side assert on a GPU)
                 dict(eos_token_id=[int(free[0, 7 + 3]), 50256], min_new_tokens=10),
                 dict()]
        lengths = []
        for case in cases:
            kw = dict(max_new_tokens=40, do_sample=False, **{"pad_token_id": 0, **case})
            want = lm.generate(**prompt, **kw)
            got = opt.generate(**prompt, **kw)
            assert opt.last_loop == "accelc" and torch.equal(got, want), case
            lengths.append(got.shape[1])
        assert min(lengths) < 7 + 40 and lengths[-1] == 7 + 40 and (got[:, 7:] != want[:, 7:]).sum() == 0
        assert any(n % 16 for n in (x - 7 for x in lengths[:-1]) if n < 40)   # a stop inside a chunk
        opt.generate(**prompt, max_new_tokens=4, do_sample=True, pad_token_id=0)
        assert opt.last_loop == "hf"
        opt.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, repetition_penalty=1.3)
        assert opt.last_loop == "hf"
    assert "greedy decoding runs accelc's own loop" in opt.summary()


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_the_step_replayed_as_a_graph_gives_the_same_tokens(monkeypatch, kv_cache):
    """Where CUDA graphs run (a stand-in here: a "graph" that re-runs the step on the buffers it was
    captured with, as a replay does), the step's cache writes replay: greedy and sampled tokens stay
    the original model's, and decode steps are replays of one captured graph."""
    from accelc import runner
    from test_runner import FakeGraph

    graphs = []

    def capture(fn, args, kwargs, pool=None, arena=None):
        graphs.append(FakeGraph(fn, args, kwargs))
        return graphs[-1], graphs[-1].outputs, pool, None
    monkeypatch.setattr(runner, "plan", lambda config, device, gm=None: ("eager", True, "test: CUDA graphs"))
    monkeypatch.setattr(runner, "capture_cuda_graph", capture)
    lm = _lm("llama")
    opt = _optimize(lm, kv_cache=kv_cache, **({"passes": ()} if kv_cache == "paged" else {}))   # the cache's concern
    prompt = _prompt(2, 9, left_pad=(3, 0))
    with torch.no_grad():
        want = lm.generate(**prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        got = opt.generate(**prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
        torch.manual_seed(3)
        want = lm.generate(**prompt, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0)
        torch.manual_seed(3)
        got = opt.generate(**prompt, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0)
        assert torch.equal(got, want)
    keys = [[tuple(leaf[0]) for leaf in key if isinstance(leaf, tuple)] for key in opt.step.runner.entries]
    assert opt.step.runner.captures >= 1 and max(g.replays for g in graphs) >= 24, \
        (opt.step.runner.status(), [g.replays for g in graphs], keys)


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_tensors_copied_by_to_or_a_pickle_keep_the_cache_and_the_step_one(kv_cache):
    """HF's loop reads the cache's length, which the step graph sets: a copy of the graph's tensors
    (.to() another device, a pickle read back) must not leave the cache reading the old tensor (its
    position would stay at the prompt's end: silently wrong tokens)."""
    import pickle
    lm = _lm("llama")
    opt = _optimize(lm, kv_cache=kv_cache, **({"passes": ()} if kv_cache == "paged" else {}))   # the cache's concern
    prompt = _prompt(2, 9, left_pad=(3, 0))
    sampling = dict(max_new_tokens=12, do_sample=True, top_k=20, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(3)
        want = lm.generate(**prompt, **sampling)
        moved = opt._apply(lambda t: t.clone())            # what .to(another device) does to every tensor
        for copy_ in (moved, pickle.loads(pickle.dumps(opt)), _pickled_before_parts(opt)):
            # the cache's keys, values and lengths are the step graph's: no stale copy kept alive
            graph = {id(t) for t in copy_.step.graph_module.buffers()}
            layers = copy_.cache_step.cache.layers
            held = [getattr(layer, "kv", None) for layer in layers] if kv_cache == "static" else []
            held = [t for t in held if t is not None] or [getattr(x, a) for x in layers for a in ("keys", "values")]
            assert all(id(t) in graph for t in held + list(copy_.cache_step._buffers.values()))
            # the static layers' keys and values are views of their kv: of the graph's, not of a stale copy
            assert all(x.keys.data_ptr() == x.kv.data_ptr() for x in layers if getattr(x, "kv", None) is not None)
            torch.manual_seed(3)
            assert torch.equal(copy_.generate(**prompt, **sampling), want)
            assert torch.equal(copy_.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0),
                               lm.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0))


def _pickled_before_parts(opt):
    """opt read back from a pickle made before GenerationParts: original, cache_step and build_step as
    attributes of their own."""
    import pickle

    state = pickle.loads(pickle.dumps(opt)).__getstate__()
    parts = state.pop("parts")
    state.pop("cache_tensors")
    state.update(original=parts.original, cache_step=parts.cache_step, build_step=parts.build_step,
                 cache_tensors=opt.cache_tensors)
    back = type(opt).__new__(type(opt))
    back.__setstate__(state)
    return back


def test_the_step_races_its_layers_on_a_decode_steps_inputs(monkeypatch):
    """The speed race (GPU) decides per layer between accelc's kernel and PyTorch; the step program
    serves one prompt and then one token a sequence per step, so its race is timed on a decode
    step's inputs (a kernel that loses at the prompt's rows may win at one); the model's own
    program races on its example. The decode inputs continue the example's prompt."""
    from accelc import guard

    raced = []
    real = guard._keep_the_faster

    def record(gm, ctx, v):
        inputs, words = guard.race_inputs(ctx)
        raced.append((tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)), words, inputs))
        return real(gm, ctx, v)
    monkeypatch.setattr(guard, "_keep_the_faster", record)
    lm = _lm("llama")
    _optimize(lm, max_cache_len=32)
    (model_shapes, model_words, _), (step_shapes, step_words, (ids, keys, positions, start)) = raced
    assert model_words == "the example inputs" and model_shapes == ((2, 6), (2, 6))
    assert step_words.startswith("a decode step's inputs") and step_shapes == ((2, 1), (2, 32), (2, 1), ())
    assert int(start) == 6 and keys[:, :7].tolist() == [[1] * 7, [0, 0, 1, 1, 1, 1, 1]] and not keys[:, 7:].any()
    assert positions[:, 0].tolist() == [6, 4]      # each row's next position: its real tokens so far


def test_hfs_loop_over_the_step_never_compiles_it_again(monkeypatch):
    """Over a static cache on a GPU, HF's generate compiles the forward itself (torch.compile with CUDA
    graphs); the shell it runs is accelc's compiled and replayed step, which Dynamo must not trace
    (on the GPU the decode steps bypassed the step's graphs). Asked to compile on every device here,
    HF's loop still calls the step, uncompiled."""
    from transformers.generation.configuration_utils import CompileConfig

    lm = _lm("llama")
    opt = _optimize(lm)
    config = CompileConfig()
    config._compile_all_devices = True
    opt.original.generation_config.compile_config = config     # (the model optimize copied)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called on the step's shell")
    monkeypatch.setattr(torch, "compile", refuse)
    calls = []
    real = opt.step.forward
    monkeypatch.setattr(opt.step, "forward", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    prompt = _prompt(2, 5)
    torch.manual_seed(1)
    with torch.no_grad():
        got = opt.generate(**prompt, max_new_tokens=6, do_sample=True, top_k=5, pad_token_id=0)
    assert got.shape == (2, 11) and opt.last_loop == "hf" and len(calls) == 6 and calls[-1] == (2, 1)


def test_the_summary_states_greedy_decodings_speed_where_optimize_measured_it():
    """On a GPU optimize times greedy generate() on the example prompt (first token, decode tokens/s)
    for the summary's generation line; here the same measurement is asked directly."""
    lm = _lm("llama")
    opt = _optimize(lm, max_cache_len=12)
    timed = runtime.can_time(DEVICE)
    assert ("measured at optimize" in opt.summary()) == timed      # the CPU: not timed at optimize
    if not timed:
        prompt = _prompt(2, 6, left_pad=(0, 2))
        opt.note_speed(prompt["input_ids"], prompt["attention_mask"])
    line = next(x for x in opt.summary().splitlines() if x.startswith("generation:"))
    assert line.count("measured at optimize") == 1
    assert "measured at optimize on the example prompt (2 x 6, greedy): first token" in line
    rate = float(line.rsplit("decode ", 1)[1].split(" tokens/s")[0])
    assert rate > 0


def test_optimize_warms_up_the_decode_step_too(monkeypatch):
    """On a GPU optimize captures the step program's graph for a decode step (the call a generation makes
    all but once), so that its glue is the one compiled for its shapes (regions.Glue.specialize), not the
    dynamic one; the step's example, a prefill at the example prompt's length (one length of many), is not
    warmed up: no static compile only prompts of exactly that length would use, its first call captures it on
    the dynamic glue. The model's own program warms up its example. Here the GPU's branch is taken with
    warm_up recorded."""
    import types

    from accelc import generation, warmup
    from accelc.optimized import OptimizedModule

    warmed = []
    shim = types.SimpleNamespace(**{k: getattr(runtime, k) for k in dir(runtime) if not k.startswith("__")})
    shim.can_time = lambda device: True          # the warm-up stage's view only: the guard does not time here
    monkeypatch.setattr(warmup, "runtime", shim)
    monkeypatch.setattr(OptimizedModule, "warm_up",
                        lambda self, inputs: warmed.append(tuple(tuple(t.shape) for t in inputs)))
    monkeypatch.setattr(generation.OptimizedLM, "note_speed", lambda self, ids, mask: None)
    _optimize(_lm("llama"), max_cache_len=32)
    # (in either order: the forward's warm-up is done in the step's first wait for the compile workers where one
    # comes, after the step's otherwise; accelc.meanwhile)
    assert sorted(warmed) == sorted([((2, 6), (2, 6)),                        # the model's program: its example
                                     ((2, 1), (2, 32), (2, 1), ())])          # the step: a decode step alone


def test_the_lms_summary_folds_the_step_program_into_its_differences():
    """The step program's layers that are the forward's (same kernel, same status) are one line, each other
    one a line naming both; its whole table stays in opt.step.summary()."""
    from accelc.step_summary import step_lines

    torch.manual_seed(0)
    lm = T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=1)).to(DEVICE).eval()
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    opt = accelc.optimize(lm, dict(input_ids=ids, attention_mask=torch.ones_like(ids)),
                          accelc.OptimizeConfig(passes=("linear_act",), only_if_faster=False))
    text = opt.summary()
    n = sum(r.status == "rewritten" for r in opt.step.layers)
    assert f"the step program: {n} of its {n} layers as the forward's (same kernel, same status)\n" in text, text
    assert text.count("layer  ") == 1 and "lm.model.layers.0" not in text
    fewer = [r for r in opt.layers if r.name != "lm_head"]        # a forward without the head: one difference
    lines = step_lines(fewer, opt.step)
    assert lines[0].endswith("the others:") and lines[1].startswith("  lm_head: rewritten accelc::linear; not in the forward")


def test_the_summary_speed_is_a_rate_or_not_given():
    """OptimizedLM.measure (the summary's decode speed at optimize): each count of tokens warmed up before it is
    timed, each timed twice and the faster kept (a 200 ms stall of one 1-token run, another process taking the
    CPU, once left a CPU test's summary without its rate), and a `new`-token generate no slower than a 1-token one
    gives no rate, not an absurd one (a sharded 8B shape's summary once said 32000000000 tokens/s)."""
    import time
    import types

    import torch

    from accelc.generation import OptimizedLM

    def fake(times):
        calls = []

        def generate(self, max_new_tokens, **kw):
            calls.append(max_new_tokens)
            time.sleep(times[len(calls) - 1])
        return types.SimpleNamespace(generate=types.MethodType(generate, object())), calls

    ids = torch.ones(1, 4, dtype=torch.long)
    # each count's first call stalls; then 10 ms and 30 ms, one 1-token run stalled 200 ms
    lm, calls = fake([0.05, 0.05, 0.01, 0.03, 0.2, 0.03])
    ttft, rate = OptimizedLM.measure(lm, ids, torch.ones_like(ids), new=5)
    assert calls == [1, 5, 1, 5, 1, 5] and 8 < ttft < 30 and 4 / 0.05 < rate < 4 / 0.01
    lm, _ = fake([0.0, 0.0, 0.03, 0.01, 0.03, 0.01])
    with pytest.raises(ValueError, match="5 tokens took"):
        OptimizedLM.measure(lm, ids, torch.ones_like(ids), new=5)
