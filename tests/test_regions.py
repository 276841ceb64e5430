"""accelc/regions.py: the glue cut at a model's repeated blocks, one compile per kind of block. The cut graph
computes what the whole graph computes (outputs and in-place cache writes, bit for bit, uncompiled), blocks of
one kind share their compiles (dynamic, and static per warmed shape), and where the cut does not pay, or is
switched off, the glue compiles whole as before."""
import dataclasses
import warnings

import pytest
import torch
import transformers as T
from torch import nn
from torch.utils import _pytree as pytree

import accelc
from accelc import meta, regions, runner
from conftest import DEVICE, rel_l2
from test_runner import Captures

LAYERS = 4


def _lm(layers=LAYERS):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.LlamaForCausalLM(cfg).to(DEVICE).eval()


@pytest.fixture(scope="module")
def optimized():
    lm = _lm()
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm, dict(input_ids=ids, attention_mask=torch.ones_like(ids)),
                              accelc.OptimizeConfig(passes=("linear_act",), only_if_faster=False))
    return lm, opt


def _leaves(x):
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


class Recorded:
    """torch.compile's stand-in: the module runs as it is; every compile is kept."""

    def __init__(self):
        self.compiles = []

    def __call__(self, gm, dynamic):
        self.compiles.append((gm, dynamic))
        return gm


@pytest.mark.parametrize("program", ["forward", "step"])
def test_the_cut_graph_computes_what_the_whole_graph_computes(optimized, program):
    """Every compute node in exactly one region, in graph order; the blocks one kind; run uncompiled, the cut
    graph's outputs equal the whole graph's, and the step program's in-place cache writes land alike."""
    _, opt = optimized
    o = opt if program == "forward" else opt.step
    gm = o.graph_module
    cut = regions.plan(gm)
    assert cut is not None
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    assert [n for s in cut.segments for n in s.nodes] == compute
    blocks = [s for s in cut.segments if s.label]
    assert [s.label.rsplit(".", 1)[1] for s in blocks] == [str(i) for i in range(LAYERS)]
    assert len({s.key for s in blocks}) == 1 and cut.kinds == len({s.key for s in cut.segments}) < len(cut.segments)
    compile_fn = Recorded()
    glue = regions.RegionalGlue(gm, gm, False, cut, compile_fn, runner.STATIC_GLUE, runner.signature_or_none)
    assert len(compile_fn.compiles) == cut.kinds
    buffers = dict(gm.named_buffers())
    before = {k: v.clone() for k, v in buffers.items()}
    with torch.no_grad():
        want = gm(*o.example_inputs)
        written = {k: v.clone() for k, v in buffers.items()}
        for k, v in buffers.items():
            v.copy_(before[k])
        got = glue(*o.example_inputs)
    assert all(torch.equal(a, b) for a, b in zip(_leaves(want), _leaves(got))) and len(_leaves(got)) == len(_leaves(want))
    assert all(torch.equal(buffers[k], written[k]) for k in buffers)
    if program == "step":
        assert any(not torch.equal(before[k], written[k]) for k in buffers), "the step wrote no cache: nothing checked"


def test_blocks_of_a_kind_share_their_compiles_dynamic_and_static(optimized):
    """A dynamic glue: one compile per kind; a warmed-up shape adds one static compile per kind (not per block);
    a call at another shape runs the dynamic ones; at most STATIC_GLUE shapes specialized."""
    _, opt = optimized
    gm = opt.step.graph_module
    cut = regions.plan(gm)
    compile_fn = Recorded()
    glue = regions.RegionalGlue(gm, gm, True, cut, compile_fn, runner.STATIC_GLUE, runner.signature_or_none)
    assert [d for _, d in compile_fn.compiles] == [True] * cut.kinds
    r = runner.Runner(glue, cuda_graphs=True, capture=Captures())
    with torch.no_grad():
        r.warm_up(*opt.step.example_inputs)
    static = [m for m, d in compile_fn.compiles if d is False]
    assert len(static) == cut.kinds and all(m.forward.__code__ is not g.forward.__code__
                                            for m, (g, _) in zip(static, compile_fn.compiles))
    assert "static ones at 1 shape(s)" in r.status() and "compile(s)" in r.status()
    key = runner.signature_or_none(tuple(opt.step.example_inputs), {})
    assert not glue.specialize(None) and glue.specialize(key)
    for i in range(runner.STATIC_GLUE + 2):
        glue.specialize(("another shape", i))
    assert len(glue.static) == runner.STATIC_GLUE


def test_no_cut_where_it_does_not_pay_or_is_switched_off(optimized, monkeypatch):
    """A graph without repeated blocks, or with too few to pay, compiles whole; ACCELC_REGIONAL_GLUE=0 too."""
    _, opt = optimized
    mlp = accelc.models.get("mlp")
    gm = torch.fx.symbolic_trace(mlp)
    assert regions.plan(gm) is None
    assert isinstance(runner.compiled_glue(gm, gm, False), runner.CompiledGlue)
    assert regions.plan(opt.graph_module) is not None
    monkeypatch.setenv("ACCELC_REGIONAL_GLUE", "0")
    assert regions.plan(opt.graph_module) is None
    assert regions.block_label("model.layers.3.mlp.up_proj", 1) == "model.layers.3"
    assert regions.block_label("layers.0.blocks.1.attn", 2) == "layers.0.blocks.1"
    assert regions.block_label("model.norm", 1) is None


def test_a_region_that_fails_to_compile_runs_the_whole_graph_plain(optimized):
    """Dynamo failing on a region: the plain graph runs from then on, said once, as CompiledGlue does."""
    _, opt = optimized
    gm = opt.graph_module

    def failing(module, dynamic):
        def call(*a):
            raise torch._dynamo.exc.InternalTorchDynamoError("no lowering for op")
        return call

    glue = regions.RegionalGlue(gm, gm, False, regions.plan(gm), failing, runner.STATIC_GLUE, runner.signature_or_none)
    with torch.no_grad(), pytest.warns(UserWarning, match="Inductor could not compile the glue"):
        got = glue(*opt.example_inputs)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(_leaves(got), _leaves(gm(*opt.example_inputs))))
    assert "Inductor could not compile" in glue.status()


def test_a_block_with_a_module_of_its_own_is_its_own_kind():
    """A block whose graph calls a submodule (not an op on its tensors) cannot share another block's compile."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.fc(x)) + x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(6))

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    class Leaves(torch.fx.Tracer):     # nn.Linear kept a call_module, as a model's own leaf module would be
        def is_leaf_module(self, m, name):
            return isinstance(m, nn.Linear)

    net = Net()
    gm = torch.fx.GraphModule(net, Leaves().trace(net))
    path = ""
    for n in gm.graph.nodes:            # each block's ops on its path, as a capture writes them
        if n.op == "call_module":
            path = n.target.rpartition(".")[0]
        n.meta[meta.PATH] = path if n.op in ("call_module", "call_function") else ""
    segs = regions._segments(gm, 1)
    users = {n: set(n.users) for n in gm.graph.nodes}
    for s in segs:
        regions._build(s, gm, users)
    blocks = [s for s in segs if s.label]
    assert len(blocks) == 6 and len({s.key for s in blocks}) == 6     # each calls its own nn.Linear
    assert regions.plan(gm) is None


def test_inductor_compiles_the_regions_and_their_numbers_match(optimized):
    """The real compile (Inductor on this machine's device): three compiles for the forward (before the blocks,
    one block kind, after them), the optimized model's outputs within fp32 tolerance of eager."""
    from torch._dynamo.utils import counters

    lm, opt = optimized
    gm = opt.graph_module
    torch._dynamo.reset()
    counters.clear()
    glue = runner.compiled_glue(gm, runner.direct_calls(gm), False)
    assert isinstance(glue, regions.RegionalGlue)
    with torch.no_grad():
        got = glue(*opt.example_inputs)
        want = gm(*opt.example_inputs)
    assert counters["stats"]["unique_graphs"] == regions.plan(gm).kinds == 3
    assert rel_l2(_leaves(got)[0], _leaves(want)[0]) < 1e-5 and not glue.failed


def test_generation_through_compiled_regions_gives_the_models_tokens():
    """The step program's glue compiled by region (its cache writes inside the regions, through Inductor):
    greedy tokens equal the model's own generate."""
    lm = _lm()
    ids = torch.randint(1, 100, (2, 6), device=DEVICE)
    mask = torch.ones_like(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm, dict(input_ids=ids, attention_mask=mask),
                              accelc.OptimizeConfig(passes=("linear_act",), only_if_faster=False, glue="inductor"))
        want = lm.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        got = opt.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert "glue compiled by region" in opt.step.runner.status(), opt.step.runner.status()
    assert torch.equal(got, want)


def test_a_first_call_that_compiles_the_glue_for_other_shapes_says_so_once(optimized, caplog):
    """Where optimize left the dynamic glue to a first call (a causal LM's forward), that call's compile is said in
    the log, once; a glue compiled at optimize says nothing at its calls."""
    _, opt = optimized
    gm = opt.graph_module
    said = "compiling the glue for other shapes at this call, once"
    for at_optimize in (False, True):
        glue = regions.RegionalGlue(gm, gm, True, regions.plan(gm), Recorded(), runner.STATIC_GLUE,
                                    runner.signature_or_none)
        caplog.clear()
        with torch.no_grad(), caplog.at_level("INFO", logger="accelc"):
            if at_optimize:
                glue.compile_dynamic(*opt.example_inputs)
            want = gm(*opt.example_inputs)
            for _ in range(2):
                assert all(torch.equal(a, b) for a, b in zip(_leaves(glue(*opt.example_inputs)), _leaves(want)))
        assert caplog.text.count(said) == (0 if at_optimize else 1), caplog.text


def _gpu_warmup_recorded(monkeypatch) -> list:
    """optimize's warm-up stage takes the GPU's branch on the CPU: no capture, each compile of the glue for other
    shapes recorded (the inputs' shapes) in the list returned."""
    import types

    from accelc import runtime, warmup
    from accelc.optimized import OptimizedModule

    made = []
    shim = types.SimpleNamespace(**{k: getattr(runtime, k) for k in dir(runtime) if not k.startswith("__")})
    shim.can_time = lambda device: True
    monkeypatch.setattr(warmup, "runtime", shim)
    monkeypatch.setattr(OptimizedModule, "warm_up", lambda self, inputs: None)
    monkeypatch.setattr(OptimizedModule, "compile_other_shapes",
                        lambda self, inputs: made.append([tuple(t.shape) for t in inputs]) or True)
    return made


def test_the_glue_for_other_shapes_compiles_at_optimize_not_at_a_first_request(optimized, monkeypatch):
    """A dynamic glue's compile for the shapes not warmed up is made by one call at optimize (its own phase in
    the summary's times), not at the first call of such a shape: by region, each kind's dynamic compile runs
    once, and no more after; a static glue, or a plain one, has none to make."""
    _, opt = optimized
    gm = opt.graph_module

    class Counting(Recorded):
        def __call__(self, gm, dynamic):
            calls = self.calls = getattr(self, "calls", {})

            def run(*args):
                calls[dynamic] = calls.get(dynamic, 0) + 1
                return gm(*args)
            self.compiles.append((gm, dynamic))
            return run

    compile_fn = Counting()
    glue = regions.RegionalGlue(gm, gm, True, regions.plan(gm), compile_fn, runner.STATIC_GLUE,
                                runner.signature_or_none)
    r = runner.Runner(glue, cuda_graphs=True, capture=Captures())
    with torch.no_grad():
        assert r.compile_other_shapes(*opt.example_inputs)
    assert compile_fn.calls == {True: len(regions.plan(gm).segments)}     # every region, on its dynamic compile
    assert not r.compile_other_shapes(*opt.example_inputs) and compile_fn.calls[True] == len(regions.plan(gm).segments)
    static = regions.RegionalGlue(gm, gm, False, regions.plan(gm), Counting(), runner.STATIC_GLUE, runner.signature_or_none)
    assert not static.compile_dynamic(*opt.example_inputs)
    assert not runner.Runner(gm, cuda_graphs=True).compile_other_shapes(*opt.example_inputs)
    # optimize on a GPU with other_shapes="now" makes it after the warm-up (here the GPU's branch taken with both
    # recorded; the default, "background", in test_glue_later)
    made = _gpu_warmup_recorded(monkeypatch)
    mlp = accelc.models.get("mlp").to(DEVICE).eval()
    x = mlp.example_inputs()
    x = tuple(t.to(DEVICE) for t in x) if isinstance(x, tuple) else x.to(DEVICE)
    out = accelc.optimize(mlp, x, accelc.OptimizeConfig(passes=(), only_if_faster=False, other_shapes="now"))
    # the example's call (the MLP is traced with no shapes recorded: no variant at a batch of one to compile)
    shape = tuple((x[0] if isinstance(x, tuple) else x).shape)
    assert made == [[shape]], made
    assert "glue for other shapes" in out.info.seconds


def test_a_causal_lms_forward_leaves_its_glue_for_other_shapes_to_a_first_call(monkeypatch):
    """A causal LM's generate() runs its generation step (a program with its own dynamic glue, compiled at optimize);
    the forward's dynamic glue is left to the forward's first call at another shape, which the shapes line says,
    unless warmup_shapes asks for forward shapes (then compiled at optimize as for any model). The GPU's branch
    taken on the CPU, the compiles recorded."""
    from accelc import warmup

    made = _gpu_warmup_recorded(monkeypatch)
    lm = _lm(layers=1)
    ids = torch.randint(1, 100, (2, 8), device=DEVICE)
    config = accelc.OptimizeConfig(passes=(), only_if_faster=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm, dict(input_ids=ids, attention_mask=torch.ones_like(ids)), config)
    assert opt.step is not None
    forward = [(2, 8), (2, 8)]          # the forward's graph inputs (the step's: tokens, mask, positions, a length)
    assert forward not in made and len(made) == 1, made       # the step's dynamic glue alone
    assert warmup.FORWARD_GLUE_LATER in opt.info.shapes
    assert "glue for other shapes" not in opt.info.seconds
    # forward shapes asked for: the forward's dynamic glue compiled at optimize
    made.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        asked = accelc.optimize(lm, dict(input_ids=ids, attention_mask=torch.ones_like(ids)),
                                dataclasses.replace(config, warmup_shapes=[{"input_ids": (1, 8),
                                                                             "attention_mask": (1, 8)}]))
    assert forward in made and "glue for other shapes" in asked.info.seconds, made
    assert warmup.FORWARD_GLUE_LATER not in asked.info.shapes


@pytest.mark.parametrize("example,lo,want", [
    ((4, 64), 1, [(1, 64)]),              # a batch of one compiles apart from the example's batch of 4
    ((1, 64), 1, [(2, 64)]),              # an example of batch 1: the other batches' compile
    ((4, 1), 1, [(4, 2), (1, 2)]),        # a length of 1 too: both
    ((4, 64), 2, []),                     # a batch that does not go down to 1: nothing apart
])
def test_the_sizes_dynamo_compiles_apart_are_compiled_at_optimize(example, lo, want):
    """warmup.apart_inputs: the graph inputs at the sizes the dynamic glue compiles apart from the example's
    (Dynamo specializes a size of 1): the varying dims of a recorded contract, the batch (a leading dim) at 1."""
    import types

    from accelc import warmup
    from accelc.capture.shapes import SHAPES, DimRange, InputShapes

    b, n = DimRange(lo, None, "s0"), DimRange(1, 512, "s1")
    shapes = InputShapes(names=("ids", "mask"), dims=((b, n), (b, n)))
    opt = types.SimpleNamespace(graph_module=types.SimpleNamespace(meta={SHAPES: shapes}))
    ids = torch.randint(0, 100, example)
    got = warmup.apart_inputs(opt, (ids, torch.ones_like(ids)))
    assert [tuple(a.shape) for a, _ in got] == want and all(m.shape == a.shape for a, m in got)
    for a, _ in got:     # the example's ids repeated and cut to size (real ids, as inputs_at gives them)
        r, c = min(a.shape[0], ids.shape[0]), min(a.shape[1], ids.shape[1])
        assert (a[:r, :c] == ids[:r, :c]).all()


def test_the_dynamic_regions_serve_other_batches_and_lengths(optimized):
    """Compiled by region for dynamic shapes (Inductor on this machine's device), the forward called at batches
    and lengths other than its example's gives the whole graph's numbers, on the one dynamic compile per kind."""
    lm, opt = optimized
    gm = opt.graph_module
    torch._dynamo.reset()
    glue = runner.compiled_glue(gm, runner.direct_calls(gm), True)
    assert isinstance(glue, regions.RegionalGlue)
    for b, n in ((2, 8), (3, 5), (1, 12)):
        ids = torch.randint(1, 100, (b, n), device=DEVICE)
        args = (ids, torch.ones_like(ids))
        with torch.no_grad():
            got, want = glue(*args), gm(*args)
        assert rel_l2(_leaves(got)[0], _leaves(want)[0]) < 1e-5 and not glue.failed, (b, n)


def test_a_batch_of_one_compiled_at_optimize_serves_a_request_without_a_compile(optimized):
    """The glue's variant for a batch of one, compiled at optimize on warmup.apart_inputs, serves a request of
    batch one at another length with no compile: the inputs it was compiled on were views of the example, and
    Dynamo's guards then read their base, which a request's tensors have not (each such request compiled the
    variant again: 1.3 s of BERT's glue on an H200)."""
    from accelc import warmup

    lm, opt = optimized
    gm = opt.graph_module
    torch._dynamo.reset()
    glue = runner.compiled_glue(gm, runner.direct_calls(gm), True)
    apart = warmup.apart_inputs(opt, opt.example_inputs)
    assert [tuple(a.shape) for a in apart[0] if isinstance(a, torch.Tensor)] == [(1, 8), (1, 8)]
    with torch.no_grad():
        assert glue.compile_dynamic(*opt.example_inputs) and glue.compile_dynamic(*apart[0])
        made = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        ids = torch.randint(1, 100, (1, 13), device=DEVICE)
        got = glue(ids, torch.ones_like(ids))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == made
        want = gm(ids, torch.ones_like(ids))
    assert rel_l2(_leaves(got)[0], _leaves(want)[0]) < 1e-5 and not glue.failed


def test_direct_calls_generates_its_code_once(optimized, monkeypatch):
    """The launchers' copy of a graph has its forward's code generated once, for the retargeted graph (its second
    generation cost ~0.9 s of a 24-layer LM's warm optimize on the GPU host), calling the launchers, sharing
    the original's weights, and the original graph keeps its ops."""
    from torch import fx
    from conftest import count_calls

    _, opt = optimized
    gm = opt.graph_module
    made = count_calls(monkeypatch, fx.GraphModule, "recompile")
    direct = runner.direct_calls(gm)
    assert len(made) == 1
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in runner.LAUNCHERS]
    called = [n.target for n in direct.graph.nodes if n.op == "call_function"]
    assert ops and all(runner.LAUNCHERS[op] in called for op in ops)
    assert not any(op in called for op in ops)
    assert all(a is b for a, b in zip(direct.parameters(), gm.parameters()))
