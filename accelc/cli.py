"""accelc's command line: a thin shell over the Python API.

    accelc convert IN -o OUT.pt2 [--batch-size 8 | --input-shape 8x3x224x224 | --example-inputs FILE] [--dtype fp16]
    accelc optimize MODEL [--dtype fp16] [--batch-size 64 | --input-shape 8x3x224x224 | --example-inputs FILE]
                          [--device cuda] [--int8 | --fp8]  (MODEL: built-in name, file, or package.module:name)
    accelc report MODEL -o DIR [--batch-size 8 | --input-shape ... | --example-inputs FILE] [--dtype fp16]
                               [--int8 | --fp8] [--format json,csv,md,html] [--no-ort] [--compile auto|yes|no]
    accelc list-models
    accelc --version

Errors print one line and exit 1 (2 for bad usage); --verbose shows the traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import warnings

import accelc
from accelc import cli_quantization, progress
from accelc.errors import CaptureError, ReportFailedError
from accelc.files import check_output_folder

# torch, the kernels and the commands' modules are imported by the commands (accelc._help_only: `accelc
# --help` and `--version` answer without them); _FORMATS is report_rows.FORMATS (a test keeps them one)
_FORMATS = ("json", "csv", "md", "html")


# one rule for every command and the Python API: the model runs in its own dtype unless asked
_DTYPE_HELP = ("run the model in this dtype (default: the model's own, as the Python API; the built-in "
               "models are fp32: give --dtype fp16 or bf16 for the GPU's tensor-core speed)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="accelc",
        description="Rewrite a PyTorch model's layers into Triton kernels, check every rewritten "
                    "layer's numbers, and say what was done.",
        epilog="examples:\n  accelc optimize mlp                      a built-in model, its summary printed\n"
               "  accelc optimize mymodels:build_net --input-shape 8x3x224x224 --dtype fp16\n"
               "  accelc convert model.pt -o model.pt2 --input-shape 8x3x224x224 --dtype fp16\n"
               "  accelc report resnet -o report/ --dtype fp16   per-layer times against PyTorch, ONNX Runtime\n"
               "  accelc <command> --help                  each command's options",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"accelc {accelc.__version__}")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show accelc's log (each step, each layer tuned) and tracebacks on errors")
    # also after the command (accelc convert IN -o OUT -v); SUPPRESS keeps the top-level value
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show accelc's log and tracebacks on errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    o = sub.add_parser("optimize", parents=[common], help="optimize a model and print the per-layer summary",
                       description="Optimize a model on example inputs and print which layers were rewritten "
                                   "(the summary). To keep the result, `accelc convert` writes it as a .pt2.",
                       epilog="MODEL: a built-in model name (accelc list-models), a torch.save'd module or a .pt2\n"
                              "program (a pickle runs code from the file: only files you trust), or\n"
                              "package.module:name, an nn.Module or what builds one with no arguments, imported\n"
                              "with the current folder on the path. Inputs: a built-in model's own (--batch-size),\n"
                              "else --input-shape or --example-inputs (a .pt2 carries its own).\n\nexamples:\n"
                              "  accelc optimize mlp\n  accelc optimize resnet --dtype fp16 --batch-size 32\n"
                              "  accelc optimize mymodels:build_net --input-shape 8x3x224x224 --dtype fp16\n"
                              "  accelc optimize model.pt --example-inputs inputs.pt",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    o.add_argument("model", metavar="MODEL", help="built-in model name, model file, or package.module:name")
    o.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None, help=_DTYPE_HELP)
    o.add_argument("--batch-size", type=_positive(int), default=None, help="a built-in model's example batch size")
    _input_args(o)
    o.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when a GPU is present")
    _runtime_args(o)
    cli_quantization.add_args(o)

    c = sub.add_parser(
        "convert", parents=[common], help="optimize a saved model and write it as a .pt2 program",
        description="Load a saved PyTorch model, rewrite its layers into accelc's kernels, check every "
                    "rewritten layer, and write a torch.export program (.pt2) that calls them. The "
                    "output reloads with accelc.load(OUT), or torch.export.load(OUT) after "
                    "`import accelc`. OUT is written atomically: never half-written.",
        epilog="IN: a torch.save'd full module (a pickle: loading it runs code from the file, so only "
               "convert files you trust), a torch.export program (.pt2), or a built-in model name "
               "(accelc list-models). TorchScript files are refused.")
    c.add_argument("input", metavar="IN", help="model file or built-in model name")
    c.add_argument("-o", "--output", metavar="OUT", required=True, help="output program, ending in .pt2")
    _input_args(c).add_argument("--batch-size", type=_positive(int), default=None, help="built-in models: example batch size")
    c.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None, help=_DTYPE_HELP)
    c.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when a GPU is present")
    c.add_argument("--report", metavar="DIR",
                   help="also write summary.txt, layers.json and the per-layer latency report "
                        "(report.json / .csv / .md / .html, as `accelc report`) to DIR")
    cli_quantization.add_args(c)
    _shape_args(c)

    r = sub.add_parser(
        "report", parents=[common], help="time and check every layer: eager PyTorch vs ONNX Runtime vs accelc",
        description="Optimize MODEL, then time every rewritten layer and the whole model three ways "
                    "(eager PyTorch, ONNX Runtime, accelc) and check each against a higher-precision "
                    "reference. Writes report.json / .csv / .md / .html to DIR.")
    r.add_argument("model", metavar="MODEL", help="built-in model name, torch.save'd module or .pt2 program")
    r.add_argument("-o", "--output", metavar="DIR", required=True, help="folder for the report files")
    _input_args(r).add_argument("--batch-size", type=_positive(int), default=None, help="built-in models: example batch size")
    r.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None, help=_DTYPE_HELP)
    r.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when a GPU is present")
    r.add_argument("--format", default="json,csv,md,html", help="comma-separated: json, csv, md, html")
    r.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime")
    r.add_argument("--compile", choices=["auto", "yes", "no"], default="auto",
                   help="also time torch.compile (default and reduce-overhead for the whole model): auto = on a GPU")
    r.add_argument("--rep-ms", type=_positive(float), default=100, help="timing budget per measurement, ms (default 100)")
    _runtime_args(r)
    cli_quantization.add_args(r)

    sub.add_parser("list-models", parents=[common], help="list the built-in example models")
    return p


def _positive(kind):
    """An argparse type: a number of `kind` above zero (a usage error, exit 2, otherwise)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:      # also NaN
            raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _input_args(p):
    """--input-shape / --example-inputs, one or the other; returns their group."""
    shapes = p.add_mutually_exclusive_group()
    shapes.add_argument("--input-shape", metavar="SHAPE",
                        help="example input sizes, e.g. 8x3x224x224 (several inputs: comma-separated); "
                             "random float inputs of these shapes")
    shapes.add_argument("--example-inputs", metavar="FILE",
                        help="torch.save'd tensor, tuple of tensors, or dict of them by input name (a "
                             "tokenizer's output as dict(inputs)) to use as example inputs")
    return shapes


def _shape_args(p) -> None:
    g = p.add_argument_group("input shapes (default: every batch size and length up to the model's limits)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--static", action="store_true", help="take the example's shapes only")
    x.add_argument("--dynamic", metavar="NAME:DIM=LO..HI[,DIM=LO..HI]", action="append", default=None,
                   help="the dims of input NAME that vary, and their ranges (HI 'any': no limit), e.g. "
                        "input_ids:0=1..64,1=1..512; every other dim takes the example's size; repeat for "
                        "each input")


def _dynamic(args):
    """OptimizeConfig.dynamic from --static / --dynamic."""
    if getattr(args, "static", False):
        return False
    if not getattr(args, "dynamic", None):
        return True
    out = {}
    for item in args.dynamic:
        name, _, dims = item.partition(":")
        try:
            ranges = []
            for part in dims.split(","):
                d, _, rng = part.partition("=")
                lo, _, hi = rng.partition("..")
                ranges.append((int(d), int(lo), None if hi.strip() in ("any", "") else int(hi)))
        except ValueError:
            raise ValueError(f"--dynamic {item!r}: expected NAME:DIM=LO..HI[,DIM=LO..HI], e.g. "
                             "input_ids:0=1..64,1=1..512") from None
        dims_of = out.setdefault(name.strip(), {})
        for d, lo, hi in ranges:
            if d in dims_of:      # said, not the last one silently winning
                raise ValueError(f"--dynamic gives {name.strip()} dim {d} twice ({item!r}): give each dim once")
            dims_of[d] = (lo, hi)
    return out


def _runtime_args(p) -> None:
    _shape_args(p)
    g = p.add_argument_group("runtime")
    g.add_argument("--glue", choices=["auto", "inductor", "eager"], default="auto",
                   help="how the layers accelc does not rewrite run: compiled by Inductor, eager, or auto "
                        "(Inductor on a GPU)")
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="plain calls instead of a CUDA graph replayed per input signature (GPU)")
    g.add_argument("--keep-slower", action="store_true",
                   help="keep rewritten layers that are slower than PyTorch on the example inputs (GPU)")


def _runtime_config(args) -> dict:
    """The config fields the runtime flags set; only_if_faster left to its default (ACCELC_ONLY_IF_FASTER, as
    accelc.convert's) unless --keep-slower turns it off."""
    out = dict(glue=args.glue, cuda_graphs=not args.no_cuda_graphs, dynamic=_dynamic(args))
    return {**out, "only_if_faster": False} if args.keep_slower else out


def _one_line_warning(message, category, filename, lineno, line=None):
    """A warning on one line, named by who gave it: accelc's as they are, another library's (torch's
    deprecations) under its package's name, not accelc's."""
    text = " ".join(str(message).split())
    if text.startswith("accelc"):
        return text + "\n"
    return f"{category.__name__} ({_package_of(filename)}): {text}\n"


def _package_of(filename: str) -> str:
    """The installed package a source file belongs to ("torch", "transformers"), else the file's name."""
    parts = os.path.normpath(filename).split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1].removesuffix(".py")
    return os.path.basename(filename)


# options whose value may begin with "-" (a negative size, said by the shape parser): argparse takes such a
# value for an option of its own and answers "expected one argument"
_VALUE_OPTIONS = ("--input-shape", "--dynamic", "--batch-size")


def _joined(argv: list[str]) -> list[str]:
    """argv with `--input-shape -2x32` given as `--input-shape=-2x32`."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] != "-":
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    if signal.getsignal(signal.SIGINT) is getattr(accelc, "_interrupted_while_importing", None):
        signal.signal(signal.SIGINT, signal.default_int_handler)     # Ctrl-C: KeyboardInterrupt again, caught below
    args = _parser().parse_args(_joined(list(sys.argv[1:] if argv is None else argv)))
    if "" not in sys.path and os.getcwd() not in sys.path:
        # the current folder importable, as `python -m accelc` has it: a pickled model's own classes, a
        # package.module:name given to the command (the console script's path starts at its bin folder)
        sys.path.insert(0, os.getcwd())
    saved, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    # accelc's progress (what is being tuned, for which layer) on stderr; quiet in the Python API
    log = logging.getLogger("accelc")
    handler = _LogLines(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)   # setLevel: also clears logging's cache
    term = _on_sigterm_unwind()
    try:
        # a terminal sees optimize's phases and the guard's layer i of N as a bar (accelc.progress), the
        # log's lines above it; elsewhere (a pipe, CI) the log's lines alone
        with progress.showing("accelc", args.command in ("convert", "optimize", "report") and sys.stderr.isatty()):
            if args.command == "convert":
                return _convert(args)
            if args.command == "optimize":
                return _optimize(args)
            if args.command == "report":
                return _report(args)
        if args.command == "list-models":
            return _list_models()
        _parser().print_help()
        return 2
    except KeyboardInterrupt:
        print("accelc: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("accelc: terminated", file=sys.stderr)
        return 143
    except Exception as e:
        if args.verbose:
            raise
        if isinstance(e, CaptureError):   # one paragraph: each tracer's reason, then what to try
            print(f"accelc: error: {str(e).strip()}\n(-v shows torch's own output and the traceback)",
                  file=sys.stderr)
        else:
            print(f"accelc: error: {_one_line(e)}", file=sys.stderr)
        return 1
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)
        warnings.formatwarning = saved
        log.removeHandler(handler)
        log.setLevel(level)


class _LogLines(logging.StreamHandler):
    """The CLI's log on stderr, written above the progress bar where one is shown."""

    def emit(self, record):
        if not progress.write(self.format(record)):
            super().emit(record)


class _Terminated(BaseException):
    """SIGTERM, raised where Python is, so that cleanups run (a temporary output file removed)."""


def _on_sigterm_unwind():
    """SIGTERM unwinds like Ctrl-C instead of killing the process where it stands; returns the
    previous handler (None where handlers cannot be set: not the main thread)."""
    def handler(signum, frame):
        raise _Terminated()
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


def _one_line(e: Exception) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # KeyError quotes str()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _optimize(args) -> int:
    from accelc.convert import check_forward, load_model_and_inputs

    device = _device(args)
    config = accelc.OptimizeConfig(dtype=args.dtype, int8=cli_quantization.int8_config(args), fp8=cli_quantization.fp8_config(args),
                                   **_runtime_config(args))
    from accelc import tensor_parallel

    with tensor_parallel.launcher_group(device):
        model, inputs, kwargs = load_model_and_inputs(args.model, device, args.input_shape, args.example_inputs,
                                                      args.batch_size)
        if args.model not in accelc.models.names():
            check_forward(model, inputs, kwargs, config.dtype)
        opt = accelc.optimize(model, inputs, config=config, example_kwargs=kwargs)
        _print_summary(opt)
        opt.release_graphs()    # (a sharded program's graphs hold the communicator the group's destroy waits on)
    return 0


def _print_summary(opt) -> None:
    """The summary; under torchrun rank 0's alone (every rank optimized its own shard), the others one line."""
    from accelc import tensor_parallel

    where = tensor_parallel.launched()
    if where is None or where[0] == 0:
        print(opt.summary())
    else:
        print(f"accelc: rank {where[0]} of {where[1]}: {len(opt.rewritten)} layer(s) rewritten (rank 0 prints its "
              "summary)")


def _device(args, check: bool = True):
    """The device a command runs on (--device, else the GPU where there is one), a missing GPU said (check),
    and the flags that change nothing off a GPU said in one line each (not taken silently)."""
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if check and device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA GPU is available")
    if device.type != "cuda":
        _gpu_only_flags(args)
    return device


def _gpu_only_flags(args) -> None:
    given = [flag for flag, on in (("--no-cuda-graphs", getattr(args, "no_cuda_graphs", False)),
                                   ("--keep-slower", getattr(args, "keep_slower", False)),
                                   ("--int8-keep-slower", getattr(args, "int8_keep_slower", False)),
                                   ("--fp8-keep-slower", getattr(args, "fp8_keep_slower", False))) if on]
    for flag in given:
        print(f"accelc: {flag} changes nothing on a CPU (no CUDA graphs, no speed race there)", file=sys.stderr)


def _convert(args) -> int:
    from accelc import tensor_parallel

    device = _device(args, check=False)     # (accelc.convert says a missing GPU in its own words)
    with tensor_parallel.launcher_group(device):
        try:
            opt = accelc.convert(args.input, args.output, input_shapes=args.input_shape,
                                 example_inputs=args.example_inputs, dtype=args.dtype, device=args.device,
                                 report_dir=args.report, int8=cli_quantization.int8_config(args),
                                 dynamic=_dynamic(args),
                                 batch_size=args.batch_size, fp8=cli_quantization.fp8_config(args))
        except ReportFailedError as e:
            if args.verbose:
                raise
            print(e.optimized.summary())
            print(f"wrote {args.output}")
            print(f"accelc: error: {e}", file=sys.stderr)
            return 1
        _print_summary(opt)
        written = tensor_parallel.program_file(args.output, opt.graph_module)
        if written is not None:
            print(f"wrote {written}")
        opt.release_graphs()
    return 0


def _report(args) -> int:
    from accelc.convert import check_forward, load_model_and_inputs

    device = _device(args)
    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    if not formats or any(f not in _FORMATS for f in formats):   # said now, not after measuring
        raise ValueError(f"--format takes {', '.join(_FORMATS)} (comma-separated), not {args.format!r}")
    dtype = args.dtype
    from accelc import tensor_parallel
    if tensor_parallel.launched() is not None:    # (every rank would time its shard into one folder)
        raise ValueError("accelc report times one process's model layer by layer: run it without torchrun, on the "
                         "unsharded model (accelc convert and optimize take a sharded one under torchrun)")
    check_output_folder(args.output)    # said now, not after measuring
    model, inputs, kwargs = load_model_and_inputs(args.model, device, args.input_shape, args.example_inputs,
                                                  args.batch_size)
    config = accelc.OptimizeConfig(dtype=dtype, int8=cli_quantization.int8_config(args),
                                   fp8=cli_quantization.fp8_config(args), **_runtime_config(args))
    check_forward(model, inputs, kwargs, config.dtype)
    rep = accelc.report(model, inputs, config, example_kwargs=kwargs,
                        with_ort=not args.no_ort, rep_ms=args.rep_ms, model_name=args.model,
                        with_compile={"auto": None, "yes": True, "no": False}[args.compile])
    for path in rep.write(args.output, formats):
        print(f"wrote {path}")
    t = rep.totals
    e2e = rep.end_to_end
    if t.get("no_ratio"):
        print(f"{t['rewritten']} layer(s) rewritten; no speedups: {t['no_ratio']}")
    else:
        print(f"{t['rewritten']} layer(s) rewritten; timed layers: accelc {_fmt_x(t['speedup_vs_eager'])} vs eager, "
              f"{_fmt_x(t['speedup_vs_ort'])} vs ONNX Runtime, {_fmt_x(t.get('speedup_vs_compile'))} vs torch.compile; "
              f"end to end {_fmt_x(e2e.speedup_vs_eager)} vs eager, {_fmt_x(e2e.speedup_vs_ort)} vs ONNX Runtime, "
              f"{_fmt_x(e2e.speedup_vs_compile)} vs torch.compile (its faster mode)")
    if t.get("no_ort_ratio") and not rep.header["interpreted"]:
        print(f"no speedup vs ONNX Runtime: {t['no_ort_ratio']}")
    if rep.header["note"]:
        print(f"note: {rep.header['note']}")
    return 0


def _fmt_x(v) -> str:
    return "n/a" if v is None else (f"{v:.2f}x" if v >= 0.1 else f"{v:.2g}x")


def _list_models() -> int:
    for name in accelc.models.names():
        print(f"{name:18s} {accelc.models.describe(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
