"""kernels/flash_decoding.py: accelc::flash_attention's split-KV path for decode steps (a few query
rows a K/V head over many keys), against an fp64 reference and eager SDPA; the path is checked
to be the one taken."""
import pytest
import torch
import torch.nn.functional as F

from accelc.kernels import flash_attention as fa, flash_decoding as fd
from conftest import DEVICE, assert_close_to_ref

DTYPES = [(torch.float16, 2e-3, 1e-2), (torch.bfloat16, 1.6e-2, 5e-2)]  # (dtype, atol, rtol) vs fp64


@pytest.fixture
def decode_calls(monkeypatch):
    """How many flash_attention calls took the decode path."""
    calls = []
    real = fd.launch

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)
    monkeypatch.setattr(fd, "launch", spy)
    return calls


def _qkv(b, h, hkv, lq, s, d, dtype):
    g = torch.Generator().manual_seed(b * 1000 + h * 100 + lq * 10 + s)
    make = lambda *shape: torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)
    return make(b, h, lq, d), make(b, hkv, s, d), make(b, hkv, s, d)


def _check(q, k, v, mask=None, scale=None, atol=2e-3, rtol=1e-2, empty_nan=False):
    out = torch.ops.accelc.flash_attention(q, k, v, mask, False, scale, False, empty_nan)
    d = lambda t: None if t is None else (t if t.dtype == torch.bool else t.double())
    ref = fa.flash_attention_ref(d(q), d(k), d(v), d(mask), False, scale, empty_nan=empty_nan)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
    if empty_nan:
        return out, ref
    assert_close_to_ref(out, ref, eager, q.dtype, atol, rtol)
    return out, ref


def _lengths_mask(b, lq, s, lengths):
    """A static cache's boolean key mask (B, 1, L, S): slot j attends where j < that row's length."""
    return (torch.arange(s, device=DEVICE)[None, None, None, :]
            < torch.tensor(lengths, device=DEVICE)[:, None, None, None]).expand(b, 1, lq, s)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("h,hkv,lq", [(4, 4, 1), (8, 2, 1), (8, 2, 3), (6, 1, 1)])
def test_decode_step_over_a_static_cache(dtype, atol, rtol, h, hkv, lq, decode_calls):
    """GQA groups stacked as one tile, the keys past each row's length masked (whole blocks of
    them skipped), S not a multiple of the key block."""
    q, k, v = _qkv(2, h, hkv, lq, 300, 32, dtype)
    _check(q, k, v, _lengths_mask(2, lq, 300, [37, 261]), atol=atol, rtol=rtol)
    assert decode_calls == [q.shape]


@pytest.mark.parametrize("d", [16, 80, 128])
def test_head_dims_and_no_mask(d, decode_calls):
    q, k, v = _qkv(1, 4, 2, 1, 257, d, torch.float16)
    _check(q, k, v)
    _check(q, k, v, scale=0.3)
    assert len(decode_calls) == 2


def test_additive_masks_with_minus_inf_and_the_dtypes_minimum(decode_calls):
    """An additive mask: -inf keys drop out; a row masked everywhere with bf16's minimum averages
    its values as eager's softmax does (the saturating log2 units)."""
    q, k, v = _qkv(2, 4, 2, 1, 320, 64, torch.bfloat16)
    add = torch.randn(2, 1, 1, 320, device=DEVICE).to(torch.bfloat16)
    add[0, ..., 100:] = float("-inf")
    add[1] = torch.finfo(torch.bfloat16).min
    _check(q, k, v, add, atol=1.6e-2, rtol=5e-2)
    assert len(decode_calls) == 1


def test_a_row_with_no_visible_key_gives_zero_or_nan_as_asked(decode_calls):
    q, k, v = _qkv(2, 4, 2, 1, 256, 32, torch.float16)
    mask = _lengths_mask(2, 1, 256, [0, 200])
    out, ref = _check(q, k, v, mask)
    assert (out[0] == 0).all()
    out, ref = _check(q, k, v, mask, empty_nan=True)
    assert out[0].isnan().all() and not out[1].isnan().any()
    assert len(decode_calls) == 2


def test_nan_at_an_attended_key_gives_nan_as_eager(decode_calls):
    q, k, v = _qkv(1, 4, 4, 1, 256, 32, torch.float16)
    v[0, 1, 10, 3] = float("nan")
    out = torch.ops.accelc.flash_attention(q, k, v, _lengths_mask(1, 1, 256, [100]))
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=_lengths_mask(1, 1, 256, [100]))
    assert torch.equal(out.isnan(), eager.isnan()) and out.isnan().any()
    assert len(decode_calls) == 1


def test_prefill_and_short_keys_keep_the_one_pass_kernel(decode_calls):
    q, k, v = _qkv(1, 2, 2, 17, 300, 32, torch.float16)       # 17 query positions: prefill
    _check(q, k, v)
    q, k, v = _qkv(1, 4, 4, 1, 100, 32, torch.float16)        # few keys
    _check(q, k, v)
    assert decode_calls == []


@pytest.mark.parametrize("b,hkv,s,sms", [(1, 4, 2048, 132), (16, 8, 768, 132), (1, 1, 64, 132), (2, 2, 300, 4)])
def test_splits_cover_the_keys_in_whole_blocks(b, hkv, s, sms):
    splits, per = fd.plan(b, hkv, s, sms, 64)
    assert per % 64 == 0 and (splits - 1) * per < s <= splits * per
    assert b * hkv * splits < 2 * sms + b * hkv       # at most about two programs an SM, at least one a head


def test_long_splits_read_their_keys_in_wider_blocks():
    assert fd.split_plan(1, 8, 768, 132, False) == (64, 12, 64)          # short: blocks of 64, one a split
    assert fd.split_plan(1, 8, 4096, 132, False) == (128, 16, 256)       # long: 16 splits of two 128-key blocks
    assert fd.split_plan(16, 4, 768, 132, False) == (128, 3, 256)
    for b, hkv, s in ((1, 8, 768), (1, 8, 4096), (16, 8, 768), (2, 2, 300), (1, 1, 5000)):
        for interpreted in (False, True):
            block_n, splits, per = fd.split_plan(b, hkv, s, 132, interpreted)
            assert per % block_n == 0 and (splits - 1) * per < s <= splits * per
            assert per < fd.WIDE_BLOCKS * block_n or block_n == 2 * fd._block_n(interpreted)


@pytest.mark.parametrize("elements", [1, 2 * 4 * 64])
def test_the_combine_folds_its_splits_in_chunks(monkeypatch, elements):
    """The combine loads CHUNK splits at once and folds the chunks in with online rescaling: chunks
    of 1 and of 2 splits (the rest masked off at the end) give what one chunk of all gives, on the
    fused and the two-kernel path, with rows of different lengths (one attending 5 keys: splits
    with no key of it) and a NaN at one row's attended key."""
    q, k, v = _qkv(2, 4, 1, 1, 1000, 64, torch.float16)
    mask = _lengths_mask(2, 1, 1000, [1000, 5])
    v[1, 0, 3, 7] = float("nan")
    one = torch.ops.accelc.flash_attention(q, k, v, mask, False, None, False, False)
    eager = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    splits = fd._tiles(q, 1, 1000)[3]
    monkeypatch.setattr(fd, "COMBINE_ELEMENTS", elements)
    assert fd.combine_tiles(4, 64, splits)[1] in (1, 2) and splits >= 3
    fused = torch.ops.accelc.flash_attention(q, k, v, mask, False, None, False, False)
    monkeypatch.setattr(fd, "_counters", lambda device, n: None)
    two = torch.ops.accelc.flash_attention(q, k, v, mask, False, None, False, False)
    for out in (fused, two):
        torch.testing.assert_close(out, one, atol=2e-3, rtol=1e-2, equal_nan=True)
        assert torch.equal(out.isnan(), eager.isnan()) and out.isnan().any()


def test_an_ordinary_call_computes_no_zero_by_zero(decode_calls):
    """Padded tile rows have no key: their output is picked without dividing 0 by 0, so numpy (the
    interpreter) has nothing to warn about and a GPU no NaN to discard, on either path."""
    import warnings

    for lq, s in ((5, 7), (1, 300)):
        q, k, v = _qkv(1, 4, 2, lq, s, 32, torch.float16)
        mask = torch.ones(1, 1, lq, s, dtype=torch.bool, device=DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            _check(q, k, v, mask)
    assert len(decode_calls) == 1


def test_splits_combined_in_the_split_kernel_its_counters_left_at_zero(monkeypatch):
    """The last split of a (batch, K/V head) combines them (one kernel): the same output as the
    two-kernel path (_combine_kernel, taken where no counters are at hand), its counters back at 0,
    and a launch at the ring's end wrapping to its start."""
    q, k, v = _qkv(3, 8, 2, 1, 700, 64, torch.float16)
    mask = _lengths_mask(3, 1, 700, [700, 390, 5])
    fused, _ = _check(q, k, v, mask)
    ring, at = fd._COUNTERS[q.device]
    assert at >= 3 * 2 and not ring.any()
    fd._COUNTERS[q.device][1] = fd.COUNTER_SLOTS - 1            # the next launch's 6 counters wrap to 0
    assert torch.equal(_check(q, k, v, mask)[0], fused) and fd._COUNTERS[q.device][1] == 3 * 2
    assert not ring.any()
    monkeypatch.setattr(fd, "_counters", lambda device, n: None)
    assert torch.equal(_check(q, k, v, mask)[0], fused)
    assert fd._tiles(q, 2, 700)[3] > 1          # several splits a (batch, K/V head) were combined


@pytest.mark.parametrize("min_keys", [64, 10 ** 6])
def test_fewer_longer_splits_give_the_same_attention(monkeypatch, min_keys, decode_calls):
    """MIN_KEYS_PER_SPLIT (the plans bench/decode.py --attention races at a short context): fewer, longer splits,
    down to one a head, cover the keys in whole blocks and give the same attention, masked rows included."""
    for b, hkv, s in ((1, 2, 640), (1, 8, 768), (16, 4, 768), (1, 1, 5000)):
        block_n, splits, per = fd.split_plan(b, hkv, s, 132, False)
        monkeypatch.setattr(fd, "MIN_KEYS_PER_SPLIT", min_keys)
        fewer = fd.split_plan(b, hkv, s, 132, False)
        monkeypatch.setattr(fd, "MIN_KEYS_PER_SPLIT", 0)
        assert fewer[1] <= splits and fewer[2] % fewer[0] == 0 and (fewer[1] - 1) * fewer[2] < s <= fewer[1] * fewer[2]
    q, k, v = _qkv(2, 8, 2, 1, 300, 32, torch.float16)
    default = fd._tiles(q, 2, 300)[3]
    monkeypatch.setattr(fd, "MIN_KEYS_PER_SPLIT", min_keys)
    assert fd._tiles(q, 2, 300)[3] == (1 if min_keys > 300 else min(default, 300 // 64)) and default > 1
    _check(q, k, v, _lengths_mask(2, 1, 300, [37, 261]))
    assert decode_calls == [q.shape]
