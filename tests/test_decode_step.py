"""kernels/decode_step.py and kernels/decode_schedule.py: a decode step as one persistent kernel (#89 item 3).

The task list is checked on the CPU by its executor (run_tasks): the tasks run one at a time in every order the
counters admit (several programs, random picks) give the step of the list's own order, bit for bit, and that step
is the chain of kernels' (accelc.persistent_step's call for a prompt); a list whose counters let a task read a
buffer before it is written shows as a different step, and one that waits on a later task as a deadlock. The
kernel itself (the interpreter runs it as one program) gives its executor's step; on a GPU, with a program an SM,
the chain's tokens. accelc.persistent_step.take puts the call in a tiny LM's step: generate gives the same tokens.
"""
import warnings

import pytest
import torch

import accelc
from accelc import persistent_step
from accelc.kernels import decode_schedule as S
from accelc.kernels import decode_step as K
from accelc.kernels.gated_linear import pack
from conftest import DEVICE, rel_l2

T = pytest.importorskip("transformers")


def _step(dtype=torch.float32, layers=2, K_=48, hq=4, hkv=2, D=16, inter=40, vocab=72, max_len=24, pos=9,
          bias=True, pad=2, device="cpu"):
    """Random operands of a one-token step (a position with earlier keys in the cache, `pad` left pads masked)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)
    d = S.Dims(layers, K_, hq, hkv, D, inter, vocab, max_len, bias, "silu")
    lays = []
    for _ in range(layers):
        w_gu, _ = pack(r(inter, K_, scale=K_ ** -0.5), r(inter, K_, scale=K_ ** -0.5))
        lays.append((1 + r(K_, scale=0.1), r((hq + 2 * hkv) * D, K_, scale=K_ ** -0.5), r((hq + 2 * hkv) * D) if bias
                     else None, r(K_, hq * D, scale=(hq * D) ** -0.5), 1 + r(K_, scale=0.1), w_gu,
                     r(K_, inter, scale=inter ** -0.5)))
    angles = torch.rand(D // 2, generator=g) * 6
    angles = torch.cat((angles, angles))
    mask = torch.zeros(max_len, dtype=torch.bool)
    mask[pad:pos + 1] = True
    st = S.Step(x=r(K_), cos=angles.cos().to(dtype).to(device), sin=angles.sin().to(dtype).to(device), position=pos,
                mask=mask.to(device), layers=lays, caches=[r(2, 1, hkv, max_len, D) for _ in range(layers)],
                final_norm=1 + r(K_, scale=0.1), head=r(vocab, K_, scale=K_ ** -0.5), eps=(1e-6, 1e-5, 1e-6),
                scale=D ** -0.5)
    return d, st


def _op_args(d, st):
    """The op's arguments for the step (x (1, 1, K), cos / sin (1, 1, 1, D), the mask (1, 1, 1, max_len))."""
    weights = []
    for n1, w, b, wo, n2, wgu, wd in st.layers:
        weights += [n1, w, b if b is not None else w, wo, n2, wgu, wd]
    D = d.head_dim
    return (st.x.reshape(1, 1, -1), st.cos.reshape(1, 1, 1, D), st.sin.reshape(1, 1, 1, D),
            torch.tensor([st.position], device=st.x.device), st.mask.reshape(1, 1, 1, -1), weights, st.caches,
            st.final_norm, st.head, d.as_list(), list(st.eps), st.scale)


def _fresh(st):
    return S.Step(**{**st.__dict__, "caches": [c.clone() for c in st.caches]})


SMALL_TILES = S.Tiles(pairs=8, rows=8, block_k=16, groups=1, splits=3, block_keys=4, programs=1, warps=1)


def test_any_order_the_counters_admit_gives_the_lists_step_and_the_chains():
    d, st = _step()
    base = _fresh(st)
    want = S.run_tasks(d, SMALL_TILES, base)
    assert len(S.schedule(d, SMALL_TILES)) > 60          # (many tasks a stage: the orders differ)
    for programs, seed in ((3, 0), (8, 1), (13, 2)):
        other = _fresh(st)
        got = S.run_tasks(d, S.Tiles(**{**SMALL_TILES.__dict__, "programs": programs}), other, seed=seed)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(other.caches, base.caches))
    chain = _fresh(st)
    args = _op_args(d, chain)
    ref = K._chain(*args[:9], d, args[10], args[11])        # the chain of kernels, as for a prompt
    assert rel_l2(want.double(), ref.reshape(-1).double()) < 1e-5
    assert all(rel_l2(a.double(), b.double()) < 1e-5 for a, b in zip(base.caches, chain.caches))
    written = base.caches[0][:, 0, :, st.position]
    assert not torch.equal(written, st.caches[0][:, 0, :, st.position])      # (the token's k / v were written)


def test_a_list_that_reads_before_the_write_or_waits_on_a_later_task_is_caught(monkeypatch):
    d, st = _step(layers=1)
    want = S.run_tasks(d, SMALL_TILES, _fresh(st))
    good = S.schedule

    def early(d, t):        # the output projection waits for q / k / v, not for the attention's output
        return [(k, lay, i, S.counter(S.QKV, lay), n) if k == S.OPROJ else (k, lay, i, w, n)
                for k, lay, i, w, n in good(d, t)]
    monkeypatch.setattr(S, "schedule", early)
    many = S.Tiles(**{**SMALL_TILES.__dict__, "programs": 16})
    outs = [S.run_tasks(d, many, _fresh(st), seed=s) for s in range(4)]
    assert any(not torch.equal(o, want) for o in outs)

    def backwards(d, t):    # attention listed before the q / k / v it waits for
        rows = good(d, t)
        return [r for r in rows if r[0] == S.ATTN] + [r for r in rows if r[0] != S.ATTN]
    monkeypatch.setattr(S, "schedule", backwards)
    with pytest.raises(RuntimeError, match="deadlock"):
        S.run_tasks(d, SMALL_TILES, _fresh(st))


@pytest.mark.parametrize("dtype, bias, hkv", [(torch.float32, True, 2), (torch.bfloat16, False, 1),
                                              (torch.float16, True, 4)])
def test_the_kernel_gives_its_executors_step(dtype, bias, hkv):
    d, st = _step(dtype=dtype, bias=bias, hkv=hkv, device=DEVICE)
    mine, ref = _fresh(st), _fresh(st)
    args = _op_args(d, mine)
    got = K._persistent(*args[:9], d, args[10], args[11])        # (not the chain it falls back to)
    assert got is not None
    want = K.decode_step_ref(*_op_args(d, ref))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (1, 1, d.vocab) and got.dtype == dtype
    assert rel_l2(got.double(), want.double()) < tol
    assert all(rel_l2(a.double(), b.double()) < tol for a, b in zip(mine.caches, ref.caches))
    if DEVICE.type == "cuda":       # every counter back to 0: the next launch runs as the first
        again = K._persistent(*args[:9], d, args[10], args[11])
        assert rel_l2(again.double(), got.double()) < tol


SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128, max_position_embeddings=256)


def test_a_step_optimized_to_one_persistent_kernel_generates_the_chains_tokens(monkeypatch):
    """OptimizeConfig(decode_step="persistent"): the step's decoder is one accelc::decode_step call (checked against
    the chain on a decode step at optimize, said on the summary's generation line, the chain's layer records kept);
    a prompt runs the chain inside it, each decoded token the persistent kernel; greedy tokens are HF's."""
    torch.manual_seed(0)
    lm = T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL)).to(DEVICE).eval()       # (q / k / v with a bias)
    ids = torch.randint(1, 128, (1, 8), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm, {"input_ids": ids}, accelc.OptimizeConfig(decode_step="persistent"))
    calls = [n.target for n in opt.step.graph_module.graph.nodes if getattr(n.target, "namespace", "") == "accelc"]
    assert calls == [torch.ops.accelc.decode_step.default]
    assert "; decode: one persistent kernel" in opt.summary()
    assert sum(r.status == "rewritten" for r in opt.step.layers) == 12
    ran = []
    real = K._persistent
    monkeypatch.setattr(K, "_persistent", lambda *a: ran.append(1) or real(*a))
    assert torch.equal(opt.generate(ids, max_new_tokens=5, do_sample=False),
                       lm.generate(ids, max_new_tokens=5, do_sample=False))
    assert len(ran) == 4                 # (each decoded token; the prompt ran the chain)
    with pytest.raises(ValueError, match="decode_step must be"):
        accelc.OptimizeConfig(decode_step="fast")


def test_a_step_it_cannot_take_is_left_with_the_reason():
    torch.manual_seed(0)
    lm = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm.to(DEVICE), {"input_ids": torch.randint(1, 64, (1, 4), device=DEVICE)})
    before = str(opt.step.graph_module.graph)
    assert persistent_step.take(opt.step.graph_module) == "no accelc::qkv_rotary layer in the step"
    assert str(opt.step.graph_module.graph) == before
    assert "; decode: " not in opt.summary()        # (nothing offered: nothing said)
