"""OptimizedModule: the drop-in module optimize() returns, and its per-layer record."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from torch import fx, nn

from accelc.rewrite import op_name

# ops that only move or combine data; not listed as "kept" layers in the summary
_GLUE = {
    "getitem", "getattr", "view", "reshape", "permute", "transpose", "t", "contiguous", "flatten",
    "unflatten", "size", "sym_size", "expand", "unsqueeze", "squeeze", "cat", "stack", "chunk",
    "split", "add", "sub", "mul", "truediv", "div", "neg", "clone", "to", "type_as", "float",
    "half", "_guards_fn", "_assert_tensor_metadata", "_assert_scalar", "alias", "detach",
    "floordiv", "rsub", "slice", "select", "arange", "logical_not", "unbind",
}


@dataclass
class LayerRecord:
    """One row of the summary (and, later, of the latency report)."""
    name: str                       # module path of the node group, e.g. "blocks.0.fc1+gelu"
    kind: str                       # "linear" for rewrites; the op or module type for kept ones
    status: str                     # "rewritten" | "reverted" | "kept"
    kernel: str = ""                # e.g. "accelc::linear[gelu]"
    reason: str = ""                # why kept or reverted
    input_shapes: tuple = ()
    dtype: str = ""
    rel_error: float = math.nan     # vs higher-precision reference (guard)
    eager_rel_error: float = math.nan
    max_abs_error: float = math.nan
    tolerance: float = math.nan
    sqnr_db: float = math.nan       # vs the same reference; the guard's measure for int8 layers


@dataclass
class OptimizeInfo:
    capture_method: str
    device: str
    pass_counts: dict = field(default_factory=dict)
    end_to_end_rel_error: float = math.nan     # optimized vs eager model output, relative L2
    int8: bool = False
    end_to_end_sqnr_db: float = math.nan       # the same comparison in dB
    float_weight_bytes: int = 0                # of the layers now running in int8 ...
    int8_weight_bytes: int = 0                 # ... and what their int8 weights + scales take


class OptimizedModule(nn.Module):
    """Calls the rewritten graph; same inputs and outputs as the model it came from."""

    def __init__(self, graph_module: fx.GraphModule, layers: list[LayerRecord], info: OptimizeInfo,
                 example_inputs: tuple = ()):
        super().__init__()
        self.graph_module = graph_module
        self.layers = layers
        self.info = info
        self.example_inputs = example_inputs  # what the guard checked; accelc.save exports with them

    def forward(self, *args, **kwargs):
        return self.graph_module(*args, **kwargs)

    @property
    def rewritten(self) -> list[LayerRecord]:
        return [r for r in self.layers if r.status == "rewritten"]

    def summary_dict(self) -> dict:
        """The summary as plain data (JSON-ready: NaN becomes None)."""
        def clean(v):
            return None if isinstance(v, float) and math.isnan(v) else v
        return {
            "info": {k: clean(v) for k, v in asdict(self.info).items()},
            "layers": [{k: clean(v) for k, v in asdict(r).items()} for r in self.layers],
        }

    def summary(self) -> str:
        n = {s: sum(r.status == s for r in self.layers) for s in ("rewritten", "reverted", "kept")}
        lines = [
            f"accelc: {n['rewritten']} layer(s) rewritten, {n['reverted']} reverted, {n['kept']} kept "
            f"as PyTorch  (capture: {self.info.capture_method}; device: {self.info.device})",
        ]
        rows = [("layer", "status", "kernel / op", "in shape", "rel.err", "eager err")
                + (("SQNR dB",) if self.info.int8 else ()) + ("note",)]
        for r in self.layers:
            rows.append((
                r.name, r.status, r.kernel or r.kind,
                "x".join(map(str, r.input_shapes[0])) if r.input_shapes else "",
                _fmt(r.rel_error), _fmt(r.eager_rel_error),
            ) + ((_fmt_db(r.sqnr_db),) if self.info.int8 else ()) + (r.reason,))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
        lines.append(f"end-to-end relative L2 error vs eager: {_fmt(self.info.end_to_end_rel_error)}"
                     + (f" (SQNR {_fmt_db(self.info.end_to_end_sqnr_db)} dB)" if self.info.int8 else ""))
        if self.info.int8:
            n8 = sum(r.status == "rewritten" and r.kind.endswith("_int8") for r in self.layers)
            lines.append(f"int8: {n8} layer(s); their weights {_mb(self.info.float_weight_bytes)} in float, "
                         f"{_mb(self.info.int8_weight_bytes)} in int8 with scales (saved in accelc.save's file)")
        return "\n".join(line.rstrip() for line in lines)


def _fmt_db(x: float) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _fmt(x: float) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1e}"


def collect_layers(gm: fx.GraphModule, checks: dict, reverted: dict) -> list[LayerRecord]:
    """Rows in graph order: rewritten layers (with their guard numbers), reverted layers, and
    the remaining compute ops, which run as PyTorch."""
    layers: list[LayerRecord] = []
    seen: set = set()
    for n in gm.graph.nodes:
        rw = n.meta.get("accelc")
        if rw is not None:
            layers.append(_record(rw.layer, rw.kind, "rewritten", rw.kernel, rw.note, checks.get(n)))
            continue
        if "accelc_reverted" in n.meta:
            name, reason = n.meta["accelc_reverted"]
            if name not in seen:
                seen.add(name)
                rw, check = reverted[name]
                layers.append(_record(name, rw.kind, "reverted", rw.kernel, reason, check))
            continue
        if n.op not in ("call_module", "call_function", "call_method"):
            continue
        if op_name(n) in _GLUE:
            continue
        path = n.meta.get("accelc_path", "")
        cls = n.meta.get("accelc_module_type") or ""
        if path and cls.startswith("torch.nn.modules.") and cls != "torch.nn.modules.module.Module":
            name, kind = path, cls.rpartition(".")[2]      # a leaf layer: "blocks.0.norm", LayerNorm
        else:
            kind = op_name(n)                               # an op written in a forward()
            name = f"{path}:{kind}" if path else kind
        if kind in _GLUE:
            continue
        if name in seen:
            continue
        seen.add(name)
        meta = n.meta.get("accelc_meta")
        shapes = tuple(a.meta["accelc_meta"].shape for a in n.all_input_nodes if "accelc_meta" in a.meta
                       and a.op != "get_attr")
        layers.append(LayerRecord(
            name=name, kind=kind, status="kept", input_shapes=shapes,
            dtype=str(meta.dtype).replace("torch.", "") if meta else "",
            reason=n.meta.get("accelc_skip", f"no accelc rewrite for {kind}"),
        ))
    return layers


def _record(name, kind, status, kernel, reason, check) -> LayerRecord:
    r = LayerRecord(name=name, kind=kind, status=status, kernel=kernel, reason=reason)
    if check is not None:
        r.input_shapes, r.dtype = check.input_shapes, str(check.dtype).replace("torch.", "")
        r.rel_error, r.eager_rel_error = check.rel_error, check.eager_rel_error
        r.max_abs_error, r.tolerance = check.max_abs_error, check.tolerance
        r.sqnr_db = check.sqnr_db
        if status == "reverted" and not r.reason:
            r.reason = check.reason
    return r
