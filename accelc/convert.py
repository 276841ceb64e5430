"""`accelc convert` and the CLI's model loading: the model files and inputs users bring, turned
into an optimized program on disk (and, on request, its summary and latency report)."""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from accelc import models
from accelc.api import optimize_prepared, prepare
from accelc.config import OptimizeConfig
from accelc.errors import ModelFileError, short_error
from accelc.files import write_text
from accelc.optimized import OptimizedModule
from accelc.report import measure
from accelc.serialize import save


# ---------------------------------------------------------------------------------------------
# the models users bring

def load_model(source: str, device: torch.device) -> tuple[nn.Module, tuple | None]:
    """A built-in model name, a torch.save'd module, or a torch.export program (.pt2).
    Returns (model on `device` in eval mode, its own example inputs if it has some)."""
    path = Path(source)
    if not path.exists():
        if source in models.names():
            model = models.get(source).to(device)
            return model, tuple(model.example_inputs())
        raise ModelFileError(f"no such file or built-in model: {source!r} "
                             f"(built-in models: {', '.join(models.names())})")
    if not path.is_file():
        raise ModelFileError(f"{source!r} is not a file")
    kind = _file_kind(path)
    if kind == "torchscript":
        raise ModelFileError(f"{source!r} is a TorchScript archive: accelc rewrites Python modules. Save "
                             "the module itself (torch.save(model, path)) or a torch.export program "
                             "(torch.export.save(torch.export.export(model, inputs), 'model.pt2'))")
    if kind == "export":
        try:
            ep = torch.export.load(path)
        except Exception as e:
            raise ModelFileError(f"{source!r} is not a readable torch.export program: {short_error(e)}") from e
        args, _ = ep.example_inputs if ep.example_inputs is not None else (None, None)
        model = ep.module().to(device)
        return model, _to(args, device) if args is not None else None
    try:
        # A full module is a pickle: loading it runs code from the file, as torch.load says.
        obj = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        raise ModelFileError(f"{source!r} is not a readable PyTorch file (corrupt or truncated?): "
                             f"{short_error(e)}") from e
    if isinstance(obj, dict):
        raise ModelFileError(f"{source!r} holds a state_dict, not a model: save the module itself "
                             "(torch.save(model, path)) or a torch.export program (.pt2)")
    if isinstance(obj, torch.jit.ScriptModule):
        raise ModelFileError(f"{source!r} is a TorchScript module: accelc rewrites Python modules")
    if not isinstance(obj, nn.Module):
        raise ModelFileError(f"{source!r} holds a {type(obj).__name__}, not an nn.Module")
    return obj.eval(), None


def _file_kind(path: Path) -> str:
    if not zipfile.is_zipfile(path):
        return "pickle"  # torch.save's legacy format, or not a model file at all
    try:
        names = zipfile.ZipFile(path).namelist()
    except zipfile.BadZipFile:
        return "pickle"
    if any(n.endswith("/archive_format") for n in names):
        return "export"
    if any("/code/" in n or n.endswith("/constants.pkl") for n in names):
        return "torchscript"
    return "pickle"


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """'8x3x224x224' -> [(8, 3, 224, 224)]; several inputs separated by commas."""
    shapes = []
    for part in text.split(","):
        dims = part.strip().lower().split("x")
        if not part.strip() or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ModelFileError(f"input shape {text!r}: expected positive sizes like 8x3x224x224, "
                                 "several inputs separated by commas")
        shapes.append(tuple(int(d) for d in dims))
    return shapes


def load_example_inputs(path: str, device: torch.device) -> tuple:
    """A torch.save'd tensor, or tuple / list of tensors."""
    if not Path(path).is_file():
        raise ModelFileError(f"no such example-inputs file: {path!r}")
    try:
        obj = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ModelFileError(f"{path!r} is not a readable tensor file: {short_error(e)}") from e
    args = (obj,) if isinstance(obj, torch.Tensor) else tuple(obj) if isinstance(obj, (tuple, list)) else None
    if args is None or not all(isinstance(a, torch.Tensor) for a in pytree.tree_leaves(args)):
        raise ModelFileError(f"{path!r} must hold a tensor or a tuple/list of tensors, not {type(obj).__name__}")
    return args


def convert(source: str, out: str | os.PathLike, *, input_shapes: str | None = None,
            example_inputs: str | None = None, dtype: str | None = None, device: str | None = None,
            report_dir: str | None = None, int8=False,
            progress: Callable[[str], None] = lambda msg: None) -> OptimizedModule:
    """The `accelc convert` command: load, optimize, write `out` (.pt2) atomically."""
    out = Path(out)
    if out.suffix != ".pt2":
        raise ModelFileError(f"output {str(out)!r} must end in .pt2 (a torch.export program)")
    if not out.parent.is_dir():
        raise ModelFileError(f"output folder {str(out.parent)!r} does not exist")
    if input_shapes and example_inputs:
        raise ModelFileError("give --input-shape or --example-inputs, not both")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelFileError("--device cuda was asked for, but no CUDA GPU is available")
    config = OptimizeConfig(dtype=dtype, int8=int8)

    progress(f"loading {source}")
    model, args = load_model_and_inputs(source, dev, input_shapes, example_inputs)
    check_args = _to(args, config.dtype) if config.dtype is not None else args
    try:
        with torch.no_grad():
            (model.to(config.dtype) if config.dtype is not None else model)(*check_args)
    except Exception as e:
        shapes = ", ".join("x".join(map(str, a.shape)) for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor))
        raise ModelFileError(f"the model's forward failed on inputs of shape {shapes}: {short_error(e)}") from e

    progress("optimizing: capture, rewrite, check every rewritten layer")
    job = prepare(model, args, config, copy_model=False)   # loaded here: nobody else holds it
    opt = optimize_prepared(job)
    progress(f"writing {out}")
    save(opt, out)
    if report_dir:
        write_summary(opt, report_dir)
        progress(f"timing every layer against eager and ONNX Runtime for {report_dir}/report.*")
        measure(opt, job, model_name=str(source)).write(report_dir)
    return opt


def load_model_and_inputs(source: str, device: torch.device, input_shapes: str | None = None,
                          example_inputs: str | None = None, batch_size: int | None = None):
    """The model and the example inputs the CLI's flags ask for: a file of inputs, random inputs
    of given shapes, a built-in model's own at `batch_size`, or those the model file carries."""
    model, own_inputs = load_model(source, device)
    if example_inputs:
        return model, load_example_inputs(example_inputs, device)
    if input_shapes:
        return model, tuple(torch.randn(s, device=device) for s in parse_shapes(input_shapes))
    if batch_size is not None and hasattr(model, "example_inputs"):
        return model, tuple(model.example_inputs(batch_size=batch_size))
    if own_inputs is not None:
        return model, own_inputs
    raise ModelFileError(f"{source!r} carries no example inputs: give --input-shape (e.g. 8x3x224x224) "
                         "or --example-inputs FILE")


def write_summary(opt: OptimizedModule, folder: str | os.PathLike) -> None:
    """summary.txt and layers.json (per-layer records) in `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("summary.txt", opt.summary() + "\n"),
                       ("layers.json", json.dumps(opt.summary_dict(), indent=1) + "\n")):
        write_text(folder / name, text)


def _to(args, target):
    return tuple(pytree.tree_map(
        lambda t: t.to(target) if isinstance(t, torch.Tensor) and (not isinstance(target, torch.dtype)
                                                                    or t.is_floating_point()) else t,
        args))
