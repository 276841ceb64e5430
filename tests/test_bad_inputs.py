"""The catalogue of ordinary model code and bad inputs a user brings: each either behaves as eager
does or is refused in one line naming the real cause and what to do. (Older cases live beside
the feature they test: matmul spellings and weight views in test_guard.py, channels-last views in
test_conv_gemm.py, bad model files in test_convert.py's BAD table, buffers and input mutation in
test_state.py; the CLI, files and logs in test_cli_files.py; pickles, copies, torch.compile and ONNX export of
the optimized module in test_copies.py.)"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelc
from accelc.errors import CaptureError, InputError
from conftest import DEVICE, rel_l2
from bad_models import CFG, Fc, Branch, Scaled


class _InplaceAfterLinear(Fc):
    def forward(self, x):
        y = self.fc(x)
        y.relu_()
        return y


def test_in_place_op_on_a_rewritten_output_with_grad_enabled():
    model = _InplaceAfterLinear().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert torch.is_grad_enabled()
    assert rel_l2(opt(x), model(x).detach()) < 1e-5


def test_an_input_that_requires_grad_is_refused_in_one_sentence():
    opt = accelc.optimize(Fc().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    with pytest.raises(InputError, match="for inference and computes no gradients.*torch.no_grad"):
        opt(x)
    with torch.no_grad():       # the same input is fine where no gradient is asked for
        assert opt(x).shape == (4, 16)
    assert opt(x.detach()).shape == (4, 16)


class _Residual(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.r = nn.Parameter(torch.randn(*shape))

    def forward(self, x):
        return F.relu(self.fc(x) + self.r)


@pytest.mark.parametrize("x_shape,r_shape", [((4, 16), (1, 16)), ((4, 16), (16,)), ((2, 3, 16), (3, 16)),
                                             ((2, 3, 16), (2, 1, 16)), ((2, 3, 16), (3, 1))])
def test_residual_add_broadcasts_as_eager(x_shape, r_shape):
    model = _Residual(r_shape).to(DEVICE).eval()
    x = torch.randn(*x_shape, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert [r.kind for r in opt.rewritten] == ["linear"], opt.summary()
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-5


class _AlwaysDropout(Fc):
    def forward(self, x):
        return F.dropout(self.fc(x), 0.5, training=True)


def test_a_capture_failure_quotes_the_models_own_line():
    """Where the tracers fail, each failure names the line of the model's code it failed on (the
    deepest frame outside torch and accelc): here the branch on a tensor's value."""
    import inspect
    with pytest.raises(CaptureError) as e:
        accelc.optimize(Branch().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    line = inspect.getsourcelines(Branch.forward)[1] + 2
    where = f"(at {inspect.getsourcefile(Branch)}:{line} in forward: `return y * 2 if y.sum() > 0 else y`)"
    failures = [ln for ln in str(e.value).splitlines() if ln.lstrip().startswith(("symbolic_trace:", "torch.export:"))]
    assert len(failures) == 2 and all(ln.endswith(where) for ln in failures), e.value


def test_randomness_in_eval_mode_is_named_not_branches():
    with pytest.raises(CaptureError) as e:
        accelc.optimize(_AlwaysDropout().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    assert "random numbers" in str(e.value) and "self.training" in str(e.value)
    assert "Branches" not in str(e.value)


def test_a_cache_given_to_the_forward_is_named_not_randomness():
    """A decoder given HF's DynamicCache appends to it at every call: the capture failure names the
    cache and what to do, not randomness."""
    T = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = T.LlamaModel(T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                        vocab_size=100, max_position_embeddings=64)).to(DEVICE).eval()
    ids = torch.randint(0, 100, (2, 8), device=DEVICE)
    with pytest.raises(CaptureError) as e:
        accelc.optimize(lm, {"input_ids": ids, "past_key_values": T.DynamicCache(config=lm.config), "use_cache": True},
                        CFG)
    assert "appends to the DynamicCache it is given" in str(e.value) and "Branches" not in str(e.value)


class _UsesItsCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return self.fc(x) * self.n


def test_output_that_depends_on_a_buffer_updated_in_forward():
    model = _UsesItsCounter().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert model.n.item() == 0
    with torch.no_grad():
        for _ in range(3):
            assert rel_l2(opt(x), model(x)) < 1e-5


def test_optional_argument_left_out_is_said_at_optimize_and_at_the_call():
    model = Scaled().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    assert "fixed at their defaults (not inputs of the optimized model" in opt.summary()
    assert "scale=None" in opt.summary()
    with pytest.raises(InputError, match="'scale' was not in the example.*left at its default, None"):
        opt(x, torch.randn(4, 8, device=DEVICE))      # (by position: bound to its name, as eager binds it)
    with pytest.raises(InputError, match="'scale' was not in the example.*left at its default, None"):
        opt(x, scale=torch.randn(4, 8, device=DEVICE))


def test_optimizing_an_optimized_module_is_refused():
    opt = accelc.optimize(Fc().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    assert not opt.training
    with pytest.raises(InputError, match="already accelc's optimized module"):
        accelc.optimize(opt, torch.randn(4, 16, device=DEVICE))


def test_an_example_that_overflows_the_configs_dtype_is_refused_naming_the_cast():
    model = Fc().to(DEVICE).eval()
    with pytest.raises(InputError, match=r"past torch.float16's range \(at most 65504\): cast by "
                                         r"OptimizeConfig\(dtype='float16'\) they become inf"):
        accelc.optimize(model, torch.full((2, 16), 1e30, device=DEVICE), accelc.OptimizeConfig(dtype="fp16"))


class _GlueNames(nn.Module):
    """Submodules whose attribute names are op names."""

    def __init__(self):
        super().__init__()
        self.cat = nn.ConvTranspose1d(8, 8, 3, padding=1)
        self.t = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        mask = x.new_ones(x.shape[0], 1, 1) > 0      # tracer artefacts: new_ones, gt
        return self.fc(self.cat(x).transpose(1, 2)) * mask, self.t(y)


def test_layers_named_like_ops_are_listed_and_their_flops_counted():
    opt = accelc.optimize(_GlueNames().to(DEVICE).eval(), (torch.randn(2, 8, 16, device=DEVICE),
                                                           torch.randn(2, 4, 5, 5, device=DEVICE)), CFG)
    kept = {r.name: r for r in opt.layers if r.status == "kept"}
    assert set(kept) == {"cat", "t"} and kept["cat"].kind == "ConvTranspose1d" and kept["t"].kind == "ConvTranspose2d"
    assert kept["cat"].flops == 2 * 2 * 8 * 16 * 8 * 3 and kept["t"].flops > 0
    assert 0 < opt.info.accelc_flops < opt.info.flops
    assert "coverage: 100.0%" not in opt.summary()


def test_positional_inputs_by_name_a_dict_given_positionally_and_none_for_a_tensor():
    model = Fc().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    with torch.no_grad():
        assert torch.equal(opt(x=x), opt(x))                  # by its parameter name, as eager takes it
    with pytest.raises(InputError, match="'x' is given both by position and by name"):
        opt(x, x=x)
    T = pytest.importorskip("transformers")
    bert = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    vocab_size=100, max_position_embeddings=64)).to(DEVICE).eval()
    inputs = {"input_ids": torch.randint(0, 100, (2, 8), device=DEVICE),
              "attention_mask": torch.ones(2, 8, dtype=torch.long, device=DEVICE)}
    opt = accelc.optimize(bert, inputs, CFG)
    with pytest.raises(InputError, match=r"call it as opt\(\*\*inputs\), not opt\(inputs\)"):
        opt(inputs)
    with torch.no_grad():     # None, as BERT takes it: its own default (every token visible), found at capture
        assert torch.equal(opt(input_ids=inputs["input_ids"], attention_mask=None).last_hidden_state,
                           opt(**inputs).last_hidden_state)
    opt = accelc.optimize(_Shifted().to(DEVICE).eval(), (x,), CFG, example_kwargs={"shift": torch.ones_like(x)})
    with pytest.raises(InputError, match=r"shift=None: the model was optimized with a tensor there"):
        opt(x, shift=None)      # a float input: no default is taken for it


class _Shifted(Fc):
    def forward(self, x, shift=None):
        return self.fc(x if shift is None else x + shift)


@pytest.mark.parametrize("example,match", [(None, "optimize\\(\\) needs example inputs"),
                                           ((), "optimize\\(\\) needs example inputs"),
                                           (3, "example_inputs is a int: give a tensor")])
def test_missing_or_odd_example_inputs_are_one_line(example, match):
    with pytest.raises(InputError, match=match):
        accelc.optimize(Fc().eval(), example)


def test_float64_is_refused_at_double_in_one_line():
    opt = accelc.optimize(Fc().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE), CFG)
    for cast in (lambda m: m.double(), lambda m: m.to(torch.float64)):
        with pytest.raises(InputError, match="not float64"):
            cast(opt)
    assert all(p.dtype == torch.float32 for p in opt.parameters())


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_a_conv_with_another_padding_mode_says_why_it_is_kept(mode):
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, padding_mode=mode)).to(DEVICE).eval()
    x = torch.randn(2, 4, 8, 8, device=DEVICE)
    opt = accelc.optimize(model, x, CFG)
    (layer,) = opt.layers
    assert layer.status == "kept" and f"padding_mode='{mode}'" in layer.reason, opt.summary()
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < 1e-6


class _Chatty(Fc):
    calls = 0            # a class counter

    def forward(self, x):
        print("forward of", tuple(x.shape))
        type(self).calls += 1
        self.last_batch = x.shape[0]
        return self.fc(x)


def test_python_side_effects_in_forward_are_said_once_at_optimize(capsys):
    """print, a class counter, a plain attribute set in forward: they run while accelc captures
    the model, never in the optimized model's calls; one warning says so (the print still shows)."""
    model = _Chatty().to(DEVICE).eval()
    with pytest.warns(UserWarning, match=r"forward printed to stdout and changed (_Chatty\.calls, _Chatty\.last_batch|"
                                         r"_Chatty\.calls).* Python side effects run at capture") as seen:
        opt = accelc.optimize(model, torch.randn(3, 16, device=DEVICE), CFG)
    assert sum("side effects" in str(w.message) for w in seen) == 1
    assert "forward of (3, 16)" in capsys.readouterr().out
    with torch.no_grad():
        opt(torch.randn(3, 16, device=DEVICE))
    assert "forward of" not in capsys.readouterr().out
    with warnings.catch_warnings(record=True) as quiet:          # no side effect: no word
        warnings.simplefilter("always")
        accelc.optimize(Fc().to(DEVICE).eval(), torch.randn(3, 16, device=DEVICE), CFG)
    assert not any("side effects" in str(w.message) for w in quiet)


def test_a_call_in_another_dtype_names_the_cast_to_make():
    """fp16-optimized, called with fp32 (and the sibling: .half() after optimize, called with the
    example's fp32): one line naming the input, both dtypes and the cast; eager's own dtype errors
    elsewhere stay as they are."""
    model = Fc().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt = accelc.optimize(model, x, accelc.OptimizeConfig(dtype="fp16", only_if_faster=False))
    with pytest.raises(InputError, match=r"input 0 is float32, and the model was optimized for float16 inputs .*"
                                         r"x.to\(torch.float16\)"):
        opt(x)
    with torch.no_grad():
        assert opt(x.half()).dtype == torch.float16
    opt32 = accelc.optimize(model, x, CFG).half()
    with pytest.raises(InputError, match="input 0 is float32, and the model was optimized for float16"):
        opt32(x)
    with torch.no_grad():
        assert rel_l2(opt32(x.half()).float(), model(x)) < 1e-2


class _AddInput(nn.Module):
    def __init__(self, conv=False):
        super().__init__()
        self.layer = nn.Conv2d(4, 8, 3, padding=1) if conv else nn.Linear(16, 16)

    def forward(self, x, r):
        return torch.relu(self.layer(x) + r)


@pytest.mark.parametrize("conv,x_shape,r_full,r_calls", [
    (False, (4, 16), (4, 16), [(1, 16), (16,)]),
    (True, (2, 4, 6, 6), (2, 8, 6, 6), [(1, 8, 6, 6), (8, 1, 1), (2, 8, 1, 6)])])
def test_a_residual_input_that_broadcasts_at_call_time_adds_as_eager(conv, x_shape, r_full, r_calls):
    """The epilogue fused a residual of the output's shape; a call whose residual broadcasts to it
    (eager's add takes that) gets eager's result, not the kernel's shape error."""
    model = _AddInput(conv).to(DEVICE).eval()
    x = torch.randn(*x_shape, device=DEVICE)
    opt = accelc.optimize(model, (x, torch.randn(*r_full, device=DEVICE)), CFG)
    assert any("residual" in (r.kernel or "") for r in opt.rewritten), opt.summary()
    with torch.no_grad():
        for shape in r_calls:
            r = torch.randn(*shape, device=DEVICE)
            assert rel_l2(opt(x, r), model(x, r)) < 1e-5, shape


@pytest.mark.parametrize("batch, match", [
    (torch.randn(4, 12), r"calibration batch 1 \(4x12\): the model itself fails on it .*shaped like the example \(4x16\)"),
    (torch.randint(0, 5, (4, 16)), r"calibration batch 1 \(4x16\): the model itself fails on it"),
    ("x", r"calibration batch 1 \(str\): the model itself fails on it"),
    (torch.full((4, 16), float("nan")), r"calibration batch 1 \(4x16\) holds NaN or inf"),
    ((torch.randn(4, 16), torch.randn(4, 16)), r"calibration batch 1 holds 2 input\(s\)"),
])
def test_a_calibration_batch_the_model_cannot_take_is_one_line_naming_it(batch, match):
    """Checked before any pass (it was a PassError from inside the int8 pass, or NaN statistics
    accepted silently)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    batch = tuple(b.to(DEVICE) for b in batch) if isinstance(batch, tuple) else \
        batch.to(DEVICE) if isinstance(batch, torch.Tensor) else batch
    config = accelc.OptimizeConfig(only_if_faster=False, int8=accelc.Int8Config(static=True, skip_first_last=False))
    with pytest.raises(InputError, match=match):
        accelc.optimize(model, x, config, calibration=[torch.randn(4, 16, device=DEVICE), batch])


def test_arrays_train_and_the_exported_errors_said_plainly():
    """What a newcomer tries: a numpy array or a list where the example had a tensor (it failed inside accelc with
    AttributeError), opt.train() (accepted silently), and catching accelc.InputError (not exported)."""
    import numpy as np

    import accelc as a
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).to(DEVICE).eval()
    x = torch.randn(2, 8, device=DEVICE)
    opt = a.optimize(model, (x,))
    for given, said in ((x.cpu().numpy(), "input 0 is a numpy array"),
                        (x.tolist(), "input 0 is a Python list of numbers")):
        with pytest.raises(a.InputError, match=said + " where the model was optimized with a tensor"):
            opt(given)
    assert isinstance(np.zeros(1), np.ndarray)
    with pytest.raises(a.InputError, match="optimized model is for inference"):
        opt.train()
    assert opt.eval() is opt and not opt.training
    torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)
    assert issubclass(a.InputError, a.AccelcError) and issubclass(a.WrongOutputError, a.AccelcError)


def test_inputs_the_example_named_may_come_by_position():
    """opt(ids, mask) on an encoder optimized with input_ids= and attention_mask=: eager binds them by position, and
    so does the optimized model (it was refused, blaming token_type_ids, which nobody passed)."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    m = T.BertModel(T.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                                 vocab_size=100, max_position_embeddings=64)).to(DEVICE).eval()
    ids = torch.randint(0, 100, (2, 8), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    opt = accelc.optimize(m, {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        want = m(ids, mask).last_hidden_state
        for got in (opt(ids, mask), opt(ids, attention_mask=mask), opt(ids, mask, None)):
            assert rel_l2(got.last_hidden_state, want) < 1e-5
    with pytest.raises(InputError, match="'input_ids' is given both by position and by name"):
        opt(ids, input_ids=ids)
    with pytest.raises(InputError, match="keyword argument 'token_type_ids' was not in the example"):
        opt(ids, mask, torch.zeros_like(ids))


def test_inputs_a_kernel_does_not_take_run_as_eager_runs_them():
    """An unbatched image (eager's conv2d takes one; accelc's kernel does not) and a wrong channel count reached the
    conv kernel's own ValueError: such a call now runs the layers' PyTorch references (said once), giving eager's
    result, or eager's own error."""
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8)).to(DEVICE).eval()
    opt = accelc.optimize(m, (torch.randn(2, 3, 16, 16, device=DEVICE),))
    image = torch.randn(3, 16, 16, device=DEVICE)
    with pytest.warns(UserWarning, match="run the layers' PyTorch references"):
        got = opt(image)
    with torch.no_grad():
        assert got.shape == (8, 16, 16) and rel_l2(got, m(image)) < 1e-5
    with pytest.raises(RuntimeError, match="to have 3 channels, but got 4 channels"):
        opt(torch.randn(2, 4, 16, 16, device=DEVICE))
