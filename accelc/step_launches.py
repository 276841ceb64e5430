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

import operator
import re
from dataclasses import dataclass

import torch
from torch import fx

from accelc import meta

aten = torch.ops.aten
# operations that launch nothing of their own: views, shapes, casts (a cast to the dtype it has is none, and
# Inductor fuses one into its neighbours), reads of a tuple's item
_FREE = {aten.view, aten.reshape, aten._unsafe_view, aten.transpose, aten.permute, aten.unsqueeze, aten.squeeze,
         aten.expand, aten.slice, aten.select, aten.narrow, aten.alias, aten.detach, aten.t, aten.sym_size,
         aten.split, aten.unbind, aten.to, aten._to_copy, aten.contiguous, aten.lift_fresh_copy}
_FREE_CALLABLES = {operator.getitem, torch.transpose, torch.narrow, torch.reshape, torch.permute, torch.unsqueeze,
                   torch.squeeze, torch.select, torch.t, torch.Tensor.view, torch.Tensor.reshape,
                   torch.Tensor.transpose, torch.Tensor.contiguous, torch.Tensor.to, torch.Tensor.size,
                   torch.sym_int, torch.sym_float}
_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")     # a module path's repeated block (model.layers.3, blocks.0)


@dataclass(frozen=True)
class Launches:
    accelc: int             # accelc kernel calls a step
    glue: int               # groups of glue (one kernel or more each)
    blocks: int             # repeated blocks (decoder layers) the step runs
    accelc_in_blocks: int
    glue_in_blocks: int
    weight_bytes: int = 0   # the weights the step reads whole (tables it gathers rows of, and its cache, aside)
    table_bytes: int = 0    # the tables it gathers rows of (an embedding's): a token reads a row of each

    def line(self) -> str:
        text = (f"launches a token: at least {self.accelc + self.glue} ({self.accelc} accelc kernel calls, "
                f"{self.glue} groups of glue between them, one kernel or more each)")
        if self.blocks:
            a, g = self.accelc_in_blocks / self.blocks, self.glue_in_blocks / self.blocks
            text += f"; a layer (of {self.blocks}): {a:g} + {g:g}"
        if self.weight_bytes:
            text += (f"; it reads {self.weight_bytes / 2**20:.2f} MiB of weights a token"
                     + (f" (besides rows of {self.table_bytes / 2**20:.2f} MiB of embedding tables)"
                        if self.table_bytes else "") + ", and the KV cache up to its context")
        return text


def _packet(target):
    return getattr(target, "overloadpacket", None)


def is_accelc(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "accelc"


def _symbolic(n: fx.Node, sym: set) -> bool:
    """A size's arithmetic (x.size(1) + 1), run on the host: sym_size, or an operator whose node inputs all are."""
    if n.op == "call_function" and _packet(n.target) is aten.sym_size:
        return True
    if n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator", "math", "builtins"):
        return all(a in sym for a in n.all_input_nodes)
    return False


def _free(n: fx.Node, sym: set) -> bool:
    if n in sym:
        return True
    if n.op == "call_method":
        return n.target in ("view", "reshape", "transpose", "permute", "unsqueeze", "size", "to", "contiguous")
    return _packet(n.target) in _FREE or n.target in _FREE_CALLABLES


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
            elif a.op in ("call_function", "call_method") and _free(a, sym):
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
    return Launches(len(accelc), len(groups), len(blocks), sum(1 for n in accelc if _block(n)), len(in_block),
                    weights, tables)


def _bytes_read(gm: fx.GraphModule, nodes: list, sym: set) -> tuple[int, int]:
    """(bytes of the tensors the graph reads whole, bytes of those it only gathers rows of), each tensor once: its
    parameters, buffers and constants (get_attr), not those it writes (the KV cache, a position counter)."""
    def base(n):
        while n.op == "call_function" and _free(n, sym) and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        return n
    written = {base(n.args[0]) for n in nodes if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node)
               and str(getattr(n.target, "__name__", "")).split(".")[0].endswith("_")}
    whole, rows = {}, {}
    for n in nodes:
        if n.op != "get_attr" or n in written:
            continue
        t = gm
        for part in n.target.split("."):
            t = getattr(t, part, None)
        if not isinstance(t, torch.Tensor):
            continue
        readers = _readers(n, sym)
        gathered = readers and all(_packet(r.target) is aten.embedding and r.args[0] is not None and base(r.args[0]) is n
                                   for r in readers)
        (rows if gathered else whole)[t.data_ptr() or id(t)] = t.numel() * t.element_size()
    rows = {k: v for k, v in rows.items() if k not in whole}
    return sum(whole.values()), sum(rows.values())


def _readers(n: fx.Node, sym: set) -> list:
    """The operations that read n, through free ones."""
    out = []
    for u in n.users:
        out += _readers(u, sym) if u.op == "call_function" and _free(u, sym) else [u]
    return out
