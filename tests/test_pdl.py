"""kernels/pdl.py: programmatic dependent launch of the decode path's kernels (gemv_kernel,
flash_decoding's split kernel): off where it cannot run; on an sm90 GPU, a chain of launches each
reading the one before's output gives what PyTorch gives, eagerly and replayed from a CUDA graph
many times, bit for bit the same each time (a read before the wait would race). The GEMV's weight
prefetch before its wait (ACCELC_PREFETCH_WEIGHTS=1): off unless asked, compiled before the wait, the same bits."""

import pytest
import torch
import triton

from accelc.kernels import pdl
from conftest import DEVICE, run_for_sm90

SM90 = DEVICE.type == "cuda" and torch.cuda.get_device_capability() >= (9, 0)


def test_off_where_it_cannot_run(monkeypatch):
    assert not pdl.enabled(torch.device("cpu"))
    if DEVICE.type == "cuda":
        monkeypatch.setenv("ACCELC_PDL", "0")
        assert not pdl.enabled(DEVICE)


def _chain(x, ws, k, v, mask):
    """Each step: a one-row projection with the step's input as its residual, then decode attention
    whose queries are that output (GQA: 8 query heads over 2 K/V heads of 64 dims)."""
    for w in ws:
        x = torch.ops.accelc.linear(x, w, None, x)
        q = x.view(1, 8, 1, 64)
        x = torch.ops.accelc.flash_attention(q, k, v, mask, False, None).reshape(1, 512) + x
    return x


def _reference(x, ws, k, v, mask):
    kk, vv = k.double().repeat_interleave(4, 1), v.double().repeat_interleave(4, 1)
    x = x.double()
    for w in ws:
        x = x @ w.double().t() + x
        att = torch.softmax((x.view(1, 8, 1, 64) @ kk.transpose(-1, -2)) / 8 + torch.where(mask, 0.0, -torch.inf), -1)
        x = (att @ vv).reshape(1, 512) + x
    return x


@pytest.mark.skipif(not SM90, reason="programmatic dependent launch needs an sm90 (Hopper) GPU or later")
def test_dependent_launches_in_a_chain_and_replayed_from_a_graph():
    assert pdl.enabled(DEVICE)
    g = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(DEVICE, torch.float16)
    ws = [make(512, 512, scale=0.02) for _ in range(24)]
    k, v = make(1, 2, 700, 64), make(1, 2, 700, 64)
    mask = torch.arange(700, device=DEVICE)[None, None, None, :] < 650
    x = make(1, 512)
    eager = _chain(x, ws, k, v, mask)
    ref = _reference(x, ws, k, v, mask)
    assert ((eager.double() - ref).norm() / ref.norm()).item() < 1e-2
    static = x.clone()
    _chain(static, ws, k, v, mask)          # warm-up on the capture's inputs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static, ws, k, v, mask)
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_weight_prefetch_is_off_unless_asked_and_needs_dependent_launch(monkeypatch):
    monkeypatch.delenv("ACCELC_PREFETCH_WEIGHTS", raising=False)
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    assert not pdl.prefetching(torch.device("cuda"))
    monkeypatch.setenv("ACCELC_PREFETCH_WEIGHTS", "1")
    assert pdl.prefetching(torch.device("cuda"))
    monkeypatch.setattr(pdl, "enabled", lambda device: False)
    assert not pdl.prefetching(torch.device("cuda"))


PREFETCH_SCRIPT = r"""
import torch
from accelc.kernels.gemm import gemv_kernel
N, K = 256, 2048
for dtype, flat, prefetch in ((torch.float16, False, True), (torch.int8, True, True), (torch.float16, True, False)):
    x, w = torch.empty(1, K, dtype=torch.float16), torch.empty(N, K, dtype=dtype)
    o, s = torch.empty(1, N, dtype=torch.float16), torch.empty(N, dtype=torch.float32)
    k = gemv_kernel.warmup(x, w, o, o, o, s, 1, N, K, N, K, 1, K, 1, N, 1, N, 1, x, 1e-6, HAS_BIAS=False,
                           HAS_RESIDUAL=False, RESIDUAL_FIRST=False, ACTIVATION=0, FAST_MATH=False, GATED=False,
                           EVEN_K=True, W_SCALED=dtype == torch.int8, BLOCK_M=1, BLOCK_N=32, BLOCK_K=256, PDL=True,
                           FLAT=flat, NORM=False, PREFETCH=prefetch, num_warps=4, num_stages=1, grid=(8, 1))
    ptx = k.asm["ptx"].splitlines()
    asks = [i for i, line in enumerate(ptx) if "prefetch.global.L2" in line]
    wait = min(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
    print(str(dtype)[6:], flat, prefetch, len(asks), all(i < wait for i in asks), bool(k.asm.get("cubin")))
"""


def test_a_prefetching_gemv_asks_l2_for_its_weights_before_its_dependent_launch_wait():
    """PREFETCH (ACCELC_PREFETCH_WEIGHTS=1): the decode GEMV, compiled for sm90 here through the stand-in driver,
    asks L2 for its rows' weights (prefetch.global.L2, a loop of them: 32 rows x 16 lines a step over 128 threads)
    before griddepcontrol.wait, so that it streams them while the kernel before it ends; without it, none.
    That it runs and what it gives: test_prefetching_gemv_gives_the_same_bits, on the GPU."""
    out = run_for_sm90(PREFETCH_SCRIPT)
    assert out.split("\n")[:3] == ["float16 False True 4 True True", "int8 True True 4 True True",
                                   "float16 True False 0 True True"], out


@pytest.mark.skipif(not SM90, reason="programmatic dependent launch needs an sm90 (Hopper) GPU or later")
@pytest.mark.parametrize("flat", [False, True])
def test_prefetching_gemv_gives_the_same_bits(flat):
    """A hint changes no number: the GEMV launched with its weights prefetched gives the bits it gives without,
    and the product within fp16's tolerance of fp64's."""
    from accelc.kernels.gemm import gemv_kernel
    g = torch.Generator(device="cpu").manual_seed(0)
    N, K = 1000, 2048        # (N not a multiple of the block: wrapped rows prefetched too)
    x = torch.randn(1, K, generator=g).to(DEVICE, torch.float16)
    w = (torch.randn(N, K, generator=g) * 0.02).to(DEVICE, torch.float16)
    s = torch.ones(N, device=DEVICE)
    outs = []
    for prefetch in (False, True):
        o = torch.empty(1, N, device=DEVICE, dtype=torch.float16)
        gemv_kernel[(triton.cdiv(N, 32), 1)](
            x, w, o, o, o, s, 1, N, K, N, K, 1, K, 1, N, 1, N, 1, x, 1e-6, HAS_BIAS=False, HAS_RESIDUAL=False,
            RESIDUAL_FIRST=False, ACTIVATION=0, FAST_MATH=False, GATED=False, EVEN_K=True, W_SCALED=False, BLOCK_M=1,
            BLOCK_N=32, BLOCK_K=256, PDL=True, FLAT=flat, NORM=False, PREFETCH=prefetch, num_warps=4, num_stages=1,
            launch_pdl=True)
        outs.append(o)
    ref = x.double() @ w.double().t()
    assert torch.equal(outs[0], outs[1])
    assert ((outs[1].double() - ref).norm() / ref.norm()).item() < 1e-2
