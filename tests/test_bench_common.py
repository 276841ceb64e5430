"""bench/_common.py's helpers that every benchmark's comparison depends on."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import _common  # noqa: E402


def test_compiled_is_static_for_every_row():
    """A benchmark defines the same function for row after row: each row's torch.compile must see
    static shapes (without the reset, the second shape recompiles with symbolic ones, and past
    dynamo's recompile limit the function runs eagerly)."""
    seen = []

    def recorder(gm, example_inputs):    # does the graph dynamo made take symbolic sizes?
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        seen.append(any(isinstance(d, torch.SymInt) for v in values if isinstance(v, torch.Tensor) for d in v.shape))
        return gm.forward

    for n in (3, 5, 7):
        x = torch.randn(n, 4)

        def row(x=x):
            return torch.relu(x) * 2

        _common.compiled(row, backend=recorder)()
    assert seen == [False, False, False]        # one static graph per row


def test_rel_l2_of_a_tensor_and_of_a_tuple_taken_together():
    ref = (torch.ones(4, dtype=torch.float64), torch.zeros(2, dtype=torch.float64) + 2)
    out = (torch.ones(4) * 1.5, torch.zeros(2) + 2)
    assert _common.rel_l2(out[0], ref[0]) == pytest.approx(0.5)
    assert _common.rel_l2(out, ref) == pytest.approx((4 * 0.25 / (4 + 8)) ** 0.5)
    with pytest.raises(ValueError):
        _common.rel_l2(out[:1], ref)


def test_tuned_reports_the_last_matching_key_and_its_spread():
    """_common.tuned: the config chosen for the last key a predicate accepts, with its spread."""
    class FakeTuner:
        chosen = {(1, "a"): "cfg-a", (2, "b"): "cfg-b", (1, "c"): "cfg-c"}

        def spread(self, key):
            return {"key": key}
    assert _common.tuned(FakeTuner(), lambda k: k[0] == 1) == ("cfg-c", {"key": (1, "c")})
    assert _common.tuned(FakeTuner(), lambda k: k[0] == 3) == (None, None)


def test_e2e_merge_joins_a_models_sides_across_runs_and_skips_merged_tables(tmp_path):
    """A model's sides split over two commands merge into one row; a merged table kept beside the runs
    (its JSON holds "rows") is not read as a run (it was: KeyError)."""
    import e2e
    env = dict(_common.environment(), date="2026-11-24 16:30 UTC")
    row = {"model": "bert", "family": "BERT", "batch": 8}
    (tmp_path / "b").mkdir()
    for path, sides in ((tmp_path / "e2e-bert-b8.json", {"eager_ms": 5.0, "accelc_ms": 2.0}),
                        (tmp_path / "b" / "e2e-bert-b8.json", {"compile_max_ms": 4.0})):
        path.write_text(json.dumps({"environment": env, "row": dict(row, **sides)}))
    e2e.merge(tmp_path, tmp_path / "out")
    (tmp_path / "e2e-merged.json").write_text((tmp_path / "out" / next(
        p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".json")).read_text())
    e2e.merge(tmp_path, tmp_path / "out2")
    md = next((tmp_path / "out2").glob("*.md")).read_text()
    line = next(x for x in md.splitlines() if x.startswith("| bert"))
    assert "| 5.000 |" in line and "| 4.000 |" in line and "| 2.000 |" in line and "2.00x" in line, line


def test_e2e_merge_mode_refuses_a_runs_options(monkeypatch, capsys, tmp_path):
    """`--merge DIR` only merges result folders: given with the options of a run (models, sides,
    batches) it would time nothing and say nothing, so it stops with a one-line reason instead."""
    import e2e
    merged = []
    monkeypatch.setattr(e2e, "merge", lambda src, out: merged.append((src, out)))
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--models", "llama", "--sides", "eager", "--merge", str(tmp_path)])
    with pytest.raises(SystemExit):
        e2e.main()
    assert "--merge DIR only merges result folders and times nothing; --models, --sides ask for a run" \
        in capsys.readouterr().err and not merged
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--merge", str(tmp_path), "--out", str(tmp_path / "out")])
    e2e.main()
    assert merged == [(str(tmp_path), str(tmp_path / "out"))]


def test_the_driver_of_a_host_of_several_gpus_is_one_line(monkeypatch):
    """nvidia-smi prints the driver once per GPU: a four-GPU host's results said it four times, on four
    lines of every table's header. environment() keeps one and counts the GPUs; env_line collapses the
    multi-line value that files written before hold."""
    import types
    monkeypatch.setattr(_common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_common.torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="GPU", multi_processor_count=132, total_memory=2**36))
    smi = types.SimpleNamespace(stdout="580.1\n580.1\n580.1\n")
    monkeypatch.setattr(_common.subprocess, "run", lambda *a, **k: smi)
    env = _common.environment()
    assert env["driver"] == "580.1" and env["gpus_on_host"] == 3
    monkeypatch.setattr(_common.sys, "pycache_prefix", "/tmp/pycache")
    monkeypatch.setattr(_common.sys, "dont_write_bytecode", False)
    assert _common.environment()["bytecode"] == "under /tmp/pycache"     # (bench/steps.sh's)
    monkeypatch.setattr(_common.sys, "dont_write_bytecode", True)
    assert _common.environment()["bytecode"] == "not written"
    line = _common.env_line({"device": "GPU", "driver": "580.1\n580.1\n580.1"})
    assert line == "device GPU, driver 580.1" and "\n" not in line


def _ncu_csv(rows) -> str:
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    return "==PROF== Connected\n" + head + "".join(
        f'"{i}","{k}","{m}","{u}","{v}"\n' for i, k, m, u, v in rows)


def test_ncu_summary_gives_each_kernel_to_its_case_and_side(tmp_path):
    """bench/ncu_profile.py --summary: kernels between marker kernels go to case 0's accelc side, case 0's
    library side, case 1's ...; times and bytes in the units ncu printed (ns, byte) come out in us and MB;
    a .csv.gz reads as the .csv; choices recorded as text (the first --cases-out) or as dicts both read."""
    import gzip

    import ncu_profile
    rows = []
    kernels = [("spin_kernel", 1000), ("ours", 12000), ("spin_kernel", 1000), ("lib_a", 6000), ("lib_b", 2000)]
    for i, (name, ns) in enumerate(kernels):
        rows += [(i, name, "gpu__time_duration.sum", "ns", f"{ns:,}"),
                 (i, name, "lts__t_bytes.sum", "byte", "3,000,000"),
                 (i, name, "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "40"),
                 (i, name, "launch__grid_size", "", "132"), (i, name, "launch__block_size", "", "384")]
    (tmp_path / "k.csv.gz").write_bytes(gzip.compress(_ncu_csv(rows).encode()))
    (tmp_path / "cases.json").write_text(json.dumps([{"case": "gemm:8,8,8", "chosen": ["linear: {'BLOCK_M': 64}"]}]))
    ncu_profile.summarize(tmp_path / "k.csv.gz", tmp_path / "cases.json", tmp_path / "t.md")
    line = next(x for x in (tmp_path / "t.md").read_text().splitlines() if x.startswith("| gemm:8,8,8 | ours"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[3:6] == ["12.0", "8.0", "1.50"]       # accelc us, library us (two kernels summed), ratio
    assert cells[7] == "3 / 6" and cells[8] == "132 x 384 / 132 x 384" and cells[9] == "BLOCK_M=64", line


def test_ncu_groups_read_the_benches_own_lists():
    """The 'layers' and 'resnet' groups come from bench/gemm_models.py's LAYERS and bench/conv.py's SHAPES
    (read from source: importing those scripts points the tuning cache at a fresh directory)."""
    import ncu_profile
    layers = ncu_profile._bench_list("gemm_models.py", "LAYERS")
    assert len(ncu_profile.GROUPS["layers"]) == sum(kind in ("linear", "conv1d") for *_, kind in layers)
    assert "gemm:6304,768,768,none,res" in ncu_profile.GROUPS["layers"]
    assert "gemm:4096,768,2304,none,kn" in ncu_profile.GROUPS["layers"]       # GPT-2's Conv1D: W stored (K, N)
    shapes = ncu_profile._bench_list("conv.py", "SHAPES")
    assert len(ncu_profile.GROUPS["resnet"]) == len(shapes) + 2 * sum(s[3] == 3 for s in shapes)
    assert "conv:1,512,7,512,3,1" in ncu_profile.GROUPS["resnet"]


def test_pyspy_tree_sums_the_main_threads_kept_frames_by_prefix(tmp_path):
    import gzip

    import pyspy_tree

    raw = ("thread (1): MainThread;main (x.py:1);optimize (accelc/api.py:77);capture (accelc/trace.py:5);f (torch/a.py:2) 40\n"
           "thread (1): MainThread;main (x.py:1);optimize (accelc/api.py:77);guard (accelc/guard.py:9) 80\n"
           "thread (2): worker;optimize (accelc/api.py:77) 400\n")
    path = tmp_path / "p.txt.gz"
    path.write_bytes(gzip.compress(raw.encode()))
    counts = pyspy_tree.tree(pyspy_tree.read(str(path)), ("accelc/",), depth=5)
    assert pyspy_tree.lines(counts, rate=40, min_s=0.5) == [
        "3.0s optimize (accelc/api.py:77)", "  1.0s capture (accelc/trace.py:5)", "  2.0s guard (accelc/guard.py:9)"]


def test_a_generates_timing_takes_the_lower_median_so_one_stalled_round_of_two_is_not_half_the_figure(monkeypatch):
    import generate

    clock = iter([0.0, 0.015, 10.0, 10.170])       # round one 15 ms, round two stalled: 170 ms
    monkeypatch.setattr(generate.time, "perf_counter", lambda: next(clock))
    seconds, out = generate.timed_generate(lambda **kw: "tokens", None, None, 1, 2, lambda: None)
    assert (round(seconds, 6), out) == (0.015, "tokens")
    clock = iter([0.0, 0.020, 1.0, 1.015, 2.0, 2.170])    # three rounds: the median as before
    assert round(generate.timed_generate(lambda **kw: "tokens", None, None, 1, 3, lambda: None)[0], 6) == 0.020


def test_the_torchao_sides_name_their_rows_and_say_when_torchao_is_missing(monkeypatch):
    import e2e

    monkeypatch.setitem(sys.modules, "torchao", None)         # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    for side, kw in (("torchao_fp8", {}), ("torchao_fp8_ro", dict(name="torchao_fp8_ro", mode="reduce-overhead"))):
        row = {}
        e2e.side_torchao_fp8(torch.nn.Linear(4, 4), (torch.randn(2, 4),), row, **kw)
        assert list(row) == [f"{side}_error"] and row[f"{side}_error"].startswith("torchao not available"), row
    assert "torchao_fp8_ro" in e2e.SIDES


def test_the_torchao_side_measures_its_error_on_its_first_output_not_on_a_buffer_later_calls_overwrote(monkeypatch):
    import types

    import e2e

    quantization = types.ModuleType("torchao.quantization")
    quantization.quantize_ = lambda model, config: None
    quantization.Float8DynamicActivationFloat8WeightConfig = lambda granularity: None
    quantization.PerRow = quantization.PerTensor = lambda: None
    torchao = types.ModuleType("torchao")
    torchao.__version__, torchao.quantization = "fake", quantization
    monkeypatch.setitem(sys.modules, "torchao", torchao)
    monkeypatch.setitem(sys.modules, "torchao.quantization", quantization)

    def graph_compile(model, mode):          # as CUDA graphs do: a call's output is invalid once the next call ran
        given = []

        def call(*inputs):
            for old in given:
                old.fill_(float("nan"))
            given.append(model(*inputs).detach())
            return given[-1]
        return call
    monkeypatch.setattr(e2e.torch, "compile", graph_compile)
    monkeypatch.setattr(e2e.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(e2e, "per_call_ms", lambda fn: [fn() for _ in range(2)] and 1.0)
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    seen = []
    monkeypatch.setattr(e2e, "_rel", lambda out, ref: seen.append((out.clone(), ref)) or 0.0)
    row = {}
    e2e.side_torchao_fp8(model, (x,), row, name="torchao_fp8_ro", mode="reduce-overhead")
    out, ref = seen[0]
    assert "torchao_fp8_ro_error" not in row and torch.equal(out, ref.detach()), row


def test_critical_path_counts_what_each_kernel_adds_to_the_stream_not_its_overlapped_wait():
    """Kernels launched with dependent launch overlap the one before (their durations hold the wait): each is
    charged only the time after every earlier kernel ended; idle time between kernels is apart; the charges and
    the idle time sum to the span of the stream."""
    spans = [("gemv", 0.0, 10.0),       # alone: 10
             ("split", 8.0, 14.0),      # started 2 us early, waited: 4 of its own
             ("gemv", 9.0, 25.0),       # started during both: 11 of its own
             ("glue", 27.0, 28.5),      # after 2 us idle: 1.5
             ("tiny", 27.5, 28.0)]      # inside glue's: nothing of its own
    by_name, idle = _common.critical_path(spans)
    assert by_name == {"gemv": [2, 21.0], "split": [1, 4.0], "glue": [1, 1.5], "tiny": [1, 0.0]}
    assert idle == 2.0
    assert sum(v for _, v in by_name.values()) + idle == 28.5 - 0.0
    assert _common.critical_path([]) == ({}, 0.0)


def test_the_decode_profiles_critical_path_leaves_the_prefill_out():
    """bench/decode.py --profile: the decode steps' critical path runs from the end of the first token's argmax to
    the end of the last's, each step one token; the prefill before it is not counted."""
    import types

    import decode

    def event(name, start, end):
        r = types.SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return types.SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA, time_range=r)

    prefill = [event("linear_kernel", 0, 50), event("_chunk_kernel", 50, 51), event("_rows_kernel", 51, 52)]
    step = lambda t: [event("gemv_kernel", t, t + 10), event("_split_kernel", t + 8, t + 12),   # noqa: E731
                      event("_chunk_kernel", t + 13, t + 14), event("_rows_kernel", t + 14, t + 15)]
    prof = types.SimpleNamespace(events=lambda: prefill + step(52) + step(67))
    own, idle, tokens = decode._decode_critical_path(prof)
    assert tokens == 2
    assert own == {"gemv_kernel": [2, 20.0], "_split_kernel": [2, 4.0], "_chunk_kernel": [2, 2.0],
                   "_rows_kernel": [2, 2.0]}
    assert idle == 2.0                   # a 1 us gap before each step's argmax
    assert sum(v for _, v in own.values()) + idle == 82 - 52


def test_tps_decode_profile_reports_the_critical_path_with_the_prefill_subtracted(monkeypatch):
    """bench/tp.py's decode profile: the generate of `new` tokens less the generate of one, kernel by kernel, for
    the durations (as before) and for each kernel's own time on the critical path and the idle time."""
    import tp

    def spans(fn):
        n = fn()
        prefill = [("linear_kernel", 0.0, 50.0)]
        steps = [s for t in range(n - 1) for s in (("gemv_kernel", 50 + 15 * t, 60 + 15 * t),
                                                   ("_split_kernel", 58 + 15 * t, 63 + 15 * t))]
        return prefill + steps

    monkeypatch.setattr(tp, "kernel_spans", spans)
    row = tp.collective_us_per_step(lambda **kw: kw["max_new_tokens"], None, None, new=5, layers=1)
    nonzero = lambda d: {k: v for k, v in d.items() if v}          # noqa: E731  (the prefill's kernel: 0)
    assert nonzero(row["top_kernels_us_per_token"]) == {"gemv_kernel": 10.0, "_split_kernel": 5.0}
    # each step's split waits 2 of its 5 us for the GEMV; 2 us idle between steps, 3 gaps over 4 steps
    assert nonzero(row["critical_path_us_per_token"]) == {"gemv_kernel": 10.0, "_split_kernel": 3.0, "(idle)": 1.5}
    assert row["gpu_us_per_token"] == 15.0


def test_optimize_times_table_says_the_time_the_glue_compiled_after_optimize(tmp_path):
    """bench/optimize_time.py's table: a cold side whose glue for other shapes compiled in the background
    (ACCELC_OTHER_SHAPES=background) shows that time beside optimize's, not inside it; one without shows none."""
    import optimize_time

    env = {"device": "GPU", "date": "d", "torch": "t", "triton": "t"}
    for name, after in (("bert", 4.25), ("resnet50", None)):
        side = {"optimize_s": 20.0, "phases_s": {"capture": 1.0}}
        if after is not None:
            side["other_shapes_after_s"] = after
        row = {"model": name, "accelc_cold": side, "compile_ro": {"first_call_s": 10.0}}
        (tmp_path / f"optimize_time-{name}.json").write_text(json.dumps({"environment": env, "row": row}))
    lines = {line.split(" | ")[0]: line for line in optimize_time.render(tmp_path).splitlines()}
    assert "| 20.0 (+4.2 in the background) | 10.0 | 2.00x |" in lines["| bert"]
    assert "| 20.0 | 10.0 | 2.00x |" in lines["| resnet50"]


def test_a_bench_waits_for_the_glue_compiling_in_the_background_and_only_then():
    """_common.other_shapes_wait_s: with other_shapes="background" the model's glue compile is waited for (and the
    wait's seconds given) before anything is timed; with "now" nothing is waited for (None)."""
    import types

    for mode, waits in (("now", False), ("background", True)):
        waited = []
        opt = types.SimpleNamespace(config=types.SimpleNamespace(other_shapes=mode),
                                    wait_for_other_shapes=lambda: waited.append(1) or True)
        got = _common.other_shapes_wait_s(opt)
        assert (got is not None, len(waited)) == (waits, int(waits)) and (got is None or got >= 0), (mode, got)


def test_every_causal_lm_optimize_time_builds_names_a_shape_generate_has():
    """bench/optimize_time.py's (and so tuning_table.py collect's) causal LMs are bench/generate.py's shapes."""
    import generate
    import optimize_time

    assert set(optimize_time.LM_CONFIGS.values()) <= set(generate.configs(False)), optimize_time.LM_CONFIGS
    assert {"qwen2-1.5b-lm", "gemma-2b-lm", "phi3-mini-lm"} <= set(optimize_time.LM_CONFIGS)
