"""A one-shot all-reduce over symmetric memory (accelc/fast_all_reduce.py), for the dtypes PyTorch's own one-shot
kernel does not take (its 2.11 build: fp32 and bf16, not fp16). Every rank's buffer of the group is mapped into
every rank's address space (symm_mem.rendezvous); `buf_ptrs` and `flag_ptrs` are device arrays of the ranks'
buffer and flag addresses. Program p of each rank:

  1. copies its slice of the input into its own buffer;
  2. meets program p of every other rank at a barrier: a flag a (program, sending rank) in each receiver's flag
     array, set 0 -> 1 by the sender (release, system scope; it waits while the flag is still 1, unconsumed) and
     taken back 1 -> 0 by the receiver (acquire): the peers' copies are then visible;
  3. sums the slice over every rank's buffer in fp32 (volatile loads: the peers' memory, written this launch) and
     writes it in the input's dtype;
  4. meets them again, so that no rank overwrites its buffer (the next all-reduce) while a peer still reads it.

The flags go back to 0 at every barrier, so the kernel is the same in every replay of a CUDA graph. Programs only
wait on their namesakes on other GPUs, never on programs of their own launch."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _barrier(flag_ptrs, rank, pid, WORLD: tl.constexpr):
    tl.debug_barrier()          # this program's memory operations before the signal (the release orders them)
    for p in tl.static_range(WORLD):
        peer = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        while tl.atomic_cas(peer + pid * WORLD + rank, 0, 1, sem="release", scope="sys") != 0:
            pass
    own = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        while tl.atomic_cas(own + pid * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()


@triton.jit
def one_shot_kernel(x_ptr, out_ptr, buf_ptrs, flag_ptrs, rank, N, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(x_ptr.dtype.element_ty))
    tl.store(mine + offs, tl.load(x_ptr + offs, mask=ok), mask=ok)
    _barrier(flag_ptrs, rank, pid, WORLD)
    acc = tl.zeros((BLOCK,), tl.float32)
    for p in tl.static_range(WORLD):
        theirs = tl.load(buf_ptrs + p).to(tl.pointer_type(x_ptr.dtype.element_ty))
        acc += tl.load(theirs + offs, mask=ok, other=0.0, volatile=True).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    _barrier(flag_ptrs, rank, pid, WORLD)


def flags_needed(max_elements: int, world: int) -> int:
    """int32 flags a rank's array holds: one a (program, rank)."""
    return triton.cdiv(max_elements, BLOCK) * world


def launch(x, out, buf_ptrs, flag_ptrs, rank: int, world: int) -> None:
    """out = the sum of x over the group's ranks (x contiguous, at most the buffers' size)."""
    n = x.numel()
    one_shot_kernel[(triton.cdiv(n, BLOCK),)](x, out, buf_ptrs, flag_ptrs, rank, n, WORLD=world, BLOCK=BLOCK,
                                               num_warps=8)
