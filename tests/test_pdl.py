"""kernels/pdl.py: programmatic dependent launch of the decode path's kernels (gemv_kernel,
flash_decoding's split kernel): off where it cannot run; on an sm90 GPU, a chain of launches each
reading the one before's output gives what PyTorch gives, eagerly and replayed from a CUDA graph
many times, bit for bit the same each time (a read before the wait would race)."""
import pytest
import torch

from accelc.kernels import pdl
from conftest import DEVICE

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
