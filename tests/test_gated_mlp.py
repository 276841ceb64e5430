"""accelc::gated_linear (kernels/gated_linear.py) and the gated_mlp pass (passes/gated_mlp.py): a
gated MLP's gate and up projections as one GEMM with the act(a) * b epilogue."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import accelc
from accelc.kernels.epilogue import activation_ref
from accelc.kernels.gated_linear import TUNER, gated_linear_launch, gated_linear_ref, pack, unpack, why_unsupported
from conftest import DEVICE, assert_close_to_ref

FLOATS = [torch.float16, torch.bfloat16, torch.float32]
ATOL = {torch.float16: 1e-2, torch.bfloat16: 8e-2, torch.float32: 1e-4}


def _ref64(x, wg, wu, bg, bu, act):
    d = torch.float64
    g = F.linear(x.to(d), wg.to(d), None if bg is None else bg.to(d))
    u = F.linear(x.to(d), wu.to(d), None if bu is None else bu.to(d))
    return activation_ref(act, g) * u


def _eager(x, wg, wu, bg, bu, act):
    return activation_ref(act, F.linear(x, wg, bg)) * F.linear(x, wu, bu)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2, 9, 40, 24), (1, 1, 64, 48), (3, 33, 72, 40)])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_gated_linear_against_fp64(shape, dtype, act):
    """Widths that are and are not multiples of the 16-row interleave (padded), with and without biases."""
    B, L, K, N = shape
    x = torch.randn(B, L, K, device=DEVICE).to(dtype)
    wg, wu = (torch.randn(N, K, device=DEVICE).div(K ** 0.5).to(dtype) for _ in range(2))
    bg, bu = (torch.randn(N, device=DEVICE).to(dtype) for _ in range(2))
    for biases in ((None, None), (bg, bu), (bg, None)):
        w, b = pack(wg, wu, *biases)
        out = gated_linear_launch(x, w, b, N, act)
        ref = _ref64(x, wg, wu, *biases, act)
        assert_close_to_ref(out, ref, _eager(x, wg, wu, *biases, act), dtype, atol=ATOL[dtype], rtol=ATOL[dtype])
        assert torch.allclose(gated_linear_ref(x, w, b, N, act).double(), ref, atol=ATOL[dtype], rtol=ATOL[dtype])


def test_pack_interleaves_and_unpacks_exactly():
    """Rows [g0..g15, u0..u15, g16..], zero-padded to 16; views (a slice of a fused gate_up matrix,
    transposed storage) pack the same as their copies."""
    K, N = 24, 40
    gate_up = torch.randn(2 * N, K, device=DEVICE)
    wg, wu = gate_up[:N], torch.randn(K, N, device=DEVICE).t()
    bg, bu = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    w, b = pack(wg, wu, bg, bu)
    assert w.shape == (96, K) and b.shape == (96,) and w.is_contiguous()
    assert torch.equal(w[:16], wg[:16]) and torch.equal(w[16:32], wu[:16]) and torch.equal(w[32:48], wg[16:32])
    assert torch.equal(w[64:72], wg[32:40]) and not w[72:80].any() and not w[88:].any()
    for got, want in zip(unpack(w, b, N), (wg, wu, bg, bu)):
        assert torch.equal(got, want)
    assert pack(wg, wu)[1] is None
    assert torch.equal(unpack(*pack(wg, wu, None, bu), N)[2], torch.zeros(N, device=DEVICE))


def test_strided_rows():
    K, N = 48, 32
    wg, wu = (torch.randn(N, K, device=DEVICE, dtype=torch.float16) / K ** 0.5 for _ in range(2))
    x = torch.randn(5, 2 * K, device=DEVICE, dtype=torch.float16)[:, ::2]
    out = gated_linear_launch(x, *pack(wg, wu), N, "silu")
    assert_close_to_ref(out, _ref64(x, wg, wu, None, None, "silu"), _eager(x, wg, wu, None, None, "silu"),
                        torch.float16, atol=1e-2, rtol=1e-2)


def test_nan_and_inf_as_eager():
    K, N = 32, 16
    x = torch.randn(4, K, device=DEVICE)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    wg, wu = torch.randn(N, K, device=DEVICE), torch.randn(N, K, device=DEVICE)
    out = gated_linear_launch(x, *pack(wg, wu), N, "silu")
    eager = _eager(x, wg, wu, None, None, "silu")
    assert torch.equal(out.isnan(), eager.isnan()) and out[1].isnan().all()
    assert torch.isfinite(out[[0, 3]]).all()


def test_empty_and_why_unsupported():
    w = torch.randn(8, 16, device=DEVICE)
    assert gated_linear_launch(torch.empty(0, 16, device=DEVICE), *pack(w, w), 8).shape == (0, 8)
    m = torch.empty(4, 16, device="meta", dtype=torch.float16)
    wm = torch.empty(8, 16, device="meta", dtype=torch.float16)
    assert why_unsupported(m, wm, wm) is None
    assert "differ in width" in why_unsupported(m, wm, torch.empty(4, 16, device="meta", dtype=torch.float16))
    assert "(N, 16)" in why_unsupported(m, torch.empty(8, 12, device="meta", dtype=torch.float16), wm)
    assert "float32" in why_unsupported(m, wm.float(), wm)
    assert "activation" in why_unsupported(m, wm, wm, activation="none")
    assert "gate bias" in why_unsupported(m, wm, wm, torch.empty(7, device="meta", dtype=torch.float16))
    with pytest.raises(ValueError, match="accelc::gated_linear: the packed weight"):
        torch.ops.accelc.gated_linear(torch.randn(2, 16), torch.randn(8, 16), None, 8)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the tuned configs need a GPU (the interpreter runs one)")
def test_every_candidate_config_is_correct():
    from accelc.kernels.gemm import CONFIGS, launch, prune_configs, tma_ok

    for M, K, N in ((300, 256, 200), (16, 128, 96)):
        x = torch.randn(M, K, device=DEVICE, dtype=torch.float16)
        wg, wu = (torch.randn(N, K, device=DEVICE, dtype=torch.float16) / K ** 0.5 for _ in range(2))
        w, _ = pack(wg, wu)
        ref = _ref64(x, wg, wu, None, None, "silu")
        for cfg in prune_configs(CONFIGS, dict(M=M, N=w.shape[0], K=K, tma=tma_ok(x) and tma_ok(w))):
            out = torch.empty(M, N, device=DEVICE, dtype=torch.float16)
            launch(x, w, None, None, out, "silu", config=cfg, tuner=TUNER, gated=True)
            torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2, msg=str(cfg))


# ---------------------------------------------------------------------------------------------
# the pass

class GatedMLP(nn.Module):
    def __init__(self, d=32, h=48, act=F.silu, bias=False, up_first=False):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, h, bias=bias), nn.Linear(d, h, bias=bias)
        self.down_proj = nn.Linear(h, d, bias=bias)
        self.act, self.up_first = act, up_first

    def forward(self, x):
        g = self.act(self.gate_proj(x))
        u = self.up_proj(x)
        return self.down_proj(u * g if self.up_first else g * u)


def _kernels(opt):
    return {r.name: r.kernel for r in opt.layers if r.status == "rewritten"}


@pytest.mark.parametrize("act, label", [(F.silu, "silu"), (nn.SiLU(), "silu"), (F.gelu, "gelu"),
                                        (nn.GELU(approximate="tanh"), "gelu_tanh"), (F.relu, "relu")])
@pytest.mark.parametrize("up_first", [False, True])
def test_gated_mlps_rewritten(act, label, up_first):
    model = GatedMLP(act=act, up_first=up_first, bias=up_first).to(DEVICE).half().eval()
    x = torch.randn(2, 8, 32, device=DEVICE, dtype=torch.float16)
    opt = accelc.optimize(model, (x,))
    kernels = _kernels(opt)
    assert f"accelc::gated_linear[{label}]" in kernels.values(), opt.summary()
    assert kernels["down_proj"] == "accelc::linear"
    assert not [r for r in opt.layers if r.status != "rewritten"], opt.summary()
    with torch.no_grad():
        ref = model.double()(x.double())
        out, eager = opt(x), model.half()(x)
    assert_close_to_ref(out, ref, eager, torch.float16, atol=1e-2, rtol=1e-2)


def test_gated_linear_layers_in_the_flop_coverage():
    model = GatedMLP().to(DEVICE).half().eval()
    opt = accelc.optimize(model, (torch.randn(2, 8, 32, device=DEVICE, dtype=torch.float16),))
    assert opt.info.flops == 3 * 2 * 16 * 32 * 48
    assert opt.info.accelc_flops == opt.info.flops


def test_a_packed_layer_holds_its_weights_once_and_the_report_reads_the_originals_from_the_model():
    """The packed gate / up weight is the optimized module's; the layer's original subgraph (what
    the report times and ORT exports) let go of the two it replaced (they stayed alive beside the
    packed one: 924 MiB on a 1.1B Llama) and reads them from the model: same numbers."""
    from accelc import guard, meta, stages
    from accelc.rewrite import layers

    torch.manual_seed(0)
    model = GatedMLP(bias=True).to(DEVICE).eval()
    x = torch.randn(2, 8, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    gm = opt.graph_module
    gated = [meta.rewrite_of(n) for n in layers(gm) if meta.rewrite_of(n).kind == "gated_linear"]
    linear = [meta.rewrite_of(n) for n in layers(gm) if meta.rewrite_of(n).kind == "linear"]
    assert len(gated) == 1 and gated[0].released and linear and not any(rw.released for rw in linear)
    assert opt.info.original_weight_bytes == 0
    assert stages.tensor_bytes([opt]) <= stages.tensor_bytes([model]) + 2 * 48 * 4 * 16    # the pack's 16-row padding
    ins, _ = guard.layer_inputs(gm, (x,), model)[next(n for n in layers(gm) if meta.rewrite_of(n) is gated[0])]
    with torch.no_grad():
        want = F.silu(model.gate_proj(x)) * model.up_proj(x)
        assert torch.equal(gated[0].eager(model)(*ins), want)
    with pytest.raises(ValueError, match="float weights were released; pass the model"):
        gated[0].eager()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory")
def test_optimize_leaves_a_gated_models_weights_allocated_once_on_the_gpu():
    """What optimize leaves allocated is the optimized module's copy of the weights (the caller's
    model apart): the gated layer's original gate and up weights, 16 MiB here, no longer stay
    alive beside the packed one (on a 1.1B Llama: 924 MiB, H100)."""
    import gc

    from accelc import stages
    from accelc.latency import layer_ms

    torch.manual_seed(0)
    model = GatedMLP(d=1024, h=4096).to("cuda").half().eval()       # three 8 MiB weights
    x = torch.randn(4, 64, 1024, device="cuda", dtype=torch.half)
    layer_ms(lambda: x @ x.transpose(1, 2), "cuda", rep_ms=1)       # both streams' cuBLAS workspaces, first

    def allocated():
        # cuBLAS / cuBLASLt keep a workspace per stream (32 MiB each on sm90), cached for the process:
        # PyTorch's, not the model's; cleared before each reading, and said apart in the message
        gc.collect()
        torch.cuda.synchronize()
        with_workspaces = torch.cuda.memory_allocated()
        torch._C._cuda_clearCublasWorkspaces()
        return torch.cuda.memory_allocated(), with_workspaces

    before, _ = allocated()
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(only_if_faster=False))   # the packed layer stays
    after, with_workspaces = allocated()
    assert "accelc::gated_linear[silu]" in _kernels(opt).values(), opt.summary()
    grown = after - before
    assert grown < stages.tensor_bytes([model]) + 4 * 2**20, \
        f"optimize left {grown / 2**20:.1f} MiB allocated for {stages.tensor_bytes([model]) / 2**20:.0f} MiB of weights " \
        f"({(with_workspaces - after) / 2**20:.1f} MiB more in cuBLAS workspaces)"
    print(f"grown {grown / 2**20:.1f} MiB; cuBLAS workspaces {(with_workspaces - after) / 2**20:.1f} MiB")
    assert opt(x).shape == x.shape


def alive_beside(model, opt_fn) -> dict:
    """{storage: shape} of the tensors of 1024 elements or more that opt_fn() (an optimize) left alive
    and that neither the model nor the optimized module holds."""
    import gc

    gc.collect()
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    opt = opt_fn()
    gc.collect()
    owned |= {t.untyped_storage().data_ptr() for t in [*opt.parameters(), *opt.buffers(), *_runner_tensors(opt)]}
    return {_storage(o): tuple(o.shape) for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and id(o) not in before and not o.is_meta and o.numel() >= 1024
            and _storage(o) not in owned | {None}}


def _runner_tensors(opt) -> list:
    """What the optimized module's runner holds on a GPU: its CUDA graphs' input buffers and the byte
    arena their outputs are copied into (the module's, not a released weight)."""
    runner = getattr(opt, "runner", None)
    if runner is None:
        return []
    held = [runner.arena] + [x for e in runner.entries.values() for x in [*e.inputs, *pytree.tree_leaves(e.outputs)]]
    return [t for t in held if isinstance(t, torch.Tensor)]


def _storage(t):
    """The data pointer of a tensor's memory; None for one without memory of its own (the fake
    tensors a compiler keeps: the Inductor glue's on a GPU)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def test_released_originals_are_freed_not_kept_alive_by_their_meta_copies():
    """A released layer keeps its original graph over meta copies of its tensors. Made from weights
    that require grad, a meta copy's grad_fn held the weight (the capture's copy of the gate and up
    weights: alive beside the packed one, 16 of 73 MiB an optimize left on an H100). Nothing but
    the model's and the optimized module's tensors stays alive; the same for a folded BN and for
    int8 layers, which release theirs too."""
    torch.manual_seed(0)
    conv_bn = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
    cases = [(GatedMLP(d=64, h=256), torch.randn(2, 4, 64), {}),
             (conv_bn, torch.randn(1, 16, 8, 8), {}),
             (nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)), torch.randn(4, 64),
              {"int8": accelc.Int8Config(weights_only=True, skip_first_last=False)})]
    for model, x, cfg in cases:
        model, x = model.to(DEVICE).eval(), x.to(DEVICE)
        assert all(p.requires_grad for p in model.parameters())
        config = accelc.OptimizeConfig(only_if_faster=False, **cfg)
        left = alive_beside(model, lambda: accelc.optimize(model, (x,), config))
        assert left == {}, (type(model).__name__, left)


class NotGated(nn.Module):
    """Look-alikes that are no gated MLP: the gate's output also read elsewhere, two different
    inputs, an activation the epilogue lacks."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(d, d) for _ in range(4))
        self.e, self.f = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, y):
        g = F.silu(self.a(x))
        shared = g * self.b(x) + g                  # the activation read twice
        other = F.silu(self.c(x)) * self.d(y)       # gate and up over different inputs
        leaky = F.leaky_relu(self.e(x)) * self.f(x)
        return shared + other + leaky


def test_look_alikes_stay_separate_linears():
    model = NotGated().to(DEVICE).eval()
    x, y = torch.randn(4, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    opt = accelc.optimize(model, (x, y))
    assert not [k for k in _kernels(opt).values() if "gated" in k], opt.summary()
    assert sum(k.startswith("accelc::linear") for k in _kernels(opt).values()) == 6
    with torch.no_grad():
        assert torch.allclose(opt(x, y), model(x, y), atol=1e-4)


def test_gated_pass_can_be_turned_off():
    from accelc.pipeline import PASS_NAMES

    model = GatedMLP().to(DEVICE).eval()
    x = torch.randn(2, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(passes=[p for p in PASS_NAMES if p != "gated_mlp"]))
    assert "accelc::linear[silu]" in _kernels(opt).values() and opt.info.pass_counts["linear_act"] == 3


def test_weights_computed_at_run_time_stay_two_linears():
    """A gate weight computed at each call (`w * 2`) is not packed with the up projection's; fold_weights (on by
    default) computes it once at optimize, a weight like another, and the pair is one gated layer."""
    from accelc.pipeline import PASS_NAMES

    class Scaled(GatedMLP):
        def forward(self, x):
            return self.down_proj(F.silu(F.linear(x, self.gate_proj.weight * 2)) * self.up_proj(x))
    model = Scaled().to(DEVICE).eval()
    x = torch.randn(2, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,), accelc.OptimizeConfig(passes=[p for p in PASS_NAMES if p != "fold_weights"]))
    assert not [k for k in _kernels(opt).values() if "gated" in k], opt.summary()
    folded = accelc.optimize(model, (x,))
    assert [k for k in _kernels(folded).values() if "gated" in k], folded.summary()
    with torch.no_grad():
        assert torch.allclose(opt(x), model(x), atol=1e-4) and torch.allclose(folded(x), model(x), atol=1e-4)


class _FusedGateUp(nn.Module):
    """Phi-3's form: one gate_up projection chunked in two along its output, `up * act(gate)`;
    `dim` as the model writes it (2 is the last dim of a 3-D input, as -1)."""

    def __init__(self, dim=-1, bias=False, order="up_first"):
        super().__init__()
        self.gate_up = nn.Linear(32, 2 * 40, bias=bias)
        self.down = nn.Linear(40, 32)
        self.dim, self.order = dim, order

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=self.dim)
        return self.down(up * F.silu(gate) if self.order == "up_first" else F.silu(gate) * up)


@pytest.mark.parametrize("dim,bias,order", [(-1, False, "up_first"), (2, True, "gate_first")])
def test_a_fused_gate_up_projection_chunked_in_two_is_one_gated_linear(dim, bias, order):
    torch.manual_seed(0)
    model = _FusedGateUp(dim, bias, order).to(DEVICE).eval()
    x = torch.randn(2, 7, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    kernels = [r.kernel for r in opt.layers if r.status == "rewritten"]
    assert "accelc::gated_linear[silu]" in kernels, opt.summary()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_chunk_along_another_dim_is_no_gated_mlp():
    class Rows(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 80)

        def forward(self, x):          # halves of the rows (dim 0), not of the output features
            a, b = self.fc(x).chunk(2, dim=0)
            return b * F.silu(a)
    model = Rows().to(DEVICE).eval()
    x = torch.randn(4, 32, device=DEVICE)
    opt = accelc.optimize(model, (x,))
    assert not any("gated_linear" in r.kernel for r in opt.layers if r.kernel)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)


def test_phi3s_mlp_under_torch_export_is_one_gated_linear():
    T = pytest.importorskip("transformers")
    import warnings
    cfg = T.Phi3Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, vocab_size=100, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.Phi3Model(cfg).to(DEVICE).eval()
        ids = torch.randint(1, 100, (2, 8), device=DEVICE)
        opt = accelc.optimize(model, {"input_ids": ids})
    assert opt.info.capture_method == "torch.export"
    # (with the RMSNorm before it taken in: accelc::rms_norm+gated_linear[silu])
    assert sum(r.kernel.endswith("gated_linear[silu]") for r in opt.layers if r.status == "rewritten") == 1
    with torch.no_grad():
        got, want = opt(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
