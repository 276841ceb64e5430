"""accelc in a process where other threads run the user's own code: what accelc does in one thread (tracing in
optimize, save and report; the background compile of the glue for other shapes) never changes what another thread's
code does, and an optimized model called from several threads gives each its own answer."""
import threading

import pytest
import torch
from torch import fx, nn

import accelc
from accelc import fx_tracing, regions
from conftest import DEVICE


def _compiled():
    f = torch.compile(lambda x: x * 2, backend="eager")
    f(torch.randn(3))
    return f


def _call_in_a_thread(fn, *args) -> str:
    out = []

    def run():
        try:
            fn(*args)
            out.append("ok")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_a_trace_in_one_thread_leaves_another_threads_compiled_functions_alone():
    """torch's flag is one global: a trace running in one thread made every compiled function in another refuse
    ("Detected that you are using FX to symbolically trace a dynamo-optimized function")."""
    f, seen = _compiled(), []

    class Waits(nn.Module):
        def forward(self, x):
            if isinstance(x, fx.Proxy):          # mid-trace: the other thread calls its compiled function now
                seen.append(_call_in_a_thread(f, torch.randn(3)))
            return x + 1
    with fx_tracing.each_thread_its_own():
        fx.symbolic_trace(Waits())
        with pytest.raises(RuntimeError, match="symbolically trace a dynamo-optimized function"):
            fx.symbolic_trace(nn.Sequential(_Calls(f)))      # (this thread's own trace still sees its own)
    assert seen == ["ok"]


class _Calls(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


def test_optimize_traces_without_touching_other_threads_and_puts_torch_back():
    f, seen = _compiled(), []
    trace, readers = fx.Tracer.trace, fx._symbolic_trace.is_fx_tracing.__code__

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            if isinstance(x, fx.Proxy):          # accelc's capture is tracing: another thread's compiled call
                seen.append(_call_in_a_thread(f, torch.randn(3)))
            return torch.relu(self.fc(x))
    model = Model().to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(4, 16, device=DEVICE),))
    opt.wait_for_other_shapes()      # (a GPU's background compile holds the flag per thread till it ends)
    assert seen and set(seen) == {"ok"}, seen
    assert fx.Tracer.trace is trace and fx._symbolic_trace.is_fx_tracing.__code__ is readers
    assert not hasattr(fx._symbolic_trace, "_accelc_traced_in_this_thread")


def test_every_entry_that_traces_holds_the_flag_per_thread(monkeypatch):
    for fn in (accelc.optimize, accelc.save, accelc.report):
        assert fn.__wrapped__ is not None and fn.__code__ is fx_tracing.own_flag(lambda: 0).__code__, fn
    held = []     # the background compile's thread holds it while it compiles
    monkeypatch.setattr(regions.Glue, "_compile_later",
                        lambda self, inputs, device: held.append(fx_tracing._READERS.count))
    glue = object.__new__(regions.Glue)
    glue.dynamic, glue.failed, glue.dynamic_done, glue.later, glue.state, glue.due = True, None, set(), None, [], False
    assert glue.compile_dynamic_later([], torch.device("cpu"))
    glue.later.join()
    assert len(held) == 1 and held[0] >= 1      # (>= : another test's background compile may hold it too)


def _tiny_llama():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    return tf.LlamaForCausalLM(cfg).to(DEVICE).eval()


def _in_threads(*jobs) -> list:
    """Each job (a function returning a list of problems) in a thread of its own, at once: every problem."""
    problems: list = []

    def run(job):
        try:
            problems.extend(job())
        except Exception as e:
            problems.append(f"{type(e).__name__}: {e}")
    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return problems


def test_generate_in_one_thread_while_another_calls_the_forward():
    """Both failed in the CPU interpreter (its state is global): each gives its own answer now."""
    lm = _tiny_llama()
    ids = torch.randint(0, 100, (1, 6), device=DEVICE)
    p = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    opt = accelc.optimize(lm, p)
    with torch.no_grad():
        tokens, logits = lm.generate(**p, max_new_tokens=6, do_sample=False), lm(**p).logits

    def generates():
        return [f"generate {i} differs" for i in range(2)
                if not torch.equal(opt.generate(**p, max_new_tokens=6, do_sample=False), tokens)]

    def forwards():
        with torch.no_grad():
            return [f"forward {i} differs" for i in range(4)
                    if not torch.allclose(opt(**p).logits, logits, atol=1e-4, rtol=1e-4)]
    assert _in_threads(generates, forwards) == []


def test_optimize_in_one_thread_while_another_calls_an_optimized_model():
    """The guard's kernels in one thread, another model's calls in the other: the interpreter runs one kernel at a
    time, so neither sees the other's state."""
    first = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)).to(DEVICE).eval()
    x = torch.randn(4, 32, device=DEVICE)
    opt = accelc.optimize(first, (x,))
    with torch.no_grad():
        want = first(x)
    second = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(DEVICE).eval()

    def calls():
        with torch.no_grad():
            return [f"call {i} differs" for i in range(6) if not torch.allclose(opt(x), want, atol=1e-5, rtol=1e-5)]

    def optimizes():
        other = accelc.optimize(second, (x,))
        with torch.no_grad():
            return [] if torch.allclose(other(x), second(x), atol=1e-5, rtol=1e-5) else ["the second model differs"]
    assert _in_threads(calls, optimizes) == []


def test_save_while_another_thread_calls_the_model(tmp_path):
    """The export put fake tensors where the module's parameters were, and edited torch's process-wide trace
    metadata at each of accelc's op calls: the other thread's calls failed (fake-mode assertions, KeyError 'custom')
    and the save could too. Now the save exports a copy, and calls wait while an export of accelc's runs."""
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)).to(DEVICE).eval()
    x = torch.randn(4, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    with torch.no_grad():
        want = model(x)
    done = threading.Event()

    def calls():
        problems, n = [], 0
        with torch.no_grad():
            while not done.is_set() or n < 3:
                n += 1
                if not torch.allclose(opt(x), want, atol=1e-5, rtol=1e-5):
                    problems.append(f"call {n} differs")
        return problems

    def saves():
        try:
            accelc.save(opt, tmp_path / "m.pt2")
        finally:
            done.set()
        return []
    assert _in_threads(calls, saves) == []
    torch.testing.assert_close(accelc.load(tmp_path / "m.pt2")(x), want, atol=1e-5, rtol=1e-5)
