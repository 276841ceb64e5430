"""The records optimize's stages leave for the later ones, low in the import tower so that each stage
imports its inputs' types and nothing above them:

    Rewrite      a rewritten layer (rewrite -> guard, runner, summary, report), on its node's meta
    Fallback     the call a layer goes back to (an int8 layer's float kernel)
    LayerCheck   the guard's verdict on one layer (guard -> summary, report)
    LayerRecord  one row of the summary and the report
    OptimizeInfo what optimize measured and decided for the whole model
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import fx

from accelc.meta import DERIVED, attr_value


@dataclass
class Fallback:
    """The call a layer goes back to when the guard rejects its current one (an int8 layer's
    float kernel)."""
    target: object
    args: tuple
    kwargs: dict
    kind: str
    kernel: str
    aux: list                    # the Rewrite.aux of that call


@dataclass
class Rewrite:
    layer: str                   # e.g. "blocks.0.fc1+gelu"
    kind: str                    # "linear", "linear_int8", ...
    kernel: str                  # e.g. "accelc::linear[gelu]"
    original: fx.GraphModule     # the replaced nodes as a module; placeholders <- inputs
    inputs: list = field(default_factory=list)   # main-graph nodes feeding original's placeholders
    aux: list = field(default_factory=list)      # nodes the pass added for the op (e.g. weight.t())
    fallback: Fallback | None = None   # the call this layer replaced, when it replaced one
    note: str = ""               # shown in the summary (why a layer stayed in float, ...)
    weight_bytes: tuple = ()     # int8 layers: (float weight bytes, int8 weight + scale bytes)
    released: bool = False       # original's tensors dropped (release_original)

    @property
    def quantized(self) -> bool:
        """int8 and fp8 layers: judged by SQNR, not the float tolerance."""
        return self.kind.endswith(("_int8", "_fp8"))

    def eager(self, model=None) -> fx.GraphModule:
        """The original layer as a module: its own, or, once released, one reading its parameters
        from `model` (the model it was captured from: same attribute paths)."""
        if not self.released:
            return self.original
        if model is None:
            raise ValueError(f"layer {self.layer}: its float weights were released; pass the model they live in")
        root = {}
        for n in self.original.graph.nodes:
            if n.op == "call_module":
                root[n.target] = model.get_submodule(n.target)
            elif n.op == "get_attr":
                root[n.target] = _model_tensor(model, n.target, n.meta.get(DERIVED), self.layer)
        return fx.GraphModule(root, self.original.graph, class_name="OriginalLayer")

    def release_original(self) -> None:
        """Keep the original's graph but not its tensors, nor the fallback call: for a layer whose
        float weights the optimized module no longer holds (int8). eager(model) rebuilds it. The
        original module's tensors become meta in place: a record this one replaced (int8's float
        layer, restack) shares the module, and its lingering node would keep them alive otherwise;
        detached first (a meta copy of a weight that requires grad held the weight in its grad_fn)."""
        for n in self.original.graph.nodes:
            value = attr_value(self.original, n) if n.op == "get_attr" else None
            if not isinstance(value, torch.Tensor) or value.device.type == "meta":
                continue
            *path, name = n.target.split(".")
            owner = self.original.get_submodule(".".join(path))
            owner._parameters.pop(name, None)
            owner._buffers.pop(name, None)
            owner.__dict__.pop(name, None)
            owner.register_buffer(name, value.detach().to("meta"))
        self.fallback = None
        self.released = True


def _model_tensor(model, target: str, derived, layer: str):
    """The tensor `target` of the model, or one a pass made, recomputed from the model's own
    (meta.DERIVED: a folded batch norm's weights, stacked projections)."""
    try:
        return functools.reduce(getattr, target.split("."), model)
    except AttributeError:
        if derived is None:
            raise ValueError(f"layer {layer}: it reads {target!r}, which the model does not hold and "
                             "no pass said how to recompute") from None
    fn, sources = derived
    with torch.no_grad():
        return fn(*(None if s is None else _model_tensor(model, s, None, layer) for s in sources))


@dataclass
class LayerCheck:
    passed: bool
    rel_error: float          # accelc vs higher-precision reference, relative L2
    eager_rel_error: float    # eager PyTorch vs the same reference
    max_abs_error: float
    tolerance: float
    input_shapes: tuple
    dtype: torch.dtype | None
    reason: str = ""
    sqnr_db: float = math.nan       # vs the same reference
    blind: bool = False             # the reference was 0 everywhere: its relative errors compared nothing
    format_rel_error: float = math.nan     # fp8: the format's own (the same quantized operands in fp64) vs the reference
    probe_rel_error: float = math.nan      # a blind layer: its kernel on non-zero probe operands vs its reference


BLIND = ("checked nothing: the layer's output is 0 everywhere in higher precision too (zero weights, as a "
         "zero-initialised norm's), so its errors compare nothing")
PROBED = ("its output is 0 everywhere (zero weights, as a zero-initialised norm's): its kernel was checked on non-zero "
          "probe weights against its reference instead, rel.err {:.1e}")


def blind_note(check: LayerCheck | None) -> str:
    """What the summary says of a layer whose output is 0 everywhere (LayerCheck.blind); "" of another."""
    if check is None or not check.blind:
        return ""
    return BLIND if math.isnan(check.probe_rel_error) else PROBED.format(check.probe_rel_error)


@dataclass
class LayerRecord:
    """One layer of the summary, and of the latency report (which adds timings to it)."""
    name: str                       # module path of the node group, e.g. "blocks.0.fc1+gelu"
    kind: str                       # "linear" for rewrites; the op or module type for kept ones
    status: str                     # "rewritten" | "reverted" | "kept"
    kernel: str = ""                # e.g. "accelc::linear[gelu]"
    reason: str = ""                # why kept or reverted
    check: LayerCheck | None = None     # the guard's, for rewritten and reverted layers
    input_shapes: tuple = ()        # kept layers (the others': their check's)
    dtype: str = ""                 # kept layers (the others': their check's)
    flops: int = 0                  # per call on the example inputs (accelc.flops)

    def __post_init__(self):
        if self.check is not None:
            self.input_shapes = self.check.input_shapes
            self.dtype = str(self.check.dtype).replace("torch.", "") if self.check.dtype else ""

    # the guard's numbers (NaN where the layer was not checked)
    rel_error = property(lambda self: _num(self.check, "rel_error"))               # vs higher precision
    eager_rel_error = property(lambda self: _num(self.check, "eager_rel_error"))
    max_abs_error = property(lambda self: _num(self.check, "max_abs_error"))
    tolerance = property(lambda self: _num(self.check, "tolerance"))
    sqnr_db = property(lambda self: _num(self.check, "sqnr_db"))                   # int8 layers' measure

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "check"}
        d.update({k: getattr(self, k) for k in ("rel_error", "eager_rel_error", "max_abs_error", "tolerance",
                                                "sqnr_db")})
        return d


def _num(check, name) -> float:
    return math.nan if check is None else getattr(check, name)


@dataclass
class OptimizeInfo:
    capture_method: str
    device: str
    pass_counts: dict = field(default_factory=dict)
    end_to_end_rel_error: float = math.nan     # optimized vs eager model output, relative L2
    int8: bool = False
    fp8: bool = False                          # (either: the summary's SQNR columns)
    end_to_end_sqnr_db: float = math.nan       # the same comparison in dB
    float_weight_bytes: int = 0                # of the layers now running in int8 (or fp8) ...
    int8_weight_bytes: int = 0                 # ... and what their int8 (fp8) weights + scales take
    model_weight_bytes: int = 0                # parameters + buffers of the captured model
    weight_bytes: int = 0                      # ... of the optimized module's graph
    original_weight_bytes: int = 0             # more held by the original layers kept for reports (folded BN)
    runtime: str = ""                          # how calls run (accelc.runner.plan), in words
    flops: int = 0                             # per call on the example inputs (accelc.flops) ...
    accelc_flops: int = 0                      # ... of which in accelc kernels
    eager_gpu_ms: float = math.nan             # eager model's GPU time a call (a GPU, only_if_faster) ...
    accelc_eager_gpu_ms: float = math.nan      # ... of which in the layers accelc now runs (their eager times)
    call_ms: tuple = ()                        # (eager, accelc) ms a plain call on the example (a GPU): speed_line
    shapes: str = ""                           # the input shapes the optimized model takes, in words
    generation: str = ""                       # a causal LM's generate(): its cache and step program, in words
    decode_step: str = ""                      # a generation step's decode: one persistent kernel or the chain
    reused: str = ""                           # when the optimize whose guard verdicts this one reused ran (accelc.reuse)
    capture_kept: bool = False                 # the captured graph was one an earlier optimize kept (capture.stored)
    seconds: dict = field(default_factory=dict)   # optimize's phases: capture, passes, guard (kernel tuning
    #                                               included), warmup (glue compile, CUDA graph capture)
    optimize_s: float = 0.0                    # optimize's wall time, to its return (accelc.optimize)


# phases measured inside another (OptimizeInfo.seconds): shown with it (by its name's first word), not counted twice
_WITHIN = {"guard: other inputs": "guard", "timing layers": "guard"}
_NAMES = {"warmup": "warm-up"}
_ORDER = ("capture", "passes", "guard (kernel tuning included)", "guard: verdicts reused", "the optimized model's check",
          "padding check", "generation step", "warmup", "glue for other shapes", "the example's call timed",
          "warm-up shapes")


def _parent(phase: str) -> str | None:
    """The first word of the phase `phase` was measured inside ("guard", "capture": the capture's parts, "capture:
    tracing and its checks", are inside the capture, or the step's "capture (during the forward's compiles)"), or
    None."""
    return _WITHIN.get(phase) or ("capture" if phase.startswith("capture: ") else None)


def time_line(info: OptimizeInfo) -> str:
    """The summary's line of where optimize's time went: its phases in order, those inside another beside it, the
    rest unmeasured by any phase; "" where nothing was timed (a module made outside optimize)."""
    top = {k: v for k, v in info.seconds.items() if _parent(k) is None}
    if not top:
        return ""
    top = {**{k: top[k] for k in _ORDER if k in top}, **top}      # (the phases in the order they run)
    parts = []
    for name, s in top.items():
        within = [f"{k.split(': ', 1)[-1]} {v:.1f}" for k, v in info.seconds.items() if _parent(k) == name.split()[0]]
        parts.append(f"{_NAMES.get(name, name)} {s:.1f}" + (f" (of it: {', '.join(within)})" if within else ""))
    rest = info.optimize_s - sum(top.values())
    if info.optimize_s and rest >= 0.05:
        parts.append(f"the rest {rest:.1f}")
    total = f"optimize {info.optimize_s:.1f} s: " if info.optimize_s else "optimize's phases (s): "
    return "time: " + total + ", ".join(parts)
