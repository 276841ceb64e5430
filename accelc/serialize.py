"""Saving and loading optimized models.

accelc.save(opt, "model.pt2") writes a torch.export program whose graph calls torch.ops.accelc.*;
torch.export.load (after `import accelc`, which registers the ops) or accelc.load reads it back.
The file is written to a temporary name in the target folder and renamed into place, so an
interrupted or failed write never leaves a half-written file under the final name.
"""
from __future__ import annotations

import inspect
import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from accelc.capture import export_program, quiet_torch_logs
from accelc.capture.shapes import SHAPES
from accelc.errors import ModelFileError, short_error
from accelc.files import atomic_path, check_output_file
from accelc.optimized import OptimizedModule

SUMMARY_FILE = "accelc_summary.json"


def save(opt: OptimizedModule, path: str | os.PathLike, example_inputs: tuple | None = None) -> None:
    """Export `opt` (on its example inputs unless given others) and write it to `path` (.pt2).
    The program takes the call the model was optimized with: positional inputs, and its tensor
    keyword arguments by name (an output holding a cache comes back as its flat tuple of tensors)."""
    if not isinstance(opt, OptimizedModule):
        raise TypeError(f"accelc.save takes the module accelc.optimize returned, not {type(opt).__name__}")
    path = check_output_file(path, ".pt2", "a torch.export program")
    args = tuple(example_inputs if example_inputs is not None else opt.example_inputs)
    spec = opt.call_spec
    dynamic = opt.config.dynamic
    shapes = opt.graph_module.meta.get(SHAPES)
    if isinstance(dynamic, dict):   # the declared ranges by the graph's input position
        names = spec.names if spec is not None else (shapes.names if shapes is not None else ())
        dynamic = tuple(dynamic.get(n) for n in names) if names else True
    with quiet_torch_logs():
        if spec is not None and spec.kw_names:
            ep, static = export_program(_as_called(opt.graph_module, spec), args[:spec.n_args],
                                        dict(zip(spec.kw_names, args[spec.n_args:])), dynamic=dynamic)
        else:
            # the graph module, not the wrapper: its forward has the model's own signature, which
            # per-dimension dynamic shapes are matched against
            ep, static = export_program(opt.graph_module, args, dynamic=dynamic)
    if static and dynamic is not False:
        warnings.warn(f"accelc.save: the saved program takes the example's shapes only: {static}", stacklevel=2)
    with atomic_path(path) as tmp:
        try:
            torch.export.save(ep, tmp, extra_files={SUMMARY_FILE: json.dumps(opt.summary_dict())})
        except (OSError, RuntimeError) as e:
            raise ModelFileError(f"could not write {str(path)!r}: {short_error(e)}") from e


def _as_called(gm: nn.Module, spec) -> nn.Module:
    """A module whose forward takes the model's call (named positional inputs, then the tensor
    keyword arguments, keyword-only) and runs the flat graph `gm`: what torch.export reads the
    program's signature from."""
    def forward(self, *args, **kwargs):
        return self.graph_module(*spec.flat(args, kwargs))

    P = inspect.Parameter
    forward.__signature__ = inspect.Signature(
        [P("self", P.POSITIONAL_OR_KEYWORD)] + [P(n, P.POSITIONAL_OR_KEYWORD) for n in spec.arg_names]
        + [P(n, P.KEYWORD_ONLY) for n in spec.kw_names])
    module = type("AccelcProgram", (nn.Module,), {"forward": forward})()
    module.graph_module = gm
    return module


def load(path: str | os.PathLike) -> nn.Module:
    """Read a program accelc.save or `accelc convert` wrote; returns a callable module. Its
    `accelc_summary` attribute holds the per-layer summary saved with it."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"no such file: {str(path)!r}")
    extra = {SUMMARY_FILE: ""}
    try:
        ep = torch.export.load(path, extra_files=extra)
    except Exception as e:
        raise ModelFileError(f"{str(path)!r} is not a readable torch.export program: {short_error(e)}") from e
    module = ep.module()
    module.accelc_summary = json.loads(extra[SUMMARY_FILE]) if extra[SUMMARY_FILE] else None
    return module
