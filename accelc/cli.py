"""accelc's command line: a thin shell over the Python API.

    accelc optimize mlp [--dtype fp16] [--batch-size 64] [--device cuda]
    accelc list-models
    accelc --version
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

    sub.add_parser("list-models", help="list the built-in example models")
    return p


def _one_line_warning(message, category, filename, lineno, line=None):
    text = str(message)
    return (text if text.startswith("accelc") else f"accelc: warning: {text}") + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    warnings.formatwarning = _one_line_warning
    try:
        if args.command == "optimize":
            return _optimize(args)
        if args.command == "list-models":
            return _list_models()
        _parser().print_help()
        return 2
    except Exception as e:
        if args.verbose:
            raise
        print(f"accelc: error: {e}", file=sys.stderr)
        return 1


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


def _list_models() -> int:
    import accelc

    for name in accelc.models.names():
        print(f"{name:18s} {accelc.models.describe(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
