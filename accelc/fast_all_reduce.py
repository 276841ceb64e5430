"""Small all-reduces by PyTorch's symmetric memory: a decode step's tensor-parallel all-reduces are one row a
sequence (8 KB for a 4096-wide fp16 model) and bound by latency, where NCCL's ring takes several steps and a
one-shot all-reduce one: each rank copies its tensor into a buffer every rank of the group can read (symmetric
memory, rendezvoused once), waits for the others at a barrier in the kernel, and sums the ranks' copies itself
(torch.ops.symm_mem.one_shot_all_reduce_copy_out; for a dtype it does not take, kernels/all_reduce.py's, the same
algorithm in Triton). Both are capturable: a step program's CUDA graphs record them as they record NCCL's.

Taken for CUDA tensors up to MAX_BYTES whose group's buffer exists; everything else, and every call while the
buffer cannot be had (a PyTorch without symmetric memory, a GPU pair without peer access, a probe that does not sum
as NCCL does: said once in the log), goes to NCCL's all-reduce. The buffer is made at the first all-reduce of a group and dtype outside a CUDA graph's
capture: every rank of a group calls its collectives in the same order, so every rank makes it at the same call
(the rendezvous is itself a collective). ACCELC_TP_ALL_REDUCE=nccl keeps every all-reduce on NCCL (the A/B of
bench/tp.py)."""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("accelc")

MAX_BYTES = 256 * 1024     # one-shot reads every peer's whole tensor: for larger ones NCCL's ring moves less
_BUFFER_BYTES = MAX_BYTES
_buffers: dict = {}         # (group name, dtype, device) -> the rendezvoused buffer, or False where none can be had


def wanted() -> bool:
    return os.environ.get("ACCELC_TP_ALL_REDUCE", "symm").lower() != "nccl"


def all_reduce(t: torch.Tensor, group_name: str) -> torch.Tensor | None:
    """t summed over the group's ranks by a one-shot kernel, or None where this call goes to NCCL (every rank
    alike: the choice depends on the tensor's size and dtype, the same on every rank)."""
    nbytes = t.numel() * t.element_size()
    if not (on_gpu(t) and wanted() and 0 < nbytes <= MAX_BYTES and nbytes % 16 == 0
            and t.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return None
    key = (group_name, t.dtype, t.device)
    fast = _buffers.get(key)
    if fast is None:
        if torch.cuda.is_current_stream_capturing():
            return None           # (made at a call outside a capture: the rendezvous cannot be recorded)
        fast = _buffers[key] = _make(group_name, t.dtype, t.device)
    if fast is False or nbytes > fast.max_bytes:
        return None
    return fast(t.contiguous())


def on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


class _TorchOneShot:
    """PyTorch's one-shot kernel over the group's buffer."""
    max_bytes = MAX_BYTES    # faster than NCCL up to 256 KB on 2 H200s (bf16: 8.5-11.7 us against 12.8-15.7)

    def __init__(self, buf, group_name):
        self.buf, self.group_name = buf, group_name

    def __call__(self, t):
        out = torch.empty_like(t)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buf[: t.numel()].view(t.shape), t, "sum",
                                                         self.group_name, out)
        return out


class _TritonOneShot:
    """kernels/all_reduce.py's one-shot kernel over the group's buffer and flags (both rendezvoused: their handles
    give every rank's addresses), what its launches need worked out once."""
    # faster than NCCL up to 16 KB on 2 H200s (fp16: 9.9-10.7 us against 12.0-13.8), level at 128 KB (14.2 against
    # 14.3), slower at 256 KB (17.2 against 15.2): larger ones go to NCCL
    max_bytes = 64 * 1024

    def __init__(self, buf, flags, buf_handle, flag_handle):
        from accelc.kernels import all_reduce as kernel

        as_array = (lambda ptrs: torch.tensor(list(ptrs), dtype=torch.int64, device=buf.device))
        self.buf, self.flags, self.kernel = buf, flags, kernel        # (the buffers stay alive with their user)
        self.buf_ptrs, self.flag_ptrs = as_array(buf_handle.buffer_ptrs), as_array(flag_handle.buffer_ptrs)
        self.rank, self.world, self.capacity = buf_handle.rank, buf_handle.world_size, buf.numel()

    def __call__(self, t):
        out = torch.empty_like(t)
        self.kernel.launch(t, out, self.buf_ptrs, self.flag_ptrs, self.rank, self.world, self.capacity)
        return out


def _make(group_name: str, dtype: torch.dtype, device: torch.device):
    """The group's one-shot all-reduce for `dtype` (PyTorch's kernel where it takes the dtype, else accelc's),
    its buffers rendezvoused and a probe summed right on every rank; False (said once) where none can be had."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    fast, why = False, None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        elements = _BUFFER_BYTES // torch.tensor([], dtype=dtype).element_size()
        buf = symm_mem.empty(elements, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buf, group_name)
        try:    # one call, every rank at once: a dtype PyTorch's kernel does not take is refused before it runs
            probe = torch.zeros(16, dtype=dtype, device=device)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:16], probe, "sum", group_name, torch.empty_like(probe))
            fast = _TorchOneShot(buf, group_name)
        except (RuntimeError, NotImplementedError, AttributeError):
            from accelc.kernels import all_reduce as kernel
            flags = symm_mem.empty(kernel.flags_needed(elements, handle.world_size), dtype=torch.int32, device=device)
            flags.zero_()
            fast = _TritonOneShot(buf, flags, handle, symm_mem.rendezvous(flags, group_name))
    except Exception as e:      # any refusal: the group stays on NCCL, said
        fast, why = False, (str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
    # every rank the same way: one rank on a one-shot kernel and another on NCCL would wait on each other for ever;
    # (this collective also orders every rank's zeroed flags before any rank's first signal into them)
    ok = torch.tensor([fast is not False], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if bool(ok.item()):         # a probe: rank-dependent values summed by the kernel as NCCL sums them
        x = (torch.arange(4096, device=device) % 13 + dist.get_rank(group)).to(dtype)
        want = x.clone()
        dist.all_reduce(want, group=group)
        ok.fill_(int(torch.equal(fast(x), want)))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        why = why or "its probe's sum differs from NCCL's"
    if not bool(ok.item()):
        log.info("accelc: tensor-parallel all-reduces stay on NCCL (symmetric memory's one-shot kernel not "
                 "available%s)", f": {why}" if why else " on another rank")
        return False
    log.info("accelc: tensor-parallel all-reduces up to %d KB by a one-shot kernel over symmetric memory (%s), "
             "group %s, %s", MAX_BYTES // 1024, "PyTorch's" if isinstance(fast, _TorchOneShot) else "accelc's",
             group_name, dtype)
    return fast


def forget() -> None:
    """Drop the buffers (before the process group is destroyed)."""
    _buffers.clear()
