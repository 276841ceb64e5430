"""Padding a call up to a bucket: the few sizes CUDA graphs are captured at when batch and length vary.

A graph that takes a range of batch sizes and lengths would need a CUDA graph per size it meets (512
lengths x 32 batch sizes). As vLLM does for batch sizes, the runner pads a call up to the next bucket
size, replays that bucket's graph and cuts the outputs back to the call's sizes. Buckets: 1, 2, 4, 8,
12, 16, then four per octave, 20, 24, 28, 32, 40, 48, 56, 64, 80, ... (from 16 on, at most a fifth of a
padded call is padding: a large call is GPU-bound, and its padding is time), the last one the range's
upper end. More buckets cost capture time once, not memory: the graphs share one pool.

Padding is never assumed inert. Rows of a batch are independent in eval mode in every layer accelc
knows, but a model may mix them (a statistic over the batch); a sequence's padded tail leaves the
real positions alone only behind an attention mask that masks it, or a causal one. So `find` runs
the optimized graph on the example and on the example padded past a bucket edge (two sizes, two
amounts of padding, each varying dim alone and then all together) and keeps a dim's padding only
where every output's real part
  - is the same, to the guard's floor for its dtype, whatever the padding holds (the call padded a
    second way: a batch with its first rows, a length with its first positions), and
  - matches the unpadded call (NaN where NaN) to the floor, or, for a deep model whose kernels round
    differently at the padded size, within numerics.whole_model_limit of the model's own error
    against the model in higher precision (a 22-layer fp16 Llama: 2.5e-3 between batch 1 and 2).
Which output dims follow a padded dim, it reads off the two calls' output shapes.

Fill: a batch pads by repeating its last row (real token ids, a real mask: no row is padding alone);
a length pads by repeating the last position, except an integer input named like an attention mask,
which pads with 0 (the padded positions masked).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from accelc import tuning
from accelc.capture.shapes import SHAPES, DimRange, InputShapes, memory_layout
from accelc.numerics import EAGER_ERROR_FACTOR, rel_l2, whole_model_limit

log = logging.getLogger("accelc")


def bucket_sizes(lo: int, hi: int | None, upto: int | None = None) -> list[int]:
    """The bucket sizes of a range from lo to hi (None: no end; then listed up to `upto`)."""
    end = hi if hi is not None else upto
    if end is None:
        raise ValueError("a range without an end lists its buckets up to a given size")
    sizes, p = [], 1
    while True:
        steps = (p,) if p < 8 else (p, p + p // 2) if p < 16 else (p, p + p // 4, p + p // 2, p + 3 * p // 4)
        for n in steps:
            if n >= lo and n <= end:
                sizes.append(n)
        if p >= end:
            break
        p *= 2
    if hi is not None and (not sizes or sizes[-1] != hi):
        sizes.append(hi)
    return sizes or [lo]


def bucket(n: int, r: DimRange) -> int:
    """The bucket a size n of range r runs at: the smallest bucket size >= n; n itself outside the
    range (the program refuses it, naming the limit: padding does not stretch a declared range)."""
    if n < r.lo or (r.hi is not None and n > r.hi):
        return n
    for b in bucket_sizes(r.lo, r.hi, upto=2 * n):
        if b >= n:
            return b
    return n


@dataclass(frozen=True)
class Padding:
    """Which dims of a graph's calls pad up to buckets, and how its outputs are cut back.

    ranges: {group: DimRange} of the padded dims (a group: dims that pad together, see _groups);
    inputs: per flat input, ((dim, group, fill), ...) with fill "edge" (repeat the last slice) or 0;
    outputs: per output leaf, ((dim, group), ...); words: {group: how the summary names it ("batch",
    "input_ids dim 1")}."""
    ranges: dict
    inputs: tuple
    outputs: tuple
    words: dict

    def sizes(self, args: tuple) -> dict | None:
        """{symbol: size} of this call's padded dims, or None where the call does not fit the plan
        (a dim whose size differs between two inputs that share it: the program will say)."""
        sizes: dict = {}
        for a, dims in zip(args, self.inputs):
            for d, sym, _ in dims:
                if not isinstance(a, torch.Tensor) or a.dim() <= d:
                    return None
                if sizes.setdefault(sym, a.shape[d]) != a.shape[d]:
                    return None
        return sizes

    def target(self, sizes: dict) -> dict:
        """The bucket size of each padded dim."""
        return {sym: bucket(n, self.ranges[sym]) for sym, n in sizes.items()}

    def pad(self, args: tuple, target: dict, first: bool = False) -> tuple:
        """args with each padded dim grown to its target size (see the module's docstring); first:
        an "edge" fill takes the first slices, in turn, instead of the last one (the check's second
        padding)."""
        out = []
        for a, dims in zip(args, self.inputs):
            for d, sym, fill in dims:
                extra = target[sym] - a.shape[d]
                if extra > 0:
                    if fill == "edge" and first:
                        index = torch.arange(extra, device=a.device) % a.shape[d]
                        tail = a.index_select(d, index)
                    elif fill == "edge":
                        tail = a.narrow(d, a.shape[d] - 1, 1).expand(*a.shape[:d], extra, *a.shape[d + 1:])
                    else:
                        tail = a.new_full((*a.shape[:d], extra, *a.shape[d + 1:]), fill)
                    layout = memory_layout(a)     # a channels_last input's tail too (a row-major one made the cat row-major)
                    if layout is not torch.contiguous_format:
                        tail = tail.contiguous(memory_format=layout)
                    a = torch.cat([a, tail], d)
            out.append(a)
        return tuple(out)

    def cut(self, outputs, sizes: dict):
        """The padded call's outputs cut back to the call's sizes (views)."""
        leaves, spec = pytree.tree_flatten(outputs)
        cut = []
        for t, dims in zip(leaves, self.outputs):
            for d, sym in dims:
                if isinstance(t, torch.Tensor) and sym in sizes and t.shape[d] != sizes[sym]:
                    t = t.narrow(d, 0, sizes[sym])
            cut.append(t)
        return pytree.tree_unflatten(cut, spec)

    def covers(self, shapes: InputShapes) -> bool:
        """Whether every dim of `shapes` that varies pads (then every call's signature is a bucket's:
        few enough to capture each at its first call)."""
        if shapes.free or len(shapes.dims) != len(self.inputs):
            return False
        for row, dims in zip(shapes.dims, self.inputs):
            padded = {d for d, _, _ in dims}
            if any(isinstance(r, DimRange) and d not in padded for d, r in enumerate(row or ())):
                return False
        return True

    def describe(self) -> str:
        parts = []
        for sym, r in self.ranges.items():
            shown = bucket_sizes(r.lo, r.hi, upto=64)
            more = ", ..." if r.hi is None or shown[-1] != r.hi else ""
            parts.append(f"{self.words[sym]} to {', '.join(map(str, shown[:8]))}"
                         + (f", ..., {shown[-1]}" if len(shown) > 8 else "") + more)
        return "padded to buckets for CUDA graphs (checked inert): " + "; ".join(parts)


CALL_PLAN = "accelc_call_plan"    # gm.meta key: the CallPlan optimize made for an optimized graph's calls


@dataclass
class CallPlan:
    """What optimize decided for an optimized graph's calls, its own record beside the call contract
    (capture.shapes.InputShapes, which the runner only reads): the padding calls take up to buckets (None:
    none), why a varying dim does not pad, and the shapes captured at optimize time, in words."""
    padding: Padding | None = None
    padding_note: str = ""
    warmed: str = ""

    def describe(self) -> str:
        """What the summary's shapes line adds to the contract's words."""
        text = "; " + self.padding.describe() if self.padding is not None else ""
        text += f" ({self.padding_note})" if self.padding_note else ""
        return text + (f"; {self.warmed}" if self.warmed else "")


def call_plan(gm) -> CallPlan:
    """gm's CallPlan: an empty one where optimize made none; for a module pickled before CallPlan, what its
    shapes held."""
    plan = gm.meta.get(CALL_PLAN)
    if plan is None:
        shapes = gm.meta.get(SHAPES)
        plan = CallPlan(*(getattr(shapes, k, d) for k, d in (("padding", None), ("padding_note", ""), ("warmed", ""))))
    return plan


def find(fn, args: tuple, shapes: InputShapes | None, tolerance, own_error=None,
         before=None) -> tuple[Padding | None, str]:
    """(the padding `fn`'s calls may take, None where none; in words, why a varying dim does not
    pad). fn: the optimized graph; args: the example; tolerance(dtype): the guard's rel-L2 floor;
    own_error(): the model's own error on the example against higher precision (asked for only where
    a padded call misses the floor; None, or returning None: the floor alone); before(args): called
    before fn is called on inputs of new sizes (its kernels' compiles for them made ahead)."""
    if shapes is None or not (shapes.free or shapes.varying()):
        return None, ""
    fills, ranges, words, example = _groups(shapes, args)
    if not ranges:
        return None, ""
    kept, why, outputs = [], [], None
    for g in ranges:
        reason, dims = _inert(fn, args, fills, ranges, example, {g}, tolerance, own_error, before)
        if reason:
            why.append(f"{words[g]} does not pad: {reason}")
        else:
            kept.append(g)
            outputs = dims
    if len(kept) > 1:
        reason, dims = _inert(fn, args, fills, ranges, example, set(kept), tolerance, own_error, before)
        if reason:
            why.append(f"{', '.join(words[g] for g in kept[1:])} does not pad with {words[kept[0]]}: {reason}")
            kept = kept[:1]
            outputs = _inert(fn, args, fills, ranges, example, set(kept), tolerance, own_error, before)[1]
        else:
            outputs = dims
    if not kept:
        return None, "; ".join(why)
    plan = Padding({g: ranges[g] for g in kept},
                   tuple(tuple((d, g, f) for d, g, f in row if g in kept) for row in fills),
                   outputs, {g: words[g] for g in kept})
    return plan, "; ".join(why)


def _groups(shapes: InputShapes, args: tuple) -> tuple[tuple, dict, dict, dict]:
    """The varying dims in groups that pad together: the same dim of several inputs at the same
    size in the example (the batch of the ids and of the mask; their length), whether or not
    export gave them one symbol. (per input ((dim, group, fill), ...), {group: DimRange, the
    intersection of its dims' ranges}, {group: its name in words}, {group: the example's size})."""
    rows, ranges, words, example = [], {}, {}, {}
    for name, row, a in zip(shapes.names, _dims(shapes, args), args):
        dims = []
        for d, r in enumerate(row or ()):
            if not isinstance(r, DimRange) or not isinstance(a, torch.Tensor):
                continue
            g = f"dim {d} = {a.shape[d]}"
            if g in ranges:
                old = ranges[g]
                hi = r.hi if old.hi is None else old.hi if r.hi is None else min(old.hi, r.hi)
                ranges[g] = DimRange(max(old.lo, r.lo), hi, g)
            else:
                ranges[g], example[g] = DimRange(r.lo, r.hi, g), a.shape[d]
                words[g] = "batch" if d == 0 else f"{name} dim {d}"
            masked = "mask" in str(name).lower() and not a.is_floating_point() and d > 0
            dims.append((d, g, 0 if masked else "edge"))
        rows.append(tuple(dims))
    return tuple(rows), ranges, words, example


def _dims(shapes: InputShapes, args: tuple) -> tuple:
    """Per input, per dim a size or a DimRange. A graph that records no shapes (symbolic_trace)
    takes what its code takes: the ranges the user declared, else a batch (dim 0 of every tensor
    input of the first one's size) from 1 up, for the check to try."""
    if not shapes.free:
        return shapes.dims
    if shapes.static:   # dynamic=False: the example's shapes, nothing to pad
        return ()
    declared = shapes.declared if isinstance(shapes.declared, tuple) else None
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    batch = tensors[0].shape[0] if tensors else None
    rows = []
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            rows.append(None)
            continue
        row = list(a.shape)
        if declared is not None:
            for d, (lo, hi) in ((declared[i] or {}) if i < len(declared) else {}).items():
                row[d] = DimRange(lo, hi, f"declared {i}.{d}")
        elif a.dim() > 0 and a.shape[0] == batch:
            row[0] = DimRange(1, None, "batch")
        rows.append(tuple(row))
    return tuple(rows)


def _trials(ranges: dict, example: dict, groups: set) -> list[tuple[dict, dict]]:
    """(real sizes, padded sizes) pairs to check: the example padded past the next bucket edge, and
    one size smaller padded to the example's (two sizes, two amounts of padding)."""
    n = {g: example[g] for g in groups}
    up = {g: bucket(n[g] + 1, ranges[g]) for g in groups}
    trials = []
    if all(up[g] > n[g] and (ranges[g].hi is None or up[g] <= ranges[g].hi) for g in groups):
        trials.append((n, up))
    down = {g: n[g] - 1 for g in groups}
    if all(down[g] >= max(ranges[g].lo, 1) for g in groups):
        trials.append((down, n))
    return trials


def _inert(fn, args, fills, ranges, example, groups, tolerance, own_error=None,
           before=None) -> tuple[str, tuple | None]:
    """("" and per output leaf the dims that follow the padded ones) where padding the dims of
    `groups` leaves the real part of every output as it is; else (why not, None)."""
    trials = _trials(ranges, example, groups)
    if not trials:
        return "no room in its range to check a pad", None
    dims = None
    for real, padded in trials:
        plan = _plan_of(fills, groups)
        small_args = _cut_args(args, plan.inputs, real)
        try:
            with torch.no_grad():
                if before is not None:
                    before(plan.pad(small_args, padded))
                # the real size unpadded is a size no call runs at once padding holds (each pads to its bucket):
                # its kernels borrow the nearest tuned config (tuning.serving) rather than race there
                with tuning.serving(say=False):
                    small = fn(*small_args)
                big = fn(*plan.pad(small_args, padded))
                other = fn(*plan.pad(small_args, padded, first=True))
        except Exception as e:
            return f"the model does not run padded ({type(e).__name__}: {str(e)[:80]})", None
        dims = _follow(small, big, real, padded)
        if dims is None:
            return "an output's shape does not follow the padded dim", None
        shown = ", ".join(f"{real[k]} -> {padded[k]}" for k in real)
        cut = Padding({}, (), dims, {}).cut
        bad = _mismatch(cut(other, real), cut(big, real), tolerance)
        if bad:
            return f"the real part of an output depends on what the padding holds ({shown}: {bad})", None
        bad = _mismatch(cut(big, real), small, tolerance)
        own = own_error() if bad and own_error is not None and bad.startswith("relative L2 error") else None
        if own is not None:      # (None: the model's own error unknown, the floor alone; `other` gave `big` again
            # within the floor, so the model is deterministic: its own error is rounding, the limit uncapped)
            bad = _mismatch(cut(big, real), small,
                            lambda dtype: whole_model_limit(tolerance(dtype), own, deterministic=True))
            bad += f" over the model's own error {own:.1e} x {EAGER_ERROR_FACTOR:g}" if bad else ""
        if bad:
            return f"the real part of an output changes when padded ({shown}: {bad})", None
    return "", dims


def _plan_of(fills, groups: set) -> Padding:
    """A Padding of the dims of `groups` alone: what a trial pads its inputs with."""
    return Padding({}, tuple(tuple(x for x in row if x[1] in groups) for row in fills), (), {})


def padded_inputs(args: tuple, shapes: InputShapes | None) -> list[tuple]:
    """The inputs find() will call the graph at beyond the example's sizes: the example padded past its next
    bucket edge, each varying group alone and all together (a trial of several groups runs where each passed
    alone). The guard hands their layers' tuning candidates to the compile workers while its own checks run
    (layer_compiles.later_ahead): the padding check then finds them compiled."""
    if shapes is None or not (shapes.free or shapes.varying()):
        return []
    out = []
    try:
        fills, ranges, _, example = _groups(shapes, args)
        for groups in [{g} for g in ranges] + ([set(ranges)] if len(ranges) > 1 else []):
            for real, padded in _trials(ranges, example, groups):
                if padded != {g: example[g] for g in groups}:     # (padded to the example's sizes: tuned there)
                    plan = _plan_of(fills, groups)
                    out.append(plan.pad(_cut_args(args, plan.inputs, real), padded))
    except Exception as e:   # (nothing compiled ahead: the padding check says what is wrong, if anything)
        log.debug("accelc: the padded sizes not known ahead: %s", e)
    return out


def _cut_args(args: tuple, inputs: tuple, sizes: dict) -> tuple:
    out = []
    for a, dims in zip(args, inputs):
        for d, s, _ in dims:
            if a.shape[d] > sizes[s]:
                a = a.narrow(d, 0, sizes[s])
        out.append(a)
    return tuple(out)


def _follow(small, big, real: dict, padded: dict) -> tuple | None:
    """Per output leaf, the dims that are a padded dim's size in both calls, or None when a leaf's
    shape differs in some other way."""
    a, b = pytree.tree_leaves(small), pytree.tree_leaves(big)
    if len(a) != len(b):
        return None
    dims = []
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return None
        row = []
        if isinstance(x, torch.Tensor):
            if x.dim() != y.dim():
                return None
            for d, (m, n) in enumerate(zip(x.shape, y.shape)):
                if m == n:
                    continue
                sym = next((s for s in real if real[s] == m and padded[s] == n), None)
                if sym is None:
                    return None
                row.append((d, sym))
        dims.append(tuple(row))
    return tuple(dims)


def _mismatch(got, want, tolerance) -> str:
    """Why `got` is not `want` (the guard's tolerance; integer and bool outputs exact), or ""."""
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        if not isinstance(w, torch.Tensor):
            if g != w:
                return "a non-tensor output differs"
            continue
        if g.shape != w.shape:
            return f"shape {tuple(g.shape)} against {tuple(w.shape)}"
        if not w.is_floating_point():
            if not torch.equal(g, w):
                return "integer values differ"
            continue
        if not torch.equal(g.isnan(), w.isnan()):
            return "NaN where there was none"
        finite = torch.isfinite(w)
        if not torch.equal(g[~finite].nan_to_num(), w[~finite].nan_to_num()):
            return "inf where there was none"
        err = rel_l2(g[finite], w[finite])
        if err > tolerance(w.dtype):
            return f"relative L2 error {err:.1e}"
    return ""
