"""accelc/capture/output_template.py: a saved program gives back the model's output structure where the model returns
tensors inside objects (HF's outputs and caches, test_generate_dropin.py), read back by an unpickler that builds
only transformers' output and cache classes, slots, containers, dtypes and devices: a program file runs no code of
its own choosing; any other structure is said at save (and at load where it cannot be rebuilt), the flat tuple kept."""
import os
import pickle
import warnings

import pytest
import torch
from torch import nn

import accelc
from accelc.capture import output_template
from accelc.capture.contract import Slot
from conftest import DEVICE


class Pair:
    """A user's own output object (neither a tuple nor a dict)."""

    def __init__(self, a, b):
        self.a, self.b = a, b


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        y = self.fc(x)
        return Pair(torch.relu(y), y * 2)


class Boom:
    def __reduce__(self):
        return os.system, ("echo unpickled > /dev/null",)


def test_a_user_objects_output_is_said_at_save_and_comes_back_flat(tmp_path):
    torch.manual_seed(0)
    model = TwoHeads().to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(glue="eager", cuda_graphs=False))
    assert isinstance(opt(x), Pair)
    with pytest.warns(UserWarning, match=r"flat tuple of tensors: its output holds .*Pair"):
        accelc.save(opt, tmp_path / "m.pt2")
    out = accelc.load(tmp_path / "m.pt2")(x)
    with torch.no_grad():
        want = model(x)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out, (want.a, want.b))


def test_the_reader_builds_no_class_but_outputs_caches_and_plain_data():
    ok = {"x": [Slot(0), (torch.float16, torch.device("cpu"))]}
    back = output_template.read(pickle.dumps(ok, protocol=4))
    assert back["x"][0].i == 0 and back["x"][1] == (torch.float16, torch.device("cpu"))
    for hostile in (Boom(), {"k": Boom()}, Pair(1, 2), eval):
        with pytest.raises(pickle.UnpicklingError):
            output_template.read(pickle.dumps(hostile, protocol=4))
    text, why = output_template.written({"out": Boom()})
    assert text is None and "system" in why, why


def test_a_program_file_whose_structure_cannot_be_rebuilt_says_so_and_returns_the_tuple(tmp_path, monkeypatch):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=1, intermediate_size=64, vocab_size=100)).to(DEVICE)
    ids = torch.randint(3, 100, (2, 6), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(lm.eval(), {"input_ids": ids}, accelc.OptimizeConfig(glue="eager", cuda_graphs=False))
        accelc.save(opt, tmp_path / "lm.pt2")
    monkeypatch.setattr(output_template, "_transformers_class", lambda module, name: None)   # (transformers gone)
    with pytest.warns(UserWarning, match="returns the model's output as its flat tuple of tensors: its structure"):
        loaded = accelc.load(tmp_path / "lm.pt2")
    out = loaded(input_ids=ids)
    assert isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)
    torch.testing.assert_close(out[0], opt(input_ids=ids).logits)
