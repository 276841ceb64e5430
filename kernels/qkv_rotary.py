"""accelc::qkv_rotary — a decoder layer's attention input in one kernel: the q / k / v projection (its RMSNorm
taken in, as accelc::linear takes it), the rotary embedding of q and k, and the write of k and v into the static
KV cache, which a decode step ran as four launches and more (#89: the GEMV, a rotary kernel for q and one for k,
the cache write's glue):

    y = norm(x) @ weight^T + bias,        weight (Hq*D + 2*Hkv*D, K): q's, k's and v's rows stacked
    q, k, v = y's heads (B, H, S, D)       (the heads split as HF's attention splits them: view + transpose)
    q, k = rope(q), rope(k)                rope(t) = t * cos + rotate_half(t) * sin (kernels/rotary.py)
    cache.index_copy_(3, positions, stack(k, v))      cache (2, B, Hkv, max_len, D): accelc.static_cache's
    returns (q, stack(k, v))              q (B, Hq, S, D) and the rows written (2, B, Hkv, S, D), contiguous

The rotation pairs column j of a head with column j + D/2, so one program computes both: it takes P pairs of
weight rows (head h, j) and (h, j + D/2), streams them over K beside x's row as accelc's one-row GEMV does
(kernels/gemm.py: gemv_row; the norm's squares summed in the same loop), and rotates the two sums in registers
before the one store of each value, where it belongs: q's output, or the cache at the row's position and the rows
written. v's heads are stored as they are. The rows written come back so the guard checks every value the layer
writes (the cache itself is the model's state); a position outside the cache writes nothing there (eager's
index_copy_ raises). Rows past GEMV_MAX_M (a prompt) run accelc::linear, then the rotation and stores as a second
kernel; so do all rows where q's and k's heads are RMS-normalized before their rotation (Qwen3's q_norm / k_norm:
q_norm, k_norm (D,), head_eps), a head a program of the second kernel, which takes each head's squares whole. Everything in fp32, rounded once (eager rounds the projection, then each product of the rotation).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from accelc import runtime
from accelc.compile_ahead import launch_kernel
from accelc.kernels import gemm
from accelc.kernels.pdl import enabled as pdl_enabled, wait_for_producers
from accelc.kernels.rotary import rotary_embedding_ref
from accelc.tuning import Tuner, check_once

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_D = 512


def _config(pairs: int, block_k: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_P": pairs, "BLOCK_K": block_k}, num_warps=warps, num_stages=1)


# two (BLOCK_P, BLOCK_K) fp32 accumulators a program: gemv_row's one-row candidates with half the rows each
CONFIGS = [_config(2, 1024, 4), _config(4, 512, 4), _config(4, 1024, 8), _config(8, 256, 4), _config(16, 128, 4),
           _config(16, 256, 8), _config(64, 32, 4)]


@triton.jit
def rotate_and_store(ya, yb, offs_p, b, s, B, S, HQ, HKV, SMAX, cos_ptr, sin_ptr, scb, scs, scd, ssb, sss, ssd,
                      pos_ptr, q_ptr, kv_ptr, cache_ptr, sc0, sc1, sc2, sc3, sc4, HALF: tl.constexpr):
    """The pairs offs_p (head h, column j and j + HALF) of row (b, s): ya, yb their projections (fp32, bias added);
    rotated where h is a q or k head, stored to q, or to the cache at the row's position and the rows written."""
    P = (HQ + 2 * HKV) * HALF
    ok = offs_p < P
    head = offs_p // HALF
    j = offs_p % HALF
    c = cos_ptr + b * scb + s * scs
    sn = sin_ptr + b * ssb + s * sss
    ca = tl.load(c + j * scd, mask=ok, other=1.0).to(tl.float32)
    cb = tl.load(c + (j + HALF) * scd, mask=ok, other=1.0).to(tl.float32)
    sa = tl.load(sn + j * ssd, mask=ok, other=0.0).to(tl.float32)
    sb = tl.load(sn + (j + HALF) * ssd, mask=ok, other=0.0).to(tl.float32)
    rot = head < HQ + HKV
    oa = tl.where(rot, ya * ca - yb * sa, ya)
    ob = tl.where(rot, yb * cb + ya * sb, yb)
    is_q = ok & (head < HQ)
    q_at = q_ptr + ((b * HQ + head) * S + s) * (2 * HALF) + j
    tl.store(q_at, oa.to(q_ptr.dtype.element_ty), mask=is_q)
    tl.store(q_at + HALF, ob.to(q_ptr.dtype.element_ty), mask=is_q)
    is_kv = ok & (head >= HQ)
    kvh = tl.where(is_kv, head - HQ, 0)
    t = kvh // HKV               # 0: k, 1: v
    hk = kvh % HKV
    kv_at = kv_ptr + (((t * B + b) * HKV + hk) * S + s) * (2 * HALF) + j
    tl.store(kv_at, oa.to(kv_ptr.dtype.element_ty), mask=is_kv)
    tl.store(kv_at + HALF, ob.to(kv_ptr.dtype.element_ty), mask=is_kv)
    pos = tl.load(pos_ptr + s + 0 * j).to(tl.int64)      # (one value, loaded as the pairs' vector)
    in_cache = is_kv & (pos >= 0) & (pos < SMAX)
    cache_at = cache_ptr + t * sc0 + b * sc1 + hk * sc2 + pos * sc3 + j * sc4
    tl.store(cache_at, oa.to(cache_ptr.dtype.element_ty), mask=in_cache)
    tl.store(cache_at + HALF * sc4, ob.to(cache_ptr.dtype.element_ty), mask=in_cache)


@triton.jit(do_not_specialize=["M", "S", "SMAX"])  # sizes that follow the batch, length or cache: one binary
def qkv_rotary_gemv_kernel(
    x_ptr, w_ptr, bias_ptr, norm_ptr, norm_eps, cos_ptr, sin_ptr, pos_ptr, q_ptr, kv_ptr, cache_ptr,
    M, S, K, HQ, HKV, SMAX, stride_xm, stride_xk, stride_wn, stride_wk,
    scb, scs, scd, ssb, sss, ssd, sc0, sc1, sc2, sc3, sc4,
    HALF: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (pid, row): BLOCK_P pairs of weight rows against x's row `row` (see the module docstring); the
    first K block of the weights loaded before waiting for x's producer (PDL), as gemv_row does."""
    pid = tl.program_id(0)
    row = tl.program_id(1)
    P = (HQ + 2 * HKV) * HALF
    offs_p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    pc = offs_p % P                       # (wrapped for the loads; the stores are masked)
    ra = (pc // HALF) * (2 * HALF) + pc % HALF
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = tl.broadcast_to(x_ptr + row * stride_xm + offs_k[None, :] * stride_xk, (BLOCK_P, BLOCK_K))
    wa_ptrs = w_ptr + ra[:, None] * stride_wn + offs_k[None, :] * stride_wk
    wb_ptrs = wa_ptrs + HALF * stride_wn
    wa = tl.load(wa_ptrs, mask=offs_k[None, :] < K, other=0.0)
    wb = tl.load(wb_ptrs, mask=offs_k[None, :] < K, other=0.0)
    if NORM:    # (the norm weight as x's values are laid out, and x's row once a block for its squares)
        n_ptrs = tl.broadcast_to(norm_ptr + offs_k[None, :], (BLOCK_P, BLOCK_K))
        nw = tl.load(n_ptrs, mask=offs_k[None, :] < K, other=0.0).to(tl.float32)
        x_row = x_ptr + row * stride_xm + offs_k * stride_xk
    wait_for_producers(PDL)
    a = tl.load(x_ptrs, mask=offs_k[None, :] < K, other=0.0).to(tl.float32)
    if NORM:
        xs = tl.load(x_row, mask=offs_k < K, other=0.0).to(tl.float32)
        ss = xs * xs
        a = a * nw
    acc_a = a * wa.to(tl.float32)
    acc_b = a * wb.to(tl.float32)
    for k in range(BLOCK_K, K, BLOCK_K):
        x_ptrs += BLOCK_K * stride_xk
        wa_ptrs += BLOCK_K * stride_wk
        wb_ptrs += BLOCK_K * stride_wk
        in_k = offs_k[None, :] < K - k
        if EVEN_K:
            a = tl.load(x_ptrs).to(tl.float32)
            wa = tl.load(wa_ptrs)
            wb = tl.load(wb_ptrs)
        else:
            a = tl.load(x_ptrs, mask=in_k, other=0.0).to(tl.float32)
            wa = tl.load(wa_ptrs, mask=in_k, other=0.0)
            wb = tl.load(wb_ptrs, mask=in_k, other=0.0)
        if NORM:
            x_row += BLOCK_K * stride_xk
            n_ptrs += BLOCK_K
            xs = tl.load(x_row, mask=offs_k < K - k, other=0.0).to(tl.float32)
            ss += xs * xs
            a = a * tl.load(n_ptrs, mask=in_k, other=0.0).to(tl.float32)
        acc_a += a * wa.to(tl.float32)
        acc_b += a * wb.to(tl.float32)
    ya = tl.sum(acc_a, axis=1)
    yb = tl.sum(acc_b, axis=1)
    if NORM:
        r = tl.rsqrt(tl.sum(ss, axis=0) / K + norm_eps)
        ya = ya * r
        yb = yb * r
    if HAS_BIAS:
        ya += tl.load(bias_ptr + ra).to(tl.float32)
        yb += tl.load(bias_ptr + ra + HALF).to(tl.float32)
    rotate_and_store(ya, yb, offs_p, row // S, row % S, M // S, S, HQ, HKV, SMAX, cos_ptr, sin_ptr,
                      scb, scs, scd, ssb, sss, ssd, pos_ptr, q_ptr, kv_ptr, cache_ptr, sc0, sc1, sc2, sc3, sc4, HALF)


@triton.jit(do_not_specialize=["M", "S", "SMAX"])
def rotary_store_kernel(
    y_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kv_ptr, cache_ptr, qn_ptr, kn_ptr, head_eps, M, S, HQ, HKV, SMAX,
    stride_ym, scb, scs, scd, ssb, sss, ssd, sc0, sc1, sc2, sc3, sc4, HALF: tl.constexpr, BLOCK_P: tl.constexpr,
    HEAD_NORM: tl.constexpr = False,
):
    """The projection `y` (M, N) made by accelc::linear (a prompt's rows; with HEAD_NORM, every row), rotated and
    stored as the GEMV stores. HEAD_NORM: q's and k's heads first RMS-normalized over their D columns (Qwen3's
    q_norm / k_norm, weights qn and kn (D,), eps head_eps), one head a program (BLOCK_P = HALF)."""
    row = tl.program_id(1)
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    P = (HQ + 2 * HKV) * HALF
    pc = offs_p % P
    ra = (pc // HALF) * (2 * HALF) + pc % HALF
    ya = tl.load(y_ptr + row * stride_ym + ra).to(tl.float32)
    yb = tl.load(y_ptr + row * stride_ym + ra + HALF).to(tl.float32)
    if HEAD_NORM:       # (the program's pairs: one head's, columns j and j + HALF)
        head = tl.program_id(0)
        j = tl.arange(0, BLOCK_P)
        r = tl.rsqrt((tl.sum(ya * ya, axis=0) + tl.sum(yb * yb, axis=0)) / (2 * HALF) + head_eps)
        is_q = head < HQ
        wa = tl.where(is_q, tl.load(qn_ptr + j), tl.load(kn_ptr + j)).to(tl.float32)
        wb = tl.where(is_q, tl.load(qn_ptr + j + HALF), tl.load(kn_ptr + j + HALF)).to(tl.float32)
        normed = head < HQ + HKV
        ya = tl.where(normed, ya * r * wa, ya)
        yb = tl.where(normed, yb * r * wb, yb)
    rotate_and_store(ya, yb, offs_p, row // S, row % S, M // S, S, HQ, HKV, SMAX, cos_ptr, sin_ptr,
                      scb, scs, scd, ssb, sss, ssd, pos_ptr, q_ptr, kv_ptr, cache_ptr, sc0, sc1, sc2, sc3, sc4, HALF)


def _default(sizes: dict) -> triton.Config:
    return _config(16, 128, 4)


def _interpreter(sizes: dict) -> triton.Config:
    """Few, wide programs: the interpreter's time goes by the operation, not by the element."""
    return _config(min(128, triton.next_power_of_2(max(1, sizes["N"] // 2))),
                   min(128, triton.next_power_of_2(max(1, sizes["K"]))), 1)


def _prune(configs, sizes):
    k = triton.next_power_of_2(max(1, sizes["K"]))
    return [c for c in configs if c.kwargs["BLOCK_K"] <= max(32, k)] or [_default(sizes)]


TUNER = Tuner("qkv_rotary", qkv_rotary_gemv_kernel, CONFIGS, prune=_prune, default=_default,
              interpreter=_interpreter)


def _heads(cache, q_heads: int, kv_heads: int):
    """(the head dim, the projection's width) of a layer writing `cache`."""
    D = cache.shape[-1]
    return D, (q_heads + 2 * kv_heads) * D


def why_unsupported(x, weight, bias, cos, sin, cache, positions, q_heads: int, kv_heads: int,
                    norm_weight=None, norm_eps=None, q_norm=None, k_norm=None, head_eps=None) -> str | None:
    """Why accelc::qkv_rotary cannot take these operands, or None (meta tensors are fine)."""
    if x.dim() != 3:
        return f"x has {x.dim()} dims (batch, length, features are supported)"
    if cache.dim() != 5 or cache.shape[0] != 2:
        return f"the cache has shape {tuple(cache.shape)} (2, batch, kv heads, length, head dim is supported)"
    B, S, K = x.shape
    D, N = _heads(cache, q_heads, kv_heads)
    if D % 2 or D > MAX_D:
        return f"the head dim is {D} (an even size up to {MAX_D} is supported)"
    if weight.dim() != 2 or tuple(weight.shape) != (N, K):
        return f"the weight has shape {tuple(weight.shape)}, not ({N}, {K}) for {q_heads} + 2 x {kv_heads} heads of {D}"
    if tuple(cache.shape[1:3]) != (B, kv_heads):
        return f"the cache {tuple(cache.shape)} does not hold {B} sequences of {kv_heads} kv heads"
    if bias is not None and tuple(bias.shape) != (N,):
        return f"the bias has shape {tuple(bias.shape)}, not ({N},)"
    if tuple(positions.shape) != (S,) or positions.dtype not in (torch.int64, torch.int32):
        return f"positions {tuple(positions.shape)} {positions.dtype} are not {S} integer indices"
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 4 or t.shape[1] != 1 or t.shape[0] not in (1, B) or tuple(t.shape[2:]) != (S, D):
            return f"{name} has shape {tuple(t.shape)} ((batch or 1, 1, {S}, {D}) is supported)"
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("cos", cos), ("sin", sin), ("cache", cache),
                    ("norm weight", norm_weight)):
        if t is None:
            continue
        if t.dtype != x.dtype or x.dtype not in SUPPORTED_DTYPES:
            return f"{name} has dtype {t.dtype} (all of fp16, bf16 or all fp32 are supported, x's is {x.dtype})"
        if t.device != x.device:
            return f"{name} is on {t.device} but x is on {x.device}"
    if positions.device != x.device:
        return f"positions are on {positions.device} but x is on {x.device}"
    if (norm_weight is None) != (norm_eps is None) or norm_weight is not None and tuple(norm_weight.shape) != (K,):
        return "the norm takes a (K,) weight and an eps together"
    heads = (q_norm, k_norm, head_eps)
    if any(h is not None for h in heads):
        if any(h is None for h in heads) or tuple(q_norm.shape) != (D,) or tuple(k_norm.shape) != (D,):
            return "the heads' norms take q's and k's (D,) weights and an eps together"
        if D // 2 & (D // 2 - 1):
            return f"the heads' norms take a head dim of twice a power of two, not {D}"
        for name, t in (("q's norm weight", q_norm), ("k's norm weight", k_norm)):
            if t.dtype != x.dtype or t.device != x.device:
                return f"{name} is {t.dtype} on {t.device}, x {x.dtype} on {x.device}"
    return None


_CHECKED: set = set()


def _broadcast_strides(t: torch.Tensor) -> tuple:
    """cos / sin (B or 1, 1, S, D): the strides of their batch (0 where 1), length and column dims."""
    return (0 if t.shape[0] == 1 else t.stride(0), t.stride(2), t.stride(3))


def qkv_rotary_launch(x, weight, bias, cos, sin, cache, positions, q_heads: int, kv_heads: int,
                      norm_weight=None, norm_eps=None, q_norm=None, k_norm=None, head_eps=None):
    sig = tuple(None if t is None else (t.shape, t.dtype, t.device)
                for t in (x, weight, bias, cos, sin, cache, positions, norm_weight, q_norm, k_norm)) + (q_heads, kv_heads)
    check_once(_CHECKED, sig, lambda: why_unsupported(x, weight, bias, cos, sin, cache, positions, q_heads, kv_heads,
                                                      norm_weight, norm_eps, q_norm, k_norm, head_eps), "qkv_rotary")
    B, S, K = x.shape
    D, N = _heads(cache, q_heads, kv_heads)
    q = torch.empty((B, q_heads, S, D), dtype=x.dtype, device=x.device)
    kv = torch.empty((2, B, kv_heads, S, D), dtype=x.dtype, device=x.device)
    M, P = B * S, N // 2
    if M == 0:
        return q, kv
    common = (*_broadcast_strides(cos), *_broadcast_strides(sin), *cache.stride())
    with runtime.device_guard(x):
        heads = q_norm is not None
        if M > gemm.GEMV_MAX_M or K == 0 or heads:   # a prompt, or heads normalized: the GEMM or GEMV, then the rest
            y = gemm.linear_launch(x, weight, bias, norm_weight=norm_weight, norm_eps=norm_eps).reshape(M, N)
            block = D // 2 if heads else min(128, triton.next_power_of_2(P))
            launch_kernel(rotary_store_kernel, (triton.cdiv(P, block), M),
                          (y, cos, sin, positions, q, kv, cache, q_norm if heads else y, k_norm if heads else y,
                           float(head_eps or 0.0), M, S, q_heads, kv_heads, cache.shape[3], y.stride(0), *common),
                          dict(HALF=D // 2, BLOCK_P=block, HEAD_NORM=heads))
            return q, kv
        x2 = x.reshape(M, K)
        pdl = pdl_enabled(x.device)
        args = (x2, weight, bias if bias is not None else q, norm_weight if norm_weight is not None else q,
                float(norm_eps or 0.0), cos, sin, positions, q, kv, cache, M, S, K, q_heads, kv_heads, cache.shape[3],
                x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), *common)

        def constexprs(cfg):
            return dict(HALF=D // 2, HAS_BIAS=bias is not None, NORM=norm_weight is not None,
                        EVEN_K=K % cfg.kwargs["BLOCK_K"] == 0, **cfg.kwargs, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages, **({"PDL": True, "launch_pdl": True} if pdl else {}))

        def grid(cfg):
            return (triton.cdiv(P, cfg.kwargs["BLOCK_P"]), M)

        key = (triton.next_power_of_2(M), N, K, D, x.dtype, norm_weight is not None, bias is not None)
        cfg = TUNER.pick(key, dict(M=M, N=N, K=K), lambda c: launch_kernel(qkv_rotary_gemv_kernel, grid(c), args,
                                                                           constexprs(c)))
        launch_kernel(qkv_rotary_gemv_kernel, grid(cfg), args, constexprs(cfg))
    return q, kv


def qkv_rotary_ref(x, weight, bias, cos, sin, cache, positions, q_heads: int, kv_heads: int,
                   norm_weight=None, norm_eps=None, q_norm=None, k_norm=None, head_eps=None):
    """The layer as the model and accelc's static cache write it (see the module docstring), in the operands'
    dtypes: the projection (accelc::linear's reference), the heads split (and normalized), rotated and written."""
    B, S, _ = x.shape
    D = cache.shape[-1]
    y = gemm.linear_ref(x, weight, bias, norm_weight=norm_weight, norm_eps=norm_eps)
    q, k, v = (t.reshape(B, S, -1, D) for t in y.split((q_heads * D, kv_heads * D, kv_heads * D), dim=-1))
    if q_norm is not None:      # (in fp32, as the models' norms compute; fp64 for fp64)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        q, k = (gemm.rms_normed_ref(t, w, head_eps, acc).to(t.dtype) for t, w in ((q, q_norm), (k, k_norm)))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kv = torch.stack((rotary_embedding_ref(k, cos, sin), v))
    cache.index_copy_(3, positions, kv)
    return rotary_embedding_ref(q, cos, sin).contiguous(), kv.contiguous()


@torch.library.custom_op("accelc::qkv_rotary", mutates_args=("cache",))
def qkv_rotary(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, q_heads: int, kv_heads: int,
               norm_weight: torch.Tensor | None = None, norm_eps: float | None = None,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
               head_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The q / k / v projection, q's and k's rotation and the cache write in one kernel: see the module docstring."""
    return runtime.launch_or_fallback("qkv_rotary", x.device, qkv_rotary_launch, qkv_rotary_ref, x, weight, bias,
                                      cos, sin, cache, positions, q_heads, kv_heads, norm_weight, norm_eps, q_norm,
                                      k_norm, head_eps)


@qkv_rotary.register_fake
def _(x, weight, bias, cos, sin, cache, positions, q_heads, kv_heads, norm_weight=None, norm_eps=None, q_norm=None,
      k_norm=None, head_eps=None):
    B, S, _ = x.shape
    D = cache.shape[-1]
    return x.new_empty((B, q_heads, S, D)), x.new_empty((2, B, kv_heads, S, D))


__all__ = ["qkv_rotary", "qkv_rotary_launch", "qkv_rotary_ref", "why_unsupported"]
