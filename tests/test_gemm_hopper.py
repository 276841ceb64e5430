"""The warp-specialized Gluon GEMM (kernels/gemm_hopper.py) against the fp32 reference, every candidate
forced: tails in M, N and K, every activation, residual before and after it, no bias, weights stored
(N, K) and (K, N), fp16 and bf16, and the same bits on every run (a race in the producer / consumer
handshake would show as runs that differ). Runs on an sm90 GPU only: Gluon kernels do not run in
Triton's interpreter; there, the tl kernel they stand beside is tested (tests/test_gemm.py), and only
what decides between the two is checked here."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import forced_outputs

from accelc import runtime
from accelc.kernels import gemm, int8_gemm
from accelc.kernels.epilogue import ACTIVATION_NAMES
from accelc.numerics import REL_L2_FLOOR, rel_l2

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not SM90, reason="Gluon kernels need an sm90 GPU (not the interpreter)")
TOL = REL_L2_FLOOR


def test_the_gluon_module_imports_or_says_why():
    """Never a crash at import: under any accepted Triton the module builds, or the launcher keeps the
    tl kernel and can say why."""
    module, reason = gemm._hopper_import()
    assert (module is None) == (reason is not None)
    if module is not None:
        assert callable(module.descriptors) and module.smem_bytes(128, 128, 64, 4, 2) < 228 * 1024


def test_no_gluon_candidate_off_sm90():
    x = torch.randn(8, 16)
    assert gemm.gluon_problem(x, None, x) is not None
    sizes = dict(M=4096, N=4096, K=4096, tma=True, dtype=torch.float16, gluon=False)
    assert not any(c.kwargs.get("GLUON") for c in gemm.prune_configs(gemm.CONFIGS, sizes))
    sizes["gluon"] = True
    assert any(c.kwargs.get("GLUON") for c in gemm.prune_configs(gemm.CONFIGS, sizes))


def test_the_gluon_gemm_builds_for_sm90_with_this_triton():
    """Here, without a GPU: the kernel compiles for sm90 through ptxas with the installed Triton (the
    newest the bounds admit, in CI), with wgmma instructions in its SASS and within shared memory: the
    ping-pong, the one-consumer and the cooperative (192-row) candidates."""
    if gemm._hopper_import()[0] is None:
        pytest.skip(gemm._hopper_import()[1])
    script = Path(__file__).parents[1] / "bench" / "gluon_compile.py"
    first_coop = next(i for i, c in enumerate(gemm.GLUON_CONFIGS) if c.kwargs.get("COOP"))
    done = subprocess.run([sys.executable, str(script), "--configs", f"0,1,{first_coop}", "--json"],
                          capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and rows, done.stdout[-2000:] + done.stderr[-2000:]
    for row in rows:
        assert row["hgmma"] > 0 and row["shared_bytes"] <= 227 * 1024, row


def test_every_gluon_candidate_fits_shared_memory():
    module, _ = gemm._hopper_import()
    if module is None:
        pytest.skip("this Triton cannot build the Gluon GEMM")
    for c in gemm.GLUON_CONFIGS:
        kw = c.kwargs
        if kw.get("COOP"):
            used = module.coop_smem_bytes(kw["WGS"], kw["BN1"], kw["BN2"], kw["BLOCK_K"], kw["STAGES"])
        else:
            used = module.smem_bytes(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["STAGES"], kw["CONSUMERS"])
        assert used <= 227 * 1024, kw


def _forced(cfg, fn, repeats=2):
    return forced_outputs(gemm.TUNER, cfg, fn, repeats)


# (1000, 320, 1000): in 192 x 192 tiles (the cooperative candidates) the last row block leaves two of the
# three warpgroups wholly past M and the last column block's second box wholly past N
SHAPES = [(130, 72, 136), (1000, 768, 2304), (4096, 256, 512), (257, 1024, 96), (3072, 3072, 768), (1000, 320, 1000)]
FIRST_COOP = next(c for c in gemm.GLUON_CONFIGS if c.kwargs.get("COOP"))


@gpu
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", gemm.GLUON_CONFIGS, ids=lambda c: "x".join(str(c.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N", "STAGES", "CONSUMERS")))
def test_gluon_candidates_match_reference(M, K, N, dtype, cfg):
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=dtype)
    r = torch.randn(M, N, device="cuda", dtype=dtype)
    ref = gemm.linear_ref(x.float(), w.float(), b.float(), r.float(), "gelu")
    outs = _forced(cfg, lambda: gemm.linear_launch(x, w, b, r, "gelu"))
    if outs is None:
        pytest.skip("not a candidate for this shape")
    assert rel_l2(outs[0].float(), ref) < TOL[dtype]
    assert torch.equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
@pytest.mark.parametrize("residual", ["none", "after", "first"])
@pytest.mark.parametrize("cfg", [gemm.GLUON_CONFIGS[0], FIRST_COOP], ids=["pingpong", "coop"])
def test_gluon_epilogues(activation, residual, cfg):
    M, K, N = 300, 192, 264
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w = torch.randn(N, K, device="cuda", dtype=torch.float16) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=torch.float16) if residual != "first" else None
    r = torch.randn(M, N, device="cuda", dtype=torch.float16) if residual != "none" else None
    first = residual == "first"
    ref = gemm.linear_ref(x.float(), w.float(), None if b is None else b.float(), None if r is None else r.float(),
                          activation, first)
    # one candidate of each kernel (the ping-pong one, the first cooperative one) for every epilogue: the
    # epilogue code is the same in every candidate of a kernel, and each candidate compiles per epilogue
    # (test_gluon_candidates_match_reference runs every candidate with GELU + residual)
    out, again = _forced(cfg, lambda: gemm.linear_launch(x, w, b, r, activation, first))
    assert rel_l2(out.float(), ref) < TOL[torch.float16]
    assert torch.equal(out, again)


@gpu
@pytest.mark.parametrize("M,K,N", [(45, 64, 96), (1030, 768, 2304), (4096, 3072, 768)])
def test_gluon_weight_stored_k_by_n(M, K, N):
    # x @ W with W (K, N) row-major (GPT-2's Conv1D): the Gluon kernel loads W's (K, N) boxes
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    W = torch.randn(K, N, device="cuda", dtype=torch.float16) / K ** 0.5
    r = torch.randn(M, N, device="cuda", dtype=torch.float16)
    ref = gemm.linear_ref(x.float(), W.t().float(), None, r.float(), "gelu_tanh")
    applied = [outs for cfg in gemm.GLUON_CONFIGS
               if (outs := _forced(cfg, lambda: gemm.linear_launch(x, W.t(), None, r, "gelu_tanh"))) is not None]
    assert applied
    for out, again in applied:
        assert rel_l2(out.float(), ref) < TOL[torch.float16]
        assert torch.equal(out, again)


@gpu
def test_gluon_nan_and_inf_as_eager():
    x = torch.randn(200, 64, device="cuda", dtype=torch.float16)
    x[0, 1], x[1] = float("nan"), float("inf")
    w = torch.randn(128, 64, device="cuda", dtype=torch.float16)
    ref = gemm.linear_ref(x.double(), w.double(), None, None, "gelu")
    applied = [outs[0] for cfg in gemm.GLUON_CONFIGS
               if (outs := _forced(cfg, lambda: gemm.linear_launch(x, w, None, None, "gelu"), repeats=1)) is not None]
    assert applied
    for out in applied:
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isposinf(), ref.isposinf())


@gpu
def test_the_race_includes_gluon_on_sm90():
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.float16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
    assert gemm.gluon_problem(x, None, x) is None
    sizes = dict(M=2048, N=1024, K=1024, tma=True, dtype=torch.float16, gluon=True)
    assert any(c.kwargs.get("GLUON") for c in gemm.prune_configs(gemm.CONFIGS, sizes))
    out = gemm.linear_launch(x, w)
    assert rel_l2(out.float(), x.float() @ w.float().t()) < 2e-3
    assert not runtime.interpreted()


# ---------------------------------------------------------------------------------------------
# W8A8 (kernels/int8_gemm.py) on the same kernel: int8 x and weight, int32 accumulators, the two
# scales applied in fp32 before the epilogue, half outputs

def test_w8a8_gluon_candidates_only_where_the_kernel_takes_the_call():
    q = torch.zeros(8, 16, dtype=torch.int8)
    assert gemm.gluon_problem(q, None, q, mode=gemm.Mode.W8A8_RAW) is not None            # raw int32 accumulators: tl only
    assert gemm.gluon_problem(q, None, torch.zeros(8, 8, dtype=torch.float16), mode=gemm.Mode.W8A8) is not None   # not sm90
    sizes = dict(M=4096, N=4096, K=4096, tma=True, dtype=torch.int8, gluon=False)
    assert not any(c.kwargs.get("GLUON") for c in gemm.prune_configs(int8_gemm.CONFIGS, sizes))
    sizes["gluon"] = True
    offered = [c for c in gemm.prune_configs(int8_gemm.CONFIGS, sizes) if c.kwargs.get("GLUON")]
    assert offered and not any(c.kwargs.get("COOP") for c in offered)
    module, _ = gemm._hopper_import()
    for c in int8_gemm.GLUON_CONFIGS if module is not None else ():
        kw = c.kwargs
        assert module.smem_bytes(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["STAGES"], kw["CONSUMERS"],
                                 elem=1) <= 227 * 1024, kw


@pytest.mark.parametrize("kernel", ["w8a8", "fp8"])
def test_the_w8a8_gluon_gemm_builds_for_sm90_with_this_triton(kernel):
    """Here, without a GPU: every W8A8 candidate compiles for sm90 with one-byte MMAs in its SASS (int8: IGMMA;
    fp8 e4m3 operands, Fp8Config(weights_only=False): QGMMA)."""
    if gemm._hopper_import()[0] is None:
        pytest.skip(gemm._hopper_import()[1])
    script = Path(__file__).parents[1] / "bench" / "gluon_compile.py"
    done = subprocess.run([sys.executable, str(script), "--kernel", kernel, "--json"],
                          capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and rows, done.stdout[-2000:] + done.stderr[-2000:]
    for row in rows:
        assert row["hgmma"] > 0 and row["shared_bytes"] <= 227 * 1024, row


def _int8_operands(M, K, N, dtype=torch.float16):
    q = torch.randint(-127, 128, (M, K), device="cuda", dtype=torch.int8)
    w = torch.randint(-127, 128, (N, K), device="cuda", dtype=torch.int8)
    a_s = torch.rand(M, device="cuda") / 100 + 1e-4
    w_s = torch.rand(N, device="cuda") / 100 + 1e-4
    return q, w, a_s, w_s


def _cfg_id(c) -> str:
    return "x".join(str(c.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N", "STAGES", "CONSUMERS"))


@gpu
@pytest.mark.parametrize("M,K,N", [(130, 80, 136), (1000, 768, 2304), (257, 1040, 96), (4096, 512, 512)])
@pytest.mark.parametrize("cfg", int8_gemm.GLUON_CONFIGS, ids=_cfg_id)
def test_w8a8_gluon_bit_exact_without_epilogue(M, K, N, cfg):
    """No bias, no activation: the int32 sums are exact and the dequantization is the reference's two fp32
    products, so every output is the reference's, bit for bit (K tails zero-filled by the copy engine)."""
    q, w, a_s, w_s = _int8_operands(M, K, N)
    ref = int8_gemm.int8_gemm_ref(q, a_s, w, w_s, out_dtype=torch.float16)
    outs = forced_outputs(int8_gemm.TUNER, cfg, lambda: int8_gemm.int8_gemm_launch(q, a_s, w, w_s))
    if outs is None:
        pytest.skip("not a candidate for this shape")
    assert torch.equal(outs[0], ref) and torch.equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("activation,residual", [("gelu", "after"), ("relu", "first"), ("silu", "none")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", int8_gemm.GLUON_CONFIGS, ids=_cfg_id)
def test_w8a8_gluon_epilogues(activation, residual, dtype, cfg):
    M, K, N = 1000, 384, 520
    q, w, a_s, w_s = _int8_operands(M, K, N)
    b = torch.randn(N, device="cuda", dtype=dtype)
    r = torch.randn(M, N, device="cuda", dtype=dtype) if residual != "none" else None
    first = residual == "first"
    ref = int8_gemm.int8_gemm_ref(q, a_s, w, w_s, b, r, activation, first, out_dtype=torch.float32)
    outs = forced_outputs(int8_gemm.TUNER, cfg,
                          lambda: int8_gemm.int8_gemm_launch(q, a_s, w, w_s, b, r, activation, first, out_dtype=dtype))
    assert outs is not None
    out, again = outs
    assert out.dtype == dtype and torch.equal(out, again)
    # the same fp32 math up to the fused multiply-adds and the SFU's tanh: within the output's rounding
    assert rel_l2(out.float(), ref) <= 2 * torch.finfo(dtype).eps


@gpu
def test_w8a8_race_includes_gluon_on_sm90():
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.float16)
    w_q, w_s = int8_gemm.quantize_weight(torch.randn(1024, 1024, device="cuda") / 32)
    q = torch.zeros(2048, 1024, device="cuda", dtype=torch.int8)
    assert gemm.gluon_problem(q, None, x, mode=gemm.Mode.W8A8) is None
    sizes = dict(M=2048, N=1024, K=1024, tma=True, dtype=torch.int8, gluon=True)
    assert any(c.kwargs.get("GLUON") for c in gemm.prune_configs(int8_gemm.CONFIGS, sizes))
    out = int8_gemm.linear_w8a8_launch(x, w_q, w_s, activation="gelu")
    assert rel_l2(out.float(), int8_gemm.linear_w8a8_ref(x, w_q, w_s, activation="gelu").float()) <= 2e-3
