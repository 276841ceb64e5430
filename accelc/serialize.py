"""Saving and loading optimized models.

accelc.save(opt, "model.pt2") writes a torch.export program whose graph calls torch.ops.accelc.*;
torch.export.load (after `import accelc`, which registers the ops) or accelc.load reads it back.
The file is written to a temporary name in the target folder and renamed into place, so an
interrupted or failed write never leaves a half-written file under the final name.
"""
from __future__ import annotations

import copy
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import logging
import os
import re
import warnings
import zlib
from pathlib import Path

import torch
from torch import nn

from accelc import fx_tracing, tensor_parallel
from accelc.capture import export_program, program_module, quiet_torch_logs
from accelc.capture import output_template
from accelc.capture.contract import rebuilt_output
from accelc.capture.shapes import SHAPES, DimRange, InputShapes, guard_failure
from accelc.errors import InputError, ModelFileError, short_error
from accelc.files import atomic_path, check_output_file
from accelc.optimized import OptimizedModule, other_dtype

log = logging.getLogger("accelc")

SUMMARY_FILE = "accelc_summary.json"
CHECKSUM_FILE = "accelc_weights_crc32.json"    # the program's weights' CRC-32, which accelc.load verifies


def weights_checksum(ep) -> dict:
    """The CRC-32 of a program's weights and constants, by name in order, bytes as stored (the
    archive's own reader checks none: flipped bytes in a weight load without a word)."""
    crc, count = 0, 0
    tensors = {**ep.state_dict, **{k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}}
    for name in sorted(tensors):
        t = tensors[name].detach()
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)    # (read in place: no copy)
        count += 1
    return {"crc32": crc, "tensors": count}


@fx_tracing.own_flag
def save(opt: OptimizedModule, path: str | os.PathLike, example_inputs: tuple | None = None,
         strict: bool = False) -> Path | None:
    """Export `opt` (on its example inputs unless given others) and write it to `path` (.pt2).
    The program takes the call the model was optimized with: positional inputs, and its tensor
    keyword arguments by name, at the shapes the optimized module takes; accelc.load gives back the
    model's output as it returns it (an HF output holding a cache too: capture.output_template). Where
    those cannot be exported with dynamic dims, the program takes the example's shapes, with a warning;
    strict=True raises ModelFileError instead (nothing written). Under tensor parallelism each rank's shard goes beside `path`, named by its rank
    (model.pt2 -> model.rank0-of-2.pt2), as the command line writes them; a model every rank holds whole is
    written by rank 0 alone. Returns the file written (None on a rank that writes none)."""
    if not isinstance(opt, OptimizedModule):
        raise TypeError(f"accelc.save takes the module accelc.optimize returned, not {type(opt).__name__}")
    path = check_output_file(path, ".pt2", "a torch.export program")
    target = tensor_parallel.program_file(path, opt.graph_module)
    if target is None:
        rank, world = tensor_parallel.launched()
        log.info("accelc.save: rank %d of %d: the model holds no shard, so rank 0 writes %s", rank, world, path)
        return None
    if target != path:
        log.info("accelc.save: this rank's shard to %s", target)
    path = target
    opt.wait_for_other_shapes()     # (its background glue compile runs Dynamo on the graph this exports)
    args = tuple(example_inputs if example_inputs is not None else opt.example_inputs)
    spec = opt.call_spec
    dynamic = opt.config.dynamic
    shapes = opt.graph_module.meta.get(SHAPES)
    if isinstance(dynamic, dict):   # the declared ranges by the graph's input position
        names = spec.names if spec is not None else (shapes.names if shapes is not None else ())
        dynamic = tuple(dynamic.get(n) for n in names) if names else True
    # a copy of the graph module over the same tensors, with attributes of its own: the export puts fake tensors in
    # place of the module's parameters while it traces, which another thread's calls of `opt` read meanwhile
    gm = copy.copy(opt.graph_module)
    with quiet_torch_logs():
        if spec is not None and spec.kw_names:
            ep, static = export_program(_as_called(gm, spec), args[:spec.n_args],
                                        dict(zip(spec.kw_names, args[spec.n_args:])), dynamic=dynamic,
                                        limits=_limits(shapes))
        else:
            # the graph module, not the wrapper: its forward has the model's own signature, which
            # per-dimension dynamic shapes are matched against
            ep, static = export_program(gm, args, dynamic=dynamic, limits=_limits(shapes))
    if not static and isinstance(dynamic, tuple):
        static = _pinned(ep, dynamic)
    if static and dynamic is not False:
        if strict:
            raise ModelFileError(f"the program cannot take the declared dims ({static}): its graph fixes a size "
                                 "(a reshape to the example's numbers?); export the model again with "
                                 "dynamic_shapes, or convert without --dynamic")
        warnings.warn(f"accelc.save: the saved program takes the example's shapes only: {static}", stacklevel=2)
    template, flat_why = output_template.written(spec.template if spec is not None else None)
    if flat_why:
        warnings.warn(f"accelc.save: the saved program returns the model's output as its flat tuple of tensors: "
                      f"{flat_why}", stacklevel=2)
    with atomic_path(path) as tmp:
        try:
            summary = {**opt.summary_dict(), **_shape_notes(shapes), **tensor_parallel.shard_note(opt.graph_module)}
            torch.export.save(ep, tmp, extra_files={SUMMARY_FILE: json.dumps(summary),
                                                    CHECKSUM_FILE: json.dumps(weights_checksum(ep)),
                                                    **({output_template.TEMPLATE_FILE: template} if template else {})})
        except (OSError, RuntimeError) as e:
            raise ModelFileError(f"could not write {str(path)!r}: {short_error(e)}") from e
    return path


def _limits(shapes) -> dict:
    """The limits the model's config set on the optimized graph's dims (InputShapes.cap), as
    export_program takes them: a saved program keeps them."""
    if shapes is None:
        return {}
    out: dict = {}
    for (i, d), why in shapes.limits.items():
        r = shapes.dims[i][d]
        if isinstance(r, DimRange) and r.hi is not None:
            out.setdefault(i, {})[d] = (r.hi, why)
    return out


def _shape_notes(shapes) -> dict:
    """What a program's own guards do not keep of the optimized model's shapes, saved beside it for
    accelc.load: the lower ends above 1 export does not check (InputShapes.lower_ends: [[input, dim, lo,
    why]]), and the dims the user declared a range for (dynamic=: [[input, dim]]), so that a loaded
    program's refusal names the user's range, as the optimized module's does."""
    if shapes is None:
        return {}
    lower = [[i, d, r.lo, shapes.lower_ends[r.sym]] for i, row in enumerate(shapes.dims) for d, r in enumerate(row or ())
             if isinstance(r, DimRange) and r.sym in shapes.lower_ends]
    declared = [[i, d] for i, ranges in enumerate(shapes.declared) for d in (ranges or {})] \
        if isinstance(shapes.declared, tuple) else []
    return {"lower_ends": lower, "declared": declared}


def _restore_shape_notes(shapes: InputShapes, summary: dict) -> InputShapes:
    """_shape_notes' entries taken out of a loaded program's summary: its shapes with them back."""
    def dim_range(i, d):
        row = shapes.dims[i] if i < len(shapes.dims) else None
        r = row[d] if row is not None and d < len(row) else None
        return r if isinstance(r, DimRange) else None

    for i, d, lo, why in summary.pop("lower_ends", None) or ():
        r = dim_range(i, d)
        if r is not None:
            shapes = shapes.lowered({r.sym}, max(r.lo, lo), why={r.sym: why})
    declared = [dict() for _ in shapes.names]
    for i, d in summary.pop("declared", None) or ():
        r = dim_range(i, d)
        if r is not None:
            declared[i][d] = (r.lo, r.hi)
    if any(declared):
        shapes = dataclasses.replace(shapes, declared=tuple(x or None for x in declared))
    return shapes


def _pinned(ep, declared: tuple) -> str:
    """The declared dims (by input position) the exported program fixed at the example's size
    anyway (export's Dim.AUTO specialises where the graph pins a size), in words; "" if none."""
    names = tuple(s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT")
    shapes = InputShapes.of_export(ep.graph_module, ep.range_constraints, names)
    pinned = [f"{names[i]} dim {d} is fixed at {row[d]}" for i, (ranges, row) in enumerate(zip(declared, shapes.dims))
              for d in (ranges or {}) if row is not None and d < len(row) and not isinstance(row[d], DimRange)]
    return "; ".join(pinned)


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


@contextlib.contextmanager
def _export_warnings():
    """torch.export's logged warnings (with their tracebacks) collected into the yielded list,
    not printed."""
    text: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: text.append(logging.Formatter().format(record))
    logger = logging.getLogger("torch.export")
    saved = logger.handlers, logger.propagate, logger.level
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.WARNING)
    try:
        yield text
    finally:
        logger.handlers, logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])


def read_export(path: Path, extra_files: dict | None = None):
    """torch.export.load, quietly (torch logs a whole traceback on a failed read) and where a
    program's outputs are types of a package not imported yet (an HF model's ModelOutput, whose
    pytree registration comes with importing it), with that package imported first. Raises
    ModelFileError in one line naming the cause."""
    for attempt in range(2):
        with _export_warnings() as logged:
            try:
                return torch.export.load(path, extra_files=extra_files)
            except Exception as e:
                error = e
        missing = re.search(r"Deserializing ([\w.]+)\.(\w+) in pytree is not registered", "\n".join(logged))
        if missing is None:
            raise ModelFileError(f"{str(path)!r} is not a readable torch.export program: {short_error(error)}") from error
        try:
            if attempt == 0:
                importlib.import_module(missing.group(1))   # registers its output types; read again
                continue
        except ImportError:
            pass
        raise ModelFileError(f"{str(path)!r}: the program returns {missing.group(1)}.{missing.group(2)}, which needs "
                             f"the {missing.group(1).split('.')[0]!r} package installed and importable to read it "
                             "back") from error


def load(path: str | os.PathLike) -> nn.Module:
    """Read a program accelc.save or `accelc convert` wrote; returns a callable module. Its
    `accelc_summary` attribute holds the per-layer summary saved with it. In a process group of several (a
    tensor-parallel program), a name `accelc convert` wrote rank files for reads this rank's
    (model.pt2 -> model.rank0-of-2.pt2)."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.pt2"))[:3]
        raise ModelFileError(f"{str(path)!r} is a folder: give the program file accelc.save or accelc convert wrote"
                             + (f" (here: {', '.join(inside)})" if inside else " (it holds no .pt2 file)"))
    if not path.is_file():
        ranks = tensor_parallel.this_ranks_file(path)     # (a sharded program: each rank's file beside the name)
        if ranks is None or not ranks.is_file():
            raise ModelFileError(f"no such file: {str(path)!r}"
                                 + (f" (nor this rank's {str(ranks)!r})" if ranks else ""))
        path = ranks
    extra = {SUMMARY_FILE: "", CHECKSUM_FILE: "", output_template.TEMPLATE_FILE: ""}
    ep = read_export(path, extra)
    if extra[CHECKSUM_FILE] and json.loads(extra[CHECKSUM_FILE]) != weights_checksum(ep):
        raise ModelFileError(f"{str(path)!r}: its weights do not match the checksum accelc.save wrote with them: the "
                             "file was changed or damaged after it was written; save or convert the model again")
    return _loaded(ep, extra[SUMMARY_FILE], repr(str(path)), extra[output_template.TEMPLATE_FILE])


def _loaded(ep, summary_text: str, where: str = "the program", template_text: str = "") -> "LoadedProgram":
    tensor_parallel.check_loaded(ep.graph_module, json.loads(summary_text) if summary_text else None, where)
    names = tuple(s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT")
    shapes = InputShapes.of_export(ep.graph_module, ep.range_constraints, names)
    if not shapes.dynamic:
        shapes = dataclasses.replace(shapes, static="a program saved with fixed shapes")
    summary = json.loads(summary_text) if summary_text else {}
    shapes = _restore_shape_notes(shapes, summary)
    summary = summary or None     # a program saved without a summary (pickled: only the shape notes)
    loaded = LoadedProgram(program_module(ep), shapes, summary)
    object.__setattr__(loaded, "_ep", ep)     # what it pickles as (not a submodule: the same weights)
    if template_text:
        try:
            loaded.template = output_template.read_text(template_text)
        except Exception as e:     # transformers missing, or a class it no longer has
            warnings.warn(f"accelc.load: {where} returns the model's output as its flat tuple of tensors: its "
                          f"structure ({short_error(e)}) cannot be rebuilt here", stacklevel=3)
    return loaded


def _loaded_from_bytes(data: bytes, device: str | None) -> "LoadedProgram":
    extra = {SUMMARY_FILE: "", output_template.TEMPLATE_FILE: ""}
    loaded = _loaded(read_export(io.BytesIO(data), extra), extra[SUMMARY_FILE],
                     template_text=extra[output_template.TEMPLATE_FILE])
    return loaded.to(device) if device is not None else loaded


class LoadedProgram(nn.Module):
    """A program read back by accelc.load: called as the optimized model was (positional inputs,
    tensor keywords by name). A call of a shape the program does not take raises InputError naming
    the input, the dim and the limit, as the optimized module does. `program`: the torch.export
    module itself; `accelc_summary`: the per-layer summary saved with it."""

    def __init__(self, program: nn.Module, shapes: InputShapes, summary):
        super().__init__()
        self.program = program
        self.shapes = shapes
        self.accelc_summary = summary
        self.template = None      # the model's output structure around the program's flat tuple (output_template)

    @property
    def graph(self):
        return self.program.graph

    def __reduce__(self):
        """Pickled as its program file's bytes (the program module holds hooks and generated code
        that do not pickle), read back on the device its weights are on."""
        buf = io.BytesIO()
        summary = {**(self.accelc_summary or {}), **_shape_notes(self.shapes)}
        template = output_template.written(self.template)[0]
        torch.export.save(self._ep, buf, extra_files={SUMMARY_FILE: json.dumps(summary), **(
            {output_template.TEMPLATE_FILE: template} if template else {})})
        weight = next(iter([*self.program.parameters(), *self.program.buffers()]), None)
        return _loaded_from_bytes, (buf.getvalue(), str(weight.device) if weight is not None else None)

    def forward(self, *args, **kwargs):
        flat = tuple(args) + tuple(kwargs.get(n) for n in self.shapes.names[len(args):])   # the program's order
        if self.shapes.lower_ends:
            refused = self.shapes.check(flat)
            if refused:
                raise InputError(refused)
        try:
            out = self.program(*args, **kwargs)
            return out if self.template is None else rebuilt_output(self.template, out)
        except AssertionError as e:
            text = guard_failure(e)
            if text is None:
                raise
            raise InputError(self.shapes.refusal(text, flat)) from None
        except (ValueError, RuntimeError) as e:     # a kernel's operand check on another dtype: said as the module says it
            wrong = other_dtype(flat, self._example_values())
            if wrong is None:
                raise
            raise InputError(f"{wrong} ({short_error(e)})") from None

    def generate(self, *args, **kwargs):
        raise InputError("a saved program holds the model's forward only, not its generation step and cache: "
                         "generate with the optimized LM accelc.optimize returns (a second optimize of the same "
                         "model on this machine reuses its tuning)")

    def _example_values(self) -> list:
        """The program's user inputs as it was exported (fake tensors: their dtypes), in call order."""
        placeholders = {n.name: n for n in self.program.graph.nodes if n.op == "placeholder"}
        return [placeholders[n].meta.get("val") if n in placeholders else None for n in self.shapes.names]
