"""torch.compile(model, backend="accelc")."""
import pytest
import torch

import accelc
from conftest import DEVICE, rel_l2


def test_backend_is_registered():
    assert "accelc" in torch._dynamo.list_backends()


@pytest.mark.parametrize("name", ["mlp", "transformer_mlp"])
def test_compiled_model_matches_eager(name):
    torch._dynamo.reset()
    model = accelc.models.get(name).to(DEVICE)
    compiled = torch.compile(model, backend="accelc")
    with torch.no_grad():
        for batch in (4, 4, 6):  # a second call, and a new shape (recompiles)
            (x,) = model.example_inputs(batch_size=batch)
            assert rel_l2(compiled(x), model(x)) < 1e-5


def test_backend_rewrites_the_dynamo_graph():
    seen = []

    def spy(gm, example_inputs, **kwargs):
        from accelc.backend import accelc_backend
        fn = accelc_backend(gm, example_inputs, **kwargs)
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return fn

    torch._dynamo.reset()
    model = accelc.models.get("mlp").to(DEVICE)
    with torch.no_grad():
        torch.compile(model, backend=spy)(*model.example_inputs())
    assert seen and seen[0].count(torch.ops.accelc.linear.default) == 4


def test_backend_options_and_dtype_refused():
    torch._dynamo.reset()
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs()
    with torch.no_grad():
        out = torch.compile(model, backend="accelc", options={"passes": ()})(x)
    assert rel_l2(out, model(x)) < 1e-6
    torch._dynamo.reset()
    with pytest.raises(Exception, match="cannot change the model's dtype"):
        torch.compile(model, backend="accelc", options={"dtype": "fp16"})(x)
