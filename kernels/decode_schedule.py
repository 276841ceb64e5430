"""The persistent decode step's task list (kernels/decode_step.py), and its CPU executor: the same tasks run one at
a time in torch, in the list's order or in any order its counters admit (`run_tasks`), through each task body's
reference math on the same shared workspace, so the list's dependencies and its buffer reuse are checked here,
without a GPU, and the step's tokens compared with the chain of kernels it replaces.
"""
from __future__ import annotations

import dataclasses
import random

import torch
import triton

from accelc.kernels.epilogue import ACTIVATION_NAMES, activation_code, activation_ref
from accelc.kernels.gated_linear import G as GATE_GROUP

PREP, QKV, ATTN, OPROJ, GATEUP, DOWN, HEAD = range(7)
KINDS = ("prep", "qkv", "attn", "oproj", "gateup", "down", "head")
A_LAYER = 8          # pointer table entries a layer: attention norm, W_qkv, b_qkv, W_o, mlp norm, packed gate/up,
#                      W_down, the layer's cache
TASK_FIELDS = 5      # a task: kind, layer, tile, the counter it waits on (-1: none), the count it waits for


@dataclasses.dataclass(frozen=True)
class Dims:
    """A step's sizes: layers, hidden (K), q / kv heads, head dim, the MLP's width (I), vocabulary, the cache's
    positions, whether q / k / v have a bias, the gate's activation."""
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    max_len: int
    bias: bool
    activation: str

    def as_list(self) -> list[int]:
        return [self.layers, self.hidden, self.q_heads, self.kv_heads, self.head_dim, self.inter, self.vocab,
                self.max_len, int(self.bias), activation_code(self.activation)]

    @classmethod
    def from_list(cls, v) -> "Dims":
        return cls(*v[:8], bool(v[8]), ACTIVATION_NAMES[v[9]])


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The tasks' tiles: rotation pairs a QKV task, rows a GEMV task, K a block, gate/up groups a GATEUP task, key
    splits a kv head, keys a block, and the programs (one an SM; one in the interpreter)."""
    pairs: int
    rows: int
    block_k: int
    groups: int
    splits: int
    block_keys: int
    programs: int
    warps: int = 8


def tiles_for(d: Dims, programs: int, interpreted: bool) -> Tiles:
    if interpreted:     # few, wide tasks: the interpreter's time goes by the operation
        return Tiles(pairs=min(64, triton.next_power_of_2((d.q_heads + 2 * d.kv_heads) * d.head_dim // 2)),
                     rows=min(64, triton.next_power_of_2(max(d.hidden, d.vocab))), block_k=64, groups=2,
                     splits=2, block_keys=16, programs=1, warps=1)
    return Tiles(pairs=8, rows=16, block_k=512, groups=1, splits=max(1, min(32, programs // d.kv_heads)),
                 block_keys=64, programs=programs)


def task_counts(d: Dims, t: Tiles) -> dict[int, int]:
    """Tasks a layer of each kind (HEAD: of the step)."""
    return {QKV: triton.cdiv((d.q_heads + 2 * d.kv_heads) * d.head_dim // 2, t.pairs),
            ATTN: d.kv_heads * t.splits, OPROJ: triton.cdiv(d.hidden, t.rows),
            GATEUP: triton.cdiv(triton.cdiv(d.inter, GATE_GROUP), t.groups), DOWN: triton.cdiv(d.hidden, t.rows),
            HEAD: triton.cdiv(d.vocab, t.rows)}


def counter(kind: int, layer: int) -> int:
    """The counter of (kind, layer)'s tasks done (ATTN's: kv heads combined)."""
    return layer * 5 + kind - 1


def schedule(d: Dims, t: Tiles) -> list[tuple]:
    """The step's tasks in the order programs take them: (kind, layer, tile, counter waited on, count)."""
    n = task_counts(d, t)
    L = d.layers
    rows = [(PREP, 0, 0, -1, 0)]
    for layer in range(L):
        wait_in = (5 * L, 1) if layer == 0 else (counter(DOWN, layer - 1), n[DOWN])
        rows += [(QKV, layer, i, *wait_in) for i in range(n[QKV])]
        rows += [(ATTN, layer, i, counter(QKV, layer), n[QKV]) for i in range(n[ATTN])]
        rows += [(OPROJ, layer, i, counter(ATTN, layer), d.kv_heads) for i in range(n[OPROJ])]
        rows += [(GATEUP, layer, i, counter(OPROJ, layer), n[OPROJ]) for i in range(n[GATEUP])]
        rows += [(DOWN, layer, i, counter(GATEUP, layer), n[GATEUP]) for i in range(n[DOWN])]
    rows += [(HEAD, L - 1, i, counter(DOWN, L - 1), n[DOWN]) for i in range(n[HEAD])]
    return rows


def counters_needed(d: Dims) -> int:
    """Stage counters (5 a layer and PREP's); the HKV tickets and the finished count follow them."""
    return 5 * d.layers + 1


@dataclasses.dataclass
class Step:
    """One decode step's operands (batch 1, one token): x (K,), cos / sin (D,), the write position, the mask's row
    (max_len,) bool, per layer (attention norm, W_qkv, b_qkv or None, W_o, mlp norm, packed gate/up, W_down), the
    layers' caches (2, 1, Hkv, max_len, D), the final norm, the LM head, eps (attention norm, mlp norm, final)
    and the softmax scale."""
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    position: int
    mask: torch.Tensor
    layers: list
    caches: list
    final_norm: torch.Tensor
    head: torch.Tensor
    eps: tuple
    scale: float


class _Workspace:
    """What the kernel's workspace holds, reused by every layer as there."""

    def __init__(self, d: Dims, st: Step, acc):
        dt, dev = st.x.dtype, st.x.device
        self.acc, self.dt, self.dev = acc, dt, dev
        self.q = torch.zeros(d.q_heads * d.head_dim, dtype=dt, device=dev)
        self.attn = torch.zeros(d.q_heads * d.head_dim, dtype=dt, device=dev)
        self.mid = torch.zeros(d.hidden, dtype=dt, device=dev)
        self.out = torch.zeros(d.hidden, dtype=dt, device=dev)
        self.act = torch.zeros(d.inter, dtype=dt, device=dev)
        self.logits = torch.zeros(d.vocab, dtype=dt, device=dev)
        self.partial: dict = {}
        self.extent = -1


def _normed(h: torch.Tensor, w: torch.Tensor, eps: float, acc):
    """(h x the norm's weight, 1 / rms(h)): the GEMV's operand and the factor its sums take."""
    hf = h.to(acc)
    return hf * w.to(acc), torch.rsqrt(hf.pow(2).mean() + eps)


def _body(kind: int, layer: int, tile: int, d: Dims, t: Tiles, st: Step, ws: _Workspace, tickets: list) -> bool:
    """Runs one task; whether it counts itself done (an ATTN task only where it combined its kv head)."""
    acc, dt, D, half = ws.acc, ws.dt, d.head_dim, d.head_dim // 2
    h = st.x if layer == 0 else ws.out
    if kind == PREP:
        keys = st.mask.nonzero()
        ws.extent = int(keys.max()) + 1 if keys.numel() else 0
        return True
    n1, w_qkv, b_qkv, w_o, n2, w_gu, w_down = st.layers[layer]
    if kind == QKV:
        P = (d.q_heads + 2 * d.kv_heads) * half
        offs = torch.arange(tile * t.pairs, min(P, (tile + 1) * t.pairs), device=ws.dev)
        ra = (offs // half) * D + offs % half
        hn, r = _normed(h, n1, st.eps[0], acc)
        ya, yb = (w_qkv[rows].to(acc) @ hn * r for rows in (ra, ra + half))
        if b_qkv is not None:
            ya, yb = ya + b_qkv[ra].to(acc), yb + b_qkv[ra + half].to(acc)
        head, j = offs // half, offs % half
        c, s = st.cos.to(acc), st.sin.to(acc)
        rot = head < d.q_heads + d.kv_heads
        oa = torch.where(rot, ya * c[j] - yb * s[j], ya).to(dt)
        ob = torch.where(rot, yb * c[j + half] + ya * s[j + half], yb).to(dt)
        is_q = head < d.q_heads
        ws.q[head[is_q] * D + j[is_q]] = oa[is_q]
        ws.q[head[is_q] * D + j[is_q] + half] = ob[is_q]
        kv = head[~is_q] - d.q_heads
        if 0 <= st.position < d.max_len:
            cache = st.caches[layer]
            cache[kv // d.kv_heads, 0, kv % d.kv_heads, st.position, j[~is_q]] = oa[~is_q].to(cache.dtype)
            cache[kv // d.kv_heads, 0, kv % d.kv_heads, st.position, j[~is_q] + half] = ob[~is_q].to(cache.dtype)
        return True
    if kind == ATTN:
        g, s = divmod(tile, t.splits)
        group = d.q_heads // d.kv_heads
        q = ws.q.view(d.q_heads, D)[g * group:(g + 1) * group].to(acc)
        per = triton.cdiv(triton.cdiv(ws.extent, t.splits), t.block_keys) * t.block_keys
        lo, hi = s * per, min(s * per + per, ws.extent)
        cache = st.caches[layer]
        keys = torch.arange(lo, max(lo, hi), device=ws.dev)
        k, v = cache[0, 0, g, keys].to(acc), cache[1, 0, g, keys].to(acc)
        scores = (q @ k.T * st.scale).masked_fill(~st.mask[keys], float("-inf"))
        m = scores.max(-1).values if keys.numel() else torch.full((group,), float("-inf"), dtype=acc, device=ws.dev)
        p = torch.exp(scores - torch.where(m == float("-inf"), 0.0, m)[:, None])
        ws.partial[g, s] = (m, p.sum(-1), p @ v)
        tickets[g] += 1
        if tickets[g] < t.splits:
            return False
        tickets[g] = 0
        ms = torch.stack([ws.partial[g, i][0] for i in range(t.splits)])
        top = ms.max(0).values
        w = torch.exp(ms - torch.where(top == float("-inf"), 0.0, top))
        total = sum(w[i] * ws.partial[g, i][1] for i in range(t.splits))
        summed = sum(w[i][:, None] * ws.partial[g, i][2] for i in range(t.splits))
        out = torch.where(total[:, None] == 0, 0.0, summed / torch.where(total == 0, 1.0, total)[:, None])
        ws.attn[g * group * D:(g + 1) * group * D] = out.reshape(-1).to(dt)
        return True
    if kind in (OPROJ, DOWN, HEAD):
        end = min((tile + 1) * t.rows, d.vocab if kind == HEAD else d.hidden)
        rows = torch.arange(tile * t.rows, end, device=ws.dev)
        if kind == HEAD:
            hn, r = _normed(ws.out, st.final_norm, st.eps[2], acc)
            ws.logits[rows] = (st.head[rows].to(acc) @ hn * r).to(dt)
            return True
        w, src, res, dst = (w_o, ws.attn, h, ws.mid) if kind == OPROJ else (w_down, ws.act, ws.mid, ws.out)
        dst[rows] = (w[rows].to(acc) @ src.to(acc) + res[rows].to(acc)).to(dt)
        return True
    e = torch.arange(t.groups * GATE_GROUP, device=ws.dev)       # GATEUP
    grp = tile * t.groups + e // GATE_GROUP
    cols = grp * GATE_GROUP + e % GATE_GROUP
    ok = cols < d.inter
    hn, r = _normed(ws.mid, n2, st.eps[1], acc)
    gate = w_gu[(grp * 2 * GATE_GROUP + e % GATE_GROUP)[ok]].to(acc) @ hn * r
    up = w_gu[(grp * 2 * GATE_GROUP + GATE_GROUP + e % GATE_GROUP)[ok]].to(acc) @ hn * r
    ws.act[cols[ok]] = (activation_ref(d.activation, gate) * up).to(dt)
    return True


def run_tasks(d: Dims, t: Tiles, st: Step, seed: int | None = None) -> torch.Tensor:
    """The step's logits (vocab,), its k / v written into st.caches: the schedule's tasks run one at a time, t.programs
    programs each taking its tasks in the list's order, the next task run that of the lowest program whose task's
    counter is met (seed: of a random such program). A state where no program can go on is a deadlock: raised."""
    acc = torch.float64 if st.x.dtype == torch.float64 else torch.float32
    ws = _Workspace(d, st, acc)
    tasks = schedule(d, t)
    queues = [tasks[p::t.programs] for p in range(t.programs)]
    at = [0] * t.programs
    counters = [0] * counters_needed(d)
    tickets = [0] * d.kv_heads
    rng = random.Random(seed) if seed is not None else None
    for _ in range(len(tasks)):
        ready = [p for p in range(t.programs) if at[p] < len(queues[p])
                 and (queues[p][at[p]][3] < 0 or counters[queues[p][at[p]][3]] >= queues[p][at[p]][4])]
        if not ready:
            waiting = [queues[p][at[p]] for p in range(t.programs) if at[p] < len(queues[p])]
            raise RuntimeError(f"the decode step's tasks deadlock: every program waits ({waiting[:3]} ...)")
        p = rng.choice(ready) if rng is not None else ready[0]
        kind, layer, tile, _, _ = queues[p][at[p]]
        at[p] += 1
        if _body(kind, layer, tile, d, t, st, ws, tickets) and kind != HEAD:
            counters[5 * d.layers if kind == PREP else counter(kind, layer)] += 1
    return ws.logits
