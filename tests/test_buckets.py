"""accelc/buckets.py and the runner's use of it: calls padded up to bucket sizes, found inert by
running the model padded (never assumed), outputs cut back to the call's sizes and equal to an
unpadded call; outputs copied into one arena; warm-up shapes. (CPU: a stand-in capture where a
CUDA graph would be; tiny configs of real HF families, fp32.)"""
import warnings

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import accelc
from accelc import buckets, cuda_graphs, runner, runtime
from accelc.capture.shapes import SHAPES, DimRange, InputShapes
from accelc.errors import InputError
from accelc.numerics import rel_l2
from conftest import DEVICE, count_calls
from test_runner import Captures

T = pytest.importorskip("transformers")
TOL = 1e-5


def tol(dtype):
    return TOL


def test_bucket_sizes_and_the_bucket_of_a_size():
    assert buckets.bucket_sizes(1, None, upto=64) == [1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert buckets.bucket_sizes(1, 512)[-5:] == [256, 320, 384, 448, 512]
    assert buckets.bucket_sizes(1, 100)[-2:] == [96, 100]           # the range's end is the last bucket
    assert buckets.bucket_sizes(8, 20) == [8, 12, 16, 20]
    r = DimRange(1, None)
    assert [buckets.bucket(n, r) for n in (1, 3, 8, 9, 13, 17, 33, 100, 423)] == [1, 4, 8, 12, 16, 20, 40, 112, 448]
    # from 16 on, a padded call is at most a fifth padding (a large call is GPU-bound: padding is time)
    assert all((buckets.bucket(n, r) - n) / buckets.bucket(n, r) <= 0.2 for n in range(16, 2000))
    assert buckets.bucket(97, DimRange(1, 100)) == 100
    assert buckets.bucket(3, DimRange(8, 100)) == 3 and buckets.bucket(101, DimRange(8, 100)) == 101   # outside: as it is
    with pytest.raises(ValueError):
        buckets.bucket_sizes(1, None)


def _bert(mask=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, vocab_size=100, max_position_embeddings=64))
    return model.to(DEVICE).eval()


def _gpt2():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return T.GPT2Model(T.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=64,
                                        use_cache=False)).to(DEVICE).eval()


def _ids(b, n, mask=True):
    ids = torch.randint(0, 100, (b, n), device=DEVICE)
    return {"input_ids": ids, "attention_mask": torch.ones(b, n, dtype=torch.long, device=DEVICE)} if mask \
        else {"input_ids": ids}


def _plan(model, inputs):
    """buckets.find on the captured (not rewritten) graph of model at inputs."""
    from accelc.capture import CALL_SPEC, capture
    from accelc.capture.shapes import SHAPES
    gm, _, _ = capture(model, (), inputs)
    flat = gm.meta[CALL_SPEC].flat((), inputs)
    return buckets.find(gm, flat, gm.meta[SHAPES], tol), gm, flat


def test_a_masked_model_pads_batch_and_length_and_an_unmasked_one_only_its_batch():
    torch.manual_seed(0)
    (plan, note), _, _ = _plan(_bert(), _ids(2, 16))
    assert plan is not None and set(plan.words.values()) == {"batch", "input_ids dim 1"}, note
    fills = dict(zip(("input_ids", "attention_mask"), plan.inputs))
    assert (1, plan.inputs[0][1][1], 0) in fills["attention_mask"]        # the mask pads with 0
    assert all(f == "edge" for _, _, f in fills["input_ids"])
    # without a mask, BERT's padded tokens are attended: the real tokens change, so the length stays exact
    (plan, note), _, _ = _plan(_bert(), _ids(2, 16, mask=False))
    assert set(plan.words.values()) == {"batch"}
    assert "input_ids dim 1 does not pad: the real part of an output depends on what the padding holds" in note


def test_causal_attention_pads_its_length_without_a_mask():
    torch.manual_seed(0)
    (plan, note), _, _ = _plan(_gpt2(), _ids(2, 16, mask=False))
    assert set(plan.words.values()) == {"batch", "input_ids dim 1"}, note


def test_a_model_that_mixes_rows_does_not_pad_its_batch():
    class Centered(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x - x.mean(0, keepdim=True))   # a statistic over the batch

    from accelc.capture import capture
    from accelc.capture.shapes import SHAPES
    torch.manual_seed(0)
    x = torch.randn(4, 8, device=DEVICE)
    gm, _, _ = capture(Centered().to(DEVICE).eval(), (x,), {})
    plan, note = buckets.find(gm, (x,), gm.meta[SHAPES], tol)
    assert plan is None and "batch does not pad: the real part of an output depends on what the padding holds" in note
    # the same graph without the statistic: its rows are independent, and the batch pads
    mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU()).to(DEVICE).eval()
    gm, _, _ = capture(mlp, (x,), {})
    plan, note = buckets.find(gm, (x,), gm.meta[SHAPES], tol)
    assert plan is not None and list(plan.words.values()) == ["batch"] and plan.outputs == (((0, plan.inputs[0][0][1]),),)


def test_a_padded_call_off_the_floor_is_refused_where_the_models_own_error_is_unknown():
    """own_error() returning None (the model does not run in higher precision): the floor alone decides, a
    padded call that misses it is refused in words, and nothing raises."""
    class Rowwise(nn.Module):       # each row's output independent of the others', but not bit-equal when padded
        def forward(self, x):
            return x * 2 + 2e-5 * x.shape[0]

    from accelc.capture import capture
    torch.manual_seed(0)
    x = torch.randn(4, 8, device=DEVICE)
    gm, _, _ = capture(Rowwise().eval(), (x,), {})
    asked = []
    plan, note = buckets.find(gm, (x,), gm.meta[SHAPES], tol, lambda: asked.append(1))
    assert asked and plan is None, note
    assert "batch does not pad: the real part of an output changes when padded" in note
    assert "own error" not in note
    # and with the model's own error known, the floor widens by it
    plan, note = buckets.find(gm, (x,), gm.meta[SHAPES], tol, lambda: 1e-4)
    assert plan is not None, note


def _padding_check_asking_own_error(monkeypatch) -> list:
    """optimize's padding check run on the CPU (the plan stood in for a GPU's: CUDA graphs), and asking for the
    model's own error at once, as a tensor-parallel graph's does; what each ask gave, in the list returned."""
    monkeypatch.setattr(runner, "plan", lambda config, device, gm=None: ("eager", True, "test: CUDA graphs"))
    real, owns = buckets.find, []

    def find(fn, args, shapes, tolerance, own_error=None, before=None):
        owns.append(own_error())
        return real(fn, args, shapes, tolerance, own_error, before)
    monkeypatch.setattr(buckets, "find", find)
    return owns


def test_optimize_where_the_model_does_not_run_in_higher_precision_pads_by_the_floor(monkeypatch):
    """The padding check asks for the model's own error (a tensor-parallel graph always, any other where a padded
    call misses the floor); a model without a higher-precision run gives None there, not an exception out of
    optimize (a GPU-only path: the check runs where CUDA graphs do, stood in for here)."""
    from accelc import api

    def fails(*args, **kwargs):
        raise RuntimeError("no fp32 path")
    monkeypatch.setattr(api, "capture_reference", fails)
    owns = _padding_check_asking_own_error(monkeypatch)
    torch.manual_seed(0)
    model = _bert()
    opt = accelc.optimize(model, _ids(2, 16), config=accelc.OptimizeConfig(passes=()))
    assert owns == [None]
    assert "padded to buckets for CUDA graphs (checked inert): batch to 1, 2, 4, 8" in opt.summary()


def test_the_padding_check_and_the_output_budget_share_one_higher_precision_run(monkeypatch):
    """The model's run in higher precision (a whole model in fp32) serves both the padding check's own error and
    the guard's output_error budget: it runs once (the check stood in on the CPU, as above)."""
    from accelc import api

    runs = count_calls(monkeypatch, api, "capture_reference")
    owns = _padding_check_asking_own_error(monkeypatch)
    torch.manual_seed(0)
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    (x,) = model.example_inputs(2)
    accelc.optimize(model, (x,), accelc.OptimizeConfig(dtype="fp16", fp8=accelc.Fp8Config(
        weights_only=False, skip_first_last=False, only_if_faster=False, output_error=1e6)))
    assert owns and owns[0] is not None and len(runs) == 1, (owns, runs)


def test_padded_calls_replay_a_buckets_graph_and_give_the_unpadded_outputs():
    torch.manual_seed(0)
    (plan, _), gm, flat = _plan(_bert(), _ids(2, 16))
    cap = Captures()
    r = runner.Runner(gm, cuda_graphs=True, capture=cap, padding=plan)
    for b, n in [(3, 9), (4, 11), (2, 16), (1, 1), (3, 10)]:
        call = _ids(b, n)
        call["attention_mask"][0, n // 2:] = 0 if n > 1 else 1        # a padded row of the caller's own
        got = r(call["input_ids"], call["attention_mask"])
        want = gm(call["input_ids"], call["attention_mask"])
        for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
            assert g.shape == w.shape and g.is_contiguous() and rel_l2(g, w) < TOL, (b, n)
    # (3, 9), (4, 11) and (3, 10) share the bucket (4, 12); (2, 16) is one; (1, 1) is below the ranges'
    # lower end (export states 2; the optimize path lowers it to 1 once the guard checked 1 x 1): a
    # size outside the range is not padded into it, it runs as it is
    assert len(cap.graphs) == 3 and [g.replays for g in cap.graphs] == [3, 1, 1]
    assert "3 of 5 call(s) padded to a bucket" in r.status()


def test_exact_sizes_are_captured_at_their_second_call():
    cap = Captures()
    r = runner.Runner(lambda x: x * 2, cuda_graphs=True, capture=cap, capture_after=2)
    x = torch.randn(3, 4)
    assert torch.equal(r(x), x * 2) and len(cap.graphs) == 0
    assert torch.equal(r(x), x * 2) and len(cap.graphs) == 1
    assert torch.equal(r(torch.ones(5, 4)), torch.full((5, 4), 2.0)) and len(cap.graphs) == 1
    r.warm_up(torch.randn(7, 4))                          # a warm-up captures at once
    assert len(cap.graphs) == 2
    assert "2 call(s) at a size not met before ran as plain calls" in r.status()


def test_outputs_land_in_one_arena_aligned_each_in_its_dtype():
    made = []

    def arena_for(n):
        made.append(torch.zeros(n, dtype=torch.uint8))
        return made[-1]
    outs = {"h": torch.randn(3, 5), "ids": torch.arange(7), "flag": torch.tensor(True), "n": 3,
            "half": torch.randn(2, 3).half().t(),
            "image": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
            "gaps": torch.randn(4, 6)[:, :3]}
    slots = cuda_graphs.output_slots(outs, arena_for)
    tensors = ("h", "ids", "flag", "half", "image", "gaps")
    assert len(made) == 1 and made[0].numel() == 7 * 256             # the image takes two slots of 256
    for k in tensors:
        assert slots[k].shape == outs[k].shape and slots[k].dtype == outs[k].dtype
        assert slots[k].untyped_storage().data_ptr() == made[0].untyped_storage().data_ptr()
        slots[k].copy_(outs[k])
        assert torch.equal(slots[k], outs[k])
    # each dense output keeps its layout (eager's channels_last image stays channels_last: a row-major
    # slot changed CNNs' output layout under CUDA graphs); one with gaps is row-major
    for k in ("h", "ids", "flag", "half", "image"):
        assert slots[k].stride() == outs[k].stride(), k
    assert slots["image"].is_contiguous(memory_format=torch.channels_last) and slots["gaps"].is_contiguous()
    assert slots["n"] == 3
    starts = sorted(slots[k].data_ptr() - made[0].data_ptr() for k in tensors)
    assert starts == [0, 256, 512, 768, 1024, 1536]


def test_optimize_finds_the_padding_and_says_it(monkeypatch):
    """The whole path where CUDA graphs would run (a stand-in plan on the CPU: the capture itself
    fails there, so the padded call runs plainly and is cut back)."""
    monkeypatch.setattr(runner, "plan", lambda config, device, gm=None: ("eager", True, "test: CUDA graphs"))
    torch.manual_seed(0)
    model = _bert()
    opt = accelc.optimize(model, _ids(2, 16))
    text = opt.summary()
    assert "padded to buckets for CUDA graphs (checked inert): batch to 1, 2, 4, 8" in text, text
    assert "input_ids dim 1 to 1, 2, 4, 8, 12, 16, 20, 24, ..., 64" in text, text
    call = _ids(3, 10)
    call["attention_mask"][1, 6:] = 0
    with torch.no_grad():
        got, want = opt(**call).last_hidden_state, model(**call).last_hidden_state
    assert got.shape == want.shape and rel_l2(got, want) < TOL
    assert opt.runner.padded == 1
    # every dim that varies pads: the buckets are few, each captured at its first call
    assert opt.runner.capture_after == 1
    # the plans alone from here on: no layer rewritten, none checked in the interpreter
    plain = accelc.OptimizeConfig(passes=())
    unmasked = accelc.optimize(model, _ids(2, 16, mask=False), config=plain)
    unmasked(**_ids(3, 10, mask=False))
    assert unmasked.runner.capture_after == 2          # the length does not pad: exact sizes, many
    off = accelc.optimize(model, _ids(2, 16), config=accelc.OptimizeConfig(padding=False, passes=()))
    assert "padded to buckets" not in off.summary()
    # a declared range is not stretched by padding: a length below it is refused, naming the limit
    dyn = {"input_ids": {0: (1, 4), 1: (8, 32)}, "attention_mask": {0: (1, 4), 1: (8, 32)}}
    ranged = accelc.optimize(model, _ids(2, 16), dynamic=dyn, config=plain)
    assert "input_ids dim 1 to 8, 12, 16, 20, 24, 28, 32" in ranged.summary()
    assert ranged(**_ids(3, 9)).last_hidden_state.shape == (3, 9, 32)
    with pytest.raises(InputError, match="dim 1 is 5: at least 8"):
        ranged(**_ids(3, 5))


def test_warmup_shapes_are_checked_and_said():
    torch.manual_seed(0)
    model = _bert()
    opt = accelc.optimize(model, _ids(2, 16), warmup_shapes=[{"input_ids": (4, 32)}, {"attention_mask": (1, 8)}])
    said = ("captured at optimize time" if runtime.can_time(DEVICE) else "not captured: no CUDA graphs on this device")
    assert f"2 warm-up shape(s) {said}" in opt.summary()
    for shapes, message in [
        ([{"input_id": (4, 32)}], "the optimized model's inputs are"),
        ([{"input_ids": (4, 65)}], "dim 1 is 65, outside its range 1..64"),
        ([{"input_ids": (4,)}], "it has 2 dims"),
        ([{"input_ids": (4, 8), "attention_mask": (4, 9)}], "where another input's same dim is 8"),
    ]:
        with pytest.raises(InputError, match=message):
            accelc.optimize(model, _ids(2, 16), warmup_shapes=shapes)


def test_a_warmup_shape_of_one_input_sizes_the_inputs_that_share_its_dims():
    """Export gives BERT's ids and mask batch two symbols: a warm-up shape naming the mask alone
    must size the ids' batch too (ids of the example's batch 2 against a mask of batch 3 index out
    of range: a device-side assert on the GPU, the process's CUDA context lost)."""
    from accelc.capture.shapes import SHAPES
    torch.manual_seed(0)
    _, gm, flat = _plan(_bert(), _ids(2, 16))
    shapes = gm.meta[SHAPES]
    ids_batch, mask_batch = shapes.dims[0][0], shapes.dims[1][0]
    assert isinstance(ids_batch, DimRange) and isinstance(mask_batch, DimRange)
    ids, mask = shapes.inputs_at(flat, shapes.sizes_of({"attention_mask": (3, 8)}, flat))
    assert ids.shape == mask.shape == (3, 8)
    ids, mask = shapes.inputs_at(flat, shapes.sizes_of({"input_ids": (4, 32)}, flat))
    assert ids.shape == mask.shape == (4, 32)


def test_warmup_of_every_bucket_needs_ranges_with_an_end(monkeypatch):
    monkeypatch.setattr(runner, "plan", lambda config, device, gm=None: ("eager", True, "test: CUDA graphs"))
    torch.manual_seed(0)
    with pytest.raises(InputError, match='"buckets": batch has no upper end'):
        accelc.optimize(_bert(), _ids(2, 16), warmup_shapes="buckets")
    dyn = {"input_ids": {0: (1, 4), 1: (1, 16)}, "attention_mask": {0: (1, 4), 1: (1, 16)}}
    opt = accelc.optimize(_bert(), _ids(2, 16), warmup_shapes="buckets", dynamic=dyn)
    # batch 1, 2, 4 x length 1, 2, 4, 8, 12, 16; on the CPU nothing is captured, and that is said
    said = "captured at optimize time" if runtime.can_time(DEVICE) else "not captured"
    assert f"18 warm-up shape(s) {said}" in opt.summary()


def test_inputs_at_repeat_the_example():
    shapes = InputShapes(("ids",), ((DimRange(1, None, "s0"), DimRange(1, 64, "s1")),))
    ids = torch.arange(6).reshape(2, 3)
    (got,) = shapes.inputs_at((ids,), {"s0": 3, "s1": 5})
    assert got.tolist() == [[0, 1, 2, 0, 1], [3, 4, 5, 3, 4], [0, 1, 2, 0, 1]]
    # the guard's other sizes and the warm-up shapes keep the example's layout (a channels_last image
    # was checked and captured row-major: kernels tested on a layout the calls do not have)
    image = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    shapes = InputShapes(("x",), ((DimRange(1, None, "b"), 3, 4, 4),))
    (got,) = shapes.inputs_at((image,), {"b": 5})
    assert got.shape == (5, 3, 4, 4) and got.is_contiguous(memory_format=torch.channels_last)
    assert not got.is_contiguous() and torch.equal(got[2:4], image)


def test_padding_keeps_each_inputs_memory_layout():
    """A channels_last image padded along its batch, height or width stays channels_last (a row-major
    zero tail made the cat row-major: the kernels then ran, and the outputs came back, in another
    layout than eager's), with both fills; a row-major input stays row-major."""
    image = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    rows = torch.randn(2, 7)
    for d in (0, 2, 3):
        for fill in ("edge", 0):
            plan = buckets.Padding(ranges={}, inputs=(((d, "s", fill),), ((0, "b", 0),)), outputs=(), words={})
            big, r = plan.pad((image, rows), {"s": image.shape[d] + 3, "b": 4})
            assert big.is_contiguous(memory_format=torch.channels_last) and not big.is_contiguous(), (d, fill)
            assert torch.equal(big.narrow(d, 0, image.shape[d]), image) and r.is_contiguous() and r.shape == (4, 7)
            tail = big.narrow(d, image.shape[d], 3)
            assert torch.equal(tail, image.narrow(d, image.shape[d] - 1, 1).expand_as(tail) if fill == "edge"
                               else torch.zeros_like(tail))


def test_a_bucket_the_models_own_check_refuses_runs_the_call_at_its_own_size():
    """A model's assertion on its batch (`batch < 100`) met the padded size: a call of 99 rows, which
    eager takes, was refused at its bucket, and a refused call named the bucket's size ("batch 104
    too large") instead of the call's. The call now runs at its own size: eager's result, or eager's
    message with the call's numbers."""
    class Checked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            torch._assert(x.shape[0] < 100, f"batch {x.shape[0]} too large")
            return self.fc(x)

    from accelc.capture import capture
    from accelc.capture.shapes import SHAPES
    torch.manual_seed(0)
    model = Checked().to(DEVICE).eval()
    x = torch.randn(4, 8, device=DEVICE)
    gm, _, _ = capture(model, (x,), {})
    plan, _ = buckets.find(gm, (x,), gm.meta[SHAPES], tol)
    assert plan is not None and buckets.bucket(99, next(iter(plan.ranges.values()))) > 99
    cap = Captures()
    r = runner.Runner(gm, cuda_graphs=True, capture=cap, padding=plan)
    y = torch.randn(99, 8, device=DEVICE)
    with torch.no_grad():
        assert rel_l2(r(y), model(y)) < TOL and rel_l2(r(y), model(y)) < TOL      # twice: the second unpadded at once
        with pytest.raises(AssertionError, match="batch 150 too large"):
            r(torch.randn(150, 8, device=DEVICE))
        assert rel_l2(r(x[:3]), model(x[:3])) < TOL                               # a bucket the check takes still pads
    assert r.padded == 1 and len(r.unpadded) == 2
    assert "2 size(s) run as they are: the model's own check refused their bucket's size" in r.status()


class _SizeRounds(nn.Module):
    """Rows independent, but its products round differently past `rows` rows (summed in four parts
    there), as GPU kernels pick other tiles at another size: 64 layers compound it past the floor."""

    def __init__(self, rows, depth=64, width=64):
        super().__init__()
        self.rows = rows
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for lin in self.layers:
            if x.shape[0] > self.rows:
                h = sum(x[:, k:k + 16] @ lin.weight[:, k:k + 16].t() for k in range(0, x.shape[1], 16)) + lin.bias
            else:
                h = lin(x)
            x = x + torch.tanh(h)
        return x


def test_a_deep_half_model_pads_within_its_own_error_and_a_mixing_one_still_does_not():
    """A 22-layer fp16 Llama's batch did not pad on the GPU (batch 1 -> 2: 2.5e-3, past fp16's floor),
    so each of 295 request shapes was captured alone. Past the floor, a padded call passes within 2x
    the model's own error against the model in fp32 (uncapped: a padded call run twice with other padding gave the
    same output, so the model is deterministic); what the padding holds must still not matter, and a model that mixes
    rows is still refused, whatever its own error."""
    from accelc.capture.shapes import InputShapes
    from accelc.numerics import REL_L2_FLOOR, upcast_run

    torch.manual_seed(0)
    x = torch.randn(4, 64, dtype=torch.float16)
    shapes = InputShapes.traced(("x",), None, (x,))
    model = _SizeRounds(rows=4).half().eval()
    half = lambda dtype: REL_L2_FLOOR[torch.float16]   # noqa: E731
    with torch.no_grad():
        own = rel_l2(model(x), upcast_run(model, x))
    plan, note = buckets.find(model, (x,), shapes, half)
    assert plan is None and "batch does not pad: the real part of an output changes when padded" in note, note
    asked = []
    plan, note = buckets.find(model, (x,), shapes, half, lambda: asked.append(1) or own)
    assert plan is not None and list(plan.words.values()) == ["batch"] and asked, note

    class Mixing(_SizeRounds):
        def forward(self, x):
            return super().forward(x - 1e-2 * x.mean(0, keepdim=True))

    mixing = Mixing(rows=4).half().eval()
    mixing.load_state_dict(model.state_dict())
    plan, note = buckets.find(mixing, (x,), shapes, half, lambda: 1.0)      # an "own error" of 100%
    assert plan is None and "depends on what the padding holds" in note, note


def test_a_gpu_bound_call_runs_at_its_own_size_once_its_bucket_graph_is_timed():
    """A large call's padding is GPU time: once its bucket's graph has measured times, a call whose
    padding would cost more than launching its kernels one by one runs at its own size (a plain
    call, the function's own result); a host-bound one, or one with little padding, replays the
    bucket's graph; exact_calls=False (the default) keeps every call on the graphs."""
    plan = buckets.Padding({"b": DimRange(1, 64, "b")}, (((0, "b", "edge"),),), (((0, "b"),),), {"b": "batch"})
    sizes = []

    def f(x):
        sizes.append(x.shape[0])
        return torch.tanh(x) * 2

    for exact_calls in (True, False):
        cap = Captures()
        r = runner.Runner(f, cuda_graphs=True, capture=cap, padding=plan, exact_calls=exact_calls)
        x = torch.randn(33, 8)
        assert torch.equal(r(x), f(x)) and r.padded == 1                 # bucket 40, captured
        (entry,) = r.entries.values()
        entry.host_ms, entry.gpu_ms = 1.0, 10.0                          # as a real capture measures them
        sizes.clear()
        got = r(x)
        assert torch.equal(got, f(x))
        assert (r.exact, sizes[0], cap.graphs[0].replays) == ((1, 33, 1) if exact_calls else (0, 40, 2))
        assert ("1 ran at their own size" in r.status()) == exact_calls
        if exact_calls:
            replays = cap.graphs[0].replays
            r(torch.randn(39, 8))                                            # 39 of 40: the graph
            assert cap.graphs[0].replays == replays + 1 and r.exact == 1
            entry.host_ms = 9.5                                              # host-bound: the graph
            r(x)
            assert cap.graphs[0].replays == replays + 2 and r.exact == 1


def test_exact_pays_needs_both_times_and_a_saving_past_the_launch_cost():
    assert not runner.exact_pays(None, 10.0, 0.5) and not runner.exact_pays(1.0, None, 0.5)
    assert runner.exact_pays(1.0, 10.0, 0.5)                  # 5.25 ms against 10
    assert not runner.exact_pays(1.0, 10.0, 0.9)              # 9.45: under a tenth saved
    assert not runner.exact_pays(9.5, 10.0, 0.1)              # the host's launches take longer than the saving


def test_padding_auto_runs_gpu_bound_calls_at_their_own_size_and_the_default_does_not():
    gm = torch.fx.symbolic_trace(nn.Linear(4, 4))
    for padding, exact in ((True, False), ("auto", True), (False, False)):
        r, _ = runner.make_runner(gm, accelc.OptimizeConfig(padding=padding), torch.device("cpu"))
        assert r.exact_calls is exact
    with pytest.raises(ValueError, match='padding must be True, False or "auto", not \'sometimes\''):
        accelc.OptimizeConfig(padding="sometimes")


def test_the_call_plan_is_its_own_record_beside_the_call_contract():
    """What optimize decides for the calls (the padding, why a dim does not pad, the shapes warmed up) is a
    CallPlan in the graph's meta, not fields of the call contract (InputShapes, read-only after capture); a
    module pickled before reads them from its shapes."""
    import dataclasses
    import types

    assert not {"padding", "padding_note", "warmed"} & {f.name for f in dataclasses.fields(InputShapes)}
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert buckets.call_plan(gm) == buckets.CallPlan()
    gm.meta[SHAPES] = types.SimpleNamespace(padding="a padding", padding_note="why", warmed="2 shapes")
    assert buckets.call_plan(gm) == buckets.CallPlan("a padding", "why", "2 shapes")
    gm.meta[buckets.CALL_PLAN] = plan = buckets.CallPlan(None, "batch does not pad", "")
    assert buckets.call_plan(gm) is plan and plan.describe() == " (batch does not pad)"


def test_the_padding_check_tunes_at_padded_sizes_only():
    """buckets.find calls `before` with the inputs of every padded size it is about to call the graph at
    (optimize compiles their kernels there first, in the compile workers), before the graph's own calls at them;
    a real size called unpadded (the example less one: no call runs at it once padding holds) runs inside
    tuning.serving, its kernels borrowing a tuned config instead of racing, and is handed to no `before`."""
    from accelc import tuning
    from accelc.capture import capture
    from accelc.capture.shapes import SHAPES
    torch.manual_seed(0)
    x = torch.randn(4, 8, device=DEVICE)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU()).to(DEVICE).eval()
    gm, _, _ = capture(mlp, (x,), {})
    events = []

    def graph(*args):
        events.append(("call", tuple(args[0].shape), bool(tuning._serving.get())))
        return gm(*args)

    plan, _ = buckets.find(graph, (x,), gm.meta[SHAPES], tol,
                           before=lambda args: events.append(("before", tuple(args[0].shape))))
    assert plan is not None
    tuned = [e[1] for e in events if e[0] == "call" and not e[2]]
    borrowed = [e[1] for e in events if e[0] == "call" and e[2]]
    assert tuned and all(("before", s) in events[:events.index(("call", s, False))] for s in tuned), events
    assert (3, 8) in borrowed and ("before", (3, 8)) not in events, events     # the example less one row
    assert all(s[0] > 3 for s in tuned), events


def test_the_padding_checks_compiles_ahead_run_where_the_guard_let_go_of_originals_weights(monkeypatch, caplog):
    """The padding check runs after the guard released the float weights its optimized module does not hold (a
    gated MLP's gate and up packed into one weight): its compiles ahead at the padded size (candidates_ahead) flow
    such a layer on its op's PyTorch reference, not on its original (meta tensors now), and reach every layer; the
    original, run, raised and nothing was compiled ahead (each padded key compiled alone at its race: 5.9 s of a
    cold Qwen2-0.5B LM's optimize, H200)."""
    import logging
    import transformers as T
    from accelc import compile_workers, layer_compiles, meta
    from accelc.rewrite import layers
    from conftest import CausalLogits

    cfg = T.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=1)
    torch.manual_seed(0)
    model = CausalLogits(T.Qwen2ForCausalLM(cfg)).to(DEVICE).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(model, (torch.randint(0, 128, (1, 12), device=DEVICE),))
    gm = opt.graph_module
    released = [n for n in layers(gm) if meta.rewrite_of(n).released]
    assert released and any(meta.rewrite_of(n).kind == "gated_linear" for n in released), \
        [meta.rewrite_of(n).kind for n in layers(gm)]
    padded = (torch.randint(0, 128, (1, 16), device=DEVICE),)
    reached = []
    layer_compiles._each_layer(gm, padded, set(layers(gm)), lambda n, a, kw: reached.append((n, a[0].shape[-2])))
    assert [n for n, _ in reached] == layers(gm) and {rows for _, rows in reached} >= {16}
    handed = []
    monkeypatch.setattr(compile_workers, "active", lambda: True)
    monkeypatch.setattr(compile_workers, "compile_jobs", lambda jobs, fill=False: handed.append(jobs))
    with caplog.at_level(logging.DEBUG, logger="accelc"):
        layer_compiles.candidates_ahead(gm, padded, set(layers(gm)))
    assert len(handed) == 1 and "not compiled ahead" not in caplog.text


def test_padded_inputs_are_the_padding_checks_calls_beyond_the_examples_sizes():
    """buckets.padded_inputs (what the guard hands to the compile workers ahead of the padding check) are the
    inputs find() calls `before` with at sizes other than the example's: a masked BERT (batch and length, each
    alone and together) and GPT-2 unmasked; one whose shapes are fixed has none."""
    from accelc.capture import CALL_SPEC, capture
    from accelc.capture.shapes import SHAPES
    torch.manual_seed(0)
    for model, inputs in ((_bert(), _ids(3, 13)), (_gpt2(), _ids(3, 13, mask=False))):
        gm, _, _ = capture(model, (), inputs)
        flat = gm.meta[CALL_SPEC].flat((), inputs)
        seen = []
        buckets.find(gm, flat, gm.meta[SHAPES], tol, before=lambda args: seen.append(_shapes(args)))
        beyond = [s for s in seen if s != _shapes(flat)]
        ahead = [_shapes(a) for a in buckets.padded_inputs(flat, gm.meta[SHAPES])]
        assert beyond and sorted(set(beyond)) == sorted(set(ahead)), (beyond, ahead)
        for a in buckets.padded_inputs(flat, gm.meta[SHAPES]):     # the real part kept, the tail padded
            for x, y in zip(a, flat):
                if isinstance(x, torch.Tensor) and x.dim() == 2:
                    assert torch.equal(x[:y.shape[0], :y.shape[1]], y)
    gm, _, _ = capture(_bert(), (), _ids(3, 13))
    assert buckets.padded_inputs(gm.meta[CALL_SPEC].flat((), _ids(3, 13)), None) == []


def _shapes(args):
    return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))


def test_the_guard_hands_the_padded_sizes_candidates_over_before_its_first_check(monkeypatch):
    """Where finish will run the padding check (its runner replays CUDA graphs: made so here), the guard hands
    the layers' candidates at the padded sizes (buckets.padded_inputs) to the compile workers right after the
    example's, before its first check, not waiting: they compile while the checks run. With padding off, none."""
    from accelc import guard, layer_compiles
    from conftest import padding_check_as_on_a_gpu

    padding_check_as_on_a_gpu(monkeypatch)
    events = []
    real_pass = guard._check_pass
    monkeypatch.setattr(guard, "_check_pass", lambda *a, **kw: (events.append("check"), real_pass(*a, **kw))[1])
    monkeypatch.setattr(layer_compiles, "later_ahead",
                        lambda gm, inputs, only: events.append(("later", [_shapes(a) for a in inputs])))
    inputs = _ids(3, 13)
    for padding, want in ((True, True), (False, False)):
        events.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accelc.optimize(_bert(), (), accelc.OptimizeConfig(padding=padding), example_kwargs=inputs)
        handed = [e for e in events if e != "check"]
        assert len(handed) == 1 and events.index(handed[0]) < events.index("check"), events
        assert bool(handed[0][1]) == want, handed
        if want:
            assert all(s[0][0] >= 3 and s[0][1] >= 13 and s != ((3, 13), (3, 13)) for s in handed[0][1]), handed


def test_the_padding_check_does_not_pass_over_the_layers_again_for_sizes_the_workers_have(monkeypatch):
    """With the compile workers on, the padding check's hand-over before a padded call (candidates_ahead: a pass
    over the layers, eager's outputs flowing, ~1 s of a 24-layer LM) runs only at sizes neither the example's nor
    handed over as the guard began (buckets.padded_inputs); BERT's trials are all of those: none runs."""
    from accelc import compile_workers, layer_compiles, stages
    from conftest import padding_check_as_on_a_gpu

    padding_check_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(compile_workers, "active", lambda: True)
    monkeypatch.setattr(compile_workers, "compile_jobs", lambda jobs, fill=False: 0)
    monkeypatch.setattr(compile_workers, "submit", lambda jobs: None)
    passes, checking = [], []
    real = layer_compiles.candidates_ahead
    monkeypatch.setattr(layer_compiles, "candidates_ahead",
                        lambda gm, args, only, fill=False: (passes.append((bool(checking), _shapes(args))),
                                                              real(gm, args, only, fill)))
    real_check = stages.padding_check
    monkeypatch.setattr(stages, "padding_check",
                        lambda *a, **kw: (checking.append(1), real_check(*a, **kw), checking.clear()))
    calls = []
    real_find = buckets.find
    monkeypatch.setattr(buckets, "find", lambda fn, args, *a: real_find(
        fn, args, *a[:3], lambda sized: (calls.append(_shapes(sized)), a[3](sized))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(_bert(), (), accelc.OptimizeConfig(), example_kwargs=_ids(3, 13))
    assert "padding check" in opt.info.seconds and calls, opt.info.seconds
    assert any(not during for during, _ in passes)                   # the guard's, at the example first
    assert [s for during, s in passes if during] == [], passes      # the padding check's: none


def test_padded_inputs_that_cannot_be_made_are_none_not_an_error(monkeypatch):
    """buckets.padded_inputs runs before the guard, outside the padding check's own handling: inputs it cannot
    pad (here the padding itself raises) give no inputs ahead, and the optimize goes on; the padding check says
    what is wrong there, if anything."""
    from accelc.capture import CALL_SPEC, capture
    from accelc.capture.shapes import SHAPES
    gm, _, _ = capture(_bert(), (), _ids(3, 13))
    flat = gm.meta[CALL_SPEC].flat((), _ids(3, 13))
    assert buckets.padded_inputs(flat, gm.meta[SHAPES])
    monkeypatch.setattr(buckets.Padding, "pad", lambda *a, **k: 1 / 0)
    assert buckets.padded_inputs(flat, gm.meta[SHAPES]) == []
