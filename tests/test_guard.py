"""accelc/guard.py: wrong or failing kernels put back, with the numbers; what the guard keeps alive."""
import pytest
import torch
from torch import fx, nn

import accelc
from accelc.kernels import gemm
from conftest import DEVICE, count_calls, rel_l2


def _model(name, dtype=torch.float32):
    return accelc.models.get(name).to(DEVICE, dtype)


def _broken_launch(*args, **kwargs):
    return gemm.linear_ref(*args[:6]) + 1.0  # right shape and dtype, wrong numbers


def test_guard_reverts_a_wrong_kernel(monkeypatch):
    monkeypatch.setattr(gemm, "linear_launch", _broken_launch)
    model = _model("mlp")
    (x,) = model.example_inputs()
    # eager glue: the comparison below is exact, and Inductor's fused glue may round differently
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(glue="eager", cuda_graphs=False))
    assert opt.rewritten == []
    reverted = [r for r in opt.layers if r.status == "reverted"]
    assert len(reverted) == 4 and all("over tolerance" in r.reason for r in reverted)
    assert reverted[0].rel_error > 1e-2
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))  # the original layers are back, exactly
    assert not any(n.target == torch.ops.accelc.linear.default for n in opt.graph_module.graph.nodes)


def test_guard_reverts_a_kernel_that_raises(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("out of resources")
    monkeypatch.setattr(gemm, "linear_launch", boom)
    model = _model("transformer_mlp")
    opt = accelc.optimize(model, model.example_inputs())
    rows = [r for r in opt.layers if r.status == "reverted"]
    assert len(rows) == 8 and "kernel failed: RuntimeError: out of resources" in rows[0].reason


class TransposedWeight(nn.Module):
    """A weight read through a transposed view: the original layer reads W.T, the rewritten one
    t(W.T). The guard must keep W.T alive until the layer has run (it used to free it after
    t(W.T) and fail with the node's name as the whole message)."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.W = nn.Parameter(torch.randn(12, 20) / 20 ** 0.5)
        self.emb = nn.Embedding(12, 20)

    def forward(self, x, w=None):
        if self.style == "W.T":
            return x @ self.W.T
        if self.style == "W.t()":
            return torch.relu(x @ self.W.t())
        if self.style == "transpose":
            return torch.matmul(x, self.W.transpose(0, 1)) + 1.0
        if self.style == "input":
            return x @ w
        return x @ self.emb.weight.T          # a tied LM head


@pytest.mark.parametrize("style", ["W.T", "W.t()", "transpose", "input", "tied"])
def test_weight_views_and_inputs_are_kept_alive_for_the_check(style):
    model = TransposedWeight(style).to(DEVICE).eval()
    args = (torch.randn(3, 7, 20, device=DEVICE),) + ((torch.randn(20, 12, device=DEVICE),) if style == "input" else ())
    opt = accelc.optimize(model, args)
    assert [r.kind for r in opt.rewritten] == ["linear"], opt.summary()
    assert not [r for r in opt.layers if r.status == "reverted"]
    with torch.no_grad():
        assert rel_l2(opt(*args), model(*args)) < 1e-5


def test_a_layer_slower_than_pytorch_stays_pytorch(monkeypatch):
    """OptimizeConfig.only_if_faster: where the original layer is faster on the example inputs,
    it is kept, with both times in the summary. (Timings mean something on a GPU only: both are
    stood in for here.)"""
    from accelc import guard, runtime

    def race(gm, args, nodes, against, ahead=False):
        # the first layer's kernel is the slower one, the others the faster
        return {n: ((0.02, 0.01) if i == 0 else (0.01, 0.02)) for i, n in enumerate(sorted(nodes, key=str))}

    monkeypatch.setattr(runtime, "can_time", lambda device: True)
    monkeypatch.setattr(runtime, "can_run_on", lambda device: True)
    monkeypatch.setattr(guard, "_race", race)
    model = _model("mlp")
    (x,) = model.example_inputs()
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=True, glue="eager", cuda_graphs=False))
    kept = [r for r in opt.layers if r.status == "kept" and r.kernel]
    assert len(kept) == 1 and len(opt.rewritten) == 3
    assert "20.0 us vs PyTorch (cuBLAS) 10.0 us on the example inputs: PyTorch kept" in kept[0].reason
    assert kept[0].check is not None and kept[0].check.passed          # its numbers were fine
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5
    off = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=False, glue="eager", cuda_graphs=False))
    assert len(off.rewritten) == 4


def test_guard_reverts_a_non_deterministic_kernel(monkeypatch):
    """Two runs on the same inputs differing is a race: reverted, named as such."""
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        out = gemm.linear_ref(*args[:6])
        return out + 1e-3 * out.abs().max() if len(calls) % 2 == 0 else out
    monkeypatch.setattr(gemm, "linear_launch", flaky)
    monkeypatch.setattr(accelc.guard, "repeat_runs", lambda: True)
    model = _model("mlp")
    opt = accelc.optimize(model, model.example_inputs())
    reverted = [r for r in opt.layers if r.status == "reverted"]
    assert reverted and all("non-deterministic" in r.reason for r in reverted), opt.summary()


@pytest.mark.parametrize("wrong_when", ["other batch", "other draw"])
def test_guard_checks_another_draw_and_another_batch(monkeypatch, wrong_when):
    """A kernel right on the example inputs but wrong on other inputs of the same shapes, or at
    another batch size, is reverted, the reason saying on which."""
    model = _model("mlp")
    (x,) = model.example_inputs()
    example_batch, first = x.shape[0], []

    def picky(*args, **kwargs):
        out = gemm.linear_ref(*args[:6])
        if wrong_when == "other batch" and args[0].shape[0] != example_batch:
            return out + 1.0
        if wrong_when == "other draw":
            first.append(1)
            if len(first) > 4:                      # the 4 layers' first calls are the example's
                return out + 1.0
        return out
    monkeypatch.setattr(gemm, "linear_launch", picky)
    monkeypatch.setattr(accelc.guard, "repeat_runs", lambda: False)    # one call per layer on the example
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(cuda_graphs=False))
    reverted = [r for r in opt.layers if r.status == "reverted"]
    assert len(reverted) == 4, opt.summary()
    label = "at batch" if wrong_when == "other batch" else "on a second draw"
    assert all(label in r.reason and "over tolerance" in r.reason for r in reverted)


def test_other_inputs_keep_shapes_ranges_and_masks():
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last) * 5 + 2
    ids = torch.randint(3, 9, (4, 7))
    mask = torch.rand(4, 7) > 0.5
    (label1, (x1, ids1, m1)), (label2, (x2, ids2, m2)) = accelc.other_inputs.other_inputs((x, ids, mask))
    assert "second draw" in label1 and label2 == "at batch 3"
    assert x1.shape == x.shape and not torch.equal(x1, x) and x1.is_contiguous(memory_format=torch.channels_last)
    assert abs(x1.mean() - x.mean()) < 0.5 and abs(x1.std() - x.std()) < 0.5
    assert ids1.dtype == ids.dtype and 3 <= ids1.min() and ids1.max() <= 8 and torch.equal(m1, mask)
    assert x2.shape == (3, 3, 8, 8) and ids2.shape == (3, 7) and torch.equal(m2, mask[:3])
    # no shared leading dim: no other batch
    assert len(accelc.other_inputs.other_inputs((x, torch.randn(5, 2)))) == 1


def test_the_speed_race_times_tuned_configs_not_borrowed_ones():
    """The checks at other sizes run under tuning.serving (numbers, not speed): a kernel size they meet first runs
    on a config borrowed from the nearest tuned size, or the default. A generation step's race times its layers
    at one row a sequence, a size only those checks had met: raced on the borrowed config, a kernel is judged by
    a config it will not serve with. The race forgets borrowed configs first, so that each kernel tunes at its
    first launch there."""
    from accelc import guard, tuning

    t = tuning.Tuner("race-borrow", gemm.linear_kernel, gemm.CONFIGS, default=lambda sizes: gemm.CONFIGS[0],
                     interpreter=lambda sizes: gemm.CONFIGS[0])
    t.chosen[(512, 64, 64)] = gemm.CONFIGS[1]         # tuned at the example's rows
    t.chosen[(1, 64, 64)] = gemm.CONFIGS[0]           # borrowed by a check at one row
    t.borrowed[(1, 64, 64)] = None
    t.calls["a launch at one row"] = object()
    assert guard._race(None, (), [], "original") == {}
    assert t.borrowed == {} and set(t.chosen) == {(512, 64, 64)} and t.calls == {}


def test_a_race_times_one_of_twin_layers_for_all_of_them(monkeypatch):
    """Layers doing the same work (the op, its inputs' sizes, dtypes and strides, the PyTorch subgraph replaced, the
    weights' names aside: a model's repeated blocks) are timed once, and every twin gets that timing and so the same
    verdict; a layer of other sizes, or replacing another subgraph, is timed on its own."""
    from accelc import guard, runtime

    timed = []

    def layer_ms(fn, device, rep_ms):
        timed.append(fn)
        return (0.001 if len(timed) % 2 else 0.002), True       # accelc's side first: faster
    monkeypatch.setattr(runtime, "can_time", lambda device: True)
    monkeypatch.setattr(guard, "layer_ms", layer_ms)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(DEVICE).eval()
    x = torch.randn(8, 64, device=DEVICE)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=True, glue="eager", cuda_graphs=False))
    linear = [r for r in opt.layers if r.kind == "linear"]
    assert len(linear) == 5 and all(r.status == "rewritten" for r in linear), opt.summary()
    # three GELU twins, the ReLU one, the narrower last one: three timings of two sides
    assert len(timed) == 6, [r.name for r in linear]


def test_a_race_times_both_sides_alike_where_one_cannot_be_captured(monkeypatch, caplog):
    """The race's timer captures each side in a CUDA graph and falls back to plain calls where capture fails:
    a side timed in plain calls carries the host's launch cost, the other's does not. Where the two differ,
    both sides are timed again in plain calls, and the log says so."""
    from accelc import guard, runtime

    graphed = iter([(0.001, True), (0.05, False)] * 8)      # accelc's side first, then PyTorch's
    plain = iter([0.02, 0.01] * 8)
    monkeypatch.setattr(runtime, "can_time", lambda device: True)
    monkeypatch.setattr(guard, "layer_ms", lambda fn, device, rep_ms: next(graphed))
    monkeypatch.setattr(guard, "median_ms", lambda fn, device, rep_ms: next(plain))
    model = _model("mlp")
    (x,) = model.example_inputs()
    with caplog.at_level("INFO", logger="accelc"):
        opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=True, glue="eager", cuda_graphs=False))
    kept = [r for r in opt.layers if r.status == "kept" and r.kernel]
    assert len(kept) == 4 and not opt.rewritten, opt.summary()
    assert all("20.0 us vs PyTorch (cuBLAS) 10.0 us" in r.reason for r in kept)
    assert "raced in plain calls (one side cannot be captured in a CUDA graph)" in caplog.text


def test_a_layers_reference_runs_its_original_in_higher_precision_without_copying_it(monkeypatch):
    """layer_check.reference: the original subgraph with its floating weights and buffers in fp32 for half inputs
    (fp64 for fp32), as a deep copy converted with .to() computed it, tied weights tied, integer buffers as they
    are; the original left as it was, and not copied (a deep copy generated its code again at every check)."""
    import copy

    from accelc import layer_check

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)
            self.b.weight = self.a.weight                     # tied
            self.register_buffer("scale", torch.rand(16) + 0.5)
            self.register_buffer("steps", torch.tensor([3]))  # an integer buffer

        def forward(self, x):
            return self.b(self.a(x) * self.scale) + self.steps

    for dtype in (torch.float16, torch.float32):
        original = fx.symbolic_trace(Layer()).to(DEVICE, dtype)
        x = torch.randn(4, 16, device=DEVICE, dtype=dtype)
        want = copy.deepcopy(original).to(layer_check.higher_precision(dtype))(x.to(layer_check.higher_precision(dtype)))
        before = {k: (v, v.dtype, v.clone()) for k, v in original.state_dict(keep_vars=True).items()}
        copies = count_calls(monkeypatch, copy, "deepcopy")
        got = layer_check.reference(original, [x])
        monkeypatch.undo()
        assert got.dtype == layer_check.higher_precision(dtype) and torch.equal(got, want)
        assert not copies
        after = original.state_dict(keep_vars=True)
        assert all(after[k] is v and v.dtype == d and torch.equal(v, c) for k, (v, d, c) in before.items())


def test_a_layer_that_casts_to_its_models_own_precision_has_its_reference_in_the_higher_one():
    """An fp32 layer that casts to float32 itself (Gemma's norm: `x.float()`, `.type_as(x)`) before a projection:
    its fp64 reference met fp32 values against fp64 weights and raised (the optimize with it); now every value is
    held in fp64 there, as the layer computed in fp64 by hand; a layer that fails for another reason still raises."""
    from accelc import layer_check

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 8)
            self.w = nn.Parameter(torch.randn(16) * 0.3)

        def forward(self, x):
            h = x.float()
            y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.w.float())).type_as(h)
            return self.proj(y.to(torch.float32))

    torch.manual_seed(0)
    layer = Layer().to(DEVICE)
    original = fx.symbolic_trace(layer)
    x = torch.randn(4, 16, device=DEVICE)
    got = layer_check.reference(original, [x])
    h = x.double()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + layer.w.double())
    want = y @ layer.proj.weight.double().t() + layer.proj.bias.double()
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-12, atol=1e-12)

    class Broken(nn.Module):
        def forward(self, x):
            return x @ torch.ones(3, 3, dtype=x.dtype, device=x.device)     # (a shape error, not a dtype one)

    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        layer_check.reference(fx.symbolic_trace(Broken()), [x])


def _error_stats_by_indexing(out, ref):
    """error_stats as it was written with boolean indexing (the reference for the one-read-back form)."""
    from accelc.numerics import rel_l2
    from torch.utils import _pytree as pytree

    rel = max_abs = 0.0
    for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        finite = torch.isfinite(r)
        rel = max(rel, rel_l2(o[finite], r[finite]))
        if finite.any():
            max_abs = max(max_abs, (o[finite].double() - r[finite].double()).abs().max().item())
    return rel, max_abs


@pytest.mark.parametrize("case", ["plain", "ref inf and nan", "out inf where ref finite", "out nan", "ref zero",
                                  "nothing finite", "empty", "two outputs"])
def test_error_stats_and_the_finite_check_are_what_boolean_indexing_gave(case):
    """The guard's error numbers (numerics.error_stats, read back once a tensor) and its finite check
    (layer_check.compare) as the boolean-indexed forms computed them, NaN and inf included."""
    from accelc import layer_check
    from accelc.numerics import error_stats

    g = torch.Generator().manual_seed(7)
    r = torch.randn(6, 33, generator=g, dtype=torch.float32).to(DEVICE)
    o = (r + 1e-3 * torch.randn(6, 33, generator=g).to(DEVICE)).half()
    if case == "ref inf and nan":
        r[0, :3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
        o[0, :3] = torch.tensor([1.0, float("nan"), 5.0])
    elif case == "out inf where ref finite":
        o[2, 5] = float("inf")
    elif case == "out nan":
        o[1, 1] = float("nan")
    elif case == "ref zero":
        r = torch.zeros_like(r)
    elif case == "nothing finite":
        r = torch.full_like(r, float("nan"))
    elif case == "empty":
        r, o = r[:0], o[:0]
    out, ref = ((o, o[:2] * 2), (r, r[:2])) if case == "two outputs" else (o, r)
    got, want = error_stats(out, ref), _error_stats_by_indexing(out, ref)
    assert (got[0] == pytest.approx(want[0], rel=1e-12, nan_ok=True)
            and got[1] == pytest.approx(want[1], rel=1e-12, nan_ok=True)), (got, want)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    finite_then = all(torch.isfinite(x[torch.isfinite(y)]).all() for x, y in zip(outs, refs))
    check = layer_check.compare(out, out, ref, [r], accelc.OptimizeConfig())
    assert (check.reason != "non-finite output where the reference is finite") == bool(finite_then), check.reason
