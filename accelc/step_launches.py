"""How many kernels a generation step launches a token, from its graph (#89: the few-launch step's target is counted
here, on any machine): accelc's kernel calls, and the groups of glue between them, each a set of operations joined
by their data (through views) that no accelc kernel separates, within one repeated block (a decoder layer: the
glue compiles block by block) or outside them. Under Inductor a group compiles to one kernel or more
(it fuses what is joined, and runs what must be materialised for an accelc kernel, a mutation or the output); under
eager glue each operation is a kernel of its own. So the count is a floor: what the step launches at least, exact
where no glue is left between the accelc kernels. Beside it, the bytes of weights the step reads a token, each tensor
once (a table it only gathers rows of, an embedding's, apart; the cache it writes apart): where that passes the
model's own weights, a weight is held twice (a stacked copy beside its original)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import fx

from accelc import meta
from accelc.capture.nodes import VIEW_OPS, view_base, written_args

# operations that launch nothing of their own: views (capture.VIEW_OPS), sizes, casts (a cast to the dtype it has is
# none, and Inductor fuses one into its neighbours)
_FREE = VIEW_OPS | {"_unsafe_view", "to", "_to_copy", "size", "sym_size", "lift_fresh_copy"}
_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")     # a module path's repeated block (model.layers.3, blocks.0)


@dataclass(frozen=True)
class Launches:
    accelc: int             # accelc kernels a step launches (a call one, or two: _kernels)
    glue: int               # groups of glue (one kernel or more each)
    blocks: int             # repeated blocks (decoder layers) the step runs
    accelc_in_blocks: int
    glue_in_blocks: int
    weight_bytes: int = 0   # the weights the step reads whole (tables it gathers rows of, and its cache, aside)
    table_bytes: int = 0    # the tables it gathers rows of (an embedding's): a token reads a row of each

    def line(self) -> str:
        text = (f"launches a token: at least {self.accelc + self.glue} ({self.accelc} accelc kernels, "
                f"{self.glue} groups of glue between them, one kernel or more each)")
        if self.blocks:
            a, g = self.accelc_in_blocks / self.blocks, self.glue_in_blocks / self.blocks
            text += f"; a layer (of {self.blocks}): {a:g} + {g:g}"
        if self.weight_bytes:
            text += (f"; it reads {self.weight_bytes / 2**20:.2f} MiB of weights a token"
                     + (f" (besides rows of {self.table_bytes / 2**20:.2f} MiB of embedding tables)"
                        if self.table_bytes else "") + ", and the KV cache up to its context")
        return text


def is_accelc(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "accelc"


def _symbolic(n: fx.Node, sym: set) -> bool:
    """A size's arithmetic (x.size(1) + 1), run on the host: sym_size, or an operator whose node inputs all are."""
    if n.op != "call_function":
        return False
    if meta.op_name(n) == "sym_size":
        return True
    return getattr(n.target, "__module__", None) in ("_operator", "math", "builtins") and \
        all(a in sym for a in n.all_input_nodes)


def _free(n: fx.Node, sym: set) -> bool:
    return n in sym or (n.op in ("call_function", "call_method") and meta.op_name(n) in _FREE)


def _block(n: fx.Node) -> str | None:
    found = _BLOCK.match(str(n.meta.get(meta.PATH) or ""))
    return found.group(1) if found else None


def count(gm: fx.GraphModule) -> Launches:
    """The step graph's launches (module docstring)."""
    nodes = list(gm.graph.nodes)
    sym: set = set()
    for n in nodes:
        if _symbolic(n, sym):
            sym.add(n)
    compute = [n for n in nodes if n.op in ("call_function", "call_method") and not is_accelc(n) and not _free(n, sym)]
    parent = {n: n for n in compute}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def reached(n, seen):
        """The glue operations n reads, through free operations."""
        out = []
        for a in n.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a in parent:
                out.append(a)
            elif _free(a, sym):
                out += reached(a, seen)
        return out
    for n in compute:     # (a block's glue compiles apart from another's: regions.py; eager glue fuses nothing)
        for a in reached(n, set()):
            if _block(a) == _block(n):
                parent[root(a)] = root(n)
    groups: dict = {}
    for n in compute:
        groups.setdefault(root(n), []).append(n)
    accelc = [n for n in nodes if is_accelc(n)]
    blocks = {_block(n) for n in accelc} - {None}
    in_block = [g for g in groups.values() if any(_block(n) for n in g)]
    weights, tables = _bytes_read(gm, nodes, sym)
    return Launches(sum(map(_kernels, accelc)), len(groups), len(blocks), sum(_kernels(n) for n in accelc if _block(n)),
                    len(in_block), weights, tables)


def _kernels(n: fx.Node) -> int:
    """The kernels an accelc call launches at a decode step's rows: one, but two for accelc::qkv_rotary with its
    heads normalized (the GEMV, then the norms, rotations and stores: kernels/qkv_rotary.py)."""
    return 2 if n.target is torch.ops.accelc.qkv_rotary.default and n.kwargs.get("q_norm") is not None else 1


def _bytes_read(gm: fx.GraphModule, nodes: list, sym: set) -> tuple[int, int]:
    """(bytes of the tensors the graph reads whole, bytes of those it only gathers rows of), each tensor once: its
    parameters, buffers and constants (get_attr), not those it writes (the KV cache, a position counter)."""
    written = {view_base(a) for n in nodes for a in written_args(n)}
    whole, rows = {}, {}
    for n in nodes:
        t = meta.attr_value(gm, n) if n.op == "get_attr" and n not in written else None
        if not isinstance(t, torch.Tensor):
            continue
        readers = _readers(n, sym)
        gathered = readers and all(meta.op_name(r) == "embedding" and view_base(r.args[0]) is n for r in readers)
        (rows if gathered else whole)[t.data_ptr() or id(t)] = t.numel() * t.element_size()
    rows = {k: v for k, v in rows.items() if k not in whole}
    return sum(whole.values()), sum(rows.values())


def _readers(n: fx.Node, sym: set) -> list:
    """The operations that read n, through free ones."""
    out = []
    for u in n.users:
        out += _readers(u, sym) if _free(u, sym) else [u]
    return out
