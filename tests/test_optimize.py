"""accelc.optimize end to end on the built-in models, the guard, config and warnings."""
import warnings

import pytest
import torch
from torch import nn

import accelc
from accelc import runtime
from conftest import DEVICE, NORMS_REWRITTEN, REL_FLOOR, rel_l2


def _model(name, dtype=torch.float32):
    return accelc.models.get(name).to(DEVICE, dtype)


def _n_linear(model):
    return sum(isinstance(m, nn.Linear) for m in model.modules())


@pytest.mark.parametrize("name", ["mlp", "transformer_mlp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_builtin_models_every_linear_rewritten_and_matching(name, dtype):
    model = _model(name, dtype)
    (x,) = model.example_inputs()
    opt = accelc.optimize(model, (x,))
    n_norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules()) if NORMS_REWRITTEN else 0
    assert len(opt.rewritten) == _n_linear(model) + n_norms
    assert all(r.status != "reverted" for r in opt.layers)
    # a fresh input, against the model run in fp64
    (x2,) = model.example_inputs(batch_size=5)
    ref_model = accelc.models.get(name).to(DEVICE, torch.float64)
    with torch.no_grad():
        out, eager, ref = opt(x2), model(x2), ref_model(x2.double())
    assert out.dtype == dtype and out.shape == eager.shape
    assert rel_l2(out, ref) <= max(2 * rel_l2(eager, ref), REL_FLOOR[dtype])


def test_config_dtype_converts_a_copy():
    model = _model("mlp")
    (x,) = model.example_inputs()
    opt = accelc.optimize(model, (x,), config=accelc.OptimizeConfig(dtype="bf16"))
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched
    assert opt(x.bfloat16()).dtype == torch.bfloat16
    assert len(opt.rewritten) == 4


def test_summary_lists_rewritten_and_kept_layers():
    model = _model("transformer_mlp")
    opt = accelc.optimize(model, model.example_inputs())
    text = opt.summary()
    if NORMS_REWRITTEN:      # eager glue: the 5 LayerNorms too
        assert "13 layer(s) rewritten, 0 reverted, 0 kept" in text and "accelc::layer_norm" in text
    else:                    # Inductor glue keeps them, and says why
        assert "8 layer(s) rewritten, 0 reverted, 5 kept" in text and "left to the Inductor glue" in text
    assert "blocks.0.fc1+gelu" in text and "accelc::linear[gelu]" in text
    assert "blocks.0.fc2+add" in text and "accelc::linear[residual]" in text
    assert "end-to-end relative L2 error vs eager" in text


def test_no_passes_rewrites_nothing():
    model = _model("mlp")
    opt = accelc.optimize(model, model.example_inputs(), config=accelc.OptimizeConfig(passes=()))
    assert opt.rewritten == [] and len(opt.layers) == 4 + 3  # linears + activations, all kept


@pytest.mark.parametrize("kwargs,message", [
    (dict(passes=("nope",)), "unknown pass"),
    (dict(dtype="fp8"), "dtype 'fp8' is not one of"),
    (dict(dtype=torch.int8), "dtype must be float32, float16 or bfloat16"),
    (dict(fp32_precision="fast"), "fp32_precision"),
    (dict(tolerance=0), "tolerance must be > 0"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        accelc.OptimizeConfig(**kwargs)


def test_bad_arguments():
    with pytest.raises(TypeError, match="takes an nn.Module"):
        accelc.optimize(lambda x: x, (torch.randn(2),))
    with pytest.raises(ValueError, match="no preset"):
        accelc.optimize(_model("mlp"), (torch.randn(2, 24, device=DEVICE),), config="fastest")


def test_training_model_is_optimized_as_its_eval_copy_with_a_warning():
    model = accelc.models.get("mlp").to(DEVICE).train()
    with pytest.warns(UserWarning, match="its optimized copy runs in eval mode"):
        opt = accelc.optimize(model, model.example_inputs())
    assert model.training                 # the caller's model is left as it was
    assert not opt.training and not opt.graph_module.training


@pytest.mark.skipif(not runtime.interpreted(), reason="the interpreter warning exists only without a GPU")
def test_interpreter_warning_once(monkeypatch):
    monkeypatch.setattr(runtime, "_warned", set())
    model = _model("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelc.optimize(model, model.example_inputs())
        accelc.optimize(model, model.example_inputs())
    texts = [str(w.message) for w in caught if "interpreter" in str(w.message)]
    assert len(texts) == 1 and "not performance figures" in texts[0]


def test_optimized_module_exports_with_accelc_ops():
    model = _model("transformer_mlp")
    (x,) = model.example_inputs()
    opt = accelc.optimize(model, (x,))
    ep = torch.export.export(opt, (x,))
    n = sum(node.target == torch.ops.accelc.linear.default for node in ep.graph.nodes)
    assert n == 8
    with torch.no_grad():
        assert rel_l2(ep.module()(x), opt(x)) < 1e-6


@pytest.mark.parametrize("name", ["mlp", "cnn_small", "transformer_mlp", "bert"])
def test_other_batch_sizes_give_the_right_answer(name):
    """Called at batch 1, 7 and twice the example's, the optimized module matches eager (or raises;
    never a wrong number): the CUDA graph runner keys on the input signature, the kernels on shapes."""
    small = {"image_size": 16} if name == "cnn_small" and DEVICE.type != "cuda" else {}   # interpreter time
    model = accelc.models.get(name, **small).to(DEVICE)
    args = model.example_inputs(batch_size=2)
    opt = accelc.optimize(model, args)
    assert opt.rewritten, opt.summary()
    for b in (1, 7, 4):
        more = model.example_inputs(batch_size=b)
        with torch.no_grad():
            assert rel_l2(opt(*more), model(*more)) < 1e-4, b


def test_only_if_faster_default_from_the_environment(monkeypatch):
    monkeypatch.delenv("ACCELC_ONLY_IF_FASTER", raising=False)
    assert accelc.OptimizeConfig().only_if_faster
    monkeypatch.setenv("ACCELC_ONLY_IF_FASTER", "0")
    assert not accelc.OptimizeConfig().only_if_faster


class _Mlp(nn.Module):
    def __init__(self, d=1024):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_eager_time_coverage_line():
    """The summary's second coverage line: the share of the eager model's GPU time in the layers
    accelc runs; absent where nothing was timed (the CPU, only_if_faster off)."""
    model = _Mlp(16).to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(4, 16, device=DEVICE),), accelc.OptimizeConfig(only_if_faster=False))
    assert opt.info.eager_gpu_ms != opt.info.eager_gpu_ms          # NaN: not timed
    assert "eager GPU time" not in opt.summary()
    assert opt.summary_dict()["info"]["eager_gpu_ms"] is None
    opt.info.eager_gpu_ms, opt.info.accelc_eager_gpu_ms = 0.2, 0.15
    assert "coverage: 75.0% of the model's eager GPU time in layers accelc runs (0.150 of 0.200 ms" in opt.summary()
    opt.info.accelc_eager_gpu_ms = 0.21      # layers timed one by one can add up to more than the whole (RegNetY)
    assert "103" not in opt.summary() and ("coverage: all of the model's eager GPU time is in layers accelc runs "
                                           "(timed one by one over CUDA graphs they take 0.210 ms, more than the "
                                           "whole model's 0.200 ms a call)") in opt.summary()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="times the eager model and its layers on the GPU")
def test_eager_time_coverage_measured_on_the_gpu():
    model = _Mlp().to(DEVICE).half().eval()
    x = torch.randn(2048, 1024, device=DEVICE, dtype=torch.float16)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=True))
    e, a = opt.info.eager_gpu_ms, opt.info.accelc_eager_gpu_ms
    assert e > 0 and "eager GPU time" in opt.summary(), opt.summary()
    kept = [r for r in opt.layers if r.kind == "linear" and r.status == "rewritten"]
    # the layers' own eager times: none where every GEMM stayed PyTorch, else a share of the model's
    assert (a == 0) == (not kept) and a <= 1.2 * e, (a, e, opt.summary())


def test_the_optimized_module_holds_nothing_of_the_callers_model():
    """accelc's module owns a copy of the weights: the caller's model, dropped, is freed (a server
    that keeps only the optimized module holds one copy of the weights, not two)."""
    import gc
    import weakref

    model = _model("transformer_mlp")
    (x,) = model.example_inputs()
    with torch.no_grad():
        want = model(x)
    opt = accelc.optimize(model, (x,))
    params = [weakref.ref(p) for p in model.parameters()]
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and all(p() is None for p in params)
    assert rel_l2(opt(x), want) <= REL_FLOOR[torch.float32]


def test_an_optimize_freezes_the_heap_it_found_and_leaves_the_collectors_state_as_it_was(monkeypatch):
    """optimize leaves the objects alive when it began out of the collector's passes while it runs (gc.freeze: its
    closing collection scans what it made), then unfreezes them; a program that froze objects itself keeps them
    frozen (none unfrozen, none added by optimize); an optimize that raises unfreezes too."""
    import gc
    from accelc import api

    seen = []
    real = api.release_cached_memory
    monkeypatch.setattr(api, "release_cached_memory", lambda device: (seen.append(gc.get_freeze_count()), real(device)))
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    assert gc.get_freeze_count() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelc.optimize(model, (x,))
    assert seen and seen[-1] > 1000 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accelc.optimize(model, (x,))
        assert 0.9 * theirs <= gc.get_freeze_count() <= theirs     # (frozen objects freed meanwhile leave it)
    finally:
        gc.unfreeze()
    with pytest.raises(Exception):
        accelc.optimize(model, (torch.randn(4, 17, device=DEVICE),))
    assert gc.get_freeze_count() == 0
