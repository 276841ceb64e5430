"""OptimizeConfig(other_shapes="background"): the glue for shapes other than the example's (Inductor's dynamic
compile and its batch-of-one variant) compiled in a thread of its own after optimize returns. Meanwhile a call at
another shape runs the plain graph (no compile waited for, no CUDA graph of it kept), after it the compiled glue,
with the same numbers; a failure is said and leaves the glue plain; a CUDA graph capture waits for it; optimize
starts it after the call's timing, and not for a generation step, a causal LM's forward or with warmup_shapes."""
import copy
import pickle
import threading
import warnings

import pytest
import torch
import transformers as T
from torch.utils import _pytree as pytree

import accelc
from accelc import api, cuda_graphs, regions, reuse, runner, warmup
from accelc.optimized import OptimizedModule
from conftest import DEVICE, rel_l2, times_as_on_a_gpu, warmup_takes_the_gpu_branch
from test_runner import Captures


def _bert():
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.BertModel(cfg).to(DEVICE).eval()


def _example(b=2, n=8):
    ids = torch.randint(1, 100, (b, n), device=DEVICE)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _optimize(model, example, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelc.optimize(model, example, accelc.OptimizeConfig(passes=("linear_act",), only_if_faster=False,
                                                                     **config))


@pytest.fixture(scope="module")
def optimized():
    model = _bert()
    return model, _optimize(model, _example())


def _first(x) -> torch.Tensor:
    return next(t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor))


def _held(monkeypatch) -> threading.Event:
    """Glue.compile_dynamic waits until the event returned is set: the background compile held in flight."""
    go, compile_dynamic = threading.Event(), regions.Glue.compile_dynamic

    def held(self, *args, **kwargs):
        assert go.wait(120)
        return compile_dynamic(self, *args, **kwargs)

    monkeypatch.setattr(regions.Glue, "compile_dynamic", held)
    return go


class Plain:
    """The plain graph, its calls counted."""

    def __init__(self, gm):
        self.gm, self.calls = gm, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.gm(*args, **kwargs)


def test_calls_while_the_glue_compiles_in_the_background_run_plain_then_compiled(optimized, monkeypatch):
    """Inductor (on this machine's device) compiles the dynamic glue in the background: a call at another shape
    meanwhile runs the plain graph and compiles nothing in the caller's thread; once it ends, the same call runs
    the compiled glue (the plain graph not called), the graph's numbers both times."""
    _, opt = optimized
    gm = opt.graph_module
    torch._dynamo.reset()
    plain = Plain(runner.direct_calls(gm))
    glue = runner.compiled_glue(gm, plain, True)
    go = _held(monkeypatch)
    example = opt.example_inputs
    assert glue.compile_dynamic_later([example], torch.device(DEVICE))   # (the batch of one's: another compile)
    assert glue.pending() and "compiling in the background" in glue.status()
    ids = torch.randint(1, 100, (3, 5), device=DEVICE)
    args = (ids, torch.ones_like(ids))
    made = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        want = gm(*args)
        got = glue(*args)
    assert plain.calls == 1 and torch.equal(_first(got), _first(want))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == made     # nothing compiled for that call
    go.set()
    assert glue.wait(300) and not glue.pending() and not glue.failed
    assert len(glue.dynamic_done) == 1 and "compiled in the background" in glue.status()
    assert not glue.compile_dynamic_later([example], torch.device(DEVICE))    # (once)
    with torch.no_grad():
        got = glue(*args)
    assert plain.calls == 1 and rel_l2(_first(got), _first(want)) < 1e-5


def test_a_background_compile_that_fails_is_said_and_the_glue_runs_plain(optimized):
    """A compile (or its call) that fails in the background leaves the glue plain from then on, said as a warning
    and in the glue's status, as a failure at optimize is; calls give the plain graph's numbers."""
    _, opt = optimized
    gm = opt.graph_module

    def broken(module, dynamic):
        def run(*args, **kwargs):
            raise RuntimeError("no kernel for this")
        return run

    plain = Plain(gm)
    glue = regions.Glue(broken(gm, True), [], plain, True, runner.STATIC_GLUE, runner.signature_or_none)
    with pytest.warns(UserWarning, match="running it uncompiled"):
        assert glue.compile_dynamic_later([opt.example_inputs], torch.device(DEVICE))
        assert glue.wait(60)
    assert "RuntimeError: no kernel for this" in glue.failed and glue.failed in glue.status()
    with torch.no_grad():
        got, want = glue(*opt.example_inputs), gm(*opt.example_inputs)
    assert plain.calls == 1 and torch.equal(_first(got), _first(want))


def _stand_in_glue(gm, pending: bool):
    glue = regions.Glue(gm, [], Plain(gm), True, runner.STATIC_GLUE, runner.signature_or_none)
    glue.pending = lambda: pending
    return glue


@pytest.mark.parametrize("pending", [True, False])
def test_the_runner_keeps_no_graph_of_a_new_signature_while_its_glue_compiles(optimized, pending):
    """While the glue compiles in the background, a call at a signature with no graph runs as a plain call and no
    graph is captured for it (it would hold the uncompiled glue for good); after, it is captured as before."""
    _, opt = optimized
    cap = Captures()
    r = runner.Runner(_stand_in_glue(opt.graph_module, pending), cuda_graphs=True, capture=cap)
    ids = torch.randint(1, 100, (3, 5), device=DEVICE)
    got = r(ids, torch.ones_like(ids))
    with torch.no_grad():
        want = opt.graph_module(ids, torch.ones_like(ids))
    assert torch.equal(_first(got), _first(want))
    assert (len(cap.graphs), r.plain, r.compiling()) == ((0, 1, True) if pending else (1, 0, False))


def test_a_cuda_graph_capture_waits_for_the_background_compiles(optimized, monkeypatch):
    """A CUDA graph is captured only once no glue compiles in the background (another thread's launches and
    allocations would break the capture): the capture starts after that thread ended."""
    _, opt = optimized
    ended, order = threading.Event(), []

    def background():
        assert ended.wait(60)
        order.append("background ended")

    def capture(fn, args, kwargs, pool=None, arena=None):
        order.append("captured")
        graph, outputs = Captures()(fn, args, kwargs)
        return graph, outputs, pool, 0.0

    monkeypatch.setattr(runner, "capture_cuda_graph", capture)
    thread = threading.Thread(target=background)
    regions._LATER.add(thread)
    thread.start()
    r = runner.Runner(opt.graph_module, cuda_graphs=True)
    threading.Timer(0.2, ended.set).start()
    r(*opt.example_inputs)
    assert order == ["background ended", "captured"]


def _gpu_branch(monkeypatch) -> list:
    """optimize's warm-up stage takes the GPU's branch on the CPU (no capture); its compiles of the glue for other
    shapes, now or in the background, and the call's timing recorded in order."""
    events = []
    warmup_takes_the_gpu_branch(monkeypatch)
    monkeypatch.setattr(OptimizedModule, "compile_other_shapes",
                        lambda self, inputs: events.append(("now", [tuple(t.shape) for t in inputs])) or True)
    monkeypatch.setattr(OptimizedModule, "compile_other_shapes_later",
                        lambda self, inputs: events.append(("later", [[tuple(t.shape) for t in a] for a in inputs])))
    call_times = api.call_times
    monkeypatch.setattr(api, "call_times", lambda job, opt: events.append(("timed",)) or call_times(job, opt))
    return events


def test_optimize_compiles_the_glue_for_other_shapes_in_the_background_after_the_calls_timing(monkeypatch):
    """other_shapes="background": optimize hands the example's inputs (copies) and the batch of one's to the
    background compile after timing the call, and compiles none itself; "now": compiled inside optimize, as
    before; with warmup_shapes: now (the shapes asked for are captured at optimize)."""
    events = _gpu_branch(monkeypatch)
    model = _bert()
    opt = _optimize(model, _example(), other_shapes="background")
    assert events == [("timed",), ("later", [[(2, 8), (2, 8)], [(1, 8), (1, 8)]])], events
    assert "the example's call timed" in opt.info.seconds        # (the summary's time line names it)
    events.clear()
    _optimize(model, _example(), other_shapes="now")
    assert events == [("now", [(2, 8), (2, 8)]), ("now", [(1, 8), (1, 8)]), ("timed",)], events
    events.clear()
    _optimize(model, _example(), other_shapes="background", warmup_shapes=[{"input_ids": (4, 8)}])
    assert [e[0] for e in events] == ["now", "now", "timed"], events


def _tiny_lm(layers=1):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return T.LlamaForCausalLM(cfg).to(DEVICE).eval()


@pytest.mark.parametrize("glue", ["inductor", "eager"])
def test_a_causal_lms_step_compiles_its_glue_in_the_background_after_the_forwards_timing(monkeypatch, glue):
    """A causal LM's forward leaves its dynamic glue to a first call (not handed over); its generation step's glue,
    cut into regions, compiles in the background (its calls on copies of the cache: regions.RegionalGlue.
    state_apart), started once the forward's optimize has timed its call; a step whose glue cannot leave the cache
    alone (eager glue here; a whole-graph compile) compiles inside optimize, as before."""
    events = _gpu_branch(monkeypatch)
    opt = _optimize(_tiny_lm(3), _example(1, 6), other_shapes="background", glue=glue)
    assert opt.step is not None and regions.plan(opt.step.graph_module) is not None
    if glue == "inductor":
        assert [e[0] for e in events] == ["timed", "timed", "later"], events
        assert events[2][1][0] == [tuple(t.shape) for t in opt.step.example_inputs]     # the step's example first
    else:
        assert [e[0] for e in events] == ["now", "timed", "timed"], events


@pytest.fixture(scope="module")
def lm_opt():
    """A tiny Llama's optimize with its glue compiled now (the tests build the glue they look at)."""
    return _optimize(_tiny_lm(3), _example(1, 6), other_shapes="now")


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_a_background_compile_of_a_generation_step_writes_copies_of_its_cache(monkeypatch, request, kv_cache):
    """The step's regions take its cache as inputs: the background compile's calls run them on copies, so the
    cache the caller's calls write meanwhile is left as they wrote it, the regions' compiled code (shared with the
    caller's calls) made on tensors of the cache's shapes; the copies are dropped after. A glue compiled whole
    over a cache refuses a background compile."""
    # (four layers for the paged cache: its step's stretch before the blocks is long; with three the cut into
    # regions paid by two nodes on the CPU (regions.PAYS) and was not made on the GPU)
    lm_opt = (request.getfixturevalue("lm_opt") if kv_cache == "static"
              else _optimize(_tiny_lm(4), _example(1, 6), other_shapes="now", kv_cache=kv_cache))
    step = lm_opt.step
    gm = step.graph_module
    cut = regions.plan(gm)
    assert cut is not None and runner.mutated_state(gm)
    seen = []

    def compile_fn(module, dynamic):
        def run(*args):
            seen.append((threading.current_thread().name, [t.data_ptr() for t in args if isinstance(t, torch.Tensor)]))
            return module(*args)
        return run

    glue = regions.RegionalGlue(gm, Plain(gm), True, cut, compile_fn, runner.STATIC_GLUE, runner.signature_or_none)
    cache = {k: v for k, v in gm.named_buffers() if k in glue.state}
    assert cache and glue.apart_ok()
    before = {k: v.clone() for k, v in cache.items()}
    go, compile_dynamic = threading.Event(), regions.Glue._compile_dynamic
    monkeypatch.setattr(regions.Glue, "_compile_dynamic",
                        lambda self, *a: go.wait(60) and compile_dynamic(self, *a))
    assert glue.compile_dynamic_later([warmup._own(step.example_inputs)], torch.device(DEVICE))
    threading.Timer(0.2, go.set).start()
    assert glue.wait(120) and not glue.failed and len(glue.dynamic_done) == 1
    ours = {v.data_ptr() for v in cache.values()}
    later = [ptrs for name, ptrs in seen if name == "accelc-glue-later"]
    assert len(later) == len(cut.segments)                   # every region called by the thread
    assert not any(ours & set(ptrs) for ptrs in later)       # none on the model's cache
    for k, v in cache.items():
        assert torch.equal(v, before[k]), k                  # which the thread's calls left as it was
    whole = runner.CompiledGlue(gm, Plain(gm), True)
    assert whole.state and not whole.apart_ok() and not whole.compile_dynamic_later([step.example_inputs],
                                                                                    torch.device(DEVICE))


def test_a_copy_of_a_view_of_the_state_is_a_view_of_a_copy():
    """A state tensor that is a view of another (its base) is copied as the same view of a copy of the base: a
    compile's guards read a view's base, so a plain copy would compile code the real view's calls fail."""
    base = torch.randn(4, 6)
    view = base[1:3, ::2]
    got = cuda_graphs.copy_as_is(view)
    assert got._base is not None and got._base is not base and got._base.shape == base.shape
    assert got.shape == view.shape and got.stride() == view.stride() and got.storage_offset() == view.storage_offset()
    assert torch.equal(got, view) and got.data_ptr() != view.data_ptr()
    plain = torch.empty_strided((5, 3), (1, 5)).copy_(torch.randn(5, 3))     # (strided, not a view)
    assert plain._base is None and cuda_graphs.copy_as_is(plain).stride() == plain.stride()
    assert cuda_graphs.copy_as_is(plain)._base is None and torch.equal(cuda_graphs.copy_as_is(plain), plain)


def test_the_setting_is_checked_comes_from_the_environment_and_leaves_the_reuse_key_alone(optimized, monkeypatch):
    _, opt = optimized
    with pytest.raises(ValueError, match="other_shapes must be one of"):
        accelc.OptimizeConfig(other_shapes="later")
    monkeypatch.delenv("ACCELC_OTHER_SHAPES", raising=False)
    assert accelc.OptimizeConfig().other_shapes == "background"     # (the default since runs/first_requests/run9)
    monkeypatch.setenv("ACCELC_OTHER_SHAPES", "now")
    assert accelc.OptimizeConfig().other_shapes == "now"
    monkeypatch.setenv("ACCELC_REUSE", "1")     # (the suite keeps reuse off)
    keys = [reuse.key(opt.graph_module, opt.example_inputs, accelc.OptimizeConfig(other_shapes=o),
                      torch.device(DEVICE), [opt.example_inputs], None, None) for o in ("now", "background")]
    assert keys[0] is not None and keys[0] == keys[1]


def test_wait_for_other_shapes_without_a_compiled_glue_returns_at_once(optimized):
    _, opt = optimized
    assert opt.wait_for_other_shapes(0)


def test_an_optimize_begins_after_the_glue_compiles_an_earlier_one_left_in_the_background(monkeypatch):
    """An optimize waits for the background glue compiles of those before it (its speed races and captures share
    the GPU with none of them): its capture starts after such a thread ended."""
    ended, order = threading.Event(), []

    def background():
        assert ended.wait(60)
        order.append("background ended")

    capture_job, wait = api.capture_job, regions.wait_background

    def waits(timeout=None):
        order.append("waits")
        threading.Timer(0.2, ended.set).start()     # (the earlier compile ends only once it is waited for)
        wait(timeout)

    monkeypatch.setattr(api, "capture_job", lambda job: order.append("captured") or capture_job(job))
    monkeypatch.setattr(regions, "wait_background", waits)
    thread = threading.Thread(target=background)
    regions._LATER.add(thread)
    thread.start()
    _optimize(torch.nn.Sequential(torch.nn.Linear(8, 8)).to(DEVICE), (torch.randn(2, 8, device=DEVICE),))
    ended.set()
    assert order[:3] == ["waits", "background ended", "captured"], order


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the glue compiles with Inductor and CUDA graphs only on a GPU")
def test_on_the_gpu_an_optimized_model_serves_other_shapes_during_and_after_its_background_compile():
    """The whole route on a GPU: optimize returns with the glue for other shapes compiling in the background; calls
    at other batches and lengths give eager's numbers while it compiles and after, and the summary says it."""
    model = _bert()
    with torch.no_grad():
        opt = _optimize(model, _example(), other_shapes="background")
        sizes = [(3, 5), (1, 11), (4, 8)]
        for when in ("during", "after"):
            if when == "after":
                assert opt.wait_for_other_shapes(300)
            for b, n in sizes:
                example = _example(b, n)
                got, want = opt(**example), model(**example)
                assert rel_l2(_first(got).float(), _first(want).float()) < 1e-3, (when, b, n)
    assert "compiled in the background after optimize" in opt.summary()


def test_a_padded_call_while_the_glue_compiles_is_cut_back_and_its_bucket_captured_after():
    """With padding (batch buckets), a call while the glue compiles runs plain on its padded inputs and gives its own
    rows back; once compiled, the same call captures its bucket's graph and replays it."""
    from accelc import buckets
    from accelc.capture.shapes import DimRange

    def f(x):
        return torch.tanh(x) * 2 + x.sum(-1, keepdim=True)

    state = {"pending": True}
    glue = regions.Glue(f, [], Plain(f), True, runner.STATIC_GLUE, runner.signature_or_none)
    glue.pending = lambda: state["pending"]
    plan = buckets.Padding({"b": DimRange(1, 64, "b")}, (((0, "b", "edge"),),), (((0, "b"),),), {"b": "batch"})
    cap = Captures()
    r = runner.Runner(glue, cuda_graphs=True, capture=cap, padding=plan)
    x = torch.randn(3, 8, device=DEVICE)
    got = r(x)
    assert got.shape == (3, 8) and torch.allclose(got, f(x)) and not cap.graphs and glue.plain.calls == 1
    state["pending"] = False
    for _ in range(2):
        got = r(x)
        assert got.shape == (3, 8) and torch.allclose(got, f(x))
    assert len(cap.graphs) == 1 and cap.graphs[0].replays >= 1 and glue.plain.calls == 1


def test_while_a_background_compile_runs_a_waiting_thread_gets_the_interpreter_back_quickly(optimized, monkeypatch):
    """A call's ops each let go of the GIL and wait to get it back from a compiling thread: while any background
    compile runs, the interpreter's switch interval is regions.BACKGROUND_SWITCH_S (not its 5 ms), put back as it
    was after the last of two overlapping compiles ends; an interval the application set meanwhile is left alone."""
    import sys
    _, opt = optimized
    gm, example, device = opt.graph_module, opt.example_inputs, torch.device(DEVICE)
    before = sys.getswitchinterval()
    assert before > regions.BACKGROUND_SWITCH_S
    try:
        go = _held(monkeypatch)
        first, second = (runner.compiled_glue(gm, Plain(gm), True) for _ in range(2))
        assert first.compile_dynamic_later([example], device) and second.compile_dynamic_later([example], device)
        assert sys.getswitchinterval() <= regions.BACKGROUND_SWITCH_S
        monkeypatch.undo()
        go.set()
        assert first.wait(300) and second.wait(300)
        assert sys.getswitchinterval() == pytest.approx(before)

        go = _held(monkeypatch)
        glue = runner.compiled_glue(gm, Plain(gm), True)
        assert glue.compile_dynamic_later([example], device)
        sys.setswitchinterval(0.003)          # (the application's own choice, made while it compiles)
        go.set()
        assert glue.wait(300) and sys.getswitchinterval() == pytest.approx(0.003)
    finally:
        sys.setswitchinterval(before)


def test_a_conversion_waits_for_the_background_compile_that_reads_the_modules_tensors(monkeypatch):
    """.to() / .half() / .float() convert the tensors a background glue compile is reading: the conversion waits
    until it has ended, then converts."""
    opt = _optimize(_bert(), _example())
    gm = opt.graph_module
    glue = runner.compiled_glue(gm, Plain(gm), True)
    go = _held(monkeypatch)
    assert glue.compile_dynamic_later([opt.example_inputs], torch.device(DEVICE))
    opt.runner = runner.Runner(glue, False)
    seen, apply = [], torch.nn.Module._apply

    def recorded(self, fn, recurse=True):
        seen.append(glue.pending())
        return apply(self, fn, recurse)

    monkeypatch.setattr(torch.nn.Module, "_apply", recorded)
    threading.Timer(0.3, go.set).start()
    opt.float()
    assert seen and not any(seen) and not glue.pending()


class _Reached(Exception):
    pass


@pytest.mark.parametrize("entry", ["save", "report", "pickle", "deepcopy", "release_graphs"])
def test_what_reads_the_graph_or_times_it_waits_for_the_background_compile(optimized, monkeypatch, tmp_path, entry):
    """accelc.save exports the graph a background glue compile is running Dynamo on, a pickle or a deep copy reads
    it, release_graphs drops the glue that compile goes on with (unseen by wait_for_other_shapes after), and the
    report times layers that compile would share the host and the GPU with: each waits until it has ended (the
    default since runs/first_requests/run9-h200-background/)."""
    from accelc import api as api_module, guard, serialize
    from accelc import optimized as optimized_module
    from accelc.report import measure

    model, opt = optimized
    gm = opt.graph_module
    glue = _stand_in_glue(gm, False)
    del glue.pending                  # (the real one: the held thread below)
    go = _held(monkeypatch)
    assert glue.compile_dynamic_later([opt.example_inputs], torch.device(DEVICE))
    monkeypatch.setattr(opt, "runner", runner.Runner(glue, False))
    seen = []

    def reached(*args, **kwargs):
        seen.append(glue.pending())
        raise _Reached

    threading.Timer(0.3, go.set).start()
    try:
        with pytest.raises(_Reached):
            if entry == "save":
                monkeypatch.setattr(serialize, "export_program", reached)
                accelc.save(opt, tmp_path / "m.pt2")
            elif entry in ("pickle", "deepcopy"):
                monkeypatch.setattr(optimized_module, "graph_state", reached)
                monkeypatch.setattr(copy, "deepcopy", reached)
                pickle.dumps(opt) if entry == "pickle" else opt.__deepcopy__({})
            elif entry == "release_graphs":
                monkeypatch.setattr(optimized_module.gc, "collect", reached)
                opt.release_graphs()
            else:
                monkeypatch.setattr(guard, "layer_inputs", reached)
                measure(opt, api_module.make_job(model, _example()), with_ort=False, progress=False)
    finally:
        go.set()
        glue.wait(60)
    assert seen == [False] and not (tmp_path / "m.pt2").exists()


def test_a_steps_glue_compiled_on_copies_of_its_cache_serves_its_calls_after(monkeypatch, lm_opt):
    """Inductor (this machine's) compiles the step's regions for dynamic shapes in the background, on copies of
    its cache: a call at another prompt length afterwards runs that compiled code (no compile, the plain graph not
    called), and writes the model's cache as the plain graph does, its outputs the plain graph's."""
    opt = lm_opt
    step = opt.step
    gm = step.graph_module
    torch._dynamo.reset()
    plain = Plain(gm)
    glue = runner.compiled_glue(gm, plain, True)
    assert isinstance(glue, regions.RegionalGlue) and glue.state
    # (tensors of their own, as warmup.run hands over: a view's compile guards on its base, which a call's has not)
    assert glue.compile_dynamic_later([warmup._own(step.example_inputs)], torch.device(DEVICE))
    assert glue.wait(600) and not glue.failed
    ids = torch.randint(1, 100, (1, 9), device=DEVICE)
    args = opt.cache_step.prefill_inputs(ids, torch.ones_like(ids))
    cache = {k: v for k, v in gm.named_buffers() if k in glue.state}
    start = {k: v.clone() for k, v in cache.items()}
    made = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        want = gm(*args)
        written = {k: v.clone() for k, v in cache.items()}
        for k, v in cache.items():
            v.copy_(start[k])
        got = glue(*args)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == made and plain.calls == 0
    assert rel_l2(_first(got), _first(want)) < 1e-5
    for k, v in cache.items():
        assert rel_l2(v.float(), written[k].float()) < 1e-5, k


def test_copies_of_the_state_that_do_not_fit_leave_the_compile_to_a_first_call(monkeypatch, lm_opt):
    """Where the copies of the cache run out of memory in the background thread, nothing is compiled there and the
    glue is not marked failed: said, and a first call at another shape compiles it (as a causal LM's forward's)."""
    opt = lm_opt
    gm = opt.step.graph_module
    glue = regions.RegionalGlue(gm, Plain(gm), True, regions.plan(gm), lambda m, d: m, runner.STATIC_GLUE,
                                runner.signature_or_none)

    def no_room(self):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(regions.RegionalGlue, "state_apart", no_room)
    with pytest.warns(UserWarning, match="did not fit in memory"):
        assert glue.compile_dynamic_later([warmup._own(opt.step.example_inputs)], torch.device(DEVICE))
        assert glue.wait(60)
    assert not glue.failed and not glue.dynamic_done and not glue.pending()


def test_an_lm_generates_its_tokens_while_and_after_its_steps_glue_compiles_in_the_background(monkeypatch):
    """End to end (the GPU's branches taken on the CPU: the warm-up's, and the speed optimize measures on the
    example prompt; Inductor compiling the step's regions): optimize returns with the step's glue for other shapes
    compiling on copies of its cache, not compiled by the speed measurement's prefill inside optimize (on the GPU
    it was: the thread then found it done and never started), whose line says the first token was not timed; a
    generate() at another prompt length meanwhile, and again once it has compiled, gives the model's own greedy
    tokens. (The compile held while the first generate runs: the Triton interpreter this machine runs the kernels
    in is not for two threads.)"""
    warmup_takes_the_gpu_branch(monkeypatch)
    times_as_on_a_gpu(monkeypatch, api)      # (attach_generation's speed measurement, note_speed)
    go, compile_dynamic = threading.Event(), regions.Glue._compile_dynamic
    monkeypatch.setattr(regions.Glue, "_compile_dynamic", lambda self, *a: go.wait(120) and compile_dynamic(self, *a))
    lm = _tiny_lm(3)
    opt = _optimize(lm, _example(1, 6), other_shapes="background", glue="inductor", max_cache_len=16)
    glue = opt.step.runner.fn
    assert isinstance(glue, regions.RegionalGlue) and glue.later is not None      # started, on copies
    assert not glue.dynamic_done and not glue.due
    line = next(x for x in opt.summary().splitlines() if x.startswith("generation:"))
    assert "first token not timed (the prompt's glue compiles in the background" in line and "decode " in line
    ids = torch.randint(1, 100, (1, 9), device=DEVICE)
    with torch.no_grad():
        want = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
        during = opt.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              pad_token_id=0)
        assert glue.pending()
        go.set()
        assert opt.wait_for_other_shapes(600) and not glue.failed and glue.dynamic_done
        after = opt.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert torch.equal(during, want) and torch.equal(after, want)


@pytest.mark.parametrize("progress", [True, False])
def test_optimize_says_when_it_returns_with_the_glue_compiling_in_the_background(monkeypatch, capsys, caplog,
                                                                                  progress):
    """A call timed right after optimize shares the host with the background compile: optimize says so where its
    progress shows (and to the logger always), with the way to wait; nothing is said where none was started."""
    warmup_takes_the_gpu_branch(monkeypatch)
    ended = threading.Event()

    def later(self, inputs):
        thread = threading.Thread(target=ended.wait, args=(60,))
        regions._LATER.add(thread)
        thread.start()
        return True

    monkeypatch.setattr(OptimizedModule, "compile_other_shapes_later", later)
    try:
        with caplog.at_level("INFO", logger="accelc"):
            accelc.optimize(_bert(), _example(), accelc.OptimizeConfig(passes=("linear_act",), only_if_faster=False,
                                                                        other_shapes="background"), progress=progress)
    finally:
        ended.set()
    said = "the glue for other shapes compiles in the background"
    assert (said in capsys.readouterr().err) == progress and said in caplog.text and "wait_for_other_shapes()" in caplog.text
    regions.wait_background()
    caplog.clear()
    monkeypatch.setattr(OptimizedModule, "compile_other_shapes", lambda self, inputs: True)
    with caplog.at_level("INFO", logger="accelc"):
        accelc.optimize(_bert(), _example(), accelc.OptimizeConfig(passes=("linear_act",), only_if_faster=False,
                                                                    other_shapes="now"), progress=True)
    assert said not in capsys.readouterr().err and said not in caplog.text
