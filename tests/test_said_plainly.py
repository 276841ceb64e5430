"""#57's misleading cases: each ends as one line naming the real cause, or as eager's behaviour."""
import warnings

import pytest
import torch

import accelc
from accelc.capture.shapes import InputShapes
from accelc.cli import _one_line_warning, main
from accelc.errors import InputError
from conftest import DEVICE, rel_l2


def test_a_dim_given_twice_in_dynamic_is_refused(tmp_path, capsys):
    assert main(["convert", "mlp", "-o", str(tmp_path / "m.pt2"), "--dynamic", "input:0=1..4,0=1..8",
                 "--device", DEVICE.type]) == 1
    assert "--dynamic gives input dim 0 twice" in capsys.readouterr().err
    assert not (tmp_path / "m.pt2").exists()


def test_a_negative_size_is_said_by_the_shape_parser_not_argparse(tmp_path, capsys):
    assert main(["convert", "mlp", "-o", str(tmp_path / "m.pt2"), "--input-shape", "-2x24",
                 "--device", DEVICE.type]) == 1
    err = capsys.readouterr().err
    assert "expected positive sizes" in err and "expected one argument" not in err


def test_another_librarys_warning_is_not_printed_as_accelcs():
    line = _one_line_warning(FutureWarning("`isinstance(treespec, LeafSpec)` is deprecated"), FutureWarning,
                             "/x/site-packages/torch/utils/_pytree.py", 1)
    assert line.startswith("FutureWarning (torch): ") and "accelc" not in line
    assert _one_line_warning(UserWarning("accelc: no CUDA GPU"), UserWarning, "f.py", 1) == "accelc: no CUDA GPU\n"


def test_a_relation_between_inputs_is_said_by_their_names():
    shapes = InputShapes(("input_ids", "attention_mask"))
    text = shapes.refusal("Guard failed: flat_1.size()[0] == flat_0.size()[0]", ())
    assert "attention_mask dim 0 == input_ids dim 0" in text and "flat_" not in text


def test_a_dim_declared_on_the_ids_carries_to_their_mask_and_after_load_the_range_is_the_users(tmp_path):
    model = accelc.models.get("bert").to(DEVICE)
    ids, mask = model.example_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(model, {"input_ids": ids, "attention_mask": mask},
                              dynamic={"input_ids": {0: (1, 4), 1: (1, 64)}})
    assert "attention_mask 1..4 x 1..64" in opt.info.shapes, opt.info.shapes
    i2, m2 = ids.repeat(2, 2)[:3, :30], mask.repeat(2, 2)[:3, :30]
    with torch.no_grad():
        assert rel_l2(opt(input_ids=i2, attention_mask=m2), model(i2, m2)) < 1e-5
    accelc.save(opt, tmp_path / "b.pt2")
    loaded = accelc.load(tmp_path / "b.pt2")
    for module in (opt, loaded):
        with pytest.raises(InputError, match="input_ids dim 0 is 6: at most 4: the range declared for it"):
            module(input_ids=ids.repeat(3, 1), attention_mask=mask.repeat(3, 1))


class _ConvRelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.c(x))


def test_a_channels_last_example_then_row_major_calls_get_row_major_outputs_as_eager():
    model = _ConvRelu().to(DEVICE).eval()
    x = torch.randn(2, 3, 16, 16, device=DEVICE)
    opt = accelc.optimize(model, (x.contiguous(memory_format=torch.channels_last),))
    with torch.no_grad():
        y = opt(x)
        assert y.is_contiguous() and y.view(2, -1).shape == (2, 8 * 16 * 16)
        assert rel_l2(y, model(x)) < 1e-5
        cl = opt(x.contiguous(memory_format=torch.channels_last))
    assert cl.is_contiguous(memory_format=torch.channels_last)     # as eager's conv on a channels-last input


def test_warmup_shapes_of_a_traced_model_are_taken_within_the_declared_range():
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs(4)
    opt = accelc.optimize(model, x, dynamic={"features": {0: (1, 64)}}, warmup_shapes=[{"features": (8, 24)}])
    assert "no dim varies" not in opt.info.shapes and "1 warm-up shape(s)" in opt.info.shapes
    with pytest.raises(InputError, match="features dim 0 is 80: outside the range 1..64 declared for it"):
        accelc.optimize(model, x, dynamic={"features": {0: (1, 64)}}, warmup_shapes=[{"features": (80, 24)}])


def test_a_report_of_a_program_accelc_made_says_to_report_the_model(tmp_path, capsys):
    assert main(["convert", "mlp", "-o", str(tmp_path / "m.pt2"), "--device", DEVICE.type]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "m.pt2"), "-o", str(tmp_path / "r"), "--no-ort",
                 "--device", DEVICE.type]) == 1
    err = capsys.readouterr().err
    assert "already runs accelc's kernels" in err and "training mode" not in err


def test_ctrl_c_while_the_command_imports_is_one_line():
    import shutil
    import signal
    import subprocess
    import time

    exe = shutil.which("accelc")
    if exe is None:
        pytest.skip("the accelc command is not installed in this environment")
    proc = subprocess.Popen([exe, "list-models"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.5)         # inside `import torch` / the kernels' imports
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines() == ["accelc: interrupted"], err


def test_the_summary_explains_its_columns_and_sums_ops_without_a_kernel():
    """Rows for the layers accelc acted on or could have; ops no rule takes (pooling here) summed in one
    line, still in opt.layers as kept; the columns defined below the table."""
    model = accelc.models.get("cnn_small").to(DEVICE)
    opt = accelc.optimize(model, model.example_inputs(batch_size=2))
    text = opt.summary()
    table = text.split("\nstatus: ")[0]
    assert "MaxPool2d" not in table and "AdaptiveAvgPool2d" not in table, text
    assert "no accelc kernel for (these run as PyTorch, as in eager): MaxPool2d x2, AdaptiveAvgPool2d" in text
    assert "kept = PyTorch runs it" in text and "rel.err / eager err: the relative L2 error" in text
    assert sum(r.kind == "MaxPool2d" and r.status == "kept" for r in opt.layers) == 2


def test_optional_ids_and_masks_left_out_take_the_models_own_default(tmp_path):
    """HF's token_type_ids and attention_mask, given in the example, may be left out of a later call as
    the model allows (found at capture: left out, the model gives what it gives with zeros / ones); the
    other result of that call is eager's. An input the model needs stays required."""
    import transformers as T

    cfg = T.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=64)
    model = T.BertModel(cfg).to(DEVICE).eval()
    ids = torch.randint(0, 100, (2, 16), device=DEVICE)
    opt = accelc.optimize(model, dict(input_ids=ids, token_type_ids=torch.zeros_like(ids),
                                      attention_mask=torch.ones_like(ids)))
    assert opt.call_spec.fills == {"token_type_ids": (0, "input_ids"), "attention_mask": (1, "input_ids")}
    ids2 = torch.randint(0, 100, (3, 9), device=DEVICE)
    with torch.no_grad():
        for call in (dict(input_ids=ids2), dict(input_ids=ids2, token_type_ids=None),
                     dict(input_ids=ids2, attention_mask=torch.ones_like(ids2))):
            got, want = opt(**call).last_hidden_state, model(**call).last_hidden_state
            assert rel_l2(got, want) < 1e-5, call.keys()
        with pytest.raises(InputError, match="'input_ids' is missing"):
            opt(token_type_ids=torch.zeros_like(ids2))


def test_a_programs_layers_are_named_by_their_modules(tmp_path):
    """A torch.export program (.pt2) optimized names its layers as the model it came from does
    (features.0+1+2), from the program's module stacks, not by their ops (conv2d++relu#2)."""
    from accelc.convert import load_model

    model = accelc.models.get("cnn_small").to(DEVICE)
    x = model.example_inputs(batch_size=2)
    torch.export.save(torch.export.export(model, tuple(x)), tmp_path / "cnn.pt2")
    program, args, _ = load_model(str(tmp_path / "cnn.pt2"), DEVICE)
    names = [r.name for r in accelc.optimize(program, args).layers]
    assert names == [r.name for r in accelc.optimize(model, tuple(x)).layers], names


def test_on_a_gpu_the_summary_says_the_models_own_speed_in_one_line(monkeypatch):
    """optimize times a plain call of the example, eager and optimized, where the device can be timed (a GPU)
    and the graph updates no state: one line of the summary; none on the CPU."""
    from accelc import api

    model = accelc.models.get("mlp").to(DEVICE)
    opt = accelc.optimize(model, model.example_inputs(4))
    line = [x for x in opt.summary().splitlines() if x.startswith("speed on this GPU")]
    assert len(line) == (1 if DEVICE.type == "cuda" else 0), opt.summary()
    opt.info.call_ms = (2.0, 0.5)
    assert "eager PyTorch 2.000 ms, accelc 0.500 ms (4.00x)" in opt.summary()
    job = api.make_job(model, model.example_inputs(4), None)
    assert len(api.call_times(job, opt)) == 2 and all(t > 0 for t in api.call_times(job, opt))

    class Counter(torch.nn.Module):    # state the calls update: timing them would count
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            self.calls.add_(1)
            return self.fc(x)
    counting = accelc.optimize(Counter().to(DEVICE), (torch.randn(2, 8, device=DEVICE),))
    assert api.call_times(api.make_job(Counter().to(DEVICE), (torch.randn(2, 8, device=DEVICE),), None), counting) == ()


def test_a_layer_whose_reference_is_all_zero_is_checked_on_probe_weights_and_said():
    """A zero-initialised norm (timm's): its output, accelc's and the reference's, is 0 everywhere, and the summary
    printed `0.0e+00 0.0e+00` as if checked. Now its errors are `-`, its kernel is checked on non-zero probe weights
    against its reference, and its note says so."""
    from torch import nn

    from conftest import NORMS_REWRITTEN

    class ZeroNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.n = nn.Linear(16, 16), nn.LayerNorm(16)
            nn.init.zeros_(self.n.weight)
            nn.init.zeros_(self.n.bias)

        def forward(self, x):
            return self.fc(x) + self.n(x)
    opt = accelc.optimize(ZeroNorm().to(DEVICE).eval(), (torch.randn(4, 16, device=DEVICE),))
    fc = next(r for r in opt.layers if r.name.startswith("fc"))
    assert not fc.check.blind
    if NORMS_REWRITTEN:
        (row,) = [line for line in opt.summary().splitlines() if line.startswith("n ")]
        assert "checked on non-zero probe weights" in row and " -  " in row and "0.0e+00" not in row, row
        check = next(r for r in opt.layers if r.name == "n").check
        assert check.blind and check.passed and 0 <= check.probe_rel_error < check.tolerance, check


def test_a_zero_weight_layer_whose_kernel_is_off_on_probe_weights_goes_back_to_pytorch(monkeypatch):
    """A Linear with zero weights and bias (blind: 0 everywhere) whose kernel is off by 1% wherever its output is
    not 0: on the example nothing shows it; on the probe weights it fails, and the layer is PyTorch's, said."""
    from torch import nn

    from accelc.kernels import gemm

    class ZeroLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            nn.init.zeros_(self.fc.weight)
            nn.init.zeros_(self.fc.bias)

        def forward(self, x):
            return torch.cat([self.fc(x), x], -1)
    launch = gemm.linear_launch
    monkeypatch.setattr(gemm, "linear_launch", lambda *a, **kw: launch(*a, **kw) * 1.01)
    model = ZeroLinear().to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(4, 16, device=DEVICE),), accelc.OptimizeConfig(only_if_faster=False))
    fc = next(r for r in opt.layers if r.name.startswith("fc"))
    assert fc.status == "reverted" and "checked on non-zero probe weights, where the kernel is off" in fc.reason, \
        (fc.status, fc.reason)
