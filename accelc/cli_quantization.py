"""The command line's quantization flags (--int8..., --fp8...): their parser group, and the Int8Config / Fp8Config
they ask for, a flag given without the one it qualifies said in one line."""
from __future__ import annotations


def add_args(p) -> None:
    """The quantization flags' group on a command's parser."""
    g = p.add_argument_group("quantization (int8 W8A8 or weight-only; fp8 weight-only)")
    g.add_argument("--int8", action="store_true",
                   help="run linear layers in int8 (weights per channel, activations per token); "
                        "layers under the SQNR floor stay in float")
    g.add_argument("--int8-attention", action="store_true", help="with --int8: also q @ k^T in int8")
    g.add_argument("--int8-smoothing", type=float, metavar="ALPHA", default=None,
                   help="with --int8: SmoothQuant migration strength (e.g. 0.5), calibrated on the example inputs")
    g.add_argument("--int8-all-layers", action="store_true",
                   help="with --int8: also the first and last linear layers")
    g.add_argument("--output-error", type=float, default=None, metavar="X",
                   help="with --int8 or --fp8: the whole output's error budget, X times eager's own against the model "
                        "in higher precision; past it the lowest-SQNR layers go back to float")
    g.add_argument("--sqnr-floor", type=float, default=None, metavar="DB",
                   help="with --int8 or --fp8: guard floor in dB (default 20)")
    g.add_argument("--int8-keep-slower", action="store_true",
                   help="with --int8: keep int8 layers that are slower than their float kernel on the GPU")
    g.add_argument("--fp8", action="store_true",
                   help="fp8 (e4m3) weights per output channel, activations in the model's dtype (weight-only: "
                        "decoding); layers under the SQNR floor stay in float; not with --int8")
    g.add_argument("--fp8-activations", action="store_true",
                   help="with --fp8: linear layers' inputs in fp8 too, a scale a row at run time (prompts, whole "
                        "models: the product on fp8 tensor cores)")
    g.add_argument("--fp8-attention", action="store_true",
                   help="with --fp8: attention's two products on fp8 operands too (fp16 / bf16 models, head dims in "
                        "multiples of 32)")
    g.add_argument("--fp8-keep-slower", action="store_true",
                   help="with --fp8: keep fp8 layers that are slower than their float kernel on the GPU")


def fp8_config(args):
    """The Fp8Config --fp8 asks for (its floor from --sqnr-floor), or False."""
    from accelc.config import Fp8Config

    if not getattr(args, "fp8", False):
        for flag in ("activations", "keep_slower", "attention"):
            if getattr(args, f"fp8_{flag}", False):
                raise ValueError(f"--fp8-{flag.replace('_', '-')} needs --fp8")
        return False
    return Fp8Config(weights_only=not args.fp8_activations, only_if_faster=not args.fp8_keep_slower,
                     attention=args.fp8_attention,
                     output_error=args.output_error,
                     **({"sqnr_floor": args.sqnr_floor} if args.sqnr_floor is not None else {}))


def int8_config(args):
    """The Int8Config the int8 flags ask for, or False."""
    from accelc.config import Int8Config

    extra = (args.int8_attention or args.int8_smoothing is not None or args.int8_all_layers or args.int8_keep_slower
             or ((args.sqnr_floor is not None or args.output_error is not None)
                 and not getattr(args, "fp8", False)))   # (--fp8 takes a floor and a budget too)
    if not args.int8:
        if extra:
            raise ValueError("--int8-attention / --int8-smoothing / --int8-all-layers / --int8-keep-slower need "
                             "--int8 (--sqnr-floor / --output-error: --int8 or --fp8)")
        return False
    kw = dict(attention=args.int8_attention, smoothing=args.int8_smoothing,
              skip_first_last=not args.int8_all_layers, only_if_faster=not args.int8_keep_slower)
    if args.sqnr_floor is not None:
        kw["sqnr_floor"] = args.sqnr_floor
    return Int8Config(**kw, output_error=args.output_error)
