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
  1. the TorchScript exporter (torch.onnx.export(dynamo=False)) in the layer's dtype,
  2. the torch.export-based exporter (dynamo=True) in the layer's dtype,
  3. and 4. the same two in fp32, the ONNX graph then converted to fp16 by ORT's own converter
     (onnxruntime.transformers.float16), for half models whose direct export ORT refuses (e.g.
     LayerNormalization bound to float and float16 at once).
Every attempt's error is kept; a layer no attempt exports is reported with them, never fatal.
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

from accelc.errors import short_error

OPSET = 17   # LayerNormalization is in the default domain from 17

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
        opts = {"device_id": str(device.index or 0), "cudnn_conv_algo_search": "EXHAUSTIVE",
                "use_tf32": "1" if allow_tf32 else "0"}
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
                    "searched exhaustively; TF32 only with fp32_precision='tf32')")
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


def torch_export(module, tensors, path, dynamo: bool) -> None:
    names = [f"in{i}" for i in range(len(tensors))]
    with _quiet(), torch.no_grad():
        if dynamo:
            torch.onnx.export(module, tuple(tensors), path, dynamo=True, input_names=names,
                              external_data=False, opset_version=max(OPSET, 18), verbose=False)
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
    attempts = [] if torch.bfloat16 in dtypes else [("torchscript", False, False), ("dynamo", True, False)]
    if half:
        attempts += [("torchscript fp32->fp16", False, True), ("dynamo fp32->fp16", True, True)]
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
            result.path, result.method = path, name + dtype
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
    return ort.InferenceSession(path, so, providers=provs)


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
