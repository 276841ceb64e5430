"""Any batch size, any sequence length: a model optimized once runs at every shape of its range, as
eager does, padded batches included; the shapes it takes are said, a shape it cannot take is refused
in one line naming the input, the dim and the limit; saved programs keep their dims. (CPU, tiny
configs of real HF families, fp32.)"""
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import accelc
from accelc.errors import InputError
from accelc.numerics import rel_l2
from conftest import DEVICE

transformers = pytest.importorskip("transformers")
T = transformers
TOL = 1e-5    # fp32 against eager fp32: a few roundings

_TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
             max_position_embeddings=64)


def _families():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "bert": lambda: T.BertModel(T.BertConfig(**_TEXT)),
            "gpt2": lambda: T.GPT2Model(T.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=64,
                                                     use_cache=False)),
            "llama": lambda: T.LlamaModel(T.LlamaConfig(**_TEXT, num_key_value_heads=1, use_cache=False)),
            "t5_encoder": lambda: T.T5EncoderModel(T.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                                              vocab_size=100)),
        }


FAMILIES = _families()


def _hidden(out):
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _inputs(b, length, pad=()):
    ids = torch.randint(0, 100, (b, length), device=DEVICE)
    mask = torch.ones(b, length, dtype=torch.long, device=DEVICE)
    for row, n in enumerate(pad):           # a tokenizer's right padding: the last n tokens of a row
        if n:
            mask[row, -n:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_text_family_takes_every_batch_and_length(name):
    torch.manual_seed(0)
    model = FAMILIES[name]().to(DEVICE).eval()
    opt = accelc.optimize(model, _inputs(2, 16))
    assert any(r.status == "rewritten" for r in opt.layers)
    for b, length in [(1, 1), (3, 17), (5, 40), (2, 64)]:
        call = _inputs(b, length)
        with torch.no_grad():
            got, want = _hidden(opt(**call)), _hidden(model(**call))
        assert got.shape == want.shape and rel_l2(got, want) < TOL, (b, length)
    text = opt.summary()
    # the models with a position table (or a config that ends the positions) take 64 tokens at most
    ends = "any" if name == "t5_encoder" else "64"
    assert f"shapes: input_ids 1..any x 1..{ends}" in text, text
    assert "besides the example, every layer was also checked at the smallest sizes (input_ids 1x1" in text, text


def _roberta():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # positions start after the padding index: 66 - 2 = 64 tokens
        return T.RobertaModel(T.RobertaConfig(**dict(_TEXT, max_position_embeddings=66), pad_token_id=1))


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "roberta"])
def test_optimized_at_the_position_limit_checks_nothing_past_it(name, monkeypatch):
    """The guard's odd-size check went one token past the example: at the model's last position that
    indexed GPT-2's position table past its end (a device-side assert on the GPU, fatal to the
    process). The config's limit closes the range: checks stay within it, a call past it is one line."""
    from accelc import guard
    torch.manual_seed(0)
    model = (_roberta() if name == "roberta" else FAMILIES[name]()).to(DEVICE).eval()
    seen, real = [], guard._check_pass

    def spy(gm, args, *rest, **kw):
        seen.extend(a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 2)
        return real(gm, args, *rest, **kw)
    monkeypatch.setattr(guard, "_check_pass", spy)
    opt = accelc.optimize(model, _inputs(2, 64))
    assert seen and max(seen) == 64, seen
    assert "shapes: input_ids 1..any x 1..64" in opt.summary()
    with pytest.raises(InputError, match=r"^input_ids dim 1 is 65: at most 64: a limit of the model's \(config\."):
        opt(**_inputs(1, 65))
    call = _inputs(3, 64)
    with torch.no_grad():
        assert rel_l2(_hidden(opt(**call)), _hidden(model(**call))) < TOL


def test_a_declared_range_past_the_models_positions_is_refused_an_open_one_closed():
    model = FAMILIES["gpt2"]().to(DEVICE).eval()
    with pytest.raises(InputError, match=r"^dynamic= declares input_ids dim 1 up to 100, past the model's 64 positions "
                                         r"\(config.max_position_embeddings = 64\)"):
        accelc.optimize(model, _inputs(2, 16), dynamic={"input_ids": {1: (1, 100)}, "attention_mask": {1: (1, 100)}})
    opt = accelc.optimize(model, _inputs(2, 16), dynamic={"input_ids": {1: (1, None)}, "attention_mask": {1: (1, None)}})
    assert "input_ids 2 x 1..64" in opt.summary(), opt.summary()


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "t5_encoder"])
def test_padded_batch_gives_eager_on_the_real_tokens(name):
    torch.manual_seed(0)
    model = FAMILIES[name]().to(DEVICE).eval()
    opt = accelc.optimize(model, _inputs(2, 16))
    call = _inputs(3, 24, pad=(0, 5, 11))
    with torch.no_grad():
        got, want = _hidden(opt(**call)), _hidden(model(**call))
    real = call["attention_mask"].bool()
    assert rel_l2(got[real], want[real]) < TOL


def test_vit_takes_every_batch_and_says_its_image_size_is_fixed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.ViTModel(T.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                       image_size=16, patch_size=8)).to(DEVICE).eval()
    opt = accelc.optimize(model, torch.randn(2, 3, 16, 16, device=DEVICE))
    for b in (1, 5):
        x = torch.randn(b, 3, 16, 16, device=DEVICE)
        with torch.no_grad():
            assert rel_l2(_hidden(opt(x)), _hidden(model(x))) < TOL
    assert "pixel_values 1..any x 3 x 16 x 16" in opt.summary()
    with pytest.raises(InputError, match=r"pixel_values dim 2 is 24: the model fixes it at 16"):
        opt(torch.randn(1, 3, 24, 24, device=DEVICE))


def test_a_length_past_the_models_limit_is_one_line_naming_it():
    torch.manual_seed(0)
    model = FAMILIES["bert"]().to(DEVICE).eval()
    opt = accelc.optimize(model, _inputs(2, 16))
    with pytest.raises(InputError, match=r"^input_ids dim 1 is 70: at most 64: a limit of the model's"):
        opt(**_inputs(2, 70))


class _Varargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, *xs):
        return torch.relu(self.fc(xs[0])) + xs[1].sum(-1, keepdim=True)


class _ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if x.shape[0] > 4:          # torch.export keeps one side of a shape branch, and a guard for it
            return self.fc(x) * 2
        return torch.relu(self.fc(x))


def test_shape_branch_takes_its_side_and_names_the_edge():
    model = _ShapeBranch().to(DEVICE).eval()
    opt = accelc.optimize(model, torch.randn(2, 16, device=DEVICE))
    x = torch.randn(3, 16, device=DEVICE)
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < TOL
    with pytest.raises(InputError, match=r"dim 0 is 6: at most 4"):
        opt(torch.randn(6, 16, device=DEVICE))


def test_varargs_model_matches_eager_at_other_batches():
    torch.manual_seed(0)
    model = _Varargs().to(DEVICE).eval()
    opt = accelc.optimize(model, (torch.randn(2, 16, device=DEVICE), torch.randn(2, 3, device=DEVICE)))
    for b in (1, 7):
        a, c = torch.randn(b, 16, device=DEVICE), torch.randn(b, 3, device=DEVICE)
        with torch.no_grad():
            assert rel_l2(opt(a, c), model(a, c)) < TOL


def test_static_and_declared_ranges():
    torch.manual_seed(0)
    model = FAMILIES["bert"]().to(DEVICE).eval()
    static = accelc.optimize(model, _inputs(2, 16), dynamic=False)
    assert "shapes: the example's only (dynamic=False)" in static.summary()
    static(**_inputs(2, 16))
    with pytest.raises(InputError, match=r"input_ids dim 0 is 3: the program takes the example's 2 only"):
        static(**_inputs(3, 16))
    ranges = {"input_ids": {0: (1, 4), 1: (1, 32)}, "attention_mask": {0: (1, 4), 1: (1, 32)}}
    declared = accelc.optimize(model, _inputs(2, 16), dynamic=ranges)
    assert "shapes: input_ids 1..4 x 1..32" in declared.summary()
    with torch.no_grad():
        assert rel_l2(_hidden(declared(**_inputs(4, 9))), _hidden(model(**_inputs(4, 9)))) < 1.0   # runs
    with pytest.raises(InputError, match=r"input_ids dim 1 is 40: at most 32: the range declared for it"):
        declared(**_inputs(2, 40))
    with pytest.raises(InputError, match="outside the range 1..8 declared"):
        accelc.optimize(model, _inputs(2, 16), dynamic={"input_ids": {1: (1, 8)}})
    with pytest.raises(InputError, match="not a tensor input"):
        accelc.optimize(model, _inputs(2, 16), dynamic={"ids": {0: (1, 8)}})
    with pytest.raises(ValueError, match=r"\(lo, hi\) range"):
        accelc.OptimizeConfig(dynamic={"input_ids": {0: (0, 8)}})


def test_declared_ranges_hold_for_a_traced_graph_too():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(DEVICE).eval()
    opt = accelc.optimize(model, torch.randn(4, 16, device=DEVICE), dynamic={"input": {0: (1, 8)}})
    assert opt.info.capture_method == "symbolic_trace"
    opt(torch.randn(8, 16, device=DEVICE))
    with pytest.raises(InputError, match=r"input dim 0 is 9: outside the range 1..8 declared"):
        opt(torch.randn(9, 16, device=DEVICE))


def test_a_failed_dynamic_export_is_said_not_silent(monkeypatch):
    real = torch.export.export

    def no_dynamic(*args, dynamic_shapes=None, **kwargs):
        if dynamic_shapes is not None:
            raise RuntimeError("Constraints violated (test)")
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.export, "export", no_dynamic)
    model = FAMILIES["bert"]().to(DEVICE).eval()
    opt = accelc.optimize(model, _inputs(2, 16))
    assert "shapes: the example's only (the dynamic export failed: Constraints violated (test))" in opt.summary()


def test_saved_program_keeps_its_dims(tmp_path):
    torch.manual_seed(0)
    model = FAMILIES["bert"]().to(DEVICE).eval()
    opt = accelc.optimize(model, _inputs(2, 16))
    accelc.save(opt, tmp_path / "bert.pt2")
    loaded = accelc.load(tmp_path / "bert.pt2")
    call = _inputs(3, 33)
    with torch.no_grad():
        assert rel_l2(loaded(**call)[0], _hidden(model(**call))) < TOL
    assert "1..any x 1..64" in loaded.accelc_summary["info"]["shapes"]
    # a model whose limit only its config states (GPT-2's positions): the saved program keeps it
    gpt2 = FAMILIES["gpt2"]().to(DEVICE).eval()
    accelc.save(accelc.optimize(gpt2, _inputs(2, 16)), tmp_path / "gpt2.pt2")
    loaded = accelc.load(tmp_path / "gpt2.pt2")
    loaded(**_inputs(1, 64))
    with pytest.raises(InputError, match=r"input_ids dim 1 is 65: at most 64"):
        loaded(**_inputs(1, 65))


def test_cli_dynamic_and_static_flags():
    from accelc.cli import _dynamic, _parser

    args = _parser().parse_args(["optimize", "mlp", "--dynamic", "input:0=1..64", "--dynamic", "mask:0=1..64,1=2..any"])
    assert _dynamic(args) == {"input": {0: (1, 64)}, "mask": {0: (1, 64), 1: (2, None)}}
    assert _dynamic(_parser().parse_args(["optimize", "mlp", "--static"])) is False
    assert _dynamic(_parser().parse_args(["optimize", "mlp"])) is True
    with pytest.raises(ValueError, match="expected NAME:DIM=LO..HI"):
        _dynamic(_parser().parse_args(["optimize", "mlp", "--dynamic", "input=1..64"]))


def test_shapes_learn_a_guard_and_word_a_refusal():
    from accelc.capture.shapes import DimRange, InputShapes

    s = InputShapes(("pixel_values",), ((DimRange(2, None, "s0"), DimRange(2, None, "s1"), DimRange(2, None, "s2"),
                                         DimRange(2, None, "s2")),))
    first = s.narrowed("Guard failed: pixel_values.size()[1] == 3")
    s2 = first.narrowed("Guard failed: flat_0.size()[2] <= 32")
    assert s2.narrowed("something else") is None
    assert s.dims[0][1] == DimRange(2, None, "s1")        # a contract is read-only: narrowed is another one
    s = s2
    assert s.dims[0][1] == 3 and s.dims[0][2] == s.dims[0][3] == DimRange(2, 32, "s2")   # one symbol, both dims
    assert s.describe().startswith("shapes: pixel_values 2..any x 3 x 2..32 x 2..32")
    assert s.describe(["at odd sizes (pixel_values 3x3x5x5)"]).endswith(
        "; besides the example, every layer was also checked at odd sizes (pixel_values 3x3x5x5)")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.dims = ()
    x = torch.randn(1, 3, 40, 40)
    assert s.refusal("Guard failed: flat_0.size()[2] <= 32", (x,)) == (
        "pixel_values dim 2 is 40: at most 32: the captured program's range: the model's code, traced by torch.export "
        "at the example, takes another way past it (a branch on the size); optimize with an example past it to serve "
        "those")


class _Baked(nn.Module):
    """A graph that bakes the example's batch into a reshape once exported at fixed shapes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(x).reshape(x.shape[0] * 2, 4)


def test_convert_keeps_a_programs_dims_and_declares_new_ones_where_the_graph_allows(tmp_path, capsys):
    """A .pt2 input keeps the dims its program has (dynamic ones, or fixed ones, said); --dynamic
    declares dims for a program exported at fixed shapes where its graph takes them, and where the
    graph fixes a size it fails in one line with nothing written. Every loaded program refuses a
    shape outside its dims in one line."""
    from accelc.cli import main

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.export.save(torch.export.export(mlp, (x,), dynamic_shapes=({0: batch},)), tmp_path / "dyn.pt2")
    torch.export.save(torch.export.export(mlp, (x,)), tmp_path / "static.pt2")
    torch.export.save(torch.export.export(_Baked().to(DEVICE).eval(), (x,)), tmp_path / "baked.pt2")
    dev = ["--device", DEVICE.type]
    for name, extra in [("dyn", []), ("static", []), ("declared", ["--dynamic", "input:0=1..32"])]:
        source = tmp_path / ("static.pt2" if name == "declared" else f"{name}.pt2")
        assert main(["convert", str(source), "-o", str(tmp_path / f"{name}_opt.pt2"), *dev, *extra]) == 0
    dyn, static, declared = (accelc.load(tmp_path / f"{n}_opt.pt2") for n in ("dyn", "static", "declared"))
    with torch.no_grad():
        for b in (1, 7, 32):
            xb = torch.randn(b, 16, device=DEVICE)
            assert rel_l2(dyn(xb), mlp(xb)) < TOL and rel_l2(declared(xb), mlp(xb)) < TOL
        assert rel_l2(static(x), mlp(x)) < TOL
        with pytest.raises(InputError, match="input dim 0 is 65: at most 64"):
            dyn(torch.randn(65, 16, device=DEVICE))
        with pytest.raises(InputError, match="input dim 0 is 33: at most 32"):
            declared(torch.randn(33, 16, device=DEVICE))
        with pytest.raises(InputError, match=r"input dim 0 is 7: the program takes the example's 4 only \(a program "
                                             r"saved with fixed shapes\)"):
            static(torch.randn(7, 16, device=DEVICE))
    assert "declared: input dim 0 1..64" in dyn.accelc_summary["info"]["shapes"]
    assert "shapes: the example's only" in static.accelc_summary["info"]["shapes"]
    code = main(["convert", str(tmp_path / "baked.pt2"), "-o", str(tmp_path / "baked_opt.pt2"), *dev,
                 "--dynamic", "x:0=1..32"])
    assert code == 1 and not (tmp_path / "baked_opt.pt2").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot take the declared dims (x dim 0 is fixed at 4)" in err[-1]


def test_a_sliding_windows_length_is_not_blamed_on_the_model():
    """A Mistral-style sliding window: the export at a 10-token example traces the mask's code for prompts within the
    window, and a longer prompt, which eager serves, was refused as "a limit of the model's": served, or refused
    naming the captured program's range and how to widen it."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=100, max_position_embeddings=128, sliding_window=16)
    model = T.MistralForCausalLM(cfg).to(DEVICE).eval()
    ids = torch.randint(0, 100, (2, 10), device=DEVICE)
    opt = accelc.optimize(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    for b, n in ((1, 10), (2, 3), (2, 24)):
        x = torch.randint(0, 100, (b, n), device=DEVICE)
        try:
            with torch.no_grad():
                got = opt(input_ids=x, attention_mask=torch.ones_like(x)).logits
        except InputError as e:
            assert "a limit of the model's" not in str(e) and "optimize with an example past it" in str(e), str(e)
            continue
        with torch.no_grad():
            assert rel_l2(got, model(input_ids=x, attention_mask=torch.ones_like(x)).logits) < TOL
