"""`accelc convert` and the CLI's model loading: the model files and inputs users bring, turned
into an optimized program on disk (and, on request, its summary and latency report)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from accelc import meta, models, tensor_parallel
from accelc.api import make_job, optimize_job
from accelc.capture import program_module
from accelc.config import OptimizeConfig
from accelc.errors import ModelFileError, ReportFailedError, short_error
from accelc.files import check_output_file, check_output_folder, write_text
from accelc.optimized import OptimizedModule
from accelc.report import measure
from accelc.serialize import read_export, save


log = logging.getLogger("accelc")


# ---------------------------------------------------------------------------------------------
# the models users bring

def load_model(source: str, device: torch.device) -> tuple[nn.Module, tuple | None, dict]:
    """A built-in model name, a torch.save'd module, a torch.export program (.pt2), or `module:name` (an
    nn.Module, or what builds one, in an importable module: module_attr).
    Returns (model on `device` in eval mode, its own example inputs if it has some, and the
    keyword arguments of that example)."""
    path = Path(source)
    if not path.exists():
        if source in models.names():
            model = models.get(source).to(device)
            return model, builtin_example(model), {}
        if _MODULE_ATTR.fullmatch(source):
            model = module_attr(source).to(device).eval()
            own = model.example_inputs() if callable(getattr(model, "example_inputs", None)) else None
            return model, (tuple(own) if own is not None else None), {}
        raise ModelFileError(f"no such file or built-in model: {source!r} (a model file, package.module:name, or "
                             f"a built-in model: {', '.join(models.names())})")
    if not path.is_file():
        raise ModelFileError(f"{source!r} is not a file")
    kind = _file_kind(path)
    if kind == "torchscript":
        raise ModelFileError(f"{source!r} is a TorchScript archive: accelc rewrites Python modules. Save "
                             "the module itself (torch.save(model, path)) or a torch.export program "
                             "(torch.export.save(torch.export.export(model, inputs), 'model.pt2'))")
    if kind == "onnx":
        raise ModelFileError(f"{source!r} is an ONNX model: accelc rewrites PyTorch models. Give the PyTorch "
                             "model it was exported from, saved as a module (torch.save(model, path)) or a "
                             "torch.export program (.pt2)")
    if kind == "export":
        ep = read_export(path)
        args, kwargs = ep.example_inputs if ep.example_inputs is not None else (None, {})
        model = program_module(ep).to(device)
        with contextlib.suppress(NotImplementedError):   # its mode was fixed at export: no training-mode warning
            model.eval()
        model.accelc_program = ep    # its dims (program_dims), and its graph without its shape checks
        return model, _to(args, device) if args is not None else None, _to(dict(kwargs or {}), device)
    try:
        # A full module is a pickle: loading it runs code from the file, as torch.load says.
        obj = torch.load(path, map_location=device, weights_only=False)
    except (AttributeError, ModuleNotFoundError) as e:
        raise ModelFileError(f"{source!r}: {_missing_class(e)}") from e
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
    return obj.eval(), None, {}


_MODULE_ATTR = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def module_attr(source: str) -> nn.Module:
    """The model `package.module:name` names, imported as `python -c "from package.module import name"`
    would (the current folder on the import path): an nn.Module, or a class or function that builds one
    with no arguments."""
    import importlib
    import sys

    name, attr = source.split(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(name)
    except ImportError as e:
        raise ModelFileError(f"{source!r}: cannot import {name} ({short_error(e)}); run accelc in the folder that "
                             "holds it, or put that folder on PYTHONPATH") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelFileError(f"{source!r}: {name} has no {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, nn.Module) and callable(obj):
        try:
            obj = obj()
        except TypeError as e:
            raise ModelFileError(f"{source!r}: {attr} needs arguments to build the model ({short_error(e)}); name "
                                 "a module instance, or a function that builds one with none") from e
    if not isinstance(obj, nn.Module):
        raise ModelFileError(f"{source!r} is a {type(obj).__name__}, not an nn.Module (or a class or function "
                             "that builds one)")
    return obj


def _missing_class(e: Exception) -> str:
    """The reason a pickled module cannot be rebuilt here: its class's module is not importable."""
    text = str(e)
    main = re.search(r"Can't get attribute '([^']+)' on <module '([\w.]*__main__|__mp_main__)'", text)
    if main:
        return (f"the model's class {main.group(1)!r} was defined in the script that saved it (__main__), so it "
                "cannot be imported here: move the class into a module and make it importable (PYTHONPATH), "
                "then save again, or save a torch.export program (.pt2), which needs no class")
    other = re.search(r"Can't get attribute '([^']+)' on <module '([^']+)'", text)
    if other:
        return (f"the model's class {other.group(1)!r} is not in module {other.group(2)!r} as imported here "
                "(renamed or moved since saving?): make that class importable, or save a torch.export "
                "program (.pt2)")
    missing = getattr(e, "name", None) or text
    return (f"the model's class comes from module {missing!r}, which cannot be imported here: install it or "
            "add its folder to PYTHONPATH, or save a torch.export program (.pt2), which needs no class")


def _file_kind(path: Path) -> str:
    if not zipfile.is_zipfile(path):
        return "onnx" if _is_onnx(path) else "pickle"  # else torch.save's legacy format, or no model file
    try:
        names = zipfile.ZipFile(path).namelist()
    except zipfile.BadZipFile:
        return "pickle"
    if any(n.endswith("/archive_format") for n in names):
        return "export"
    if any("/code/" in n or n.endswith("/constants.pkl") for n in names):
        return "torchscript"
    return "pickle"


def _is_onnx(path: Path) -> bool:
    """An ONNX ModelProto: a protobuf starting with field 1 (ir_version, a varint); parsed with
    the onnx package where it is installed, else told by the .onnx suffix."""
    with open(path, "rb") as f:
        head = f.read(1)
    if head != b"\x08":
        return False
    try:
        import onnx
    except ImportError:
        return path.suffix.lower() == ".onnx"
    try:
        onnx.load(str(path), load_external_data=False)
        return True
    except Exception:
        return False


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


def load_example_inputs(path: str, device: torch.device) -> tuple[tuple, dict]:
    """(args, kwargs) from a torch.save'd tensor, tuple / list of tensors, or dict of named tensors
    (a tokenizer's output: the model's keyword inputs)."""
    if not Path(path).is_file():
        raise ModelFileError(f"no such example-inputs file: {path!r}")
    try:
        obj = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if found:
            kind = found.group(1).rpartition('.')[2]
            hint = ("save it as a plain dict: torch.save(dict(inputs), path)" if kind == "BatchEncoding"
                    else "e.g. torch.save((x,), path), or a dict of named inputs")
            raise ModelFileError(f"{path!r} holds a {kind}, not only tensors: example inputs are a torch.save'd "
                                 f"tensor, tuple/list of tensors or dict of them by input name; {hint}") from e
        reason = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(e))   # past torch's advice to unpickle anyway
        raise ModelFileError(f"{path!r} is not a readable tensor file (corrupt, truncated, or not torch.save'd): "
                             f"{reason.group(1).strip() if reason else short_error(e)}") from e
    except Exception as e:
        raise ModelFileError(f"{path!r} is not a readable tensor file: {short_error(e)}") from e
    if isinstance(obj, dict):
        if not obj or not all(isinstance(k, str) for k in obj):
            raise ModelFileError(f"{path!r} holds a dict whose keys are not input names (strings): give the model's "
                                 "keyword inputs by name, as a tokenizer's output has them")
        args, kwargs = (), dict(obj)
    else:
        args = (obj,) if isinstance(obj, torch.Tensor) else tuple(obj) if isinstance(obj, (tuple, list)) else None
        kwargs = {}
    if args is None or not all(isinstance(a, torch.Tensor) for a in pytree.tree_leaves((args, kwargs))):
        raise ModelFileError(f"{path!r} must hold a tensor, a tuple/list of tensors or a dict of them by input name, "
                             f"not {type(obj).__name__}" + (" holding other values" if args is not None else ""))
    return args, kwargs


def convert(source: str, out: str | os.PathLike, *, input_shapes: str | None = None,
            example_inputs: str | None = None, dtype: str | None = None, device: str | None = None,
            report_dir: str | None = None, int8=False, dynamic=True, batch_size: int | None = None,
            fp8=False) -> OptimizedModule:
    """The `accelc convert` command: load, optimize, write `out` (.pt2) atomically. Its steps go
    to the "accelc" logger at INFO. A model sharded with tensor parallelism (one process a rank under
    torchrun) writes each rank's program beside `out`, named by its rank (tensor_parallel.program_file).
    dynamic: OptimizeConfig.dynamic; the written program takes the shapes the optimized model takes (a .pt2 input
    exported with fixed shapes keeps them: the summary says which dims are fixed)."""
    out = check_output_file(out, ".pt2", "a torch.export program")
    if Path(source).exists() and Path(source).resolve() == out.resolve():
        raise ModelFileError(f"the output {str(out)!r} is the model file being converted: write the program to "
                             "another file (the model is read as the program is written)")
    if report_dir:
        if tensor_parallel.launched() is not None:
            raise ModelFileError("--report times one process's model layer by layer: under torchrun, convert without "
                                 "it (each rank writes its shard's program), and report the unsharded model alone")
        check_output_folder(report_dir)
    if input_shapes and example_inputs:
        raise ModelFileError("give --input-shape or --example-inputs, not both")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelFileError("--device cuda was asked for, but no CUDA GPU is available")
    config = OptimizeConfig(dtype=dtype, int8=int8, fp8=fp8, dynamic=dynamic)

    log.info(f"accelc: loading {source}")
    model, args, kwargs = load_model_and_inputs(source, dev, input_shapes, example_inputs, batch_size)
    program = getattr(model, "accelc_program", None)
    if meta.runs_accelc(model):
        raise ModelFileError(f"{source!r} already runs accelc's kernels (an accelc.save / accelc convert output): "
                             "convert the model it was made from (accelc.load runs this one as it is)")
    if program is not None:
        model, config = _program_shapes(model, program, config, dev)
    check_forward(model, args, kwargs, config.dtype)

    job = make_job(model, args, config, copy_model=False, example_kwargs=kwargs)   # loaded here: nobody else holds it
    opt = optimize_job(job)
    written = tensor_parallel.program_file(out, opt.graph_module)
    if written is None:
        rank, world = tensor_parallel.launched()
        log.info(f"accelc: rank {rank} of {world}: the model holds no shard (no collectives in its program): every "
                 f"rank optimized all of it, rank 0 writes {out}")
    else:
        log.info(f"accelc: writing {written}")
        save(opt, out, strict=isinstance(config.dynamic, dict) and program is not None)    # (save names the rank's)
    if report_dir:
        try:
            write_summary(opt, report_dir)
            log.info(f"accelc: timing every layer against eager and ONNX Runtime for {report_dir}/report.*")
            measure(opt, job, model_name=str(source)).write(report_dir)
        except Exception as e:   # the program is complete: say so, not a bare failure after writing it
            raise ReportFailedError(str(out), e, opt) from e
    return opt


def program_dims(ep) -> dict:
    """{input name: {dim: (lo, hi)}} of the dims a torch.export program takes in a range (hi None:
    no end); {} for a program exported with fixed shapes."""
    from accelc.capture.shapes import DimRange, InputShapes

    names = tuple(s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT")
    shapes = InputShapes.of_export(ep.graph_module, ep.range_constraints, names)
    return {name: {d: (max(r.lo, 1), r.hi) for d, r in enumerate(row) if isinstance(r, DimRange)}
            for name, row in zip(names, shapes.dims) if row and any(isinstance(r, DimRange) for r in row)}


def _program_shapes(model, ep, config: OptimizeConfig, device) -> tuple[nn.Module, OptimizeConfig]:
    """A .pt2 input keeps the dims its program has (config.dynamic True: the program's ranges, or
    its fixed shapes, said in the summary); dims the user declares (--dynamic) replace them, the
    program's own shape checks left out (a graph that bakes a size in then fails the capture check
    or the guard's check at other sizes, and says so)."""
    import dataclasses

    if config.dynamic is True:
        dims = program_dims(ep)
        log.info("accelc: the program takes %s", "; ".join(f"{n} {d}" for n, d in dims.items()) if dims
                 else "its example's shapes only (exported without dynamic_shapes; --dynamic to declare others)")
        return model, dataclasses.replace(config, dynamic=dims or False)
    if isinstance(config.dynamic, dict):
        model = ep.module(check_guards=False).to(device)
    return model, config


def builtin_example(model: nn.Module, batch_size: int | None = None) -> tuple:
    """A model's own example inputs (at batch_size), drawn from a fixed seed, the caller's RNG left alone: the
    command line's runs of one built-in model take the same example (and a second one reuses the first one's
    verdicts, accelc.reuse)."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        return tuple(model.example_inputs() if batch_size is None else model.example_inputs(batch_size=batch_size))


def load_model_and_inputs(source: str, device: torch.device, input_shapes: str | None = None,
                          example_inputs: str | None = None, batch_size: int | None = None):
    """The model and the example inputs the CLI's flags ask for, as (model, args, kwargs): a file of
    inputs, random inputs of given shapes, a built-in model's own at `batch_size`, or those the
    model file carries (a .pt2's keyword arguments included)."""
    model, own_inputs, own_kwargs = load_model(source, device)
    if example_inputs:
        return model, *load_example_inputs(example_inputs, device)
    if input_shapes is not None:
        return model, random_inputs(model, parse_shapes(input_shapes), device), {}
    if batch_size is not None:
        if not hasattr(model, "example_inputs"):
            raise ModelFileError(f"--batch-size sets a built-in model's example batch; {source!r} has none to set: "
                                 "give --input-shape (e.g. 8x3x224x224) or --example-inputs FILE")
        return model, builtin_example(model, batch_size), {}
    if own_inputs is not None:
        return model, own_inputs, own_kwargs
    raise ModelFileError(f"{source!r} carries no example inputs: give --input-shape (e.g. 8x3x224x224) "
                         "or --example-inputs FILE")


def random_inputs(model: nn.Module, shapes: list, device: torch.device) -> tuple:
    """Random example inputs of `shapes` (--input-shape): token ids for the first of a model that takes them (one
    with input embeddings, as HF's language models: ids drawn below its vocabulary's size), floats drawn normal for
    the rest (a float tensor where a model embeds token ids failed inside its embedding)."""
    embeddings = getattr(model, "get_input_embeddings", None)
    try:
        table = embeddings() if callable(embeddings) else None
    except (NotImplementedError, AttributeError):
        table = None
    vocab = table.num_embeddings if isinstance(table, nn.Embedding) else None
    return tuple(torch.randint(0, vocab, s, device=device) if i == 0 and vocab else torch.randn(s, device=device)
                 for i, s in enumerate(shapes))


def check_forward(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype | None = None) -> None:
    """One call of the model on the example inputs (cast to `dtype` where given) before any long
    work: a model that fails on them is one line naming the inputs' shapes and its own error."""
    check_args = _to(args, dtype) if dtype is not None else args
    check_kwargs = _to(kwargs, dtype) if dtype is not None else kwargs
    try:
        with torch.no_grad():
            out = (model.to(dtype) if dtype is not None else model)(*check_args, **check_kwargs)
        for t in pytree.tree_leaves(out):    # a sharded model's output: its collective waited for, not left in flight
            if isinstance(t, torch.Tensor) and callable(getattr(t, "wait", None)):
                t.wait()
    except Exception as e:
        shapes = ", ".join("x".join(map(str, a.shape)) for a in pytree.tree_leaves((args, kwargs))
                           if isinstance(a, torch.Tensor))
        raise ModelFileError(f"the model's forward failed on inputs of shape {shapes}: {short_error(e)}") from e


def write_summary(opt: OptimizedModule, folder: str | os.PathLike) -> None:
    """summary.txt and layers.json (per-layer records) in `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("summary.txt", opt.summary() + "\n"),
                       ("layers.json", json.dumps(opt.summary_dict(), indent=1) + "\n")):
        write_text(folder / name, text)


def _to(tree, target):
    """`tree` (a tuple of arguments, a dict of keyword arguments) with its tensors moved to a
    device, or its floating-point tensors cast to a dtype; the same structure back."""
    return pytree.tree_map(
        lambda t: t.to(target) if isinstance(t, torch.Tensor) and (not isinstance(target, torch.dtype)
                                                                    or t.is_floating_point()) else t,
        tree)
