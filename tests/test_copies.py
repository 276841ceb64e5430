"""The optimized module as other tools take it, after ordinary use: pickled, copied (deep and shallow),
compiled by torch.compile, exported to ONNX, read back by accelc.load. Split from test_bad_inputs.py."""
import warnings

import pytest
import torch
from torch import nn

import accelc
from accelc.errors import InputError
from conftest import DEVICE, rel_l2
from bad_models import CFG, Fc


def test_torch_compile_of_the_optimized_module_with_grad_enabled():
    """Its weights need no gradient (its own copy): torch.compile traces no backward through
    accelc's ops; the caller's model keeps requires_grad."""
    model = Fc().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert torch.is_grad_enabled() and not any(p.requires_grad for p in opt.parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert rel_l2(torch.compile(opt)(x), model(x).detach()) < 1e-5


class _Branchy(nn.Module):
    """A shape branch: symbolic_trace cannot take it, torch.export pins the batch to its side of 4."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) * 2 if x.shape[0] > 4 else self.fc(x) - 1


def test_a_module_captured_by_export_pickles_with_its_shape_checks_and_output_type():
    """pickle / torch.save of an optimized model torch.export captured (the shape checks are a function
    export generates with exec; the output an HF ModelOutput built with pytree): it reads back, takes
    the same calls, refuses the same shapes (a call on the other side of a shape branch must not run
    the traced side silently) and returns the same output type."""
    import io
    import pickle

    torch.manual_seed(0)
    model = _Branchy().to(DEVICE).eval()
    x = torch.randn(6, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert opt.info.capture_method == "torch.export"
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    for back in (pickle.loads(pickle.dumps(opt)), torch.load(buf, weights_only=False)):
        with torch.no_grad():
            assert rel_l2(back(x), model(x)) < 1e-5
            with pytest.raises(InputError, match="shape"):
                back(torch.randn(3, 16, device=DEVICE))          # the other branch: refused, as before pickling
    bert = _tiny_bert()
    ids = torch.randint(0, 100, (2, 16), device=DEVICE)
    opt = accelc.optimize(bert, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, CFG)
    back = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(opt))))      # twice: a read-back pickles again
    call = {"input_ids": torch.randint(0, 100, (3, 9), device=DEVICE), "attention_mask": torch.ones(3, 9, dtype=torch.long,
                                                                                                    device=DEVICE)}
    with torch.no_grad():
        got, want = back(**call), bert(**call)
    assert type(got) is type(want) and rel_l2(got.last_hidden_state, want.last_hidden_state) < 1e-5
    with pytest.raises(InputError):
        back(input_ids=torch.randint(0, 100, (3, 65), device=DEVICE), attention_mask=torch.ones(3, 65, dtype=torch.long,
                                                                                                  device=DEVICE))


def test_the_shape_checks_of_an_export_captured_module_compile_under_dynamo():
    """torch.compile traces the program's shape checks (ShapeGuards' function): built without
    __builtins__ in its globals, every Inductor compile of the glue failed (KeyError: '__builtins__')
    and the glue ran uncompiled, a GPU decode step three times slower; before pickling and after."""
    import pickle

    torch.manual_seed(0)
    model = _Branchy().to(DEVICE).eval()
    x = torch.randn(6, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert opt.info.capture_method == "torch.export"
    back = pickle.loads(pickle.dumps(opt))
    for gm in (opt.graph_module, back.graph_module):
        torch._dynamo.reset()
        compiled = torch.compile(gm, backend="eager", fullgraph=True)
        with torch.no_grad():
            out = compiled(x)
            assert rel_l2(out[0] if isinstance(out, (tuple, list)) else out, model(x)) < 1e-5
    if DEVICE.type == "cuda":     # the default runtime compiles the glue with Inductor: it must not give up
        with torch.no_grad():
            opt(x), opt(x)
        assert "could not compile" not in opt.summary()


def test_a_module_captured_by_symbolic_trace_pickles_and_deep_copies():
    """Its graph's inputs carry type annotations (x: torch.Tensor), which fx's own pickling names by a
    global it cannot import; a deep copy keeps the graph and its node metadata."""
    import copy
    import pickle

    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs(4)
    opt = accelc.optimize(model, (x,), CFG)
    assert opt.info.capture_method == "symbolic_trace"
    with torch.no_grad():
        want = opt(x)
        back = pickle.loads(pickle.dumps(opt))
        # (the runtime line counts the graphs captured so far: a read-back module has none yet)
        same = [line for line in opt.summary().splitlines() if not line.lstrip().startswith("runtime:")]
        assert torch.equal(back(x), want)
        assert [line for line in back.summary().splitlines() if not line.lstrip().startswith("runtime:")] == same
        twin = copy.deepcopy(opt)
        assert torch.equal(twin(x), want)
    assert [n.meta.keys() for n in twin.graph_module.graph.nodes] == [n.meta.keys() for n in opt.graph_module.graph.nodes]


def test_a_shallow_copy_of_the_optimized_module_keeps_its_graph_module():
    """copy.copy goes through __getstate__ like pickle: it must not take the pickling stand-in for
    the graph module (it did, and the copy failed at its first call)."""
    import copy

    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs(4)
    opt = accelc.optimize(model, (x,), CFG)
    with torch.no_grad():
        want = opt(x)
        twin = copy.copy(opt)
        assert twin.graph_module is opt.graph_module and twin.runner is None and torch.equal(twin(x), want)


def test_a_program_accelc_load_read_pickles(tmp_path):
    """accelc.load's module pickles as its program (its module holds export's hooks, which do not)."""
    import pickle

    torch.manual_seed(0)
    model = Fc().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    accelc.save(accelc.optimize(model, x, CFG), tmp_path / "m.pt2")
    back = pickle.loads(pickle.dumps(accelc.load(tmp_path / "m.pt2")))
    y = torch.randn(7, 16, device=DEVICE)
    with torch.no_grad():
        assert rel_l2(back(y), model(y)) < 1e-5
    assert back.accelc_summary is not None and next(back.program.parameters()).device.type == x.device.type


def test_onnx_export_of_the_optimized_module_records_each_accelc_op_as_its_reference(tmp_path):
    """ONNX has no accelc ops: torch.onnx.export of an optimized model records each one as its
    PyTorch reference (it failed deep in the exporter), and ONNX Runtime's result is eager's."""
    ort = pytest.importorskip("onnxruntime")
    bert = _tiny_bert()
    ids = torch.randint(0, 100, (2, 16), device=DEVICE)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    # (eager glue: on a GPU the Inductor glue keeps the LayerNorms, and the test wants one rewritten)
    opt = accelc.optimize(bert, inputs, accelc.OptimizeConfig(only_if_faster=False, glue="eager"))
    assert {r.kernel.split("[")[0] for r in opt.rewritten} >= {"accelc::linear", "accelc::layer_norm"}, opt.summary()
    path = tmp_path / "bert.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(opt, (), str(path), kwargs=inputs, dynamo=True, verbose=False)
        want = bert(**inputs).last_hidden_state
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {i.name: inputs[i.name].cpu().numpy() for i in session.get_inputs()}
    got = torch.from_numpy(session.run(None, feed)[0])
    assert rel_l2(got, want.cpu()) < 1e-5


def _tiny_bert():
    T = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           vocab_size=100, max_position_embeddings=64)
        return T.BertModel(cfg).to(DEVICE).eval()


def test_an_hf_model_with_its_glue_and_graphs_pickles_and_compiles_after_calls():
    """The default runtime (on the GPU: Inductor glue, a CUDA graph per shape bucket) after it has
    run: pickle / torch.save and torch.compile of the optimized HF model with grad enabled give
    eager's numbers and the HF output type; the read-back module runs through its own runtime."""
    import io
    import pickle

    torch.manual_seed(0)
    bert = _tiny_bert()
    ids = torch.randint(0, 100, (2, 16), device=DEVICE)
    opt = accelc.optimize(bert, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, CFG)
    calls = [{"input_ids": torch.randint(0, 100, (b, n), device=DEVICE),
              "attention_mask": torch.ones(b, n, dtype=torch.long, device=DEVICE)} for b, n in ((2, 16), (3, 9))]
    with torch.no_grad():
        want = [bert(**c).last_hidden_state for c in calls]
        got = [opt(**c).last_hidden_state for c in calls]
    assert all(rel_l2(g, w) < 1e-5 for g, w in zip(got, want))
    if DEVICE.type == "cuda":
        assert opt.runner is not None and opt.runner.cuda_graphs and "could not compile" not in opt.summary()
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    for back in (pickle.loads(pickle.dumps(opt)), torch.load(buf, weights_only=False)):
        with torch.no_grad():
            out = [back(**c) for c in calls]
        assert type(out[0]) is type(bert(**calls[0]))
        assert all(rel_l2(o.last_hidden_state, w) < 1e-5 for o, w in zip(out, want))
    assert torch.is_grad_enabled()
    compiled = torch.compile(opt)
    out = [compiled(**c).last_hidden_state for c in calls]
    assert all(rel_l2(o.detach(), w) < 1e-5 for o, w in zip(out, want))
