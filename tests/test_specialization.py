"""A size that follows the batch or the sequence (rows of a GEMM, a norm or rotary) compiles no new
binary: Triton specializes an int argument on 1 and on divisibility by 16, so a kernel met at 64 rows,
then 37, then 1 compiled three times (a call at a new batch size stalled on it; the guard's checks at
other sizes paid it for every layer). The kernels declare those sizes do_not_specialize."""
import pytest
import torch

from accelc.kernels import gemm, layernorm, rotary
from conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="compiled binaries exist on a GPU only")


def _binaries(kernel) -> int:
    """How many binaries the Triton kernel holds for the current GPU."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.parametrize("tma", [False, True])
def test_linear_rows_compile_once(tma):
    k, n = 64, 96
    w = torch.randn(n, k, device=DEVICE, dtype=torch.float16)
    cfg = gemm.config(64, 64, 32, 3, 4, tma=tma)
    counts = []
    for m in (64, 37, 1, 130):
        x = torch.randn(m, k, device=DEVICE, dtype=torch.float16)
        out = torch.empty(m, n, device=DEVICE, dtype=torch.float16)
        gemm.launch(x, w, None, None, out, config=cfg)
        torch.testing.assert_close(out.float(), x.float() @ w.float().T, atol=2e-2, rtol=2e-2)
        counts.append(_binaries(gemm.linear_kernel))
    assert counts[1:] == [counts[0]] * 3, counts


def test_norm_and_rotary_rows_compile_once():
    d = 128
    wn = torch.randn(d, device=DEVICE, dtype=torch.float16)
    norms, rots = [], []
    for rows in (64, 37, 1, 130):
        x = torch.randn(rows, d, device=DEVICE, dtype=torch.float16)
        y = layernorm.rms_norm_launch(x, wn)
        torch.testing.assert_close(y.float(), layernorm.rms_norm_ref(x.float(), wn.float()), atol=2e-2, rtol=2e-2)
        norms.append(_binaries(layernorm._layer_norm_kernel))
        q = torch.randn(1, 2, rows, d, device=DEVICE, dtype=torch.float16)
        cos, sin = torch.randn(1, 1, rows, d, device=DEVICE).half(), torch.randn(1, 1, rows, d, device=DEVICE).half()
        r = rotary.rotary_embedding_launch(q, cos, sin)
        torch.testing.assert_close(r.float(), rotary.rotary_embedding_ref(q.float(), cos.float(), sin.float()),
                                   atol=2e-2, rtol=2e-2)
        rots.append(_binaries(rotary._rotary_kernel))
    assert norms[1:] == [norms[0]] * 3 and rots[1:] == [rots[0]] * 3, (norms, rots)


def test_attention_lengths_and_mask_rows_compile_once():
    """The lengths, and the strides of a padding mask's rows that follow them (S keys a row), unspecialized."""
    from accelc.kernels import flash_attention as fa

    sizes = dict(B=2, H=2, L=64, S=64, D=64, tma=False, fp32=False, gluon=False)
    cfg = next(c for c in fa._prune(fa.CONFIGS, sizes) if not c.kwargs.get("TMA"))
    counts = []
    with fa.TUNER.force(cfg):
        for n in (64, 28, 37, 130):
            q, k, v = (torch.randn(2, 2, n, 64, device=DEVICE, dtype=torch.float16) for _ in range(3))
            mask = torch.zeros(2, 1, 1, n, device=DEVICE, dtype=torch.float16)
            mask[0, ..., n // 2:] = torch.finfo(torch.float16).min
            out = fa.flash_attention_launch(q, k, v, mask)
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask.float())
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
            counts.append(_binaries(fa._flash_fwd_kernel))
    assert counts[1:] == [counts[0]] * 3, counts
