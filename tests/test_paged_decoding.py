"""kernels/flash_decoding.paged: decode attention through a paged KV cache (a block table per
sequence, flash_attn_with_kvcache's layout), against an fp64 reference over each sequence's keys
gathered from its blocks: ragged lengths, GQA, several new positions (causal among them), blocks
in any order and shared free blocks holding garbage (never read)."""
import pytest
import torch

from accelc.kernels import flash_attention as fa, flash_decoding as fd
from conftest import DEVICE


def _case(lens, h=4, hkv=2, lq=1, d=32, page=16, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    pages = max(-(-n // page) for n in lens) + 1
    blocks = B * pages + 3
    k_cache = torch.randn(blocks, page, hkv, d, generator=g)
    v_cache = torch.randn(blocks, page, hkv, d, generator=g)
    perm = torch.randperm(blocks, generator=g)            # each sequence's blocks scattered over the cache
    table = perm[:B * pages].view(B, pages).to(torch.int32)
    used = {int(table[b, i]) for b, n in enumerate(lens) for i in range(-(-n // page))}
    for blk in set(range(blocks)) - used:                  # blocks no sequence uses hold NaN: never read
        k_cache[blk] = float("nan")
        v_cache[blk] = float("nan")
    for b, n in enumerate(lens):                           # a sequence's last block: rows past its length too
        last = int(table[b, (n - 1) // page])
        k_cache[last, (n - 1) % page + 1:] = float("nan")
        v_cache[last, (n - 1) % page + 1:] = float("nan")
    q = torch.randn(B, h, lq, d, generator=g)
    cast = lambda t: t.to(device=DEVICE, dtype=dtype)
    return cast(q), cast(k_cache), cast(v_cache), table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _reference(q, k_cache, v_cache, table, lens):
    """Per sequence: its keys gathered from its blocks in order, causal among the last L positions."""
    B, H, L, D = q.shape
    page = k_cache.shape[1]
    out = []
    for b in range(B):
        n = int(lens[b])
        rows = [int(table[b, p // page]) * page + p % page for p in range(n)]
        k = k_cache.reshape(-1, *k_cache.shape[2:])[rows].permute(1, 0, 2)[None].double()
        v = v_cache.reshape(-1, *v_cache.shape[2:])[rows].permute(1, 0, 2)[None].double()
        mask = torch.ones(L, n, dtype=torch.bool, device=q.device)
        for i in range(L):
            mask[i, n - (L - 1 - i):] = False
        out.append(fa.flash_attention_ref(q[b:b + 1].double(), k, v, mask))
    return torch.cat(out)


@pytest.mark.parametrize("lens,h,hkv,lq,page", [
    ([300, 17, 129], 4, 2, 1, 16),      # ragged lengths, GQA, one new token
    ([64, 200], 8, 8, 1, 32),           # no GQA, a length a whole number of pages
    ([100, 41], 4, 1, 3, 16),           # three new positions (drafted tokens): causal among them
])
def test_paged_decode_matches_the_gathered_keys(lens, h, hkv, lq, page):
    q, kc, vc, table, n = _case(lens, h=h, hkv=hkv, lq=lq, page=page)
    out = fd.paged(q, kc, vc, table, n)
    ref = _reference(q, kc, vc, table, n)
    assert not torch.isnan(out).any()                   # the NaN in unused blocks and rows was never read
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=1e-2)


def test_paged_decode_bf16_and_a_given_scale():
    q, kc, vc, table, n = _case([90, 33], dtype=torch.bfloat16, seed=3)
    out = fd.paged(q, kc, vc, table, n, scale=0.2)
    ref = _reference(q * (0.2 * 32 ** 0.5), kc, vc, table, n)   # the reference's scale is 1 / sqrt(D)
    torch.testing.assert_close(out.double(), ref, atol=1.6e-2, rtol=5e-2)


def test_paged_decode_refuses_what_it_cannot_take_in_one_line():
    q, kc, vc, table, n = _case([40])
    with pytest.raises(ValueError, match="the page size must be a power of two"):
        fd.paged(q, kc[:, :12], vc[:, :12], table, n)
    with pytest.raises(ValueError, match="block_table must be"):
        fd.paged(q, kc, vc, table[:, :1].expand(2, 1), n)
    with pytest.raises(ValueError, match="fp16 / bf16"):
        fd.paged(q.float(), kc.float(), vc.float(), table, n)


def _step_case(lens_before, new, T, h=4, hkv=2, d=32, page=16, dtype=torch.float16, seed=5):
    """A generation step over a paged cache: sequence b holds lens_before[b] keys and writes its last
    new[b] of T columns (the earlier ones pads); the cache already holds the step's keys and values."""
    g = torch.Generator().manual_seed(seed)
    B = len(new)
    pages = max(-(-(n + m) // page) for n, m in zip(lens_before, new)) + 1
    blocks = B * pages + 1
    k_cache = torch.randn(blocks, page, hkv, d, generator=g)
    v_cache = torch.randn(blocks, page, hkv, d, generator=g)
    table = torch.randperm(blocks - 1, generator=g)[:B * pages].view(B, pages).to(torch.int32)
    q = torch.randn(B, h, T, d, generator=g)
    k = torch.randn(B, hkv, T, d, generator=g)
    v = torch.randn(B, hkv, T, d, generator=g)
    for b in range(B):                      # the step's real columns written to their slots
        for j in range(new[b]):
            p = lens_before[b] + j
            blk, row = int(table[b, p // page]), p % page
            k_cache[blk, row] = k[b, :, T - new[b] + j]
            v_cache[blk, row] = v[b, :, T - new[b] + j]
    cast = lambda t: t.to(device=DEVICE, dtype=dtype)
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)
    total = [n + m for n, m in zip(lens_before, new)]
    return (cast(q), cast(k), cast(v), cast(k_cache), cast(v_cache), table.to(DEVICE), ints(total), ints(new))


def _step_reference(q, k_cache, v_cache, table, lens, new):
    """Each real column attends to its sequence's keys up to itself; pad columns are not compared."""
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        m = int(new[b])
        if m:
            out[b:b + 1, :, T - m:] = _reference(q[b:b + 1, :, T - m:], k_cache, v_cache, table[b:b + 1],
                                                 lens[b:b + 1])
    return out


@pytest.mark.parametrize("lens_before,new,T,dtype", [
    ([0, 0, 0], [20, 13, 0], 20, torch.float16),     # a ragged prompt (the prompt path), a row with no tokens
    ([37, 5, 0], [1, 1, 0], 1, torch.float16),       # a decode step (the kernel), an unused row
    ([0, 0], [7, 4], 7, torch.float16),              # a short prompt: the kernel over the cache
    ([37, 0], [1, 6], 6, torch.float32),             # fp32: the keys gathered from the table
])
def test_paged_attention_op_serves_prompts_and_decode_steps(lens_before, new, T, dtype):
    from accelc.kernels.paged_attention import paged_attention, paged_attention_ref

    q, k, v, kc, vc, table, lens, n = _step_case(lens_before, new, T, dtype=dtype)
    ref = _step_reference(q, kc, vc, table, lens, n)
    # the op, and its pure-PyTorch reference (what an ONNX export records)
    args = (q, k, v, kc, vc, table, lens, n)
    for out in (paged_attention(*args, None), paged_attention_ref(*args)):
        assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()     # HF's layout: (B, T, H, D) memory
        for b, m in enumerate(new):
            torch.testing.assert_close(out[b, :, T - m:].double(), ref[b, :, T - m:], atol=2e-3, rtol=1e-2)
            if not m:                       # a row without tokens: nothing attended, 0 (never NaN)
                assert torch.equal(out[b].float(), torch.zeros_like(out[b].float()))
