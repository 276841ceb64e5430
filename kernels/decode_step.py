"""accelc::decode_step — a Llama-like decoder's whole decode step (batch 1, one token) as one persistent kernel
(#89 item 3): launched once a token on every SM, where the few-launch step (accelc.persistent_step's chain, five
kernels a layer) pays each kernel's launch, ramp and tail.

The step is a list of tasks (`schedule`, built on the host from the model's sizes), each a tile of one of the
layer's stages:

    PREP     the mask's extent: the keys any query may attend end there (one task, first)
    QKV      norm(h) @ W_qkv^T (+ bias) for BLOCK_P rotation pairs, rotated, q stored, k / v written to the cache
             at the token's position (kernels/qkv_rotary.py's layer)
    ATTN     (kv head g, split s): the group's q heads over split s of the keys (online softmax, base 2); the
             last split of g to finish combines them (flash_decoding's ticket and combine_rows)
    OPROJ    attn @ W_o^T + h for BLOCK_N columns
    GATEUP   act(norm(h2) @ W_gate^T) * (norm(h2) @ W_up^T) for one group of gated_linear.pack's rows
    DOWN     act @ W_down^T + h2 for BLOCK_N columns: the next layer's h
    HEAD     norm(h) @ W_head^T for BLOCK_N logits (the final norm and the LM head)

Program p runs tasks p, p + P, p + 2P, ... in order. A task first loads its first weight block (no task writes
weights), then waits until the counter of the stage it reads says every task of it is done (an acquire load
of a global counter), computes, stores, and counts itself done (a barrier, then a release add). Every task
waits only on tasks listed before it, so the lowest unfinished task can always run: with every program resident
(one an SM) the step cannot deadlock, and with one program (Triton's interpreter) it runs the list in order.
The activations (h, q, attn, act, the splits' partials) live in one small workspace that every layer reuses:
each buffer is rewritten only after every reader of its last value is done (test_decode_step checks it by
running the tasks in every order the counters admit, `run_tasks`). Data written during the kernel is read
through L2 (.cg): an SM's L1 does not see other SMs' writes. The last program to finish sets the counters back
to 0 for the next launch.

Numerics as the chain's kernels: fp32 accumulation, each stage's output rounded once to the model's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from accelc import runtime
from accelc.kernels.decode_schedule import Dims, Step, Tiles, counters_needed, run_tasks, schedule, tiles_for
from accelc.kernels.epilogue import activation_code, apply_activation
from accelc.kernels.flash_decoding import LOG2E, combine_rows, combine_tiles, dot_in_fp32
from accelc.kernels.primitives import sm_count
from accelc.kernels.primitives import softmax_update
from accelc.kernels.qkv_rotary import rotate_and_store


@triton.jit
def _spin(counter_ptr, idx, need):
    """Wait until counter idx reaches need (idx < 0: nothing to wait for)."""
    if idx >= 0:
        while tl.atomic_add(counter_ptr + idx, 0, sem="acquire", scope="gpu") < need:
            pass


@triton.jit
def _done(counter_ptr, idx):
    """Every thread's stores of this task made, then counted (release)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr + idx, 1, sem="release", scope="gpu")


@triton.jit
def _ptr(tab_ptr, i, like):
    """Entry i of the pointer table (int64 addresses) as a pointer to like's element type."""
    return tl.load(tab_ptr + i).to(tl.pointer_type(like.dtype.element_ty))


@triton.jit
def _gemv2(x_ptr, nw_ptr, w_ptr, rows_a, rows_b, ok, K, counter_ptr, wait_idx, wait_n,
           NORM: tl.constexpr, TWO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """(sum_k x'[k] w[rows_a, k], the same for rows_b where TWO, x's sum of squares), fp32, x' = x * the norm's
    weight where NORM. The first weight block is loaded before the wait (no task writes weights), x after it."""
    offs_k = tl.arange(0, BLOCK_K)
    wa_ptrs = w_ptr + rows_a.to(tl.int64)[:, None] * K + offs_k[None, :]
    wb_ptrs = w_ptr + rows_b.to(tl.int64)[:, None] * K + offs_k[None, :]
    in_k = ok[:, None] & (offs_k[None, :] < K)
    wa = tl.load(wa_ptrs, mask=in_k, other=0.0)
    wb = wa
    if TWO:
        wb = tl.load(wb_ptrs, mask=in_k, other=0.0)
    _spin(counter_ptr, wait_idx, wait_n)
    acc_a = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    acc_b = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    ss = tl.zeros((BLOCK_K,), tl.float32)
    for k in range(0, K, BLOCK_K):
        if k > 0:
            in_k = ok[:, None] & (offs_k[None, :] < K - k)
            wa = tl.load(wa_ptrs + k, mask=in_k, other=0.0)
            if TWO:
                wb = tl.load(wb_ptrs + k, mask=in_k, other=0.0)
        xk = tl.load(x_ptr + k + offs_k, mask=offs_k < K - k, other=0.0, cache_modifier=".cg").to(tl.float32)
        if NORM:
            ss += xk * xk
            xk = xk * tl.load(nw_ptr + k + offs_k, mask=offs_k < K - k, other=0.0).to(tl.float32)
        acc_a += xk[None, :] * wa.to(tl.float32)
        if TWO:
            acc_b += xk[None, :] * wb.to(tl.float32)
    return tl.sum(acc_a, 1), tl.sum(acc_b, 1), tl.sum(ss, 0)


@triton.jit
def _attend(q_ptr, cache_ptr, mask_ptr, mask_stride, extent_ptr, pacc_ptr, pml_ptr, g, s, SPLITS, GROUP,
            sc0, sc2, sc3, sc4, qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_KEYS: tl.constexpr, DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Split s of kv head g: the group's q heads over its keys (online softmax in base 2, flash_decoding's), the
    partial row max, sum and accumulator stored where combine_rows reads them."""
    rows = tl.arange(0, BLOCK_M)
    r_ok = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(q_ptr + (g * GROUP + rows)[:, None] * D + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0, cache_modifier=".cg")
    S = tl.load(extent_ptr, cache_modifier=".cg")
    per = tl.cdiv(tl.cdiv(S, SPLITS), BLOCK_KEYS) * BLOCK_KEYS
    lo = s * per
    hi = tl.minimum(lo + per, S)
    k_base = cache_ptr + g * sc2
    v_base = k_base + sc0
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_KEYS):
        offs_n = start + tl.arange(0, BLOCK_KEYS)
        n_ok = offs_n < hi
        keep = (tl.load(mask_ptr + offs_n * mask_stride, mask=n_ok, other=0) != 0) & n_ok
        kt = tl.load(k_base + offs_n[None, :] * sc3 + offs_d[:, None] * sc4, mask=d_ok[:, None] & n_ok[None, :],
                     other=0.0, cache_modifier=".cg")
        v = tl.load(v_base + offs_n[:, None] * sc3 + offs_d[None, :] * sc4, mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0, cache_modifier=".cg")
        if DOT_IN_FP32:
            qk = tl.dot(q.to(tl.float32), kt.to(tl.float32))
        else:
            qk = tl.dot(q, kt, input_precision=PRECISION)
        qk = tl.where(keep[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
        acc, l_i, m_i = softmax_update(acc, l_i, m_i, m_new, m_sub, p, v, DOT_IN_FP32, PRECISION)
    slot = g * SPLITS + s
    tl.store(pacc_ptr + (slot * BLOCK_M + rows[:, None]) * BLOCK_D + offs_d[None, :], acc)
    tl.store(pml_ptr + (slot * 2) * BLOCK_M + rows, m_i)
    tl.store(pml_ptr + (slot * 2 + 1) * BLOCK_M + rows, l_i)


@triton.jit
def decode_step_kernel(
    task_ptr, n_tasks, counter_ptr, n_counters, tab_ptr, x_ptr, cos_ptr, sin_ptr, cos_stride, sin_stride, pos_ptr,
    mask_ptr, mask_stride, fnorm_ptr, head_ptr, logits_ptr, q_ptr, attn_ptr, mid_ptr, out_ptr, act_ptr, kv_ptr,
    pacc_ptr, pml_ptr, extent_ptr, K, HQ, HKV, I, V, SMAX, sc0, sc2, sc3, sc4, eps1, eps2, eps_f, qk_scale, SPLITS,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GG: tl.constexpr, BLOCK_KEYS: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program pid's tasks of the list (see the module docstring). Counters: 5 a layer (QKV .. DOWN), PREP's
    (n_counters - 1), then HKV tickets and the programs-finished count."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tickets = counter_ptr + n_counters
    D = 2 * HALF
    GROUP = HQ // HKV
    for t in range(pid, n_tasks, nprog):
        kind = tl.load(task_ptr + t * 5)
        layer = tl.load(task_ptr + t * 5 + 1)
        tile = tl.load(task_ptr + t * 5 + 2)
        wait_idx = tl.load(task_ptr + t * 5 + 3)
        wait_n = tl.load(task_ptr + t * 5 + 4)
        base = layer * 8
        mine = layer * 5 + kind - 1          # this task's counter (QKV .. DOWN)
        h_ptr = out_ptr                      # the layer's input: the step's x at layer 0, else the last DOWN's
        if layer == 0:
            h_ptr = x_ptr
        if kind == 0:       # PREP: one past the last key the mask lets the token attend
            offs = tl.arange(0, 1024)
            last = tl.full((1024,), -1, tl.int32)
            for s0 in range(0, SMAX, 1024):
                keep = tl.load(mask_ptr + (s0 + offs) * mask_stride, mask=s0 + offs < SMAX, other=0) != 0
                last = tl.maximum(last, tl.where(keep, s0 + offs, -1))
            tl.store(extent_ptr, tl.max(last, 0) + 1)
            _done(counter_ptr, n_counters - 1)
        elif kind == 1:     # QKV
            offs_p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
            P = (HQ + 2 * HKV) * HALF
            pc = offs_p % P
            ra = (pc // HALF) * D + pc % HALF
            ya, yb, ss = _gemv2(h_ptr, _ptr(tab_ptr, base, x_ptr), _ptr(tab_ptr, base + 1, x_ptr), ra, ra + HALF,
                                offs_p < P, K, counter_ptr, wait_idx, wait_n, True, True, BLOCK_P, BLOCK_K)
            r = tl.rsqrt(ss / K + eps1)
            ya = ya * r
            yb = yb * r
            if HAS_BIAS:
                bias = _ptr(tab_ptr, base + 2, x_ptr)
                ya += tl.load(bias + ra).to(tl.float32)
                yb += tl.load(bias + ra + HALF).to(tl.float32)
            rotate_and_store(ya, yb, offs_p, 0, 0, 1, 1, HQ, HKV, SMAX, cos_ptr, sin_ptr, 0, 0, cos_stride, 0, 0,
                              sin_stride, pos_ptr, q_ptr, kv_ptr, _ptr(tab_ptr, base + 7, x_ptr), sc0, 0, sc2, sc3,
                              sc4, HALF)
            _done(counter_ptr, mine)
        elif kind == 2:     # ATTN (kv head g, split s); the last split of g to finish combines g's
            _spin(counter_ptr, wait_idx, wait_n)
            g = tile // SPLITS
            _attend(q_ptr, _ptr(tab_ptr, base + 7, x_ptr), mask_ptr, mask_stride, extent_ptr, pacc_ptr, pml_ptr, g,
                    tile % SPLITS, SPLITS, GROUP, sc0, sc2, sc3, sc4, qk_scale, D, BLOCK_D, BLOCK_M, BLOCK_KEYS,
                    DOT_IN_FP32, PRECISION)
            tl.debug_barrier()
            if tl.atomic_add(tickets + g, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                combine_rows(pacc_ptr, pml_ptr, attn_ptr, g, HKV, GROUP, 1, SPLITS, 0, D, 0, 1, D, BLOCK_D,
                              BLOCK_M, False, ROWS, CHUNK)
                tl.atomic_xchg(tickets + g, 0, sem="relaxed", scope="gpu")
                _done(counter_ptr, mine)
        elif kind == 3:     # OPROJ: + the layer's input
            rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = rows < K
            y, _b, _s = _gemv2(attn_ptr, attn_ptr, _ptr(tab_ptr, base + 3, x_ptr), rows, rows, ok, HQ * D,
                               counter_ptr, wait_idx, wait_n, False, False, BLOCK_N, BLOCK_K)
            y += tl.load(h_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(mid_ptr + rows, y.to(mid_ptr.dtype.element_ty), mask=ok)
            _done(counter_ptr, mine)
        elif kind == 4:     # GATEUP: GG groups of gated_linear.pack's interleaved rows (16 gate, then 16 up)
            e = tl.arange(0, GG * 16)
            grp = tile * GG + e // 16
            cols = grp * 16 + e % 16
            ok = cols < I
            g_sum, u_sum, ss = _gemv2(mid_ptr, _ptr(tab_ptr, base + 4, x_ptr), _ptr(tab_ptr, base + 5, x_ptr),
                                      grp * 32 + e % 16, grp * 32 + 16 + e % 16, ok, K, counter_ptr, wait_idx,
                                      wait_n, True, True, GG * 16, BLOCK_K)
            r = tl.rsqrt(ss / K + eps2)
            y = apply_activation(g_sum * r, ACTIVATION, False) * (u_sum * r)
            tl.store(act_ptr + cols, y.to(act_ptr.dtype.element_ty), mask=ok)
            _done(counter_ptr, mine)
        elif kind == 5:     # DOWN: + h2
            rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = rows < K
            y, _b, _s = _gemv2(act_ptr, act_ptr, _ptr(tab_ptr, base + 6, x_ptr), rows, rows, ok, I, counter_ptr,
                               wait_idx, wait_n, False, False, BLOCK_N, BLOCK_K)
            y += tl.load(mid_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=ok)
            _done(counter_ptr, mine)
        else:               # HEAD: the final norm and the LM head
            rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = rows < V
            y, _b, ss = _gemv2(out_ptr, fnorm_ptr, head_ptr, rows, rows, ok, K, counter_ptr, wait_idx, wait_n,
                               True, False, BLOCK_N, BLOCK_K)
            y = y * tl.rsqrt(ss / K + eps_f)
            tl.store(logits_ptr + rows, y.to(logits_ptr.dtype.element_ty), mask=ok)
    # the last program out sets every counter back to 0 (the others have finished: none reads one again)
    tl.debug_barrier()
    total = n_counters + HKV + 1
    if tl.atomic_add(counter_ptr + total - 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        offs = tl.arange(0, 1024)
        for c0 in range(0, total, 1024):
            tl.store(counter_ptr + c0 + offs, 0, mask=c0 + offs < total)



# ---- host side ------------------------------------------------------------------------------------------------

A_LAYER = 8        # the pointer table's entries a layer (the kernel's `base`): the six weights, b_qkv, the cache
MAX_PREPARED = 8   # steps whose tables and workspace are kept (a model's step is one; one stream at a time uses one)
_PREPARED: dict = {}


def _layer(weights, i: int, bias: bool) -> tuple:
    """Layer i's (attention norm, W_qkv, b_qkv or None, W_o, mlp norm, packed gate/up, W_down) from the op's flat
    list (7 a layer, b_qkv's place holding W_qkv where there is no bias)."""
    n1, w_qkv, b, w_o, n2, w_gu, w_down = weights[7 * i:7 * i + 7]
    return n1, w_qkv, b if bias else None, w_o, n2, w_gu, w_down


def why_unsupported(x, weights, caches, d: Dims) -> str | None:
    """Why the persistent kernel cannot take this step (the chain of kernels then runs it), or None."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {x.dtype}"
    if d.q_heads % d.kv_heads or d.head_dim % 2:
        return f"{d.q_heads} q heads over {d.kv_heads} kv heads of {d.head_dim}"
    strides = {c.stride() for c in caches}
    if len(strides) != 1 or any(c.shape != caches[0].shape or c.dtype != x.dtype for c in caches):
        return "the layers' caches differ in shape, strides or dtype"
    if any(w.dtype != x.dtype or not w.is_contiguous() or w.device != x.device for w in weights):
        return "a weight is not a contiguous tensor of x's dtype on its device"
    return None


def _prepared(x, weights, caches, final_norm, head, d: Dims, t: Tiles):
    """The step's pointer table, task list, counters (0) and workspace, made once; None where the kernel cannot take
    the step (why_unsupported, also asked once) or a CUDA graph is being captured before they exist (their
    host-to-device copies must not be captured)."""
    # (the table holds addresses, and the key is them: right for whatever tensors lie there; none is kept alive)
    key = (x.device, x.dtype, d, t, tuple(w.data_ptr() for w in (*weights, *caches, final_norm, head)))
    if key in _PREPARED:
        return _PREPARED[key]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    got = None if why_unsupported(x, weights, caches, d) is not None else _made(x, weights, caches, d, t)
    if len(_PREPARED) >= MAX_PREPARED:
        _PREPARED.pop(next(iter(_PREPARED)))
    _PREPARED[key] = got
    return got


def _made(x, weights, caches, d: Dims, t: Tiles) -> dict:
    """_prepared's tables, workspace and launch constants for a step the kernel takes."""
    dev, dt = x.device, x.dtype
    table = []
    for i in range(d.layers):
        n1, w_qkv, b, w_o, n2, w_gu, w_down = _layer(weights, i, True)
        table += [n1, w_qkv, b, w_o, n2, w_gu, w_down, caches[i]]
    block_d = triton.next_power_of_2(d.head_dim)
    group = d.q_heads // d.kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    rows, chunk = combine_tiles(group, block_d, t.splits)
    qd = d.q_heads * d.head_dim
    got = dict(
        table=torch.tensor([w.data_ptr() for w in table], dtype=torch.int64, device=dev),
        tasks=torch.tensor(schedule(d, t), dtype=torch.int32, device=dev).reshape(-1),
        counters=torch.zeros(counters_needed(d) + d.kv_heads + 1, dtype=torch.int32, device=dev),
        q=torch.empty(qd, dtype=dt, device=dev), attn=torch.empty(qd, dtype=dt, device=dev),
        mid=torch.empty(d.hidden, dtype=dt, device=dev), out=torch.empty(d.hidden, dtype=dt, device=dev),
        act=torch.empty(d.inter, dtype=dt, device=dev),
        kv=torch.empty(2 * d.kv_heads * d.head_dim, dtype=dt, device=dev),
        pacc=torch.empty(d.kv_heads * t.splits * block_m * block_d, dtype=torch.float32, device=dev),
        pml=torch.empty(d.kv_heads * t.splits * 2 * block_m, dtype=torch.float32, device=dev),
        extent=torch.empty(1, dtype=torch.int32, device=dev),
        const=dict(HALF=d.head_dim // 2, BLOCK_D=block_d, BLOCK_M=block_m, ROWS=rows, CHUNK=chunk, HAS_BIAS=d.bias,
                   ACTIVATION=activation_code(d.activation), BLOCK_P=t.pairs, BLOCK_N=t.rows, BLOCK_K=t.block_k,
                   GG=t.groups, BLOCK_KEYS=t.block_keys, DOT_IN_FP32=dot_in_fp32(x),
                   PRECISION="ieee" if dt == torch.float32 else "tf32", num_warps=t.warps, num_stages=1))
    return got


def tiles_of(x, d: Dims) -> Tiles:
    interpreted = runtime.interpreted()
    return tiles_for(d, 1 if interpreted else sm_count(x.device.index or 0), interpreted)


def _persistent(x, cos, sin, positions, mask, weights, caches, final_norm, head, d: Dims, eps, scale):
    """The step by the persistent kernel; None where it cannot run (the chain then does)."""
    t = tiles_of(x, d)
    p = _prepared(x, weights, caches, final_norm, head, d, t)
    if p is None:
        return None
    c = caches[0]
    row = mask.reshape(-1, mask.shape[-1])[-1]        # the token's row of the mask (batch 1, one query)
    cs, sn = cos.reshape(-1, d.head_dim), sin.reshape(-1, d.head_dim)
    logits = torch.empty((1, 1, d.vocab), dtype=x.dtype, device=x.device)
    n_tasks = p["tasks"].numel() // 5
    with runtime.device_guard(x):
        decode_step_kernel[(t.programs,)](
            p["tasks"], n_tasks, p["counters"], counters_needed(d), p["table"], x.reshape(-1).contiguous(), cs, sn,
            cs.stride(1), sn.stride(1), positions, row.view(torch.uint8), row.stride(0), final_norm, head, logits,
            p["q"], p["attn"], p["mid"], p["out"], p["act"], p["kv"], p["pacc"], p["pml"], p["extent"],
            d.hidden, d.q_heads, d.kv_heads, d.inter, d.vocab, d.max_len, c.stride(0), c.stride(2), c.stride(3),
            c.stride(4), float(eps[0]), float(eps[1]), float(eps[2]), float(scale) * LOG2E, t.splits, **p["const"])
    return logits


def _chain(x, cos, sin, positions, mask, weights, caches, final_norm, head, d: Dims, eps, scale):
    """The step as the chain of accelc kernels it replaces (any batch and length): five a layer, then the final
    norm and the LM head on the last position."""
    ops = torch.ops.accelc
    B, S, _ = x.shape
    h = x
    for i in range(d.layers):
        n1, w_qkv, b, w_o, n2, w_gu, w_down = _layer(weights, i, d.bias)
        q, _ = ops.qkv_rotary(x=h, weight=w_qkv, bias=b, cos=cos, sin=sin, cache=caches[i], positions=positions,
                              q_heads=d.q_heads, kv_heads=d.kv_heads, norm_weight=n1, norm_eps=eps[0])
        a = ops.flash_attention(q, caches[i][0], caches[i][1], mask, False, scale)
        h2 = ops.linear(a.transpose(1, 2).reshape(B, S, -1), w_o, None, h)
        g = ops.gated_linear(h2, w_gu, None, d.inter, d.activation, norm_weight=n2, norm_eps=eps[1])
        h = ops.linear(g, w_down, None, h2)
    return ops.linear(ops.rms_norm(h[:, -1:], final_norm, None, eps[2]), head)


def _one_token(x, mask) -> bool:
    return x.shape[0] * x.shape[1] == 1 and mask.dtype == torch.bool


def decode_step_launch(x, cos, sin, positions, mask, weights, caches, final_norm, head, dims, eps, scale):
    d = Dims.from_list(dims)
    if _one_token(x, mask):
        out = _persistent(x, cos, sin, positions, mask, weights, caches, final_norm, head, d, eps, scale)
        if out is not None:
            return out
    return _chain(x, cos, sin, positions, mask, weights, caches, final_norm, head, d, eps, scale)


def decode_step_ref(x, cos, sin, positions, mask, weights, caches, final_norm, head, dims, eps, scale):
    """One token: the task list run by the CPU executor (kernels/decode_schedule.run_tasks), in order; else the
    chain."""
    d = Dims.from_list(dims)
    if not _one_token(x, mask):
        return _chain(x, cos, sin, positions, mask, weights, caches, final_norm, head, d, eps, scale)
    D = d.head_dim
    st = Step(x=x.reshape(-1), cos=cos.reshape(-1, D)[-1], sin=sin.reshape(-1, D)[-1], position=int(positions[0]),
              mask=mask.reshape(-1, mask.shape[-1])[-1], layers=[_layer(weights, i, d.bias) for i in range(d.layers)],
              caches=caches, final_norm=final_norm, head=head, eps=tuple(eps), scale=float(scale))
    t = tiles_for(d, 1, True)
    return run_tasks(d, t, st).reshape(1, 1, -1)


@torch.library.custom_op("accelc::decode_step", mutates_args=("caches",))
def decode_step(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                weights: list[torch.Tensor], caches: list[torch.Tensor], final_norm: torch.Tensor, head: torch.Tensor,
                dims: list[int], eps: list[float], scale: float) -> torch.Tensor:
    """A Llama-like decoder's step from the embeddings to the last position's logits (B, 1, vocab), writing each
    layer's k / v into its cache: one token by the persistent kernel, else the chain of kernels (see the module
    docstring; accelc.persistent_step builds the call)."""
    return runtime.launch_or_fallback("decode_step", x.device, decode_step_launch, decode_step_ref, x, cos, sin,
                                      positions, mask, weights, caches, final_norm, head, dims, eps, scale)


@decode_step.register_fake
def _(x, cos, sin, positions, mask, weights, caches, final_norm, head, dims, eps, scale):
    return x.new_empty((x.shape[0], 1, dims[6]))


__all__ = ["decode_step", "decode_step_launch", "decode_step_ref", "why_unsupported"]
