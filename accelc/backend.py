"""accelc as a torch.compile backend: torch.compile(model, backend="accelc").

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so the name works
once accelc is installed. Dynamo hands over each captured graph with real example inputs; accelc
puts it in canonical form, runs the same passes and guard as accelc.optimize, and hands the
rewritten graph to Inductor, which compiles what accelc did not rewrite around accelc's opaque
ops (on a CUDA device with glue "auto"; OptimizeConfig.cuda_graphs turns Inductor's CUDA graphs
on). Options: torch.compile(model, backend="accelc", options={...}) with the fields of
OptimizeConfig except `dtype` (the model's dtype is fixed by the time Dynamo runs).
"""
from __future__ import annotations

import warnings

from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from accelc import runtime
from accelc.api import device_of, optimize_graph
from accelc.capture import make_canonical
from accelc.config import OptimizeConfig
from accelc.runtime import resolve_glue


def accelc_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **_):
    options = dict(options or {})
    if "dtype" in options:
        raise ValueError("the accelc torch.compile backend cannot change the model's dtype: convert "
                         "the model first (model.half()), or use accelc.optimize(config=...)")
    config = OptimizeConfig(**options)
    args = tuple(example_inputs)
    if any(isinstance(a, FakeTensor) for a in args):
        warnings.warn("accelc backend: example inputs are fake tensors, so rewritten layers cannot be "
                      "checked; this graph runs as PyTorch", stacklevel=2)
        return gm.forward
    runtime.warn_if_interpreted(stacklevel=2)
    device = device_of(gm, args)
    expected = make_canonical(gm, args)
    opt = optimize_graph(gm, args, config, "torch.compile (Dynamo)", expected, device)
    on_gpu = runtime.can_time(device)
    if resolve_glue(config.glue, on_gpu) == "inductor":
        from torch._inductor.compile_fx import compile_fx   # Inductor's entry point, imported on use

        return compile_fx(opt.graph_module, list(args),
                          config_patches={"triton.cudagraphs": bool(config.cuda_graphs and on_gpu)})
    return opt.graph_module.forward
