"""kernels/argmax.py: torch.argmax(x, -1) of (B, V) rows (greedy decoding's next token): the same
index, ties to the first, NaN first, -inf rows, one and many chunks, fp16 / bf16 / fp32."""
import pytest
import torch

from accelc.kernels import argmax
from conftest import DEVICE


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,v", [(1, 7), (3, 300), (2, 5000)])
def test_argmax_rows_is_torchs(dtype, b, v, monkeypatch):
    monkeypatch.setattr(argmax, "CHUNK", 256)       # several chunks a row at these sizes
    g = torch.Generator().manual_seed(b * v)
    x = torch.randn(b, v, generator=g).to(DEVICE, dtype)
    assert torch.equal(argmax.argmax_rows(x), x.argmax(-1))
    x[:, v // 3] = x[:, 2 * v // 3] = 100          # tied maxima in two chunks: the first wins
    assert torch.equal(argmax.argmax_rows(x), torch.full((b,), v // 3, device=DEVICE))


def test_nan_infinities_and_tiny_rows(monkeypatch):
    monkeypatch.setattr(argmax, "CHUNK", 64)
    x = torch.randn(6, 1000, device=DEVICE, dtype=torch.float16)
    x[0, 700] = float("nan")                        # NaN beats +inf before it
    x[0, 10] = float("inf")
    x[1, 900] = float("nan")                        # the first NaN of a row
    x[1, 950] = float("nan")
    x[2] = float("-inf")                            # every entry -inf: the first
    x[3, 999] = float("inf")                        # the row's last entry, the last chunk's tail
    x[4, 0] = float("nan")
    x[5, 5] = 3e4
    x[5, 640] = 3e4
    out = argmax.argmax_rows(x)
    assert out.tolist() == x.argmax(-1).tolist() == [700, 900, 0, 999, 0, 5]


def test_what_it_does_not_serve_goes_to_torch():
    x = torch.randn(4, 10, device=DEVICE, dtype=torch.float32)
    for t in (x.t(), x.double(), x[None], torch.randint(0, 9, (2, 5), device=DEVICE)):
        assert torch.equal(argmax.argmax_rows(t), t.argmax(-1))
