"""A second optimize of the same model: the first one's verdicts, reused.

What makes a warm optimize slow is not compiling (Triton's and Inductor's caches hold that) but judging: the
guard runs every layer on the example and on other inputs against PyTorch and a higher-precision reference,
races int8 against float and each layer against PyTorch, and the padding check runs the model at the ends of
its buckets. Their outcome is a short record (`Memo`): the guard's decisions in their order (a layer demoted
to its float kernel, put back to PyTorch, kept as PyTorch's), every layer's final check, the eager times it
took, the shapes it learned, the padding plan, the tuned configs its kernels ran with.

That outcome depends on nothing but what `key` digests: the captured graph (its code, before the passes),
the values of every tensor it holds (but the state it updates, a generation cache: its
shapes only), the example inputs' structure, shapes and dtypes (and the values of
their integer tensors, which a branch or a mask may read; of every input and calibration batch with int8,
whose scales read them), the input shape contract, the config, accelc's own source, the versions of
Python, PyTorch and Triton, the GPU, accelc's environment switches and PyTorch's precision flags.
stages.finish keeps the record under that key in accelc's cache folder (`verdicts/`, beside the tuning
cache) and, where a later optimize's key finds one, replays it on the graph its passes made again instead
of checking, racing and timing. The passes and the warm-up run as always (capture reads back the graph an
earlier optimize kept: accelc.capture.stored, under `captures()`), and the replay refuses (the guard runs) unless
the passes made the same layers.

ACCELC_REUSE=0 turns reuse off (the guard runs every time). A record that cannot be read is said once,
removed, and the guard runs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
from torch import fx
from torch.utils import _pytree as pytree

from accelc import guard, meta, runtime, tuning
from accelc.capture import aliased_state, mutated_state
from accelc.files import read_record, write_record
from accelc.layer_signature import values_digest
from accelc.rewrite import layers
from accelc.version import source_digest

log = logging.getLogger("accelc")

FORMAT = 1
# accelc's environment switches that change no verdict (where caches live, how many compile threads, ...)
_NEUTRAL_ENV = {"ACCELC_CACHE_DIR", "ACCELC_COMPILE_THREADS", "ACCELC_COMPILE_PROCS", "ACCELC_REUSE", "ACCELC_LOG",
                "ACCELC_PROGRESS"}
# the folder's bounds: past either, the least recently used records go
MAX_RECORDS = 1024
MAX_RECORD_BYTES = 256 << 20


def enabled() -> bool:
    return os.environ.get("ACCELC_REUSE", "1").strip().lower() not in ("0", "false", "no", "off")


def folder() -> Path:
    """Where the records live: `verdicts/` beside the tuning cache (ACCELC_CACHE_DIR)."""
    return tuning.cache_dir().parent / "verdicts"


def captures() -> Path | None:
    """Where captured graphs are kept for a later optimize (accelc.capture.stored): `captures/` beside the
    verdicts; None with reuse off."""
    return tuning.cache_dir().parent / "captures" if enabled() else None


@dataclass
class Memo:
    """What a finished optimize settled for one graph (see the module docstring)."""
    layers: list                  # [(layer, kernel)] the passes made, in graph order
    decisions: list               # the guard's, in order: ("demote" | "revert", layer, reason, status)
    checks: dict                  # layer name -> its final LayerCheck
    eager_ms: dict                # layer name -> eager ms of the original on the race inputs
    eager_gpu_ms: float | None    # the eager model's GPU time a call (the summary's share of eager time)
    shapes: object                # the input shape contract after the guard (InputShapes: what it learned)
    padding: tuple | None         # (Padding or None, note) of the padding check, None where it did not run
    picks: list                   # [(tuner, key, triton.Config)]: the configs the checked kernels ran with
    seconds: dict = field(default_factory=dict)   # where the optimize that made it spent its time
    made: str = ""                # when, UTC
    checked_at: list = field(default_factory=list)   # the guard's record: the other sizes every layer passed at
    key: str = ""                 # the key it was kept under (keep sets it; lookup reads no record of another key)

    def fits(self, gm: fx.GraphModule) -> bool:
        """Whether the passes made the layers this record judged (same names, same kernels)."""
        return self.layers == layer_list(gm)

    def replay(self, gm: fx.GraphModule, ctx) -> dict:
        """Settle `gm` as the recorded optimize did (guard.replay), its shapes, eager times and tuned configs
        restored; the checks by layer, as guard.settle returns them."""
        _restore_picks(self.picks)
        checks = guard.replay(gm, self.decisions, self.checks, ctx)
        ctx.eager_ms.update(self.eager_ms)
        if ctx.shapes is not None and self.shapes is not None:
            ctx.shapes = self.shapes      # (a contract is read-only: the recorded one, as the guard left it)
            ctx.checked_at = list(self.checked_at)
        return checks


def layer_list(gm: fx.GraphModule) -> list:
    return [(meta.rewrite_of(n).layer, meta.rewrite_of(n).kernel) for n in layers(gm)]


def record(gm_before: list, ctx, checks: dict, eager_gpu_ms, seconds: dict, picks_before: list,
           padding: tuple | None) -> Memo:
    """The Memo of a settle just done: gm_before is layer_list of the graph before it, picks_before picks()
    before it (the record keeps the configs chosen in the settle), padding the padding check's outcome."""
    known = {(name, k) for name, k, _ in picks_before}
    return Memo(layers=gm_before, decisions=list(ctx.decisions), checks=dict(checks), eager_ms=dict(ctx.eager_ms),
                eager_gpu_ms=eager_gpu_ms, shapes=ctx.shapes, checked_at=list(ctx.checked_at),
                padding=padding, picks=[p for p in picks() if (p[0], p[1]) not in known], seconds=dict(seconds),
                made=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


# ---------------------------------------------------------------------------------------------
# the key

def key(gm: fx.GraphModule, args: tuple, config, device: torch.device, calibration: list, race, shapes) -> str | None:
    """The digest of everything a settle of `gm` on `args` depends on (module docstring), or None where
    something cannot be told apart by value (a config or graph holding an object printed by address): no reuse."""
    if not enabled():
        return None
    try:
        h = hashlib.sha256()
        trail = []    # each part's label and own digest, for the debug log: which part of two keys differs

        def put(label: str, value) -> None:
            text = str(value).encode()
            h.update(label.encode() + b"\0" + text + b"\0")
            trail.append(f"{label}:{hashlib.sha256(text).hexdigest()[:8]}")
        text = repr(dataclasses.replace(config, other_shapes="now"))   # (when the glue compiles: not a verdict's)
        if " at 0x" in text:
            return None
        put("accelc", (FORMAT, source_digest()))
        put("versions", (sys.version, platform.machine(), torch.__version__, triton.__version__, torch.version.cuda))
        put("device", (_device(device), runtime.interpreted(), runtime.autotune_enabled()))
        put("config", text)
        put("env", switches())
        put("flags", _flags())
        for name, mod in gm.named_modules():
            code = mod.code if isinstance(mod, fx.GraphModule) else f"{type(mod).__module__}.{type(mod).__qualname__}"
            if " at 0x" in code:
                return None
            put(f"module[{name}]", code)
        tensors = _graph_tensors(gm)
        put("tensors", [(name, tuple(t.shape), t.dtype, t.stride(), t.device.type) for name, t in tensors])
        every_value = config.int8 is not None    # int8 scales read the inputs' values (fp8 weights' do not)
        leaves = pytree.tree_leaves((args, race[0] if race is not None else (), calibration if every_value else ()))
        put("structure", pytree.tree_structure((args, race[0] if race is not None else ())))
        shown = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                shown.append((tuple(x.shape), x.dtype, x.stride(), x.device.type))
            elif " at 0x" in repr(x):
                return None
            else:
                shown.append(repr(x))
        put("inputs", shown)
        put("shapes", repr(vars(shapes)) if shapes is not None else None)
        state = set(mutated_state(gm)) | {name for pair in aliased_state(gm) for name in pair}
        named = [(name, t) for name, t in tensors if name not in state] + [
            (f"input[{i}]", x) for i, x in enumerate(leaves)
            if isinstance(x, torch.Tensor) and (every_value or not x.is_floating_point())]
        for (name, _), sums in zip(named, values_digest([t for _, t in named])):
            put(f"values[{name}]", sums)
        digest = h.hexdigest()[:40]
        log.debug("accelc: reuse key %s of parts %s", digest, " ".join(trail))
        return digest
    except Exception as e:   # nothing the key cannot read is worth a failed optimize: no reuse, said in the log
        log.debug("accelc: no reuse of verdicts (%s: %s)", type(e).__name__, e)
        return None


def switches() -> list:
    """accelc's and Triton's environment switches that may change a verdict: not where files are (paths, cache
    folders: Inductor sets TRITON_PTXAS_PATH, TRITON_LIBDEVICE_PATH and TRITON_CACHE_DIR when it compiles, so
    a process that compiled glue before would key apart from one that loaded it) nor what is only said."""
    return sorted((k, v) for k, v in os.environ.items() if k.startswith(("ACCELC_", "TRITON_")) and k not in _NEUTRAL_ENV
                  and not k.endswith(("_PATH", "_DIR", "_HOME")) and "CACHE" not in k)


def _device(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    p = torch.cuda.get_device_properties(device)
    return f"{p.name} {p.major}.{p.minor} {p.multi_processor_count}"


def _flags() -> tuple:
    b = torch.backends
    return (torch.get_default_dtype(), torch.get_float32_matmul_precision(), b.cuda.matmul.allow_tf32,
            b.cudnn.allow_tf32, b.cuda.matmul.allow_fp16_reduced_precision_reduction,
            b.cuda.matmul.allow_bf16_reduced_precision_reduction, torch.are_deterministic_algorithms_enabled())


def _graph_tensors(gm: fx.GraphModule) -> list:
    """(name, tensor) of every tensor the graph holds: parameters, buffers, and tensors read by get_attr."""
    out = dict(gm.named_parameters(remove_duplicate=False))
    out.update(gm.named_buffers(remove_duplicate=False))
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target not in out:
            v = meta.attr_value(gm, n)
            if isinstance(v, torch.Tensor):
                out[n.target] = v
    return sorted(out.items())


# ---------------------------------------------------------------------------------------------
# tuned configs

def picks() -> list:
    """[(tuner, key, triton.Config)] of every key this process chose a config for (not borrowed)."""
    return [(t.name, k, cfg) for t in tuning.all_tuners() for k, cfg in t.chosen.items() if k not in t.borrowed]


def _restore_picks(recorded: list) -> None:
    """The recorded configs (triton.Configs: the candidates and their pruned forms are accelc's source, which
    keys the record) chosen again for their keys, where this process chose none yet. A kernel whose module this
    process has not imported yet is left to its tuner (the tuning cache holds its choice)."""
    tuners = {t.name: t for t in tuning.all_tuners()}
    for name, k, cfg in recorded:
        t = tuners.get(name)
        if t is not None and (k not in t.chosen or k in t.borrowed):
            t.chosen[k] = cfg
            t.borrowed.pop(k, None)


# ---------------------------------------------------------------------------------------------
# the records on disk

def _memo(record) -> Memo:
    if not isinstance(record, Memo):
        raise TypeError(f"not a record ({type(record).__name__})")
    return record


def lookup(k: str | None) -> Memo | None:
    if k is None:
        return None

    def mine(record) -> Memo:
        memo = _memo(record)
        if memo.key != k:      # (a file copied or renamed into another's place: its verdicts are another graph's)
            raise TypeError(f"a record kept under another key ({memo.key[:12] or 'none'})")
        return memo
    return read_record(folder() / f"{k}.pkl", mine, "the reused-verdicts record", "the guard runs")


def keep(k: str | None, memo: Memo) -> None:
    if k is not None:
        memo = dataclasses.replace(memo, key=k)
        write_record(folder() / f"{k}.pkl", memo, MAX_RECORDS, MAX_RECORD_BYTES,
                     "the guard's verdicts not kept for reuse")
