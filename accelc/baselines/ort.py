"""ONNX Runtime as the baseline engine: a layer (or a whole model) exported to ONNX and run in
ORT, on the same inputs, timed with the same timer as eager PyTorch and accelc.

ORT stands in for a closed engine that can only be timed one whole layer at a time, so each
layer is exported on its own: the original subgraph of a rewritten layer (Rewrite.original),
with its real inputs captured from a forward pass. On a GPU the session uses the
CUDAExecutionProvider (cuDNN algorithms searched exhaustively, and ORT's own CUDA graph when the
session allows it), with inputs and outputs bound to CUDA tensors (IO binding) so that no host
copy is timed; elsewhere the CPUExecutionProvider.

Real models break naive ONNX export, so `export` tries, in order, and keeps the first file that
ORT accepts (a session is created to check):
  1. the torch.export-based exporter (torch.onnx.export(dynamo=True), opset DYNAMO_OPSET) in the
     layer's dtype,
  2. the TorchScript exporter (dynamo=False, opset OPSET; deprecated, kept for what the first
     cannot export) in the layer's dtype,
  3. and 4. the same two in fp32, the ONNX graph then converted to fp16 by ORT's own converter
     (onnxruntime.transformers.float16), for half models whose direct export ORT refuses (e.g.
     LayerNormalization bound to float and float16 at once).
Every attempt's error is kept; a layer no attempt exports is reported with them, never fatal.
bf16 has no ORT kernels to speak of: bf16 layers run in ORT as fp16 (their method says so).

A whole transformer also gets ORT at its best (`optimized_candidates`): ORT's transformer
optimizer (onnxruntime.transformers.optimizer, what HF Optimum's O2-O4 levels run: fused
Attention, SkipLayerNormalization, BiasGelu / FastGelu) on each exporter's fp32 graph, with the
model's attention in its exportable form (HF's "eager" attention, timm's unfused path) where it
has one, then converted to fp16 by the optimizer's own converter. The caller times each candidate
that matches the reference and keeps the fastest.
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from accelc import runtime
from accelc.errors import short_error

OPSET = 17           # the TorchScript exporter: LayerNormalization is in the default domain from 17
DYNAMO_OPSET = 20    # the torch.export-based exporter (its own default is 18)

_NP_DTYPES = {"tensor(float16)": torch.float16, "tensor(float)": torch.float32, "tensor(double)": torch.float64,
              "tensor(bfloat16)": torch.bfloat16, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
              "tensor(bool)": torch.bool, "tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8}


def available() -> str | None:
    """None if onnxruntime can be imported, else why not."""
    try:
        import onnxruntime  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install's OSError
        return (f"onnxruntime cannot be imported ({type(e).__name__}: {e}): pip install 'accelc[ort-gpu]' for "
                "ONNX Runtime with its CUDA provider ('accelc[ort]': the CPU build)")
    return None


def providers(device: torch.device, allow_tf32: bool = False) -> list:
    """ORT's CUDA provider rounds fp32 matmul operands to TF32 by default; accelc and PyTorch do
    not unless asked (OptimizeConfig.fp32_precision), so neither does the baseline."""
    import onnxruntime as ort

    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        # prefer_nhwc: ORT's convs in channels-last, as accelc's and torch.compile's run
        opts = {"device_id": str(device.index or 0), "cudnn_conv_algo_search": "EXHAUSTIVE",
                "use_tf32": "1" if allow_tf32 else "0", "prefer_nhwc": "1"}
        return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def has_cuda() -> bool:
    """Whether onnxruntime here has its CUDA execution provider (onnxruntime-gpu)."""
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def provider_note(device: torch.device) -> str:
    """Which execution provider layers run on, in words (for the report's header)."""
    import onnxruntime as ort

    have = ort.get_available_providers()
    if device.type == "cuda":
        if "CUDAExecutionProvider" in have:
            return (f"onnxruntime {ort.__version__}, CUDAExecutionProvider (IO binding; cuDNN algorithms "
                    "searched exhaustively; NHWC convs (prefer_nhwc); TF32 only with fp32_precision='tf32'); "
                    "per layer: the layer exported alone, dynamo exporter first; whole model: plain and with "
                    "ORT's transformer optimizer, the faster one compared")
        return (f"onnxruntime {ort.__version__} has no CUDAExecutionProvider here ({', '.join(have)}): ORT ran "
                "on the CPU, for accuracy only, and no speedup is stated against it (pip install "
                "'accelc[ort-gpu]' for the CUDA provider)")
    return f"onnxruntime {ort.__version__}, CPUExecutionProvider"


@dataclass
class OrtExport:
    path: str | None                 # the .onnx file ORT accepted, or None
    method: str = ""                 # e.g. "torchscript fp16", "dynamo fp32->fp16"
    errors: list = field(default_factory=list)   # one line per failed attempt

    @property
    def error(self) -> str:
        return "; ".join(self.errors)


class _Tensors(nn.Module):
    """`module` called with its non-tensor arguments fixed: ONNX inputs are tensors only."""

    def __init__(self, module: nn.Module, args: list):
        super().__init__()
        self.module = module
        self.args = args
        self.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def forward(self, *tensors):
        args = list(self.args)
        for i, t in zip(self.slots, tensors):
            args[i] = t
        return self.module(*args)


@contextlib.contextmanager
def _quiet():
    """The exporters print warnings and progress for every call, and the TorchScript one prints
    the whole graph of a failed export from C++; a report exports dozens of layers. Python's
    streams and file descriptors 1 and 2 are silenced for the call (their errors still raise)."""
    level = logging.getLogger("torch.onnx").level
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    saved = []
    try:
        for fd in (1, 2):
            saved.append((fd, os.dup(fd)))
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd, _ in saved:
            os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:  # no real descriptors (an embedding host): Python-level silence only
        pass
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.getLogger("torch.onnx").setLevel(level)
            for fd, copy_fd in saved:
                os.dup2(copy_fd, fd)
                os.close(copy_fd)


def torch_export(module, tensors, path, dynamo: bool, external_data: bool = False) -> None:
    """`module` on `tensors` to an ONNX file (inputs named in0, in1, ...); external_data: the
    weights beside it (the dynamo exporter; a model over protobuf's 2 GB always)."""
    names = [f"in{i}" for i in range(len(tensors))]
    external_data = external_data or _large(module)
    with runtime.EXPORTS.export(), _quiet(), torch.no_grad():     # (apart from other threads' calls of accelc modules)
        if dynamo:
            torch.onnx.export(module, tuple(tensors), path, dynamo=True, input_names=names,
                              external_data=external_data, opset_version=DYNAMO_OPSET, verbose=False)
        else:
            torch.onnx.export(module, tuple(tensors), path, dynamo=False, input_names=names,
                              opset_version=OPSET, do_constant_folding=True)


def _to_fp16(path: str) -> None:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with _quiet():
        model = convert_float_to_float16(onnx.load(path), keep_io_types=False)
    onnx.save(model, path)


def export(module: nn.Module, args: list, path: str, device: torch.device, allow_tf32: bool = False) -> OrtExport:
    """Export `module` called on `args` to `path`, trying the exporters in turn (module
    docstring); the first file an ORT session accepts wins."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    half = bool(dtypes & {torch.float16, torch.bfloat16})
    wrapped = _Tensors(module, list(args)).eval()
    # bf16: no numpy type to bind it with, and few ORT kernels; such layers run in fp16 in ORT
    attempts = [] if torch.bfloat16 in dtypes else [("dynamo", True, False), ("torchscript", False, False)]
    if half:
        attempts += [("dynamo fp32->fp16", True, True), ("torchscript fp32->fp16", False, True)]
    result = OrtExport(None)
    for name, dynamo, via_fp32 in attempts:
        dtype = "" if via_fp32 else " " + str(next(iter(dtypes), "")).replace("torch.", "")
        try:
            m, ts = wrapped, tensors
            if via_fp32:
                m = copy.deepcopy(wrapped).float()
                ts = [t.float() if t.is_floating_point() else t for t in tensors]
            torch_export(m, ts, path, dynamo)
            if via_fp32:
                _to_fp16(path)
            session(path, device, allow_tf32=allow_tf32)       # ORT must accept the file
            result.path, result.method = path, (name + dtype).strip()
            return result
        except Exception as e:  # each exporter fails in its own way; the next one may not
            result.errors.append(f"{name}{dtype}: {short_error(e)}")
            with contextlib.suppress(OSError):
                os.remove(path)
    return result


def session(path: str, device: torch.device, cuda_graph: bool = False, allow_tf32: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    provs = providers(device, allow_tf32)
    if cuda_graph and isinstance(provs[0], tuple):
        provs = [(provs[0][0], {**provs[0][1], "enable_cuda_graph": "1"})] + provs[1:]
    try:
        return ort.InferenceSession(path, so, providers=provs)
    except Exception as e:
        # a CUDA provider built without NHWC kernels refuses prefer_nhwc: the session without it
        if not (isinstance(provs[0], tuple) and "nhwc" in str(e).lower()):
            raise
        opts = {k: v for k, v in provs[0][1].items() if k != "prefer_nhwc"}
        return ort.InferenceSession(path, so, providers=[(provs[0][0], opts)] + provs[1:])


class OrtRunner:
    """One exported layer in ORT with its inputs bound once. run() -> outputs as torch tensors
    on the inputs' device (bound buffers: no copies), in the ONNX file's dtypes."""

    def __init__(self, path: str, args: list, device: torch.device, allow_tf32: bool = False):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.device = device
        self.cuda_graph = False
        self.sess = session(path, device, allow_tf32=allow_tf32)
        self.on_gpu = device.type == "cuda" and "CUDAExecutionProvider" in self.sess.get_providers()
        self.inputs = {}
        for i, inp in enumerate(self.sess.get_inputs()):
            t = tensors[int(inp.name[2:])] if inp.name.startswith("in") and inp.name[2:].isdigit() else tensors[i]
            want = _NP_DTYPES.get(inp.type, t.dtype)
            self.inputs[inp.name] = t.to(want).contiguous().clone()
        if not self.on_gpu:
            self.inputs = {k: v.cpu() for k, v in self.inputs.items()}
        # one unbound run learns the output shapes and dtypes
        first = self.sess.run(None, {k: v.numpy() if not self.on_gpu else v.cpu().numpy()
                                     for k, v in self.inputs.items()})
        self.outputs = [torch.from_numpy(o).to(device if self.on_gpu else "cpu") for o in first]
        self.binding = self._bind(self.sess)
        if self.on_gpu:
            # ORT's own CUDA graph: replays without per-kernel launches, as accelc and eager are
            # timed; sessions whose nodes are not all on the GPU refuse it and run without
            try:
                sess = session(path, device, cuda_graph=True, allow_tf32=allow_tf32)
                binding = self._bind(sess)
                sess.run_with_iobinding(binding)
                sess.run_with_iobinding(binding)
                self.sess, self.binding, self.cuda_graph = sess, binding, True
            except Exception:  # the session without a CUDA graph stays
                pass

    def _bind(self, sess):
        b = sess.io_binding()
        dev_type = "cuda" if self.on_gpu else "cpu"
        dev_id = (self.device.index or 0) if self.on_gpu else 0
        for name, t in self.inputs.items():
            b.bind_input(name, dev_type, dev_id, _np(t.dtype), tuple(t.shape), t.data_ptr())
        for o, t in zip(sess.get_outputs(), self.outputs):
            b.bind_output(o.name, dev_type, dev_id, _np(t.dtype), tuple(t.shape), t.data_ptr())
        return b

    def run(self) -> list[torch.Tensor]:
        self.sess.run_with_iobinding(self.binding)
        return self.outputs


def _np(dtype: torch.dtype):
    import numpy as np

    return {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
            torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.int8: np.int8,
            torch.uint8: np.uint8}[dtype]


# ---------------------------------------------------------------------------------------------
# ORT at its best on a whole transformer: its transformer optimizer

# HF config.model_type -> the optimizer's model_type (the encoders of the BERT family share its fusions)
_HF_TYPES = {"bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "distilbert": "bert", "electra": "bert",
             "camembert": "bert", "albert": "bert", "gpt2": "gpt2", "vit": "vit", "deit": "vit", "t5": "t5",
             "bart": "bart", "gpt_neox": "gpt_neox", "swin": "swin", "clip": "clip", "phi": "phi"}
_FUSED_ATTENTION = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention")


@dataclass
class OptimizedCandidate:
    path: str                 # the optimized .onnx file
    args: list                # the inputs it takes (a variant may add e.g. an attention mask)
    method: str               # how it was made, in words
    fused: dict               # fused operator -> count


def optimizer_types(model: nn.Module) -> tuple[list[str], int, int]:
    """(model types to try, heads, hidden size; 0 = the optimizer finds them) of ORT's
    transformer optimizer for `model`: HF's config names it; another model with LayerNorm and
    attention gets the BERT and GPT-2 fusions tried (the fastest correct one is kept); any other
    model (CNNs, RMSNorm decoders: the optimizer's fusions for those need its own export scripts), none."""
    cfg = next((m.config for m in model.modules() if hasattr(getattr(m, "config", None), "model_type")), None)
    kind = _HF_TYPES.get(getattr(cfg, "model_type", None))
    if kind:
        heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 0) or 0
        hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0) or 0
        return [kind], int(heads), int(hidden)
    mods = list(model.modules())
    if any(isinstance(m, nn.LayerNorm) for m in mods) and any(_is_attention(m) for m in mods):
        return ["bert", "gpt2"], 0, 0
    return [], 0, 0


def _is_attention(m: nn.Module) -> bool:
    return (isinstance(m, nn.MultiheadAttention) or isinstance(getattr(m, "fused_attn", None), bool)
            or "attention" in type(m).__name__.lower())


def exportable_attention(model: nn.Module) -> tuple[nn.Module, str]:
    """A copy of `model` whose attention is written in ops ORT's optimizer fuses (HF's "eager"
    attention instead of SDPA, timm's unfused path), and what changed; (model, "") if nothing did."""
    changed = []
    hf = [name for name, m in model.named_modules() if hasattr(m, "set_attn_implementation")
          and getattr(getattr(m, "config", None), "_attn_implementation", "eager") not in (None, "eager")]
    if hf:   # the outermost HF model (a wrapper may hold it); it sets its submodels' too
        clone = copy.deepcopy(model)
        try:
            clone.get_submodule(hf[0]).set_attn_implementation("eager")
            model, changed = clone, ["HF eager attention"]
        except Exception:   # a model without an eager path: as it is
            pass
    if any(getattr(m, "fused_attn", None) is True for m in model.modules()):
        if not changed:
            model = copy.deepcopy(model)
        for m in model.modules():
            if getattr(m, "fused_attn", None) is True:
                m.fused_attn = False
        changed.append("unfused attention")
    return model, ", ".join(changed)


def _large(module: nn.Module) -> bool:
    """Over protobuf's 2 GB once in fp32: weights in an external data file."""
    return sum(p.numel() for p in module.parameters()) * 4 > 1.8e9


def optimized_candidates(model: nn.Module, args: list, workdir: str, device: torch.device,
                         variants: list | None = None) -> tuple[list[OptimizedCandidate], list[str]]:
    """ORT's transformer optimizer on `model` (see the module docstring): one candidate per
    (variant, exporter, model type) with a distinct set of fusions, and one line per failed try.
    `variants`: extra (label, module, args) to export as well (e.g. the model given an all-ones
    attention mask, as ORT's users export it)."""
    kinds, heads, hidden = optimizer_types(model)
    if not kinds:
        return [], ["ORT's transformer optimizer has no fusions for this model (not a transformer with LayerNorm "
                    "or of an HF model type it knows)"]
    from onnxruntime.transformers import optimizer

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    params = {p.dtype for p in model.parameters()}
    half = bool((dtypes | params) & {torch.float16, torch.bfloat16})
    plain, changed = exportable_attention(model)
    todo = [(changed, plain, list(args))] + list(variants or [])
    out, errors, seen = [], [], set()
    for v, (label, module, vargs) in enumerate(todo):
        module = copy.deepcopy(module).float().eval() if half else module
        fts = [a.float() if a.is_floating_point() else a for a in vargs if isinstance(a, torch.Tensor)]
        for exporter, dynamo in (("dynamo", True), ("torchscript", False)):
            raw = os.path.join(workdir, f"whole{v}-{exporter}.onnx")
            try:
                torch_export(_Tensors(module, list(vargs)).eval(), fts, raw, dynamo, external_data=_large(module))
            except Exception as e:
                errors.append(f"{exporter}{' (' + label + ')' if label else ''}: {short_error(e)}")
                continue
            for kind in kinds:
                name = f"{exporter} opset {DYNAMO_OPSET if dynamo else OPSET}" + (f", {label}" if label else "")
                try:
                    with _quiet():
                        opt = optimizer.optimize_model(raw, model_type=kind, num_heads=heads, hidden_size=hidden,
                                                       opt_level=0, use_gpu=device.type == "cuda")
                    fused = {k: n for k, n in opt.get_fused_operator_statistics().items() if n}
                    key = (v, tuple(sorted(fused.items())))
                    if not fused or key in seen:
                        continue
                    seen.add(key)
                    if half:
                        with _quiet():
                            opt.convert_float_to_float16(keep_io_types=False)
                    path = os.path.join(workdir, f"whole{v}-{exporter}-{kind}.onnx")
                    opt.save_model_to_file(path, use_external_data_format=_large(module))
                except Exception as e:   # the optimizer's patterns assume shapes it may not find
                    errors.append(f"{name}, optimizer '{kind}': {short_error(e)}")
                    continue
                fusions = ", ".join(f"{k} {n}" for k, n in sorted(fused.items()))
                out.append(OptimizedCandidate(
                    path, list(vargs), f"{name}, transformer optimizer '{kind}' ({fusions})"
                    + (", fp16 by its converter" if half else ""), fused))
    # the candidates with fused attention first: the caller may time only the first few
    out.sort(key=lambda c: -sum(c.fused.get(k, 0) for k in _FUSED_ATTENTION))
    return out, errors


@dataclass
class TimedCandidate:
    candidate: OptimizedCandidate
    ms: float
    rel_error: float          # the judge's figure for its output
    cuda_graph: bool          # ORT's own CUDA graph took the session


def time_candidates(cands: list, device: torch.device, judge, timer, limit: int = 3,
                    allow_tf32: bool = False) -> tuple[list[TimedCandidate], list[str]]:
    """The first `limit` candidates run in ORT: `judge(outputs)` -> (relative error, why it is no
    baseline or ""); each one it accepts is timed by `timer(runner)` (ms). Returns the timed ones
    and one line per refused or failed candidate."""
    timed, errors = [], []
    for c in cands[:limit]:
        try:
            runner = OrtRunner(c.path, c.args, device, allow_tf32=allow_tf32)
            rel, bad = judge([o.clone() for o in runner.run()])
            if bad:
                errors.append(f"{c.method}: {bad}")
                continue
            timed.append(TimedCandidate(c, timer(runner), rel, runner.cuda_graph))
        except Exception as e:   # ORT refused the optimized file or its inputs
            errors.append(f"{c.method}: {short_error(e)}")
    return timed, errors
