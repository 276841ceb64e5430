"""The warp-specialized Gluon attention kernel (kernels/attention_hopper.py) against the fp32 reference,
every candidate forced: ragged lengths (L and S past a block, one query row, fewer keys than a block),
head dims 32 / 64 / 128, grouped-query heads, q / k / v as views of (B, S, H, D) memory, additive key
padding masks, boolean masks per query row, causal, rows with no visible key (0 as SDPA, NaN with
empty_nan), NaN in one sequence staying in it, fp16 and bf16, and the same bits on every run (a race
in the producer / consumer handshake would show as runs that differ). GPU tests run on sm90 only:
Gluon kernels do not run in Triton's interpreter; there, the tl kernel they race is tested
(tests/test_flash_attention.py), and here what decides between the two and that the kernel builds."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import forced_outputs

from accelc import runtime
from accelc.kernels import flash_attention as fa
from accelc.numerics import REL_L2_FLOOR, rel_l2

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not SM90, reason="Gluon kernels need an sm90 GPU (not the interpreter)")
TOL = REL_L2_FLOOR
IDS = lambda c: "x".join(str(c.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N", "STAGES", "PINGPONG"))  # noqa: E731


def test_the_gluon_module_imports_or_says_why():
    module, reason = fa._hopper_import()
    assert (module is None) == (reason is not None)
    if module is not None:
        assert module.smem_bytes(128, 128, 2) < 227 * 1024 < module.smem_bytes(128, 128, 4)


def test_no_gluon_candidate_off_sm90():
    q = torch.randn(1, 2, 8, 64)
    assert fa.gluon_problem(q, q, q) is not None
    sizes = dict(B=1, H=2, L=1024, S=1024, D=128, tma=True, fp32=False, gluon=False)
    assert not any(c.kwargs.get("GLUON") for c in fa._prune(fa.CONFIGS, sizes))
    sizes["gluon"] = True
    gluon = [c for c in fa._prune(fa.CONFIGS, sizes) if c.kwargs.get("GLUON")]
    assert gluon and all(c in fa.GLUON_CONFIGS for c in gluon)
    # three softmax warpgroups (192 rows) only up to head dim 64: at 128 their 160 registers spill
    assert not any(c.kwargs["CONSUMERS"] == 3 for c in gluon)
    assert any(c.kwargs.get("CONSUMERS") == 3 for c in fa._prune(fa.CONFIGS, dict(sizes, D=64)))
    # the wide head dims and fp32 never get one
    assert not any(c.kwargs.get("GLUON") for c in fa._prune(fa.CONFIGS, dict(sizes, D=256)))
    assert not any(c.kwargs.get("GLUON") for c in fa._prune(fa.CONFIGS, dict(sizes, fp32=True)))


def test_the_gluon_attention_builds_for_sm90_with_this_triton():
    """Here, without a GPU: every candidate compiles for sm90 through ptxas with the installed Triton,
    with wgmma instructions in its SASS, within shared memory, for a plain, a key-padding-masked and
    a causal boolean-masked call."""
    if fa._hopper_import()[0] is None:
        pytest.skip(fa._hopper_import()[1])
    script = Path(__file__).parents[1] / "bench" / "gluon_compile.py"
    three = next(i for i, c in enumerate(fa.GLUON_CONFIGS) if c.kwargs["CONSUMERS"] == 3)
    done = subprocess.run([sys.executable, str(script), "--kernel", "attention", "--configs", f"0,{three}", "--json"],
                          capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(rows) == 8, done.stdout[-2000:] + done.stderr[-2000:]
    for row in rows:
        assert row["hgmma"] > 0 and row["shared_bytes"] <= 227 * 1024, row


def test_the_fp8_gluon_attention_builds_for_sm90_with_this_triton():
    """Here, without a GPU: the two-warpgroup candidates' fp8 path (Fp8Config(attention=True): e4m3 q, K and
    keys-contiguous V) compiles for sm90 with every product on fp8 wgmma (QGMMA, no HGMMA), within shared memory,
    the first candidate's plain build without a spill and the others' few (FP8's scale vectors: the three-warpgroup
    candidates, at 128 registers a thread, spilled 87-401 stores; they are not fp8 candidates)."""
    if fa._hopper_import()[0] is None:
        pytest.skip(fa._hopper_import()[1])
    script = Path(__file__).parents[1] / "bench" / "gluon_compile.py"
    two = [i for i, c in enumerate(fa.GLUON_CONFIGS) if c.kwargs["CONSUMERS"] == 2][:2]
    done = subprocess.run([sys.executable, str(script), "--kernel", "attention_fp8", "--configs",
                           ",".join(map(str, two)), "--json"], capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(rows) == 4, done.stdout[-2000:] + done.stderr[-2000:]
    for row in rows:
        assert row["dtype"] == "fp8" and row["qgmma"] == row["hgmma"] > 0 and row["shared_bytes"] <= 227 * 1024, row
        assert row["spill_stores"] < 32, row
    assert [r["spill_stores"] for r in rows if r["config"] == two[0] and r["mask_kind"] == 0] == [0], rows
    sizes = dict(B=1, H=2, L=1024, S=1024, D=64, tma=False, fp32=False, gluon=True, fp8=True)
    assert all(c.kwargs["CONSUMERS"] == 2 for c in fa._prune(fa.CONFIGS, sizes) if c.kwargs.get("GLUON"))


def _forced(cfg, fn, repeats=2):
    return forced_outputs(fa.TUNER, cfg, fn, repeats)


def _qkv(B, H, Hkv, L, S, D, dtype, bshd=True):
    """q, k, v; bshd: views of (B, S, H, D) memory, as a model's head split makes them."""
    def one(heads, n):
        if bshd:
            return torch.randn(B, n, heads, D, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(B, heads, n, D, device="cuda", dtype=dtype)
    return one(H, L), one(Hkv, S), one(Hkv, S)


SHAPES = [  # B, H, Hkv, L, S, D
    (2, 4, 4, 197, 197, 64), (1, 2, 2, 70, 300, 128), (2, 8, 2, 130, 64, 128), (1, 3, 3, 257, 1000, 32),
    (3, 2, 1, 384, 384, 64),
]


@gpu
@pytest.mark.parametrize("B,H,Hkv,L,S,D", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", fa.GLUON_CONFIGS, ids=IDS)
def test_gluon_candidates_match_reference(B, H, Hkv, L, S, D, dtype, cfg):
    q, k, v = _qkv(B, H, Hkv, L, S, D, dtype)
    ref = fa.flash_attention_ref(q.float(), k.float(), v.float())
    outs = _forced(cfg, lambda: fa.flash_attention(q, k, v))
    if outs is None:
        pytest.skip("not a candidate for this shape")
    assert rel_l2(outs[0].float(), ref) < TOL[dtype]
    assert torch.equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("cfg", fa.GLUON_CONFIGS, ids=IDS)
@pytest.mark.parametrize("kind", ["padding", "bool_rows", "causal", "causal_longer_keys", "causal_padding"])
def test_gluon_masks_and_causal(cfg, kind):
    B, H, L, S, D = 3, 4, 200, 200 if kind != "causal_longer_keys" else 330, 64
    q, k, v = _qkv(B, H, H, L, S, D, torch.float16)
    mask, causal = None, kind.startswith("causal")
    if kind in ("padding", "causal_padding"):     # HF's additive key padding mask, rows of different lengths
        mask = torch.zeros(B, 1, 1, S, device="cuda", dtype=torch.float16)
        for b in range(B):
            mask[b, ..., S - 37 * b:] = torch.finfo(torch.float16).min
    elif kind == "bool_rows":
        mask = torch.rand(B, 1, L, S, device="cuda") > 0.3
    ref = fa.flash_attention_ref(q.float(), k.float(), v.float(), None if mask is None else
                                 (mask if mask.dtype == torch.bool else mask.float()), causal)
    outs = _forced(cfg, lambda: fa.flash_attention(q, k, v, mask, causal))
    assert outs is not None
    assert rel_l2(outs[0].float(), ref) < TOL[torch.float16]
    assert torch.equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("cfg", fa.GLUON_CONFIGS, ids=IDS)
@pytest.mark.parametrize("empty_nan", [False, True])
def test_gluon_rows_with_no_visible_key(cfg, empty_nan):
    B, H, L, S, D = 2, 2, 150, 150, 128
    q, k, v = _qkv(B, H, H, L, S, D, torch.float16)
    mask = torch.rand(B, 1, L, S, device="cuda") > 0.5
    mask[0, 0, 7] = False          # row 7 of batch 0 sees no key
    mask[1, 0, 140:] = False       # the last rows of batch 1 too
    ref = fa.flash_attention_ref(q.float(), k.float(), v.float(), mask, empty_nan=empty_nan)
    outs = _forced(cfg, lambda: fa.flash_attention(q, k, v, mask, empty_nan=empty_nan), repeats=1)
    if outs is None:
        pytest.skip("not a candidate for this head dim")
    out = outs[0]
    assert torch.equal(out.isnan(), ref.isnan())
    if not empty_nan:
        assert out[0, :, 7].abs().max() == 0 and out[1, :, 140:].abs().max() == 0
    keep = ~ref.isnan()
    assert rel_l2(out.float()[keep], ref[keep]) < TOL[torch.float16]


@gpu
@pytest.mark.parametrize("cfg", fa.GLUON_CONFIGS, ids=IDS)
def test_gluon_nan_stays_in_its_sequence(cfg):
    """NaN / inf in one sequence's keys or values reach that sequence's rows, as eager's, and never
    another's: K / V boxes end at each sequence's S (the copy engine zero-fills), not in the next one."""
    B, H, L, S, D = 3, 2, 70, 70, 64
    q, k, v = _qkv(B, H, H, L, S, D, torch.float16, bshd=False)
    v[1, :, 3, 5] = float("nan")
    k[2, 1, 0, 0] = float("inf")
    ref = fa.flash_attention_ref(q.double(), k.double(), v.double())
    out = _forced(cfg, lambda: fa.flash_attention(q, k, v), repeats=1)[0]
    assert torch.equal(out.isnan(), ref.isnan())
    assert not out[0].isnan().any() and out[1].isnan().any()
    fine = ~ref.isnan()
    assert rel_l2(out.float()[fine], ref.float()[fine]) < TOL[torch.float16]


@gpu
def test_the_race_includes_gluon_on_sm90():
    q, k, v = _qkv(2, 8, 8, 1024, 1024, 128, torch.float16)
    assert fa.gluon_problem(q, k, v) is None
    assert fa.gluon_problem(q, k, v, qk_int8=True) is not None
    assert fa.gluon_problem(q[..., :96], k[..., :96], v[..., :96]) is not None   # head dim 96
    out = fa.flash_attention(q, k, v)
    assert rel_l2(out.float(), fa.flash_attention_ref(q.float(), k.float(), v.float())) < TOL[torch.float16]
    assert not runtime.interpreted()
    assert any("gluon" in key for key in fa.TUNER.chosen)


@gpu
@pytest.mark.parametrize("cfg", fa.GLUON_CONFIGS, ids=IDS)
def test_gluon_three_dim_inputs(cfg):
    """(batch * heads, length, head_dim) q, k, v, as attention written with bmm gives them: one batch of
    that many heads, into a contiguous result."""
    q, k, v = (torch.randn(24, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    ref = fa.flash_attention_ref(q.float(), k.float(), v.float())
    outs = _forced(cfg, lambda: fa.flash_attention(q, k, v))
    assert outs is not None
    assert outs[0].shape == (24, 300, 64) and outs[0].is_contiguous()
    assert rel_l2(outs[0].float(), ref) < TOL[torch.float16]
    assert torch.equal(outs[0], outs[1])


FP8_IDS = lambda c: "x".join(str(c.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N", "STAGES", "PINGPONG"))  # noqa: E731


@gpu
@pytest.mark.parametrize("cfg", [c for c in fa.GLUON_CONFIGS if c.kwargs["CONSUMERS"] == 2], ids=FP8_IDS)
@pytest.mark.parametrize("case", ["plain", "padding", "causal gqa", "ragged"])
def test_gluon_fp8_against_the_exact_attention(cfg, case):
    """The fp8 path of every two-warpgroup candidate (both products on e4m3 operands): within 25 dB SQNR of the
    attention in fp64 and near the tl fp8 kernel (the same quantized operands: only the products' order and p's
    rounding differ), the same bits on every run; NaN in a key reaches every row, as eager's."""
    from accelc.numerics import sqnr_db
    B, H, Hkv, L, S, D = {"plain": (2, 4, 4, 256, 256, 128), "padding": (2, 4, 4, 200, 200, 64),
                          "causal gqa": (1, 8, 2, 300, 300, 128), "ragged": (1, 2, 2, 70, 333, 32)}[case]
    q, k, v = _qkv(B, H, Hkv, L, S, D, torch.float16)
    mask = None
    if case == "padding":
        mask = torch.zeros(B, 1, 1, S, device="cuda", dtype=torch.float16)
        mask[1, ..., S - 50:] = torch.finfo(torch.float16).min
    causal = case == "causal gqa"
    ref = fa.flash_attention_ref(q.double(), k.double(), v.double(), None if mask is None else mask.double(), causal)
    outs = _forced(cfg, lambda: fa.flash_attention(q, k, v, mask, causal, fp8=True))
    if outs is None:
        pytest.skip("not a candidate for this shape")
    tl_cfg = next(c for c in fa.CONFIGS if not c.kwargs.get("GLUON") and not c.kwargs["TMA"])
    tl_out = _forced(tl_cfg, lambda: fa.flash_attention(q, k, v, mask, causal, fp8=True), repeats=1)[0]
    assert sqnr_db(rel_l2(outs[0].double(), ref)) > 25, sqnr_db(rel_l2(outs[0].double(), ref))
    assert sqnr_db(rel_l2(outs[0].double(), tl_out.double())) > 35
    assert torch.equal(outs[0], outs[1])
    k[0, 0, 1, 3] = float("nan")
    nan = _forced(cfg, lambda: fa.flash_attention(q, k, v, mask, causal, fp8=True), repeats=1)[0]
    assert nan[0, : H // Hkv].isnan().all() or causal and nan[0, : H // Hkv, 1:].isnan().all()
