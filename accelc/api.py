"""accelc.optimize: capture, rewrite, guard, and hand back a drop-in module."""
from __future__ import annotations

import copy
import warnings

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from accelc import runtime
from accelc.capture import capture
from accelc.config import OptimizeConfig, PRESETS
from accelc.guard import check_layers, layer_inputs, rel_l2, sqnr_db
from accelc.latency import layer_ms
from accelc.optimized import OptimizeInfo, OptimizedModule, collect_layers
from accelc.pipeline import run_passes
from accelc.passes.int8 import CALIBRATION_KEY
from accelc.rewrite import attr_value, demote, forget_replacements, revert


def optimize(model: nn.Module, example_inputs, config: OptimizeConfig | str | None = None,
             calibration=None) -> OptimizedModule:
    """Rewrite `model`'s recognised layers into accelc's Triton kernels.

    example_inputs: a tensor or a tuple of positional arguments, on the device the model runs
        on; they fix the shapes the guard checks and the layers are named and measured with.
    config: an OptimizeConfig, a PRESETS name ("fp16", ...), or None for the defaults.
    calibration: with int8 static scales or smoothing (Int8Config), a list of input batches
        (tensors or tuples, like example_inputs) the activation ranges are measured on; the
        example inputs when None.

    Layers accelc does not recognise, and rewritten layers whose numbers the guard rejects, run
    as PyTorch; OptimizedModule.summary() lists every one with its reason. The caller's model is
    left as it is, except that it is put in eval mode (accelc optimizes for inference).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes an nn.Module, not {type(model).__name__}")
    config = _config(config)
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if model.training:
        try:
            model.eval()
        except NotImplementedError:
            pass  # a torch.export program (ep.module()): its mode was fixed when it was exported
        else:
            warnings.warn("accelc optimizes for inference: the model was in training mode and has been "
                          "switched to eval() (dropout off, batch norm on running statistics)", stacklevel=2)
    batches = [args] if calibration is None else [
        (b,) if isinstance(b, torch.Tensor) else tuple(b) for b in calibration]
    if config.dtype is not None:
        model, args = _to_dtype(model, args, config.dtype)
        batches = [_to_dtype(model, b, config.dtype)[1] for b in batches]
    device = device_of(model, args)
    runtime.warn_if_interpreted(stacklevel=2)

    gm, method, expected = capture(model, args)
    return optimize_graph(gm, args, config, method, expected, device, calibration=batches)


def optimize_graph(gm, args: tuple, config: OptimizeConfig, method: str, expected,
                   device: torch.device, calibration: list | None = None) -> OptimizedModule:
    """Passes, guard and revert on a prepared graph (accelc.capture.prepare) whose output on
    `args` is `expected`."""
    if runtime.can_run_on(device):
        gm.meta[CALIBRATION_KEY] = calibration if calibration is not None else [args]
        try:
            counts = run_passes(gm, config)
        finally:
            gm.meta.pop(CALIBRATION_KEY, None)
    else:
        counts = {}
        for n in gm.graph.nodes:
            n.meta["accelc_skip"] = (f"model on {device}: accelc kernels need a CUDA device "
                                     "(or Triton's interpreter, TRITON_INTERPRET=1)")

    checks = check_layers(gm, args, config) if config.guard else {}
    reverted = {}
    demoted = {}
    for node, check in list(checks.items()):
        if check.passed:
            continue
        rw = node.meta["accelc"]
        del checks[node]
        if rw.fallback is not None:
            # an int8 layer under the SQNR floor: back to its float accelc kernel, checked below
            demoted[demote(gm, node, f"{check.reason}: float kernel instead")] = check
        else:
            reverted[rw.layer] = (rw, check)
            revert(gm, node, check.reason)
    if config.int8 is not None and config.int8.only_if_faster and device.type == "cuda" \
            and not runtime.interpreted():
        for node, note in _slower_int8(gm, args).items():
            check = checks.pop(node, None)
            if check is not None:
                note = f"int8 SQNR {check.sqnr_db:.1f} dB; {note}"
            demoted[demote(gm, node, note)] = check
    if demoted:
        for node, check in check_layers(gm, args, config, only=set(demoted)).items():
            if check.passed:
                checks[node] = check
            else:
                reverted[node.meta["accelc"].layer] = (node.meta["accelc"], check)
                revert(gm, node, check.reason)
    forget_replacements(gm)
    if demoted or config.int8 is not None:
        gm.graph.eliminate_dead_code()   # weight.t() nodes the int8 layers no longer read
    gm.graph.lint()
    gm.recompile()

    with torch.no_grad():
        got = gm(*args)
    err = _output_error(got, expected)
    weight_bytes = [n.meta["accelc"].weight_bytes for n in gm.graph.nodes
                    if "accelc" in n.meta and n.meta["accelc"].weight_bytes]
    info = OptimizeInfo(capture_method=method, device=runtime.backend_name(device), pass_counts=counts,
                        end_to_end_rel_error=err, int8=config.int8 is not None,
                        end_to_end_sqnr_db=sqnr_db(err),
                        float_weight_bytes=sum(b[0] for b in weight_bytes),
                        int8_weight_bytes=sum(b[1] for b in weight_bytes))
    return OptimizedModule(gm, collect_layers(gm, checks, reverted), info, example_inputs=args)


def _slower_int8(gm, args) -> dict:
    """{int8 node: why it goes back to float} for the int8 layers whose kernel is slower than their
    float kernel on the example inputs (the report's timer, over a CUDA graph)."""
    nodes = [n for n in gm.graph.nodes if "accelc" in n.meta and n.meta["accelc"].quantized]
    if not nodes:
        return {}
    captured = layer_inputs(gm, args, set(nodes))
    slower = {}
    with torch.no_grad():
        for n in nodes:
            a, kw = captured[n][1]
            fb = n.meta["accelc"].fallback
            env = dict(zip(n.args, a))
            fa = [_value(gm, x, env) for x in fb.args]
            fkw = {k: _value(gm, v, env) for k, v in fb.kwargs.items()}
            t8, _ = layer_ms(lambda: n.target(*a, **kw), a[0].device, rep_ms=20)
            tf, _ = layer_ms(lambda: fb.target(*fa, **fkw), a[0].device, rep_ms=20)
            if not t8 < tf:
                slower[n] = (f"int8 {t8 * 1e3:.1f} us vs float {tf * 1e3:.1f} us on the example inputs: "
                             "float kernel kept (Int8Config.only_if_faster)")
    return slower


def _value(gm, x, env):
    """The value of a float fallback's argument: shared with the int8 call, a parameter, or an op
    on parameters (weight.t())."""
    if not isinstance(x, fx.Node):
        return x
    if x in env:
        return env[x]
    if x.op == "get_attr":
        return attr_value(gm, x)
    return x.target(*[_value(gm, a, env) for a in x.args], **{k: _value(gm, v, env) for k, v in x.kwargs.items()})


def _config(config) -> OptimizeConfig:
    if config is None:
        return OptimizeConfig()
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"no preset {config!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[config]()
    if not isinstance(config, OptimizeConfig):
        raise TypeError(f"config must be an OptimizeConfig or a preset name, not {type(config).__name__}")
    return config


def _to_dtype(model, args, dtype):
    p = next(iter(model.parameters()), None)
    if p is not None and p.dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    args = tuple(pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, args))
    return model, args


def device_of(model, args) -> torch.device:
    for t in pytree.tree_leaves(args):
        if isinstance(t, torch.Tensor):
            return t.device
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _output_error(got, expected) -> float:
    errs = [rel_l2(g, e) for g, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected))
            if isinstance(e, torch.Tensor) and e.is_floating_point()]
    return max(errs) if errs else 0.0
