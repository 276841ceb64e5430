"""accelc/runner.py: the CUDA-graph cache's signature logic, its fallback to plain calls, output
safety, direct kernel launches, and the optimized module's use of it. On the CPU a stand-in
"graph" re-runs the function into fixed output buffers, as a CUDA graph replay writes its own."""
import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import accelc
from accelc import cuda_graphs, runner
from accelc.kernels import LAUNCHERS
from conftest import DEVICE, rel_l2


class FakeGraph:
    """A CUDA graph's contract: fixed input buffers (those it was captured on), fixed output
    buffers, rewritten by every replay."""

    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs, self.replays = fn, args, kwargs, 0
        self.outputs = fn(*args, **kwargs)

    def replay(self):
        fresh = self.fn(*self.args, **self.kwargs)
        for out, new in zip(pytree.tree_leaves(self.outputs), pytree.tree_leaves(fresh)):
            out.copy_(new)
        self.replays += 1


class Captures:
    def __init__(self, fail=None):
        self.graphs, self.fail = [], fail

    def __call__(self, fn, args, kwargs):
        if self.fail:
            raise runner.Uncapturable(self.fail)
        g = FakeGraph(fn, args, kwargs)
        self.graphs.append(g)
        return g, g.outputs


def _f(x, y=None, scale=1.0):
    out = torch.tanh(x) * scale
    return {"out": out if y is None else out + y, "sum": out.sum()}


def test_one_graph_per_signature_and_fresh_data_each_call():
    cap = Captures()
    r = runner.Runner(_f, cuda_graphs=True, capture=cap)
    for _ in range(3):
        x = torch.randn(4, 8)
        got = r(x)
        assert torch.equal(got["out"], _f(x)["out"]) and torch.equal(got["sum"], _f(x)["sum"])
    assert len(cap.graphs) == 1 and cap.graphs[0].replays == 3
    r(torch.randn(5, 8))                               # another shape
    r(torch.randn(8, 4).t())                           # same shape as the first, other strides
    r(torch.randn(4, 8, dtype=torch.float64))          # another dtype
    r(torch.randn(4, 8), scale=2.0)                    # a non-tensor argument is part of the signature
    r(torch.randn(4, 8), torch.randn(4, 8))            # another structure
    assert len(cap.graphs) == 6
    x = torch.randn(4, 8)
    assert torch.equal(r(x, scale=2.0)["out"], _f(x, scale=2.0)["out"])
    assert len(cap.graphs) == 6


def test_outputs_are_never_overwritten_by_the_next_call():
    r = runner.Runner(_f, cuda_graphs=True, capture=Captures())
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    y1 = r(x1)["out"]
    y2 = r(x2)["out"]
    assert torch.equal(y1, torch.tanh(x1)) and torch.equal(y2, torch.tanh(x2))
    y1.zero_()                                         # and writing to one leaves the next call alone
    assert torch.equal(r(x1)["out"], torch.tanh(x1))


def test_a_signature_that_cannot_be_captured_runs_plain_calls_with_the_reason():
    r = runner.Runner(_f, cuda_graphs=True, capture=Captures(fail="an op waits for the host"))
    x = torch.randn(4, 8)
    assert torch.equal(r(x)["out"], torch.tanh(x))
    assert torch.equal(r(x)["out"], torch.tanh(x))
    assert "plain calls where: an op waits for the host" in r.status()

    class Opaque:
        __hash__ = None
    r2 = runner.Runner(lambda x, o: x + 1, cuda_graphs=True, capture=Captures())
    assert torch.equal(r2(x, Opaque()), x + 1)
    assert "not a tensor, not hashable" in r2.status()


def test_at_most_max_graphs_the_least_recently_used_goes(monkeypatch):
    """Any number of shapes (any batch, any length), at most MAX_GRAPHS graphs alive: a new shape
    beyond them evicts the least recently used one, and that shape is captured again when it comes
    back."""
    monkeypatch.setattr(runner, "MAX_GRAPHS", 2)
    cap = Captures()
    r = runner.Runner(_f, cuda_graphs=True, capture=cap)
    for n in (1, 2, 3, 4):
        x = torch.randn(n, 8)
        assert torch.equal(r(x)["out"], torch.tanh(x))
    assert len(cap.graphs) == 4 and sum(e.graph is not None for e in r.entries.values()) == 2
    assert "(4 captured, 2 evicted: at most 2 kept)" in r.status()
    x = torch.randn(4, 8)
    assert torch.equal(r(x)["out"], torch.tanh(x)) and len(cap.graphs) == 4          # still kept
    x = torch.randn(1, 8)
    assert torch.equal(r(x)["out"], torch.tanh(x)) and len(cap.graphs) == 5          # evicted: captured again
    assert [k[0][0][0] for k in r.entries] == [4, 1]                                 # (the batch sizes kept)


def test_cpu_tensors_are_not_captured():
    with pytest.raises(cuda_graphs.Uncapturable, match="not on a CUDA device"):
        cuda_graphs.capture_cuda_graph(_f, (torch.randn(2, 2),), {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs")
def test_real_graphs_share_one_stream_and_pool_and_memory_does_not_grow_with_their_number():
    """Graphs of many sizes, captured largest first: one side stream, one pool, the warm-up inside
    it, so each new graph reuses the memory the first one needed (a stream per capture, or warm-up
    outside the pool, holds another working set per graph); every replay's outputs are right."""
    torch.manual_seed(0)
    w1 = torch.randn(64, 8192, device="cuda", dtype=torch.half) / 8
    w2 = torch.randn(8192, 64, device="cuda", dtype=torch.half) / 90

    def f(x):
        return torch.relu(x @ w1) @ w2        # a working set of n x 8192 halves

    r = runner.Runner(f, cuda_graphs=True)
    x = torch.randn(2048, 64, device="cuda", dtype=torch.half)
    assert rel_l2(r(x), f(x)) < 1e-3                    # the largest graph: one working set (32 MiB)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for n in range(1024, 2048, 96):                     # eleven more graphs
        x = torch.randn(n, 64, device="cuda", dtype=torch.half)
        assert rel_l2(r(x), f(x)) < 1e-3
        assert rel_l2(r(x), f(x)) < 1e-3                # replayed
    torch.cuda.synchronize()
    assert r.captures == 12
    grown = torch.cuda.memory_reserved() - before
    assert grown < 2048 * 8192 * 2, f"reserved memory grew {grown / 2**20:.0f} MiB over eleven more graphs"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS workspaces, real CUDA graphs")
def test_timing_and_capturing_leave_no_cublas_workspace_per_use():
    """cuBLAS keeps a workspace for every stream it has run on: the guard's race timed 30 layers
    on 30 new streams and left 495 MiB behind (H100). Timed layers and runners' captures share the
    GPU's one side stream, so after the first of each, more of them allocate nothing that stays."""
    from accelc.latency import layer_ms

    a = torch.randn(512, 512, device="cuda", dtype=torch.half)
    ref = a @ a                   # the caller's stream's workspace, before counting
    layer_ms(lambda: a @ a, "cuda", rep_ms=1)
    runner.Runner(lambda x: x @ a, cuda_graphs=True)(a)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(40):
        layer_ms(lambda: a @ a, "cuda", rep_ms=1)
    for _ in range(8):
        r = runner.Runner(lambda x: x @ a, cuda_graphs=True)
        assert rel_l2(r(a), ref) < 1e-3
        del r
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert grown < 2**20, f"{grown / 2**20:.0f} MiB stayed allocated after timing 40 layers and 8 runners' captures"


def test_an_input_that_is_also_the_state_the_graph_updates_counts_once_at_the_capturing_call():
    """A generation step given its cache's own length as `start`: the capture's runs update that
    length, and the capturing call must still see the length as it was when called."""
    length = torch.zeros((), dtype=torch.long)

    def step(start):
        length.copy_(start)
        length.add_(1)             # the step advances the cache it was given the start of
        return length * 10

    for after in (1, 2):
        length.zero_()
        r = runner.Runner(step, cuda_graphs=True, capture=Captures(), capture_after=after)
        outs = [int(r(length)) for _ in range(4)]
        assert outs == [10, 20, 30, 40] and int(length) == 4, (after, outs)


def test_no_grad_inside():
    w = torch.randn(8, 8, requires_grad=True)
    r = runner.Runner(lambda x: x @ w, cuda_graphs=False)
    assert not r(torch.randn(2, 8)).requires_grad


def test_optimized_module_plain_calls_use_the_launchers():
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs(8)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(glue="eager", cuda_graphs=False, only_if_faster=False))
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5
    assert opt.info.runtime == "eager glue, direct kernel launches, plain calls"
    direct = opt.runner.fn
    targets = {n.target for n in direct.graph.nodes if n.op == "call_function"}
    assert targets & set(LAUNCHERS.values()) and not targets & set(LAUNCHERS)
    assert any(n.target in LAUNCHERS for n in opt.graph_module.graph.nodes)   # the ops stay for export
    assert "runtime: eager glue" in opt.summary()
    opt.to(DEVICE)                                    # maybe new tensors: a new runner at the next call
    assert opt.runner is None
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


def test_glue_validated():
    with pytest.raises(ValueError, match="glue must be one of"):
        accelc.OptimizeConfig(glue="xla")


def test_optimized_module_copies_without_its_runner():
    """A copy builds its own runner: compiled code and captured graphs belong to the tensors
    they were made for."""
    import copy

    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs(4)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=False))
    with torch.no_grad():
        want = opt(x)
        assert opt.runner is not None and opt.__getstate__()["runner"] is None
        twin = copy.deepcopy(opt)
        assert twin.runner is None and torch.equal(twin(x), want)


def test_glue_that_inductor_cannot_compile_runs_plain(monkeypatch):
    """Dynamo / Inductor failing on the graph is not the user's problem: the plain graph runs,
    and the summary says why. A model's own error still raises (from the plain call)."""
    class Failing:
        def __init__(self, *a, **k):
            pass

        def __call__(self, *a, **k):
            raise torch._dynamo.exc.InternalTorchDynamoError("no lowering for op")

    monkeypatch.setattr(torch, "compile", lambda gm, **kw: Failing())
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    glue = runner.CompiledGlue(gm, gm)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="Inductor could not compile the glue.*running it uncompiled"):
        assert torch.equal(glue(x), gm(x)) and "Inductor could not compile the glue" in glue.failed
    r = runner.Runner(glue, cuda_graphs=False)
    r(x)
    assert "Inductor could not compile" in r.status()
    with pytest.raises(RuntimeError):
        glue(torch.randn(2, 5))            # the model's own shape error, from the plain graph


def test_dynamic_glue_is_also_compiled_static_for_the_shapes_warmed_up(monkeypatch):
    """A glue compiled for dynamic shapes gets a static compile for each shape captured at optimize
    time (the example's, the warm-up shapes; at most STATIC_GLUE), and calls at those shapes run
    it: Inductor's dynamic kernels cost GPT-2 7% at its one shape (H100). Other shapes run the
    dynamic compile; a glue compiled static takes no second compile."""
    compiles = []

    class Recorded:
        def __init__(self, gm, dynamic):
            self.gm, self.dynamic, self.calls = gm, dynamic, 0
            compiles.append(self)

        def __call__(self, *args, **kwargs):
            self.calls += 1
            return self.gm(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", lambda gm, dynamic=None, **kw: Recorded(gm, dynamic))
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    glue = runner.CompiledGlue(gm, gm, dynamic=True)
    r = runner.Runner(glue, cuda_graphs=True, capture=Captures())
    x = torch.randn(4, 8)
    r.warm_up(x)
    assert [c.dynamic for c in compiles] == [True, False] and compiles[1].gm is not gm
    assert compiles[1].gm.forward.__code__ is not gm.forward.__code__   # its own Dynamo cache
    assert compiles[1].gm.get_submodule("0").weight is gm.get_submodule("0").weight   # the same weights and
    # buffers, not copies: a step program's in-place cache writes reach the one cache
    assert compiles[1].calls == 2 and compiles[0].calls == 0    # the (fake) capture and its first replay
    y = torch.randn(3, 8)
    assert torch.equal(r(y), gm(y)) and compiles[0].calls > 0 and compiles[1].calls == 2   # the dynamic one
    assert torch.equal(r(x), gm(x)) and compiles[1].calls == 3
    assert "static ones at 1 shape(s)" in r.status()
    r.warm_up(x)                                                        # captured already: nothing more
    for n in range(2, 2 + runner.STATIC_GLUE + 2):
        r.warm_up(torch.randn(n * 8, 8))
    assert sum(not c.dynamic for c in compiles) == runner.STATIC_GLUE
    # a runner made at a call (after .to(), accelc.load): its first captured shape gets one, no other
    del compiles[:]
    lazy = runner.Runner(runner.CompiledGlue(gm, gm, dynamic=True), cuda_graphs=True, capture=Captures())
    lazy(x)
    lazy(y)
    assert [c.dynamic for c in compiles] == [True, False] and compiles[1].calls == 2
    glue_static = runner.CompiledGlue(gm, gm, dynamic=False)
    assert not glue_static.specialize(runner.signature((x,), {})[0]) and compiles[-1].dynamic is False and len(glue_static.static) == 0


def test_calls_from_several_threads_give_each_the_same_result():
    """Several threads calling one optimized module: in Triton's interpreter (global state) calls
    run one at a time; on the GPU the runner records and replays under its lock. Each thread's
    results equal a call made alone (they failed or came out wrong in the interpreter)."""
    import threading

    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs(8)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=False))
    xs = [x, x[:3].clone(), x[:5].clone()]       # the example's shape, and two a thread is first to call
    with torch.no_grad():
        want = [opt(xs[0])]
        alone = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=False))
        want += [alone(v) for v in xs[1:]]      # a twin makes them, so that the threads record those graphs
    errors, wrong = [], []

    def work(first):
        try:
            for i in range(6):
                k = (first + i) % len(xs)
                with torch.no_grad():
                    if not torch.equal(opt(xs[k]), want[k]):
                        wrong.append(k)
        except Exception as e:   # reported below with the rest
            errors.append(f"{type(e).__name__}: {e}")
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong, (errors[:2], len(wrong))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs, GPU timing")
def test_a_gpu_bound_call_runs_at_its_own_size_in_the_graphs_pool():
    """A call padded from 2049 to 2560 rows of eight large layers: after its bucket's graph is timed
    it runs at its own size (its padding is a fifth of the GPU time, the launches a small part), its
    working memory taken from the graphs' pool (a plain call outside it cached 64 MiB more), its
    outputs copied out (a later replay leaves them as they are), its numbers the function's: within twice
    eager fp16's own error against fp32 (the padded call's GEMMs take other cuBLAS algorithms than eager's
    at 2049 rows: 1.07e-3 apart on an H200, each as near to fp32 as the other)."""
    from accelc import buckets
    from accelc.capture.shapes import DimRange

    torch.manual_seed(0)
    ws = [(torch.randn(1024, 16384, device="cuda", dtype=torch.half) / 32,
           torch.randn(16384, 1024, device="cuda", dtype=torch.half) / 128) for _ in range(8)]

    def f(x, weights=ws):
        for w1, w2 in weights:
            x = torch.relu(x @ w1) @ w2        # a working set of n x 16384 halves: 64 MiB at 2049 rows
        return x

    plan = buckets.Padding({"b": DimRange(1, 4096, "b")}, (((0, "b", "edge"),),), (((0, "b"),),), {"b": "batch"})
    r = runner.Runner(f, cuda_graphs=True, padding=plan, exact_calls=True)     # padding="auto"
    x = torch.randn(2049, 1024, device="cuda", dtype=torch.half)
    ref = f(x.float(), [(a.float(), b.float()) for a, b in ws])
    limit = 2 * rel_l2(f(x), ref)
    for _ in range(2):                         # captured at 2560; its next replay timed
        assert rel_l2(r(x), ref) <= limit
    torch.cuda.synchronize()
    (entry,) = r.entries.values()
    assert entry.gpu_time() > 4 * entry.host_ms, (entry.gpu_time(), entry.host_ms)
    before = torch.cuda.memory_reserved()
    got = r(x)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - before
    assert r.exact == 1 and rel_l2(got, ref) <= limit
    assert grown < 32 * 2**20, f"the plain call cached {grown / 2**20:.0f} MiB outside the graphs' pool"
    kept = got.clone()
    r(torch.randn(2560, 1024, device="cuda", dtype=torch.half))       # the bucket's graph replays
    torch.cuda.synchronize()
    assert torch.equal(got, kept)
