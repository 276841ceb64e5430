"""The shapes a captured graph takes: which dims of which inputs may vary, over what range, and why a
dim is fixed; and a call's shape that the graph refuses, said in one line naming the input, the dim
and the limit.

torch.export states them (each input dim a number or a symbol, each symbol a range) for graphs it
captures with dynamic dims (capture's default: every dim allowed to vary, fixed where the model pins
it, as TensorRT profiles and ONNX dynamic axes let a user do). symbolic_trace records no shapes: its
graph takes what the model's code takes.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from accelc.errors import InputError

SHAPES = "accelc_shapes"   # gm.meta key: the InputShapes of a captured graph
CHECKED_AT = "accelc_checked_at"   # gm.meta key: the guard's record, the other sizes every layer passed at
# a program's shape guard, as torch.export words it: "Guard failed: flat_0.size()[1] <= 64"
# a guard on one dim alone, the whole guard ("Guard failed: x.size()[0] <= 64"); a term of a longer
# relation ("x.size()[1] * x.size()[0] == 2 * ...") is no bound of that dim
_GUARD = re.compile(r"^\s*(?:Guard failed:\s*)?(\w+)\.size\(\)\[(\d+)\]\s*(<=|>=|==|<|>)\s*(-?\d+)\s*(?:$|from user code)")


@dataclass(frozen=True)
class DimRange:
    """A dim that varies: from lo to hi (None: no upper limit). Dims with one `sym` are one size
    (a batch dim across inputs, a sequence dim across ids and mask)."""
    lo: int
    hi: int | None
    sym: str = ""

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi if self.hi is not None else 'any'}"


@dataclass(frozen=True)
class InputShapes:
    """Per flat input (the CallSpec's order, named), per dim: a fixed size or a DimRange; None for an
    input that is no tensor. `free`: no shape recorded (symbolic_trace); `static`: why every dim is
    the example's (dynamic=False, or the dynamic export failed: said, never silent).

    The call contract, read-only: what capture settles (the lower ends, the config's limits), what the
    guard learns (a range a program's own check narrows) and what a loaded program's notes restore are
    each a new contract (lowered, capped, narrowed, with_notes), stored where the graph keeps its
    contract; the sizes the guard checked at are the guard's record, not the contract's."""
    names: tuple
    dims: tuple = ()
    free: bool = False
    static: str = ""
    declared: object = True   # OptimizeConfig.dynamic by input position: a free graph enforces its ranges itself
    limits: dict = field(default_factory=dict)   # {(input index, dim): the config field that ends it}
    lower_ends: dict = field(default_factory=dict)   # {symbol: why it does not go down to 1}

    @staticmethod
    def of_export(gm: fx.GraphModule, ranges: dict, names: tuple, static: str = "") -> "InputShapes":
        """From an exported program's module (its placeholders' symbolic sizes) and its
        range_constraints (symbol -> ValueRanges)."""
        bounds = {str(sym): _bounds(vr) for sym, vr in (ranges or {}).items()}
        dims = []
        user = [n for n in gm.graph.nodes if n.op == "placeholder"][-len(names):] if names else []
        for n in user:
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                dims.append(None)
                continue
            row = []
            for s in val.shape:
                expr = s.node.expr if isinstance(s, torch.SymInt) else None
                if expr is not None and not expr.is_number:
                    lo, hi = bounds.get(str(expr), (2, None))
                    row.append(DimRange(lo, hi, str(expr)))
                else:   # a number, or a symbol export specialised to one
                    row.append(int(expr) if expr is not None else int(s))
            dims.append(tuple(row))
        return InputShapes(tuple(names), tuple(dims), static=static)

    @staticmethod
    def traced(names: tuple, declared, args: tuple) -> "InputShapes":
        """Of a graph that records no shapes (symbolic_trace): it takes what the model's code takes,
        within the ranges declared (dynamic=), or the example's shapes only with dynamic=False."""
        if declared is False:
            fixed = tuple({d: (n, n) for d, n in enumerate(a.shape)} if isinstance(a, torch.Tensor) else None
                          for a in args)
            return InputShapes(tuple(names), free=True, declared=fixed, static="dynamic=False")
        return InputShapes(tuple(names), free=True, declared=declared)

    @property
    def dynamic(self) -> bool:
        return (self.free and not self.static) or any(isinstance(d, DimRange) for row in self.dims if row for d in row)

    def describe(self, checked=()) -> str:
        """One line for the summary; checked: the guard's record of the other sizes it checked every layer at
        (checked_label's words)."""
        if self.free and self.static:
            shown = ["x".join(str(lo) for lo, _ in ranges.values()) for ranges in self.declared if ranges is not None]
            text = f"shapes: the example's only ({self.static}): {', '.join(shown)}"
        elif self.free:
            text = "shapes: any the model's code takes (symbolic_trace fixes none)"
            if isinstance(self.declared, tuple):
                shown = [f"{name} dim {d} {lo}..{hi if hi is not None else 'any'}"
                         for name, ranges in zip(self.names, self.declared) for d, (lo, hi) in (ranges or {}).items()]
                text += f"; declared: {', '.join(shown)} (a call outside is refused)" if shown else ""
        elif self.static:
            text = f"shapes: the example's only ({self.static})"
        else:
            parts = [f"{name} {' x '.join(map(str, row)) or 'scalar'}" for name, row in zip(self.names, self.dims)
                     if row is not None]
            text = "shapes: " + "; ".join(parts)
            if self.dynamic:
                text += " (a..b: a dim that varies; a number: fixed by the model)"
        if checked:
            text += "; besides the example, every layer was also checked " + "; ".join(checked)
        return text

    def sizes_of(self, named: dict, args: tuple) -> dict:
        """{symbol: size} from {input name: shape} (a warm-up shape), checked against the ranges;
        InputError-worthy ValueError naming the input, dim and range where it does not fit."""
        sizes: dict = {}
        for name, shape in named.items():
            if name not in self.names:
                raise ValueError(f"warm-up shape for {name!r}: the optimized model's inputs are {list(self.names)}")
            i = self.names.index(name)
            row = self.dims[i] if i < len(self.dims) else None
            if row is None or len(tuple(shape)) != len(row):
                raise ValueError(f"warm-up shape {tuple(shape)} for {name!r}: it has {len(row or ())} dims")
            for d, (r, n) in enumerate(zip(row, shape)):
                if isinstance(r, DimRange):
                    if not (r.lo <= n and (r.hi is None or n <= r.hi)):
                        raise ValueError(f"warm-up shape for {name!r}: dim {d} is {n}, outside its range {r}")
                    if sizes.setdefault(r.sym, n) != n:
                        raise ValueError(f"warm-up shape for {name!r}: dim {d} is {n} where another input's same "
                                         f"dim is {sizes[r.sym]}")
                elif r != n:
                    raise ValueError(f"warm-up shape for {name!r}: dim {d} is {n}, but the model fixes it at {r}")
        return self._followed(sizes, args)

    def _followed(self, sizes: dict, args: tuple) -> dict:
        """sizes with each dim not given taken from a given one of another input at the same dim that
        had its size in the example (the mask's batch follows the ids' batch where export gave them
        two symbols: inputs of two batch sizes would index out of range on the device)."""
        rows = [(row, a) for row, a in zip(self.dims, args) if row is not None and isinstance(a, torch.Tensor)]
        for row, a in rows:
            for d, r in enumerate(row):
                if not isinstance(r, DimRange) or r.sym in sizes or d >= a.dim():
                    continue
                for other, b in rows:
                    o = other[d] if d < len(other) and d < b.dim() else None
                    if isinstance(o, DimRange) and o.sym in sizes and b.shape[d] == a.shape[d]:
                        sizes[r.sym] = sizes[o.sym]
                        break
        return sizes

    def check(self, args: tuple) -> str | None:
        """Why a call's inputs are outside the ranges the user declared for a graph that records no
        shapes (a free one: symbolic_trace), or None. (An exported program's guards check its own,
        the limits the model's config sets included: export_dims gives them to export; but not a lower
        end of 2 kept where the model runs another way at 1: lower_ends, checked here.)"""
        if self.lower_ends:
            for name, row, a in zip(self.names, self.dims, args):
                for d, r in enumerate(row or ()):
                    if isinstance(r, DimRange) and r.sym in self.lower_ends and isinstance(a, torch.Tensor) \
                            and a.dim() > d and a.shape[d] < r.lo:
                        return (f"{name} dim {d} is {a.shape[d]}: at least {r.lo}: {self.lower_ends[r.sym]}; "
                                f"optimize with an example of that size for calls of it")
        if not self.free or not isinstance(self.declared, tuple):
            return None
        for name, ranges, a in zip(self.names, self.declared, args):
            for d, (lo, hi) in (ranges or {}).items():
                n = a.shape[d] if isinstance(a, torch.Tensor) and a.dim() > d else None
                if n is not None and not (lo <= n and (hi is None or n <= hi)):
                    if self.static:
                        return f"{name} dim {d} is {n}: the optimized model takes the example's {lo} only ({self.static})"
                    return f"{name} dim {d} is {n}: outside the range {lo}..{hi} declared for it (dynamic=)"
        return None

    def varying(self) -> dict:
        """{symbol: DimRange} of the dims that vary (one entry per size that varies)."""
        return {r.sym: r for row in self.dims if row for r in row if isinstance(r, DimRange)}

    def sizes_in(self, args: tuple, leading: bool = False) -> dict:
        """{symbol: its size in these inputs} for the dims that vary (leading: only those some input holds as
        its first dim, a batch)."""
        sizes = {}
        for row, a in zip(self.dims, args):
            for d, r in enumerate(row or ()):
                if isinstance(r, DimRange) and isinstance(a, torch.Tensor) and (d == 0 or not leading):
                    sizes.setdefault(r.sym, a.shape[d])
        return sizes

    def other_shapes(self, args: tuple, max_scale: int = 8) -> list[tuple[str, dict]]:
        """Sizes the guard checks every layer at besides the example, for the dims that vary:
        [(label, {symbol: size})]: the smallest (each at its lower end), one odd size in between, and the
        largest where the range has an end and the inputs stay within max_scale x the example's elements."""
        ranges = self.varying()
        if not ranges:
            return []
        example = self.sizes_in(args)
        small = {k: r.lo for k, r in ranges.items()}
        odd = {k: _odd(ranges[k], example.get(k, 2)) for k in ranges}
        out = [("at the smallest sizes", small), ("at odd sizes", odd)]
        # the upper ends the ranges have (a dim without one stays at the example's size)
        large = {k: r.hi if r.hi is not None else example.get(k, 1) for k, r in ranges.items()}
        grow = 1.0
        for k, n in large.items():
            grow *= n / max(example.get(k, n), 1)
        if any(r.hi is not None for r in ranges.values()) and grow <= max_scale and any(
                large[k] != example.get(k) for k in large):
            out.append(("at the largest sizes", large))
        return out

    def shaped(self, args: tuple, sizes: dict) -> list:
        """The target shape of each input with the varying dims at `sizes` (None for non-tensors)."""
        shapes = []
        for row, a in zip(self.dims, args):
            if row is None or not isinstance(a, torch.Tensor):
                shapes.append(None)
                continue
            shapes.append(tuple(sizes.get(r.sym, a.shape[d]) if isinstance(r, DimRange) else a.shape[d]
                                for d, r in enumerate(row)))
        return shapes

    def inputs_at(self, args: tuple, sizes: dict) -> tuple:
        """The example's inputs with the varying dims at `sizes`: each tensor repeated along its dims
        and cut to size (real token ids, a real mask)."""
        out = []
        for a, shape in zip(args, self.shaped(args, sizes)):
            if shape is not None and tuple(shape) != tuple(a.shape):
                a = repeated_to(a, shape)
            out.append(a)
        return tuple(out)

    def checked_label(self, label: str, args: tuple, sizes: dict) -> str:
        """In words, the sizes every layer passed at: 'at the smallest sizes (input_ids 2x1, attention_mask
        2x1)' (the guard's record keeps them)."""
        shown = [f"{name} {'x'.join(map(str, s))}" for name, s in zip(self.names, self.shaped(args, sizes)) if s]
        return f"{label} ({', '.join(shown)})"

    def _with_dim(self, sym: str, new) -> "InputShapes":
        """This contract with every dim of symbol `sym` replaced by `new` (a DimRange or a fixed size)."""
        return dataclasses.replace(self, dims=tuple(None if row is None else tuple(
            new if isinstance(x, DimRange) and x.sym == sym else x for x in row) for row in self.dims))

    def lowered(self, syms, lo: int = 1, why: dict | None = None) -> "InputShapes":
        """This contract with these dims' ranges starting at `lo` (1: capture ran the model there,
        check.settle_lower_ends; a loaded program's saved lower ends, serialize), and lower_ends without them, or
        with `why` ({symbol: why it does not go down to 1}) where given."""
        lower_ends = {**{k: v for k, v in self.lower_ends.items() if k not in syms}, **(why or {})}
        return dataclasses.replace(self, lower_ends=lower_ends, dims=tuple(None if row is None else tuple(
            DimRange(lo, r.hi, r.sym) if isinstance(r, DimRange) and r.sym in syms else r for r in row)
            for row in self.dims))

    def with_lower_ends(self, why: dict) -> "InputShapes":
        """This contract with these dims' reasons for not going down to 1 ({symbol: why})."""
        return dataclasses.replace(self, lower_ends={**self.lower_ends, **why})

    def capped(self, limits: dict) -> "InputShapes":
        """This contract with the ranges closed at the limits the model's config sets (position_limits),
        remembered for the refusal's words: the guard never checks a layer past them (on a GPU, a position
        table read past its end is a device-side assert that ends the process's CUDA context)."""
        out, said = self, dict(self.limits)
        for i, dims in limits.items():
            row = out.dims[i] if i < len(out.dims) else None
            for d, (most, why) in dims.items():
                r = row[d] if row is not None and d < len(row) else None
                if not isinstance(r, DimRange) or (r.hi is not None and r.hi < most):
                    continue    # export found a tighter end: its words stand
                said[(i, d)] = why
                if r.hi is None or r.hi > most:
                    out = out._with_dim(r.sym, DimRange(r.lo, most, r.sym))
                    row = out.dims[i]
        return dataclasses.replace(out, limits=said)

    def narrowed(self, guard_text: str) -> "InputShapes | None":
        """This contract narrowed by a shape guard the program refused a probe with (a guard export keeps
        outside its range constraints: a model's own check pins a dim), or None where the guard bounds no
        varying dim alone."""
        found = _GUARD.search(_first_line(guard_text))
        if found is None:
            return None
        index, dim = _input_index(found.group(1), self.names), int(found.group(2))
        op, limit = found.group(3), int(found.group(4))
        if index is None or index >= len(self.dims) or not self.dims[index] or dim >= len(self.dims[index]):
            return None
        r = self.dims[index][dim]
        if not isinstance(r, DimRange):
            return None
        if op == "==":
            new = limit
        elif op in ("<=", "<"):
            new = DimRange(r.lo, min(r.hi or limit, limit if op == "<=" else limit - 1), r.sym)
        else:
            new = DimRange(max(r.lo, limit if op == ">=" else limit + 1), r.hi, r.sym)
        return self._with_dim(r.sym, new)

    def refusal(self, guard_text: str, args: tuple) -> str:
        """The one line to say for a call the program's shape guard refused (guard_text: the
        guard's own words, e.g. "Guard failed: flat_0.size()[1] <= 64")."""
        found = _GUARD.search(_first_line(guard_text))
        if found is None:    # a relation between inputs (flat_1.size()[0] == flat_0.size()[0]): said by their names
            text = re.sub(r"\b(flat|args)_(\d+)\.size\(\)\[(\d+)\]", self._dim_words, guard_text)
            text = re.sub(r"^Guard failed:\s*", "", text.strip())
            return f"these inputs have shapes the captured program does not take together: it needs {text}"
        arg, dim, op, limit = found.group(1), int(found.group(2)), found.group(3), int(found.group(4))
        index = _input_index(arg, self.names)
        name = self.names[index] if index is not None and index < len(self.names) else arg
        got = ""
        if index is not None and index < len(args) and isinstance(args[index], torch.Tensor):
            got = f" is {args[index].shape[dim]}"
        declared = (isinstance(self.declared, tuple) and index is not None and index < len(self.declared)
                    and dim in (self.declared[index] or {}))
        field_ = self.limits.get((index, dim))
        # an end no config field gives is where torch.export's trace of the model's code stopped holding (a branch on
        # the size, a sliding window's mask, a check of the model's own): the captured program's limit, which eager
        # may not have
        source = ("the range declared for it (dynamic=)" if declared else
                  f"a limit of the model's ({field_})" if field_ else
                  "the captured program's range: the model's code, traced by torch.export at the example, takes "
                  "another way past it (a branch on the size); optimize with an example past it to serve those")
        if op == "==":
            why = (f"the model fixes it at {limit}" if not self.static
                   else f"the program takes the example's {limit} only ({self.static})")
        elif op in ("<=", "<"):
            why = f"at most {limit if op == '<=' else limit - 1}: {source}"
        else:
            why = f"at least {limit if op == '>=' else limit + 1}: {source}"
        return f"{name} dim {dim}{got}: {why}"

    def _dim_words(self, m) -> str:
        i, d = int(m.group(2)), int(m.group(3))
        name = self.names[i] if i < len(self.names) else f"input {i}"
        return f"{name} dim {d}"


# inputs whose dim 1 counts token positions, and the config fields that end them (the first the
# config has): a learned position table indexed past its end is a device-side assert on the GPU
_POSITION_FIELDS = ("max_position_embeddings",)
_DECODER_FIELDS = ("max_target_positions", "max_position_embeddings")
_POSITION_INPUTS = {"input_ids": _POSITION_FIELDS, "attention_mask": _POSITION_FIELDS,
                    "token_type_ids": _POSITION_FIELDS, "position_ids": _POSITION_FIELDS,
                    "inputs_embeds": _POSITION_FIELDS, "decoder_input_ids": _DECODER_FIELDS,
                    "decoder_attention_mask": _DECODER_FIELDS, "decoder_inputs_embeds": _DECODER_FIELDS}


def position_limits(model, names: tuple) -> dict:
    """{flat input index: {1: (most tokens, the config field that says so)}} for an HF model whose
    config ends its positions (max_position_embeddings, GPT-2's n_positions through it, Whisper's
    decoder max_target_positions); {} for other models. A position table with a padding index
    (RoBERTa's: positions start after it) takes that many fewer tokens."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    offset = 0
    for name, mod in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(mod, torch.nn.Embedding) and mod.padding_idx is not None:
            offset = max(offset, mod.padding_idx + 1)
    out = {}
    for i, name in enumerate(names):
        for field_ in _POSITION_INPUTS.get(name, ()):
            n = getattr(config, field_, None)
            n = n if isinstance(n, int) else getattr(text, field_, None)
            if isinstance(n, int) and not isinstance(n, bool) and n > offset:
                said = f"config.{field_} = {n}" + (f", less {offset} for its padding index" if offset else "")
                out[i] = {1: (n - offset, said)}
                break
    return out


def export_dims(a, bounds: dict | None, every: bool):
    """torch.export's spec of one input: Dim.AUTO on every dim (every: dynamic=True; export fixes the
    ones the model pins) or on the dims `bounds` names only (ranges a user declared, the others
    fixed), each dim in `bounds` ({dim: (lo, hi)}, None: no end) with its bounds."""
    if not isinstance(a, torch.Tensor) or not (every or bounds):
        return None
    spec = {d: torch.export.Dim.AUTO for d in range(a.dim())} if every else {}
    for d, (lo, hi) in (bounds or {}).items():
        if d < a.dim():
            spec[d] = torch.export.Dim.AUTO(min=lo, max=hi)
    return spec


def within_limits(declared: tuple, limits: dict, names: tuple = ()) -> tuple:
    """Declared ranges with an open upper end closed at the model's limit; one past it refused."""
    out = []
    for i, ranges in enumerate(declared):
        ranges = dict(ranges or {}) if ranges is not None else None
        for d, (most, why) in limits.get(i, {}).items():
            if ranges is None or d not in ranges:
                continue
            lo, hi = ranges[d]
            if hi is not None and hi > most:
                raise InputError(f"dynamic= declares {names[i] if i < len(names) else f'input {i}'} dim {d} up to {hi}, "
                                 f"past the model's {most} positions "
                                 f"({why}): declare at most {most}")
            ranges[d] = (lo, most if hi is None else hi)
        out.append(ranges)
    return tuple(out)


def guard_failure(e: AssertionError) -> str | None:
    """The shape guard a program refused a call with ("Guard failed: flat_0.size()[1] <= 64"), or
    None for another assertion (the model's own: raised as it is)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if text.startswith("Guard failed") else None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _bounds(vr) -> tuple:
    lo, hi = vr.lower, vr.upper
    lo = int(lo) if _finite(lo) else 0
    hi = int(hi) if _finite(hi) else None
    return lo, hi


def _finite(x) -> bool:
    """Whether a range bound is a number (torch's int_oo claims is_finite, and int() of it fails)."""
    try:
        return abs(int(x)) < 2 ** 62
    except (TypeError, ValueError, OverflowError, AttributeError):
        return False


def _input_index(arg: str, names: tuple):
    """The flat input a guard's argument name stands for: flat_3 (flat_module's *args), a forward's
    own parameter name, or args_0 / L['args'][0]-style names."""
    if arg in names:
        return names.index(arg)
    found = re.search(r"(\d+)$", arg)
    return int(found.group(1)) if found else None


def _odd(r: DimRange, example: int) -> int:
    """A size inside r unlike the example's: odd, not a power of two (a tail for every tile)."""
    for n in (example + 1 if example % 2 == 0 else example + 2, 17, 3):
        if n >= r.lo and (r.hi is None or n <= r.hi) and n != example:
            return n
    return example


def repeated_to(t: torch.Tensor, shape) -> torch.Tensor:
    """t repeated along each dim and cut to `shape`, in t's own memory layout (a channels_last image
    checked or warmed up row-major tested kernels on a layout the user's calls do not have)."""
    reps = [-(-n // max(m, 1)) for n, m in zip(shape, t.shape)]
    return t.repeat(*reps)[tuple(slice(0, n) for n in shape)].contiguous(memory_format=memory_layout(t))


def memory_layout(t: torch.Tensor) -> torch.memory_format:
    """t's memory format: channels_last (3d) where t is that and not row-major, else row-major."""
    cl = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return cl if cl is not None and not t.is_contiguous() and t.is_contiguous(memory_format=cl) else \
        torch.contiguous_format
