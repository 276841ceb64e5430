"""accelc's command line: a thin shell over the Python API.

    accelc convert IN -o OUT.pt2 [--input-shape 8x3x224x224 | --example-inputs FILE] [--dtype fp16]
    accelc optimize mlp [--dtype fp16] [--batch-size 64] [--device cuda]
    accelc list-models
    accelc --version

Errors print one line and exit 1 (2 for bad usage); --verbose shows the traceback.
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch


def _parser() -> argparse.ArgumentParser:
    import accelc

    p = argparse.ArgumentParser(
        prog="accelc",
        description="Rewrite a PyTorch model's layers into Triton kernels, check every rewritten "
                    "layer's numbers, and say what was done.")
    p.add_argument("--version", action="version", version=f"accelc {accelc.__version__}")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    o = sub.add_parser("optimize", help="optimize a built-in model and print the per-layer summary",
                       description="Optimize a built-in example model (see `accelc list-models`) on "
                                   "its default example input and print which layers were rewritten.")
    o.add_argument("model", help="built-in model name")
    o.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="run the model in this dtype (default: fp16 on a GPU, fp32 on the CPU)")
    o.add_argument("--batch-size", type=int, default=None, help="example input batch size")
    o.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when a GPU is present")

    c = sub.add_parser(
        "convert", help="optimize a saved model and write it as a .pt2 program",
        description="Load a saved PyTorch model, rewrite its layers into accelc's kernels, check every "
                    "rewritten layer, and write a torch.export program (.pt2) that calls them. The "
                    "output reloads with accelc.load(OUT), or torch.export.load(OUT) after "
                    "`import accelc`. OUT is written atomically: never half-written.",
        epilog="IN: a torch.save'd full module (a pickle: loading it runs code from the file, so only "
               "convert files you trust), a torch.export program (.pt2), or a built-in model name "
               "(accelc list-models). TorchScript files are refused.")
    c.add_argument("input", metavar="IN", help="model file or built-in model name")
    c.add_argument("-o", "--output", metavar="OUT", required=True, help="output program, ending in .pt2")
    shapes = c.add_mutually_exclusive_group()
    shapes.add_argument("--input-shape", metavar="SHAPE",
                        help="example input sizes, e.g. 8x3x224x224 (several inputs: comma-separated); "
                             "random float inputs of these shapes")
    shapes.add_argument("--example-inputs", metavar="FILE",
                        help="torch.save'd tensor or tuple of tensors to use as example inputs")
    c.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="convert the model to this dtype (default: keep the model's)")
    c.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when a GPU is present")
    c.add_argument("--report", metavar="DIR", help="also write summary.txt and layers.json to DIR")

    sub.add_parser("list-models", help="list the built-in example models")
    return p


def _one_line_warning(message, category, filename, lineno, line=None):
    text = str(message)
    return (text if text.startswith("accelc") else f"accelc: warning: {text}") + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    saved, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        if args.command == "convert":
            return _convert(args)
        if args.command == "optimize":
            return _optimize(args)
        if args.command == "list-models":
            return _list_models()
        _parser().print_help()
        return 2
    except KeyboardInterrupt:
        print("accelc: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose:
            raise
        print(f"accelc: error: {_one_line(e)}", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = saved


def _one_line(e: Exception) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # KeyError quotes str()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _optimize(args) -> int:
    import accelc

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA GPU is available")
    dtype = args.dtype or ("fp16" if device == "cuda" else "fp32")
    model = accelc.models.get(args.model).to(device)
    kwargs = {} if args.batch_size is None else {"batch_size": args.batch_size}
    inputs = model.example_inputs(**kwargs)
    opt = accelc.optimize(model, inputs, config=accelc.OptimizeConfig(dtype=dtype))
    print(opt.summary())
    return 0


def _convert(args) -> int:
    import accelc

    opt = accelc.convert(args.input, args.output, input_shapes=args.input_shape,
                         example_inputs=args.example_inputs, dtype=args.dtype, device=args.device,
                         report_dir=args.report,
                         progress=lambda msg: print(f"accelc: {msg}", file=sys.stderr, flush=True))
    print(opt.summary())
    print(f"wrote {args.output}")
    return 0


def _list_models() -> int:
    import accelc

    for name in accelc.models.names():
        print(f"{name:18s} {accelc.models.describe(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
