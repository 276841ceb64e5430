"""A one-shot all-reduce over symmetric memory (accelc/fast_all_reduce.py), for the dtypes PyTorch's own one-shot
kernel does not take (its 2.11 build: fp32 and bf16, not fp16). Every rank's buffer of the group is mapped into
every rank's address space (symm_mem.rendezvous); `buf_ptrs` and `flag_ptrs` are device arrays of the ranks'
buffer and flag addresses. Program p of each rank:

  1. copies its slice of the input into its own buffer;
  2. meets program p of every other rank at a barrier: a flag a (barrier, program, sending rank) in each
     receiver's flag array, set 0 -> 1 by the sender (release, system scope; by compare-and-swap, waiting while the
     flag is still 1, unconsumed, or with SIGNAL_BY_STORE by a plain exchange, no round trip) and taken back
     1 -> 0 by the receiver (acquire): the peers' copies are then visible;
  3. sums the slice over every rank's buffer in fp32 (volatile loads: the peers' memory, written this launch) and
     writes it in the input's dtype;
  4. meets them again, so that no rank overwrites its buffer (the next all-reduce) while a peer still reads it.

The flags go back to 0 at every barrier, so the kernel is the same in every replay of a CUDA graph. Programs only
wait on their namesakes on other GPUs, never on programs of their own launch. The two barriers have flags of their
own, which is what lets a sender signal without checking: a flag is never set twice unconsumed, since setting a
rank's start flag again takes that rank's end signal of the call before (sent after it consumed the start flag),
and setting its end flag again takes its start signal of the next call (sent after it consumed the end flag).
SIGNAL_BY_STORE signals so (bench/all_reduce.py's A/B: 1.2-1.9 us faster a call than compare-and-swap on 2 H200s,
every sum as NCCL's).

COUNTED_SIGNALS (off until bench/all_reduce.py has timed it on the GPU): the exchange still waits for the peer's
reply (atom.exch returns the old value). Instead each sender adds 1 to its flag in the receiver (an atomic add whose
result is not read: `red`, posted, no round trip), and each receiver waits until that flag reaches this call's count,
the program's own counter of its calls (kept beside the flags, one more each call; int32 arithmetic that wraps, the
flag compared by its difference). Nothing is reset, and these flags are their own (past the others), so the modes
can follow one another on one array."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 2048
SIGNAL_BY_STORE = True      # the senders' signal by exchange instead of compare-and-swap (no wait for it to be free)
COUNTED_SIGNALS = False     # the senders' signal by a counted add, no reply awaited (above)


@triton.jit
def _barrier(flag_ptrs, base, rank, WORLD: tl.constexpr, BY_STORE: tl.constexpr):
    """base: this barrier's and program's first flag (a flag a sending rank follows)."""
    tl.debug_barrier()          # this program's memory operations before the signal (the release orders them)
    for p in tl.static_range(WORLD):
        peer = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        if BY_STORE:
            tl.atomic_xchg(peer + base + rank, 1, sem="release", scope="sys")
        else:
            while tl.atomic_cas(peer + base + rank, 0, 1, sem="release", scope="sys") != 0:
                pass
    own = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        while tl.atomic_cas(own + base + p, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()


@triton.jit
def _counted_barrier(flag_ptrs, own, base, rank, count, WORLD: tl.constexpr):
    """COUNTED_SIGNALS' barrier: base as _barrier's; own: this rank's flags; count: this call's, the flags' value
    once every sender signalled it."""
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        peer = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        tl.atomic_add(peer + base + rank, 1, sem="release", scope="sys")        # (result unread: red, posted)
    for p in tl.static_range(WORLD):
        while tl.atomic_add(own + base + p, 0, sem="acquire", scope="sys") - count < 0:
            pass
    tl.debug_barrier()


@triton.jit
def one_shot_kernel(x_ptr, out_ptr, buf_ptrs, flag_ptrs, rank, N, END, WORLD: tl.constexpr,
                    BLOCK: tl.constexpr, BY_STORE: tl.constexpr, COUNT: tl.constexpr):
    """END: the end barrier's first flag, past the start barrier's flags of the largest launch (the same in every
    launch, whatever its size: a program's flags are its own in every call). COUNT (COUNTED_SIGNALS): the barriers'
    flags past those, from 2 END on (start, then end at 3 END), each program's count of its calls at 4 END."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(x_ptr.dtype.element_ty))
    tl.store(mine + offs, tl.load(x_ptr + offs, mask=ok), mask=ok)
    if COUNT:
        own = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
        count = tl.load(own + 4 * END + pid) + 1
        _counted_barrier(flag_ptrs, own, 2 * END + pid * WORLD, rank, count, WORLD)   # the start barrier's flags
    else:
        _barrier(flag_ptrs, pid * WORLD, rank, WORLD, BY_STORE)
    acc = tl.zeros((BLOCK,), tl.float32)
    for p in tl.static_range(WORLD):
        theirs = tl.load(buf_ptrs + p).to(tl.pointer_type(x_ptr.dtype.element_ty))
        acc += tl.load(theirs + offs, mask=ok, other=0.0, volatile=True).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    if COUNT:
        _counted_barrier(flag_ptrs, own, 3 * END + pid * WORLD, rank, count, WORLD)   # the end barrier's
        tl.store(own + 4 * END + pid, count)
    else:
        _barrier(flag_ptrs, END + pid * WORLD, rank, WORLD, BY_STORE)


def _programs(max_elements: int) -> int:
    return triton.cdiv(max_elements, BLOCK)


def flags_needed(max_elements: int, world: int) -> int:
    """int32 flags a rank's array holds, for a launch of up to max_elements: one a (barrier, program, rank) for the
    flags reset each call, as many for the counted ones, and a count a program."""
    return 4 * _programs(max_elements) * world + _programs(max_elements)


def launch(x, out, buf_ptrs, flag_ptrs, rank: int, world: int, max_elements: int) -> None:
    """out = the sum of x over the group's ranks (x contiguous, at most the buffers' max_elements; the flag array
    flags_needed(max_elements, world) long)."""
    n = x.numel()
    one_shot_kernel[(triton.cdiv(n, BLOCK),)](x, out, buf_ptrs, flag_ptrs, rank, n, _programs(max_elements) * world,
                                               WORLD=world, BLOCK=BLOCK, BY_STORE=SIGNAL_BY_STORE,
                                               COUNT=COUNTED_SIGNALS, num_warps=8)
