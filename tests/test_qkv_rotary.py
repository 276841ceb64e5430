"""kernels/qkv_rotary.py: a decoder layer's q / k / v projection, the rotation of q and k and the static cache's
write in one kernel (#89), against the same layer computed in fp64 from the same operands: the decode rows' GEMV
(with the RMSNorm before it taken in, a bias, grouped kv heads) and a prompt's GEMM path, the cache written at the
rows' positions and nowhere else."""
import pytest
import torch

from accelc.kernels import gemm
from accelc.kernels.qkv_rotary import qkv_rotary, qkv_rotary_ref, why_unsupported
from conftest import DEVICE, REL_FLOOR, rel_l2


def _operands(B, S, K, hq, hkv, D, dtype, bias, norm, start, max_len=16, cos_batch=1):
    N = (hq + 2 * hkv) * D
    x = torch.randn(B, S, K, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, device=DEVICE) / K ** 0.5).to(dtype)
    b = torch.randn(N, device=DEVICE).to(dtype) if bias else None
    angles = torch.rand(cos_batch, 1, S, D // 2, device=DEVICE) * 6
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache = torch.randn(2, B, hkv, max_len, D, device=DEVICE).to(dtype)
    positions = torch.arange(S, device=DEVICE) + start
    nw = (1 + 0.1 * torch.randn(K, device=DEVICE)).to(dtype) if norm else None
    return x, w, b, cos, sin, cache, positions, hq, hkv, nw, (1e-6 if norm else None)


@pytest.mark.parametrize("B, S, K, hq, hkv, D, dtype, bias, norm, start", [
    (1, 1, 64, 4, 2, 16, torch.float32, False, True, 5),      # a decode step: the GEMV
    (2, 1, 96, 4, 4, 8, torch.float16, True, False, 0),       # a bias (Qwen2), K past the block
    (1, 3, 64, 2, 1, 32, torch.bfloat16, False, True, 2),     # three rows of one sequence
    (2, 6, 32, 4, 2, 16, torch.float32, True, True, 0),       # a prompt: the GEMM, then the rotation kernel
])
def test_the_layer_and_its_cache_write_match_fp64(B, S, K, hq, hkv, D, dtype, bias, norm, start):
    ops = _operands(B, S, K, hq, hkv, D, dtype, bias, norm, start, cos_batch=B if bias else 1)
    cache = ops[5]
    before = cache.clone()
    up = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ops]
    q, kv = qkv_rotary(*ops)
    rq, rkv = qkv_rotary_ref(*up)
    assert q.shape == (B, hq, S, D) and kv.shape == (2, B, hkv, S, D) and q.dtype == kv.dtype == dtype
    floor = 4 * REL_FLOOR[dtype]
    assert rel_l2(q, rq) < floor and rel_l2(kv, rkv) < floor
    positions = ops[6]
    assert torch.equal(cache.index_select(3, positions), kv)          # written where the positions say
    others = torch.ones(cache.shape[3], dtype=torch.bool)
    others[positions.cpu()] = False
    assert torch.equal(cache[:, :, :, others.to(DEVICE)], before[:, :, :, others.to(DEVICE)])   # and nowhere else


@pytest.mark.parametrize("S, dtype", [(1, torch.float32), (1, torch.float16), (10, torch.bfloat16)])
def test_heads_normalized_before_their_rotation_match_fp64(S, dtype):
    """Qwen3's q_norm / k_norm: q's and k's heads RMS-normalized over D (their own weights), v's not."""
    ops = list(_operands(2, S, 64, 4, 2, 16, dtype, False, True, 3))
    ops += [(1 + 0.2 * torch.randn(16, device=DEVICE)).to(dtype), (1 + 0.2 * torch.randn(16, device=DEVICE)).to(dtype),
            1e-6]
    up = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ops]
    q, kv = qkv_rotary(*ops)
    rq, rkv = qkv_rotary_ref(*up)
    floor = 4 * REL_FLOOR[dtype]
    assert rel_l2(q, rq) < floor and rel_l2(kv, rkv) < floor
    assert torch.equal(ops[5].index_select(3, ops[6]), kv)
    plain = qkv_rotary_ref(*up[:-3])
    assert rel_l2(plain[0], rq) > 0.1       # (the norms change the result: the test sees them)
    bad = list(ops)
    bad[-2] = bad[-2][:8]
    assert "q's and k's (D,) weights" in why_unsupported(*bad)


def test_eager_rounding_is_no_closer_than_the_kernel():
    """The layer as the model runs it in fp16 (rounded at each step) is farther from fp64 than the kernel."""
    ops = _operands(1, 1, 128, 8, 2, 32, torch.float16, True, True, 3)
    q, kv = qkv_rotary(*ops)
    eager = qkv_rotary_ref(*[t.clone() if isinstance(t, torch.Tensor) else t for t in ops])
    ref = qkv_rotary_ref(*[t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ops])
    for got, e, r in zip((q, kv), eager, ref):
        assert rel_l2(got, r) <= rel_l2(e, r) * 1.5 + 1e-7


def test_a_position_past_the_cache_writes_nothing_there():
    ops = list(_operands(1, 2, 32, 2, 1, 8, torch.float32, False, False, 15))   # positions 15, 16 of 16
    cache = ops[5]
    before = cache.clone()
    q, kv = qkv_rotary(*ops)
    assert torch.equal(cache[:, :, :, 15], kv[:, :, :, 0]) and torch.equal(cache[:, :, :, :15], before[:, :, :, :15])


def test_why_unsupported_names_the_operand():
    ops = list(_operands(1, 1, 32, 2, 1, 8, torch.float32, False, False, 0))
    assert why_unsupported(*ops) is None
    ops[1] = ops[1][:-1]
    assert "the weight has shape (31, 32), not (32, 32)" in why_unsupported(*ops)
    ops = list(_operands(1, 1, 32, 2, 1, 8, torch.float32, False, False, 0))
    ops[3] = ops[3].half()
    assert "cos has dtype torch.float16" in why_unsupported(*ops)
    assert gemm.GEMV_MAX_M >= 1


T = pytest.importorskip("transformers")


def _optimized(cfg_cls, seed=0, **kw):
    import warnings
    import accelc
    torch.manual_seed(seed)
    cfg = cfg_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, **kw)
    lm = getattr(T, cfg_cls.__name__.replace("Config", "ForCausalLM"))(cfg).to(DEVICE).eval()
    ids = torch.randint(1, 100, (1, 7), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lm, ids, lambda **c: accelc.optimize(lm, {"input_ids": ids}, accelc.OptimizeConfig(glue="eager", **c))


@pytest.mark.parametrize("family, kw", [("LlamaConfig", {}), ("Qwen2Config", {}),
                                        ("Phi3Config", {"pad_token_id": 0}), ("GemmaConfig", {"head_dim": 16}),
                                        ("Qwen3Config", {"head_dim": 16})])
def test_a_steps_attention_input_is_one_call_and_generates_the_same_tokens(family, kw):
    """The step's layers: one qkv_rotary call a layer (Qwen2's with its q / k / v bias; Phi-3's projection one
    Linear of the model's own, its heads sliced, its rotation partial over all D columns; Gemma's norm weight 1 + w),
    Qwen3's heads normalized before their rotation, q_norm / k_norm taken in: two kernels, counted so), no rotary
    kernel or cache glue left; greedy tokens as HF's own generate (and, for Llama, as the step without the pass)."""
    from accelc.config import PASS_NAMES
    from accelc.step_launches import count
    lm, ids, optimize = _optimized(getattr(T, family), **kw)
    opt = optimize()
    nodes = list(opt.step.graph_module.graph.nodes)
    fused = [n for n in nodes if n.target is torch.ops.accelc.qkv_rotary.default]
    assert len(fused) == 2 and all(n.meta["accelc"].kernel == "accelc::rms_norm+qkv_rotary" for n in fused), \
        [line for line in opt.summary().splitlines() if "rotary" in line]
    assert (family == "Qwen2Config") == (fused[0].args[2] is not None)           # the bias
    assert not [n for n in nodes if n.target is torch.ops.accelc.rotary_embedding.default
                or str(n.target).startswith("aten.index_copy_")]
    assert "  model.layers.*.input_layernorm+self_attn.q" in opt.summary() and "+rotary+cache (2 layers): " \
        "rewritten accelc::rms_norm+qkv_rotary" in opt.summary()      # (one summary line for the layers alike)
    got = count(opt.step.graph_module)
    assert (got.accelc_in_blocks, got.glue_in_blocks) == (12 if family == "Qwen3Config" else 10, 0), got
    assert (family == "Qwen3Config") == (fused[0].kwargs.get("q_norm") is not None)
    ref = lm.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(opt.generate(ids, max_new_tokens=10, do_sample=False), ref)
    if DEVICE.type == "cpu":      # (the persistent decode step is raced on a GPU only; where not taken, why: said)
        said = opt.info.generation.partition("; decode: ")[2]
        assert said.startswith("the chain of kernels (" + ("one persistent kernel is raced against it on a GPU only)"
                                                           if family == "LlamaConfig" else "")), said
    if family != "LlamaConfig":      # (the step without the pass once: CI's time)
        return
    without = optimize(passes=tuple(p for p in PASS_NAMES if p != "qkv_rotary"))
    assert not any(n.target is torch.ops.accelc.qkv_rotary.default for n in without.step.graph_module.graph.nodes)
    assert torch.equal(without.generate(ids, max_new_tokens=10, do_sample=False), ref)


def test_under_inductor_glue_the_step_generates_the_same_tokens(monkeypatch):
    """The GPU's default glue: Inductor compiles the step around the call that writes the cache (its mutation of a
    module buffer), and the tokens are HF's. The guard's speed race (a GPU's) times the call, whose output is a
    tuple: it had read the device off the output's value, and on the GPU every step failed (generate() then ran
    HF's model at 2% of the bandwidth)."""
    import warnings
    import accelc
    from accelc import guard
    from accelc.rewrite import layers
    lm, ids, _ = _optimized(T.LlamaConfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm, {"input_ids": ids}, accelc.OptimizeConfig(glue="inductor"))
    assert "Inductor-compiled glue" in opt.step.info.runtime
    assert sum(n.target is torch.ops.accelc.qkv_rotary.default for n in opt.step.graph_module.graph.nodes) == 2
    timed = []
    monkeypatch.setattr(guard, "layer_ms", lambda fn, device, rep_ms: (timed.append(device), (1.0, True))[1])
    gm = opt.step.graph_module
    raced = guard._race(gm, opt.step.example_inputs, layers(gm), "original")
    assert sum(n.target is torch.ops.accelc.qkv_rotary.default for n in raced) == 2 and set(timed) == {DEVICE}
    assert torch.equal(opt.generate(ids, max_new_tokens=10, do_sample=False),
                       lm.generate(ids, max_new_tokens=10, do_sample=False))


def test_a_wrong_cache_write_is_reverted_by_the_guard(monkeypatch):
    """The layer's check covers the rows it writes, not only q: a kernel that writes k 3% off is reverted (the
    original's rotations and cache write put back), and the tokens stay eager's."""
    from accelc.kernels import qkv_rotary as mod
    real = mod.qkv_rotary_launch

    def off(*args, **kwargs):
        q, kv = real(*args, **kwargs)
        args[5][0] *= 1.03            # the cache's keys
        kv[0] *= 1.03
        return q, kv
    monkeypatch.setattr(mod, "qkv_rotary_launch", off)
    lm, ids, optimize = _optimized(T.LlamaConfig)
    opt = optimize()
    assert not any(n.target is torch.ops.accelc.qkv_rotary.default for n in opt.step.graph_module.graph.nodes)
    assert "+rotary+cache: reverted" in opt.summary()
    assert torch.equal(opt.generate(ids, max_new_tokens=8, do_sample=False),
                       lm.generate(ids, max_new_tokens=8, do_sample=False))


def test_what_the_pass_leaves_says_why():
    """On a step graph made without the pass: the pass takes each layer's group; where q is read before the cache
    write, or the projection has an epilogue of its own, it leaves the group and the projection's note says why."""
    import copy
    from accelc import meta
    from accelc.config import PASS_NAMES
    from accelc.passes import qkv_rotary as pass_
    lm, ids, optimize = _optimized(T.LlamaConfig)
    opt = optimize(passes=tuple(p for p in PASS_NAMES if p != "qkv_rotary"))
    gm = opt.step.graph_module

    def linears(g):
        return [n for n in g.graph.nodes if n.target is torch.ops.accelc.linear.default and n.kwargs.get("norm_eps")
                and len(n.users) == 3]
    taken = copy.deepcopy(gm)
    assert pass_.PASS.transform(taken, None) == 2 and not linears(taken)
    early = copy.deepcopy(gm)
    first = linears(early)[0]
    write = next(n for n in early.graph.nodes if str(n.target) == "aten.index_copy_.default")
    q = next(u for u in early.graph.nodes if u.target is torch.ops.accelc.rotary_embedding.default)
    with early.graph.inserting_before(write):
        early.graph.call_function(torch.neg, (q,))        # q read before the write
    assert pass_.PASS.transform(early, None) == 1
    assert meta.rewrite_of(first).note.endswith("rotation and cache write not taken in: q is read before the cache "
                                                "write")
    residual = copy.deepcopy(gm)
    first = linears(residual)[0]
    first.args = (*first.args[:3], first.args[0])          # a residual of its own
    assert pass_.PASS.transform(residual, None) == 1
    assert "has a residual or activation of its own" in meta.rewrite_of(first).note
