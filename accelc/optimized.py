"""OptimizedModule: the drop-in module optimize() returns, and its per-layer record."""
from __future__ import annotations

import collections
import copy
import gc
import math
from dataclasses import asdict

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from accelc import meta, regions, runtime, tuning
from accelc.call_inputs import array_input, traced
from accelc.capture.pickling import graph_state
from accelc.capture.shapes import SHAPES, guard_failure
from accelc.config import OptimizeConfig
from accelc.errors import InputError, short_error
from accelc.records import LayerRecord, OptimizeInfo, blind_note, time_line
from accelc.kernels import REFERENCES
from accelc.runner import direct_calls, make_runner
from accelc.rewrite import layers as layer_nodes
from accelc.meta import op_name
from accelc.near_miss import near_miss

# ops that only move or combine data; not listed as "kept" layers in the summary
_GLUE = {
    "getitem", "getattr", "view", "reshape", "permute", "transpose", "t", "contiguous", "flatten",
    "unflatten", "size", "sym_size", "expand", "unsqueeze", "squeeze", "cat", "stack", "chunk",
    "split", "add", "sub", "mul", "truediv", "div", "neg", "clone", "to", "type_as", "float",
    "half", "_guards_fn", "_assert_tensor_metadata", "_assert_scalar", "_assert", "assert_formatted", "alias", "detach",
    "floordiv", "rsub", "slice", "select", "narrow", "arange", "logical_not", "unbind", "_assert_is_none",
    # comparisons, logic and new tensors (masks built from shapes; tracer artefacts)
    "le", "lt", "ge", "gt", "eq", "ne", "__and__", "__or__", "__invert__", "and_", "or_", "bitwise_and",
    "bitwise_or", "bitwise_not", "lift_fresh_copy", "detach_", "new_ones", "new_zeros", "new_full", "new_empty",
    "ones", "zeros", "full", "empty", "ones_like", "zeros_like", "full_like", "empty_like", "_to_copy",
    # elementwise tests and selections (HF's fp16 overflow guard: isfinite, all, where, clamp)
    "isfinite", "isinf", "isnan", "all", "any", "where", "clamp", "clip",
}


class OptimizedModule(nn.Module):
    """Calls the rewritten graph; same inputs and outputs as the model it came from.

    `graph_module` is the graph with torch.ops.accelc.* calls (what export, accelc.save and
    torch.compile see); a call of the module itself goes through accelc.runner (on a GPU:
    Inductor-compiled glue, a CUDA graph per input signature), built at the first call and again
    after .to() / .half() (captured graphs point at the tensors they were captured with)."""

    def __init__(self, graph_module: fx.GraphModule, layers: list[LayerRecord], info: OptimizeInfo,
                 example_inputs: tuple = (), config=None, call_spec=None):
        super().__init__()
        # how a call maps onto the graph's flat inputs and back (accelc.capture.CallSpec): keyword
        # arguments, outputs holding caches; None: the graph takes the call as it is
        self.call_spec = call_spec
        self.graph_module = graph_module
        self.layers = layers
        self.info = info
        self.example_inputs = example_inputs  # the graph's inputs the guard checked; accelc.save exports with them
        self.config = config if config is not None else OptimizeConfig()
        self.runner = None   # accelc.runner.Runner of this module's calls, made at the first call
        self.eval()          # an inference module: what it computes does not depend on the mode
        # and computes no gradients: its weights (its own copy) need none, so torch.compile of it
        # with grad enabled traces no backward through accelc's ops
        for p in self.parameters():
            p.requires_grad_(False)

    def train(self, mode: bool = True):
        """eval() as nn.Module's; train() refused: the optimized module is for inference (no gradients, its layers'
        training behaviour, dropout and batch statistics, gone with the rewrite), and switching it was silent."""
        if mode:
            raise InputError("accelc's optimized model is for inference: it computes no gradients and its layers "
                             "keep their eval behaviour (no dropout, batch norm on its running statistics); train the "
                             "original model, then optimize it again")
        return super().train(False)

    def forward(self, *args, **kwargs):
        spec = self.call_spec
        if spec is not None:
            return spec.rebuild(self.call_flat(*spec.flat(args, kwargs)))
        return self.call_flat(*args, **kwargs)

    def call_flat(self, *args, **kwargs):
        """A call on the graph's own inputs (the CallSpec's flat ones), returning what the graph
        returns: the report times and compares both sides this way."""
        if torch.onnx.is_in_onnx_export():   # ONNX has no accelc ops: each recorded as its PyTorch reference
            return self._reference_graph()(*args, **kwargs)
        if traced(args, kwargs):   # torch.export / torch.compile / fx tracing this module: the plain graph
            return self.graph_module(*args, **kwargs)
        array = array_input(args, self.example_inputs)
        if array is not None:
            raise InputError(f"{array} where the model was optimized with a tensor: pass torch.as_tensor(...) on "
                             "the model's device (accelc's program takes tensors, as the captured model did)")
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            raise InputError("accelc's optimized model is for inference and computes no gradients, but an input "
                             "requires grad: call it with inputs that do not (x.detach()), under torch.no_grad() "
                             "or torch.inference_mode(); differentiate the original model")
        shapes = self.graph_module.meta.get(SHAPES)
        refused = shapes.check(args) if shapes is not None else None
        if refused:
            raise InputError(refused)
        self._runner_for(args, kwargs)
        try:
            # no kernel tunes inside a call (a size not tuned borrows the nearest's config); in the
            # interpreter, one call at a time across threads
            with runtime.EXPORTS.call(), tuning.serving(), runtime.serialized():
                out = self.runner(*args, **kwargs)
            return _rows_major_as_called(out, args) if self._rows_major_calls else out
        except AssertionError as e:
            text = guard_failure(e)
            if text is None:
                raise
            if shapes is not None:
                raise InputError(shapes.refusal(text, args)) from None
            raise InputError(f"these inputs have a shape the captured program does not take ({text}: a shape "
                             "torch.export fixed); call it with inputs shaped like the example, or optimize (or "
                             "export) with an example of the shape you call it with") from None
        except (ValueError, RuntimeError) as e:     # a kernel's operand check, or PyTorch's own, on another dtype
            wrong = self._other_dtype(args)
            if wrong is not None:
                raise InputError(f"{wrong} ({short_error(e)})") from None
            if not (isinstance(e, ValueError) and str(e).startswith("accelc::")):
                raise
            problem = short_error(e)
        # an input a kernel does not take that the model's code does (an unbatched image where conv2d takes a batch):
        # this call runs the layers' PyTorch references, as eager would run them (eager's own error where it has one)
        runtime.warn_once(f"references-{id(self)}", f"accelc: a call's inputs that an accelc kernel does not take "
                          f"({problem}): such calls run the layers' PyTorch references, not accelc's kernels")
        with torch.no_grad():
            return self._reference_graph()(*args, **kwargs)

    def _reference_graph(self) -> fx.GraphModule:
        """The graph with each accelc op its PyTorch reference (an ONNX export's record; a call no kernel takes)."""
        if getattr(self, "_references", None) is None:     # (made once, kept out of the module's submodules and state)
            object.__setattr__(self, "_references", direct_calls(self.graph_module, REFERENCES))
        return self._references

    def release_graphs(self) -> None:
        """Drop this module's CUDA graphs and compiled glue now (made again at its next call). A tensor-parallel
        program's graphs hold its NCCL communicator, whose destroy waits for them: call this before
        torch.distributed.destroy_process_group (PyTorch issue 115388). A background glue compile is waited for
        first (it would go on with the glue dropped, unseen by wait_for_other_shapes)."""
        self.wait_for_other_shapes()
        self.runner = None
        gc.collect()

    def _runner_for(self, args: tuple, kwargs: dict):
        """The runner of this module's calls, made at the first call (again after .to(), a pickle) on the
        device of these inputs."""
        if self.runner is None:
            self._new_runner(_device(args, kwargs, self))
        return self.runner

    def _new_runner(self, device) -> None:
        """The runner of this module's calls (again after .to(), a pickle), and, decided once with it, whether
        the example held a channels-last image: then a call in row-major NCHW gets row-major outputs, as
        eager's convs give (_rows_major_as_called)."""
        self.runner, self.info.runtime = make_runner(self.graph_module, self.config, device)
        self._rows_major_calls = any(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous()
                                     and t.is_contiguous(memory_format=torch.channels_last)
                                     for t in self.example_inputs)

    def _other_dtype(self, args) -> str | None:
        return other_dtype(args, self.example_inputs)

    def warm_up(self, inputs: tuple) -> None:
        """Compile the glue and capture the CUDA graph of these graph inputs (the CallSpec's flat
        ones) now, rather than at a user's call."""
        runner = self._runner_for(inputs, {})
        tuning.forget_borrowed()         # sizes calls ran on a borrowed config are tuned now
        runner.warm_up(*inputs)

    def compile_other_shapes(self, inputs: tuple) -> bool:
        """Compile the glue that serves the shapes not warmed up now, on these graph inputs, rather than at
        the first call of such a shape (runner.Runner.compile_other_shapes); whether there was one."""
        return self._runner_for(inputs, {}).compile_other_shapes(*inputs)

    def compile_other_shapes_later(self, inputs: list) -> bool:
        """compile_other_shapes on each of `inputs` (the example's first) in a thread of its own, after optimize
        returns (OptimizeConfig.other_shapes="background"); whether one was started."""
        return self._runner_for(inputs[0], {}).compile_other_shapes_later(inputs, _device(inputs[0], {}, self))

    def hold_other_shapes(self, inputs: tuple) -> bool:
        """compile_other_shapes_later due soon (a generation step's, held until its forward's optimize ends): calls
        at other shapes meanwhile run uncompiled glue rather than compiling it (regions.Glue.hold_later)."""
        glue = self._runner_for(inputs, {}).fn
        return isinstance(glue, regions.Glue) and glue.hold_later()

    def other_shapes_deferred(self) -> bool:
        """Whether calls at shapes not warmed up run uncompiled glue now: its compile running in the background, or
        held to start."""
        return self.runner is not None and self.runner.compiling()

    def compiles_apart_from_state(self, inputs: tuple) -> bool:
        """Whether a background compile of the glue for other shapes can leave the state this program writes in
        place alone (regions.Glue.apart_ok: a glue cut into regions, its calls then on copies of that state)."""
        glue = self._runner_for(inputs, {}).fn
        return isinstance(glue, regions.Glue) and glue.apart_ok()

    def wait_for_other_shapes(self, timeout: float | None = None) -> bool:
        """Wait until the glue for other shapes, compiling in the background after optimize
        (OptimizeConfig.other_shapes="background"), is compiled (or `timeout` seconds); True when nothing is
        left compiling. Until then a call at a shape other than those warmed up runs uncompiled glue."""
        glue = self.runner.fn if self.runner is not None else None
        return glue.wait(timeout) if isinstance(glue, regions.Glue) else True

    def _apply(self, fn, recurse=True):
        probe = fn(torch.zeros((), dtype=torch.float32))
        if isinstance(probe, torch.Tensor) and probe.dtype == torch.float64:
            raise InputError("accelc's kernels take fp16, bf16 and fp32, not float64 (.double()): run the original "
                             "model in float64, or optimize a float64 model (its layers stay PyTorch)")
        literal = self._fixed_dtype(fn)
        if literal:
            raise InputError(literal)
        self.wait_for_other_shapes()      # (a background compile reads the tensors this converts)
        self.runner = None
        out = super()._apply(fn, recurse)
        # the example follows the weights' dtype and device (.half(), .cuda()): what calls are compared with
        self.example_inputs = tuple(fn(t) if isinstance(t, torch.Tensor) else t for t in self.example_inputs)
        return out

    def _fixed_dtype(self, fn) -> str:
        """Why a conversion to another floating dtype (.half(), .to(torch.bfloat16)) cannot follow this
        module's graph, or "": torch.export records the dtype a model casts to (`cos.to(x.dtype)`) as
        the number it was at capture, so the converted graph would mix dtypes where eager would not."""
        weights = [t for t in (*self.parameters(), *self.buffers()) if t.is_floating_point()]
        if not weights or self.info.capture_method != "torch.export":
            return ""
        before = weights[0].dtype
        after = fn(torch.zeros((), dtype=before))
        if not isinstance(after, torch.Tensor) or after.dtype == before:
            return ""
        for module in self.modules():
            gm = getattr(module, "graph_module", None)
            if not isinstance(gm, fx.GraphModule):
                continue
            for n in gm.graph.nodes:
                if any(isinstance(a, torch.dtype) and a.is_floating_point for a in (*n.args, *n.kwargs.values())):
                    name = str(after.dtype).replace("torch.", "")
                    return (f"this model was optimized in {str(before).replace('torch.', '')}, and its captured graph "
                            f"casts to fixed dtypes (torch.export records them): converted to {name} it would not "
                            f"compute what the model does in {name}; optimize the model in {name} instead "
                            f"(accelc.optimize(model.to(torch.{name}), ...), or OptimizeConfig(dtype='{name}'))")
        return ""

    def __getstate__(self):
        # compiled code and captured graphs do not pickle (nor survive a new process): rebuilt on use;
        # the graph pickled with its output structure (capture.pickling), once a background glue compile
        # running Dynamo on it has ended
        self.wait_for_other_shapes()
        return graph_state({**self.__dict__, "runner": None})

    def __copy__(self):
        # a shallow copy shares the graph module (copy.copy would otherwise take __getstate__'s
        # pickling stand-in for it)
        new = type(self).__new__(type(self))
        new.__setstate__({**self.__dict__, "runner": None})
        return new

    def __deepcopy__(self, memo):
        # the graph copied as a graph (node metadata kept), not through its pickled code, once a background
        # glue compile running Dynamo on it has ended
        self.wait_for_other_shapes()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy({**self.__dict__, "runner": None}, memo))
        return new

    @property
    def rewritten(self) -> list[LayerRecord]:
        return [r for r in self.layers if r.status == "rewritten"]

    def summary_dict(self) -> dict:
        """The summary as plain data (JSON-ready: NaN becomes None)."""
        def clean(v):
            return None if isinstance(v, float) and math.isnan(v) else v
        return {
            "info": {k: clean(v) for k, v in asdict(self.info).items()},
            "layers": [{k: clean(v) for k, v in r.to_dict().items()} for r in self.layers],
        }

    def summary(self) -> str:
        no_kernel = [r for r in self.layers if without_rule(r)]
        shown = [r for r in self.layers if r not in no_kernel]
        n = {s: sum(r.status == s for r in shown) for s in ("rewritten", "reverted", "kept")}
        lines = [
            f"accelc: {n['rewritten']} layer(s) rewritten, {n['reverted']} reverted, {n['kept']} kept "
            f"as PyTorch  (capture: {self.info.capture_method}"
            f"{', the graph an earlier optimize kept' if getattr(self.info, 'capture_kept', False) else ''}; "
            f"device: {self.info.device})",
        ]
        quantized = self.info.int8 or getattr(self.info, "fp8", False)
        rows = [("layer", "status", "kernel / op", "in shape", "rel.err", "eager err")
                + (("SQNR dB",) if quantized else ()) + ("note",)]
        for r in shown:
            rows.append((
                r.name, r.status, r.kernel or r.kind,
                "x".join(map(str, r.input_shapes[0])) if r.input_shapes else "",
                *(("-", "-") if blind_note(r.check) else (_fmt(r.rel_error), _fmt(r.eager_rel_error))),
            ) + ((_fmt_db(r.sqnr_db),) if quantized else ()) + (r.reason or blind_note(r.check),))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
        lines.append(LEGEND + ("\nSQNR dB: an int8 or fp8 layer's signal to quantization noise against its float "
                               "layer." if quantized else ""))
        if no_kernel:
            kinds = collections.Counter(r.kind for r in no_kernel)
            lines.append("no accelc kernel for (these run as PyTorch, as in eager): "
                         + ", ".join(f"{k} x{c}" if c > 1 else k for k, c in kinds.most_common()))
        lines += self.coverage_lines()
        if getattr(self.info, "call_ms", ()):
            eager, ours = self.info.call_ms
            lines.append(f"speed on this GPU, a plain call of the example (median): eager PyTorch {eager:.3f} ms, "
                         f"accelc {ours:.3f} ms ({eager / ours:.2f}x)")
        lines.append(f"end-to-end relative L2 error vs eager: {_fmt(self.info.end_to_end_rel_error)}"
                     + (f" (SQNR {_fmt_db(self.info.end_to_end_sqnr_db)} dB)" if quantized else ""))
        if self.info.shapes:
            lines.append(self.info.shapes)
        fixed = self.call_spec.defaults if self.call_spec is not None else {}
        if fixed:
            shown = ", ".join(f"{k}={_short_repr(v)}" for k, v in list(fixed.items())[:6])
            lines.append(f"fixed at their defaults (not inputs of the optimized model; pass them in the example to "
                         f"make them inputs): {shown}" + (f" and {len(fixed) - 6} more" if len(fixed) > 6 else ""))
        if self.info.runtime:
            status = self.runner.status() if self.runner is not None else ""
            lines.append(f"runtime: {self.info.runtime}" + (f" ({status})" if status else ""))
        if time_line(self.info):
            lines.append(time_line(self.info))
        if self.info.reused:
            lines.append(f"guard: the verdicts of an identical optimize ({self.info.reused}: same graph, weights, "
                         "example shapes, config, accelc and GPU) reused, not checked again (ACCELC_REUSE=0 checks "
                         "every time)")
        borrowed = tuning.borrowed_count()
        if borrowed:
            lines.append(f"tuning: {borrowed} kernel size(s) met in calls were not tuned (calls never tune: they "
                         "ran with the config tuned for the nearest size); warm_up(inputs) or optimize's "
                         "warmup_shapes tunes them")
        lines.append(f"weights: model {_mb(self.info.model_weight_bytes)}, optimized module "
                     f"{_mb(self.info.weight_bytes)}"
                     + (f" (+ {_mb(self.info.original_weight_bytes)} held for the original layers the report "
                        "times)" if self.info.original_weight_bytes else ""))
        if quantized:
            q = "int8" if self.info.int8 else "fp8"
            n8 = sum(r.status == "rewritten" and r.kind.endswith(f"_{q}") for r in self.layers)
            lines.append(f"{q}: {n8} layer(s); their weights {_mb(self.info.float_weight_bytes)} in float, "
                         f"{_mb(self.info.int8_weight_bytes)} in {q} with scales (saved in accelc.save's file)")
        return "\n".join(line.rstrip() for line in lines)

    def coverage_lines(self) -> list[str]:
        """The share of the model's FLOPs in accelc kernels, and the biggest layers left to PyTorch."""
        total, ours = self.info.flops, self.info.accelc_flops
        if not total:
            return ["coverage: the model has no matrix-product, conv or attention FLOPs"]
        lines = [f"coverage: {100 * ours / total:.1f}% of the model's FLOPs in accelc kernels ({_flop(ours)} of "
                 f"{_flop(total)} a call on the example inputs; matmul, conv and attention FLOPs)"]
        if (self.info.eager_gpu_ms or 0) > 0:      # (NaN: not timed)
            e, a = self.info.eager_gpu_ms, self.info.accelc_eager_gpu_ms
            if a <= e:
                lines.append(f"coverage: {100 * a / e:.1f}% of the model's eager GPU time in layers accelc runs "
                             f"({a:.3f} of {e:.3f} ms a call, each side timed over a CUDA graph on the example inputs)")
            else:   # (timed one by one, layers cost more than together: never a share over 100%)
                lines.append(f"coverage: all of the model's eager GPU time is in layers accelc runs (timed one by one "
                             f"over CUDA graphs they take {a:.3f} ms, more than the whole model's {e:.3f} ms a call)")
        left = sorted((r for r in self.layers if r.status != "rewritten" and r.flops), key=lambda r: -r.flops)
        for r in left[:5]:
            lines.append(f"  left to PyTorch: {r.name} ({r.kernel or r.kind}) {100 * r.flops / total:.1f}%: {r.reason}")
        if len(left) > 5:
            lines.append(f"  ... and {len(left) - 5} more layer(s), {100 * sum(r.flops for r in left[5:]) / total:.1f}%")
        return lines


NO_RULE = "no accelc rewrite for"     # a kept layer's reason where no rule takes its op at all


def without_rule(r: LayerRecord) -> bool:
    """A layer no rule takes at all (pooling, index, cos...): summed in one line of a summary, not a row."""
    return r.status == "kept" and r.reason == f"{NO_RULE} {r.kind}"
LEGEND = ("status: rewritten = an accelc kernel runs it; reverted = its kernel failed a check, PyTorch runs it;\n"
          "  kept = PyTorch runs it (the note says why: a rule's condition unmet, or PyTorch was faster).\n"
          "rel.err / eager err: the relative L2 error of accelc's / eager PyTorch's output against the layer computed\n"
          "  in higher precision; a layer passes within its dtype's tolerance or twice eager's.")


def _short_repr(v) -> str:
    text = repr(v)
    return text if len(text) <= 24 else type(v).__name__


def _flop(n: int) -> str:
    return f"{n / 1e9:.3g} GFLOP" if n >= 1e8 else f"{n / 1e6:.3g} MFLOP"


def _rows_major_as_called(out, args):
    """A call whose images are all row-major (NCHW) gets its 4-D outputs row-major, as eager's convs
    follow their input's layout: a model optimized on a channels-last example writes channels-last
    outputs, on which a caller's `y.view(N, -1)` fails where eager's works."""
    images = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if not images or not all(a.is_contiguous() for a in images):
        return out
    return pytree.tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) and t.dim() == 4
                           and not t.is_contiguous() else t, out)


def other_dtype(args, examples) -> str | None:
    """The first floating-point input whose dtype is not its example's, in words (examples: tensors,
    or anything with a .dtype, such as a program's fake inputs)."""
    for i, (a, ex) in enumerate(zip(args, examples)):
        dtype = getattr(ex, "dtype", None)
        if (isinstance(a, torch.Tensor) and isinstance(dtype, torch.dtype) and a.is_floating_point()
                and dtype.is_floating_point and a.dtype != dtype):
            name = str(dtype).replace("torch.", "")
            return (f"input {i} is {str(a.dtype).replace('torch.', '')}, and the model was optimized for {name} "
                    f"inputs (its weights are {name}): cast the inputs (x.to(torch.{name})), or optimize with "
                    "an example in the dtype you call it with")
    return None


def _device(args, kwargs, module) -> torch.device:
    """The device a call runs on: its first tensor argument's, else the module's."""
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            return x.device
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


def _fmt_db(x: float) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _fmt(x: float) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1e}"


def collect_layers(gm: fx.GraphModule, checks: dict, flops: dict | None = None) -> list[LayerRecord]:
    """Rows in graph order: rewritten layers and reverted layers with the guard's `checks` (by
    layer name), and the remaining compute ops, which run as PyTorch; each with its FLOPs from
    `flops` ({node: FLOPs}, accelc.flops.node_flops)."""
    flops = flops or {}
    layers: list[LayerRecord] = []
    by_name: dict = {}
    rewritten = set(layer_nodes(gm))
    for n in gm.graph.nodes:
        if n in rewritten:
            rw = meta.rewrite_of(n)
            layers.append(LayerRecord(rw.layer, rw.kind, "rewritten", rw.kernel, rw.note, checks.get(rw.layer),
                                      flops=flops.get(n, 0)))
            continue
        if meta.REVERTED in n.meta:
            rw, reason, status = n.meta[meta.REVERTED]
            if rw.layer not in by_name:
                by_name[rw.layer] = LayerRecord(rw.layer, rw.kind, status, rw.kernel, reason, checks.get(rw.layer))
                layers.append(by_name[rw.layer])
            by_name[rw.layer].flops += flops.get(n, 0)
            continue
        if n.op not in ("call_module", "call_function", "call_method"):
            continue
        module = n.op == "call_module"     # a layer, whatever its attribute is called (self.cat = nn.Conv1d)
        if not module and op_name(n) in _GLUE:
            continue
        path = meta.path(n)
        if path == "_guards_fn" or path.startswith("_guards_fn."):
            continue   # a torch.export program's input-shape checks, not a layer of the model
        cls = n.meta.get(meta.MODULE_TYPE) or ""
        if path and cls.startswith("torch.nn.modules.") and cls != "torch.nn.modules.module.Module":
            name, kind = path, cls.rpartition(".")[2]      # a leaf layer: "blocks.0.norm", LayerNorm
        elif module:
            name, kind = path or str(n.target), cls.rpartition(".")[2] or "module"
        else:
            kind = op_name(n)                               # an op written in a forward()
            name = f"{path}:{kind}" if path else kind
        if not module and kind in _GLUE:
            continue
        if name in by_name:
            by_name[name].flops += flops.get(n, 0)
            continue
        value = meta.tensor_meta(n)
        shapes = tuple(meta.tensor_meta(a).shape for a in n.all_input_nodes
                       if meta.tensor_meta(a) is not None and a.op != "get_attr")
        by_name[name] = LayerRecord(
            name=name, kind=kind, status="kept", input_shapes=shapes,
            dtype=str(value.dtype).replace("torch.", "") if value else "",
            reason=meta.reason_kept(n) or near_miss(n) or f"{NO_RULE} {kind}", flops=flops.get(n, 0),
        )
        layers.append(by_name[name])
    return layers
