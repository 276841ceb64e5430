"""accelc/shared_checks.py: a causal LM's generation step takes its forward's layer checks where the kernel, the
weights (by their values) and the shapes are the same, and checks the rest itself; a failed check stays failed;
a program never reads its own checks (its second draw is drawn); quantized layers and another config share none."""
import logging
import warnings

import torch
import transformers as T

import accelc
from accelc import shared_checks
from accelc.kernels import gemm
from conftest import DEVICE

CONFIG = T.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=1)


def _lm():
    torch.manual_seed(0)
    return T.Qwen2ForCausalLM(CONFIG).to(DEVICE).eval()


def _optimize(model, inputs, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelc.optimize(model, inputs, accelc.OptimizeConfig(glue="eager", cuda_graphs=False, **config))


def _shared(caplog) -> int:
    lines = [r.getMessage() for r in caplog.records if "layer check(s) shared" in r.getMessage()]
    return int(lines[-1].split("guard: ")[1].split()[0]) if lines else 0


def test_the_step_takes_the_forwards_checks_and_generates_the_same(monkeypatch, caplog):
    ids = torch.randint(0, 128, (1, 12), device=DEVICE)
    with caplog.at_level(logging.INFO, logger="accelc"):
        shared = _optimize(_lm(), (ids,))
    n = _shared(caplog)
    caplog.clear()
    monkeypatch.setattr(shared_checks, "key", lambda *args, **kwargs: None)     # each program checks all
    alone = _optimize(_lm(), (ids,))
    assert n > 0 and _shared(caplog) == 0
    assert [(r.name, r.status, r.kernel) for r in shared.step.layers] == \
        [(r.name, r.status, r.kernel) for r in alone.step.layers]
    tokens = shared.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(tokens, alone.generate(ids, max_new_tokens=5, do_sample=False))
    with torch.no_grad():
        assert torch.equal(tokens, _lm().generate(ids, max_new_tokens=5, do_sample=False))


def test_a_layer_the_forward_failed_stays_failed_in_the_step_without_running_again(monkeypatch):
    """The kernel wrong on the q/k/v projections (their stacked width): reverted in the forward, and in the step
    too, where those projections' kernel runs only at the step's own sizes (decode rows), not at the prompt's."""
    width = CONFIG.hidden_size + 2 * CONFIG.hidden_size // CONFIG.num_attention_heads * CONFIG.num_key_value_heads
    rows = []

    def wrong_for_qkv(*args, **kwargs):
        out = gemm.linear_ref(*args[:6])
        if out.shape[-1] == width:
            rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
            return out + 1.0
        return out
    monkeypatch.setattr(gemm, "linear_launch", wrong_for_qkv)
    ids = torch.randint(0, 128, (1, 12), device=DEVICE)
    # (the step's projection as the forward's layer: its rotations and cache write not taken in, which makes it
    # a layer of its own that the step checks itself, accelc::qkv_rotary; test_qkv_rotary.py reverts that one)
    apart = tuple(p for p in accelc.config.PASS_NAMES if p != "qkv_rotary")
    opt = _optimize(_lm(), (ids,), passes=apart)
    reverted = [r.name for r in opt.step.layers if r.status == "reverted"]
    assert reverted and all("q_proj" in name for name in reverted), opt.step.summary()
    assert [r.name for r in opt.layers if r.status == "reverted"] == [n.removeprefix("lm.") for n in reverted]
    prompt = rows.count(ids.numel())
    rows.clear()
    monkeypatch.setattr(shared_checks, "key", lambda *args, **kwargs: None)
    _optimize(_lm(), (ids,), passes=apart)
    assert 0 < prompt < rows.count(ids.numel())    # checking alone, the step runs it at the prompt's rows again


def test_the_key_tells_weights_apart_by_value_and_skips_quantized_layers():
    """Two programs whose layer reads another weight of the same shape share nothing; the same values in another
    tensor do; a quantized layer has no key."""
    from types import SimpleNamespace

    from torch import fx

    def program(weight):
        g = fx.Graph()
        x = g.placeholder("x")
        w = g.get_attr("w")
        g.output(g.call_function(torch.ops.accelc.linear.default, (x, w)))
        return [n for n in g.nodes if n.op == "call_function"][0]
    x = torch.randn(4, 8)
    w = torch.randn(16, 8)
    float_layer = SimpleNamespace(quantized="", original=None)
    config = accelc.OptimizeConfig()
    with shared_checks.sharing():
        k = shared_checks.key(program(w), (x, w), {}, float_layer, config)
        assert k is not None
        assert shared_checks.key(program(w), (x.clone(), w.clone()), {}, float_layer, config) == k
        assert shared_checks.key(program(w), (x, w + 1), {}, float_layer, config) != k
        assert shared_checks.key(program(w), (x[:2], w), {}, float_layer, config) != k
        assert shared_checks.key(program(w), (x, w), {}, float_layer, accelc.OptimizeConfig(tolerance=0.1)) != k
        int8_layer = SimpleNamespace(quantized="int8", original=None)
        assert shared_checks.key(program(w), (x, w), {}, int8_layer, config) is None
    assert shared_checks.key(program(w), (x, w), {}, float_layer, config) is None     # outside an optimize


def test_a_program_never_takes_its_own_checks_its_second_draw_is_drawn(monkeypatch):
    """A kernel right at each weight's first call at a shape and wrong after: the forward reverts every projection
    that goes through it (on its second draw of the example's shapes, which the first draw's check, same key, must
    not stand in for)."""
    calls = {}

    def right_once(*args, **kwargs):
        out = gemm.linear_ref(*args[:6])
        k = (args[1].data_ptr(), tuple(args[0].shape))
        calls[k] = calls.get(k, 0) + 1
        return out if calls[k] == 1 else out + 1.0
    monkeypatch.setattr(gemm, "linear_launch", right_once)
    monkeypatch.setattr(accelc.guard, "repeat_runs", lambda: False)
    opt = _optimize(_lm(), (torch.randint(0, 128, (1, 12), device=DEVICE),))
    linears = [r for r in opt.layers if (r.kernel or "").startswith(("accelc::linear", "accelc::rms_norm+linear"))]
    assert linears and all(r.status == "reverted" for r in linears), opt.summary()
    assert any("second draw" in r.reason for r in linears), opt.summary()
