"""The bookkeeping of accelc's greedy decoding loop between two decode steps (accelc.generation), in
one small kernel each instead of PyTorch's one per op.

After each step's argmax the loop did, in PyTorch: the token of a finished row set to the pad, the
rows that hit a stop token marked finished, whether all are finished recorded, the token stored in
the output; and the static cache's next inputs written: the key padding mask's new column, the
position of each row, the step's start. Thirteen kernels and device copies of about a microsecond
and their launch gaps: about 30 us from the argmax to the step's input copies on an H100, where a
Llama-3-8B decode step is ~5.8 ms and a Qwen2-0.5B one ~1 ms (with these two kernels, about a
quarter of that). Here:
  - pick(token, finished, eos, pad, out, done, i): the first four, in place;
  - static_inputs(token, ids, keys, positions, count, start, column, i): the second, in place.
Each is one program over the batch (the rows of a generate call: up to the cache's batch).
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from accelc import runtime

log = logging.getLogger("accelc")


# the step index, the cache column and the call's sizes unspecialized: Triton tells 1, multiples of 16 and other
# integers apart, so the loop's first steps compiled this kernel four times and _inputs_kernel three (7 compiles,
# 1.7 s of a cold Qwen2-0.5B LM optimize's first generate, H200: diag_workers.py); one binary each now
@triton.jit(do_not_specialize=["B", "E", "pad", "i", "out_stride"])
def _pick_kernel(token_ptr, finished_ptr, eos_ptr, out_ptr, done_ptr, B, E, pad, i, out_stride,
                 HAS_EOS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.arange(0, BLOCK_B)
    ok = b < B
    tok = tl.load(token_ptr + b, mask=ok, other=0)
    if HAS_EOS:
        fin = tl.load(finished_ptr + b, mask=ok, other=1) != 0
        tok = tl.where(fin, pad, tok)
        e = tl.arange(0, BLOCK_E)
        eos = tl.load(eos_ptr + e, mask=e < E, other=0)
        hit = tl.sum(((tok[:, None] == eos[None, :]) & (e[None, :] < E)).to(tl.int32), 1) > 0
        fin = fin | hit
        tl.store(finished_ptr + b, fin, mask=ok)
        tl.store(token_ptr + b, tok, mask=ok)
        every = tl.min(tl.where(ok, fin.to(tl.int32), 1), 0)
        tl.store(done_ptr + i, every != 0)
    tl.store(out_ptr + b * out_stride + i, tok, mask=ok)


@triton.jit(do_not_specialize=["B", "column", "i", "keys_stride"])
def _inputs_kernel(token_ptr, ids_ptr, keys_ptr, pos_ptr, count_ptr, start_ptr, B, column, i, keys_stride,
                   BLOCK_B: tl.constexpr):
    b = tl.arange(0, BLOCK_B)
    ok = b < B
    tl.store(ids_ptr + b, tl.load(token_ptr + b, mask=ok, other=0), mask=ok)
    tl.store(keys_ptr + b.to(tl.int64) * keys_stride + column, tl.full([BLOCK_B], 1, tl.int64), mask=ok)
    tl.store(pos_ptr + b, tl.load(count_ptr + b, mask=ok, other=0) + i, mask=ok)
    tl.store(start_ptr + b * 0, tl.full([BLOCK_B], column, tl.int64), mask=b == 0)


def pick(token: torch.Tensor, finished: torch.Tensor, eos: torch.Tensor | None, pad: int, out: torch.Tensor,
         done: torch.Tensor, i: int) -> None:
    """In place, as this PyTorch does:
        if eos is not None:
            token[:] = torch.where(finished, pad, token); finished |= torch.isin(token, eos)
            done[i] = finished.all()
        out[:, i] = token
    token (B,) int64, finished (B,) bool, eos (E,) int64 or None, out (B, new) int64, done (new,) bool."""
    B = token.shape[0]
    if not runtime.can_run_on(token.device) or token.stride(0) != 1 or out.stride(1) != 1 or (eos is not None and eos.numel() == 0):
        if eos is not None:
            token.copy_(torch.where(finished, pad, token))
            finished |= torch.isin(token, eos)
            done[i] = finished.all()
        out[:, i] = token
        return
    has_eos = eos is not None
    eos_ = eos if has_eos else token
    with runtime.device_guard(token):
        _pick_kernel[(1,)](token, finished, eos_, out, done, B, eos_.numel(), pad, i, out.stride(0),
                           HAS_EOS=has_eos, BLOCK_B=max(16, triton.next_power_of_2(B)),
                           BLOCK_E=max(16, triton.next_power_of_2(eos_.numel())), num_warps=4)


def static_inputs(token: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                  count: torch.Tensor, start: torch.Tensor, column: int, i: int) -> None:
    """In place, as this PyTorch does: ids[:, 0] = token; keys[:, column] = 1; positions[:, 0] = count + i;
    start.fill_(column). token, count (B,) int64; ids, positions (B, 1), keys (B, L) int64; start () int64."""
    B = token.shape[0]
    tensors = (token, ids, keys, positions, count, start)
    contiguous = all(t.is_contiguous() for t in tensors if t is not keys) and keys.stride(1) == 1
    if not runtime.can_run_on(token.device) or not contiguous or any(t.dtype != torch.int64 for t in tensors):
        ids[:, 0] = token
        keys[:, column] = 1
        positions[:, 0] = count + i
        start.fill_(column)
        return
    with runtime.device_guard(token):
        _inputs_kernel[(1,)](token, ids, keys, positions, count, start, B, column, i, keys.stride(0),
                             BLOCK_B=max(16, triton.next_power_of_2(B)), num_warps=4)


def loop_ahead(logits: torch.Tensor, stops: int, static: bool = True):
    """The loop's kernels at a generation's sizes handed to the compile workers at once, not waited for
    (compile_workers.Pending, or None where no workers run): the argmax over logits like `logits` (a step's
    output, (rows, vocabulary)), pick with `stops` stop tokens (0: none) and, for a static cache, static_inputs.
    The loop launches each only after the one before, so in a cold process each compile was a wait of its own
    (four of ~0.45 s at the end of a cold causal LM optimize, its speed's measurement: diag_workers.py, H200). The
    launches here, on stand-in tensors of those sizes, compile nothing and run nothing not compiled already
    (compile_workers.handing_over); their kernels then load from the workers' compiles."""
    from accelc import compile_workers
    from accelc.kernels.argmax import argmax_rows

    if logits.dim() != 2 or not compile_workers.active() or not runtime.can_run_on(logits.device):
        return None
    B, device, long = logits.shape[0], logits.device, torch.int64
    try:
        with compile_workers.handing_over() as found:
            token = argmax_rows(torch.empty(B, logits.shape[1], dtype=logits.dtype, device=device))   # (int64)
            eos = torch.zeros(stops, dtype=long, device=device) if stops else None
            pick(token, torch.zeros(B, dtype=torch.bool, device=device), eos, 0,
                 torch.empty(B, 2, dtype=long, device=device), torch.zeros(2, dtype=torch.bool, device=device), 0)
            if static:
                static_inputs(token, torch.empty(B, 1, dtype=long, device=device),
                              torch.zeros(B, 16, dtype=long, device=device), torch.empty(B, 1, dtype=long, device=device),
                              torch.zeros(B, dtype=long, device=device), torch.zeros((), dtype=long, device=device), 1, 0)
        return compile_workers.submit(found) if found else None
    except Exception as e:    # nothing here is a result: the loop compiles what it meets
        log.debug("accelc: the greedy loop's kernels not compiled ahead: %s", e)
        return None
