"""Small all-reduces by PyTorch's symmetric memory: a decode step's tensor-parallel all-reduces are one row a
sequence (8 KB for a 4096-wide fp16 model) and bound by latency, where NCCL's ring takes several steps and a
one-shot all-reduce one: each rank copies its tensor into a buffer every rank of the group can read (symmetric
memory, rendezvoused once), waits for the others at a barrier in the kernel, and sums the ranks' copies itself
(torch.ops.symm_mem.one_shot_all_reduce_copy_out). The kernel is capturable: a step program's CUDA graphs record
it as they record NCCL's.

Taken for CUDA tensors up to MAX_BYTES whose group's buffer exists; everything else, and every call while the
buffer cannot be had (a PyTorch without symmetric memory, a GPU pair without peer access, a dtype the kernel does
not take: PyTorch 2.11's takes fp32 and bf16, not fp16; said once in the log), goes to NCCL's all-reduce. The buffer is made at the first all-reduce of a group and dtype outside a CUDA graph's
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
    """t summed over the group's ranks by the one-shot kernel, or None where this call goes to NCCL."""
    nbytes = t.numel() * t.element_size()
    if not (t.is_cuda and wanted() and 0 < nbytes <= MAX_BYTES and nbytes % 16 == 0
            and t.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return None
    key = (group_name, t.dtype, t.device)
    buf = _buffers.get(key)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            return None           # (made at a call outside a capture: the rendezvous cannot be recorded)
        buf = _buffers[key] = _make(group_name, t.dtype, t.device)
    if buf is False:
        return None
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    view = buf[: t.numel()].view(t.shape)
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, t.contiguous(), "sum", group_name, out)
    return out


def _make(group_name: str, dtype: torch.dtype, device: torch.device):
    """The group's buffer for `dtype`, rendezvoused, or False (said once) where symmetric memory is not to be had."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    buf, why = False, None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
            raise RuntimeError("this PyTorch has no symm_mem.one_shot_all_reduce_copy_out")
        elements = _BUFFER_BYTES // torch.tensor([], dtype=dtype).element_size()
        buf = symm_mem.empty(elements, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group_name)
        # one call, every rank at once: a dtype the kernel does not take (PyTorch 2.11's: fp32 and bf16, not fp16)
        # is refused before anything runs on the GPU
        probe = torch.zeros(16, dtype=dtype, device=device)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:16], probe, "sum", group_name, torch.empty_like(probe))
    except Exception as e:      # any refusal: the group stays on NCCL, said
        buf, why = False, (str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
    # every rank the same way: one rank on the one-shot kernel and another on NCCL would wait on each other for ever
    ok = torch.tensor([buf is not False], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=_resolve_process_group(group_name))
    if not bool(ok.item()):
        log.info("accelc: tensor-parallel all-reduces stay on NCCL (symmetric memory not available%s)",
                 f": {why}" if why else " on another rank")
        return False
    log.info("accelc: tensor-parallel all-reduces up to %d KB by symmetric memory (one-shot), group %s, %s",
             MAX_BYTES // 1024, group_name, dtype)
    return buf


def forget() -> None:
    """Drop the buffers (before the process group is destroyed)."""
    _buffers.clear()
