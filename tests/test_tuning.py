"""accelc/tuning.py: one config per key, chosen once, remembered on disk across processes; what
runs where there is nothing to time. The GPU is stood in for (device name, timer), so the cache
logic is tested on the CPU."""
import json

import pytest
import triton

from accelc import compile_ahead, runtime, tuning

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=s) for b in (32, 64, 128) for s in (2, 3)]
FAST = {"BLOCK": 64, "num_stages": 3}    # the candidate the fake timer makes fastest


class _Kernel:
    src = "def kernel(x, BLOCK): ..."


def _tuner():
    return tuning.Tuner("fake", _Kernel(), CONFIGS, prune=lambda cs, sizes: [c for c in cs if c.kwargs["BLOCK"] <= sizes["M"]],
                        default=lambda sizes: CONFIGS[0], interpreter=lambda sizes: CONFIGS[1])


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A 'GPU': nothing interpreted, a device name, a timer that counts its calls."""
    timed = []

    def fake_time(launch, cfg):
        launch(cfg)
        timed.append(cfg)
        if cfg.kwargs["BLOCK"] == 128 and cfg.num_stages == 2:
            return float("inf")            # a config that fails to compile: skipped
        return 1.0 if (cfg.kwargs["BLOCK"], cfg.num_stages) == (64, 3) else 2.0 + cfg.kwargs["BLOCK"] / 100

    monkeypatch.setattr(runtime, "interpreted", lambda: False)
    monkeypatch.setattr(tuning, "device_identity", lambda: ("Fake GPU", "9.0"))
    monkeypatch.setattr(tuning, "time_config", fake_time)
    monkeypatch.setattr(tuning, "quick_time", fake_time)     # (the first round: no finals with these times)
    monkeypatch.setenv("ACCELC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ACCELC_AUTOTUNE", "1")   # these tests are about tuning, whatever the caller set
    monkeypatch.setenv("ACCELC_COMPILE_THREADS", "1")   # no compiling ahead (its own test below)
    monkeypatch.setenv("ACCELC_COMPILE_PROCS", "0")     # no compile workers (tests/test_compile_workers.py)
    return timed


def _chosen(cfg):
    return {"BLOCK": cfg.kwargs["BLOCK"], "num_stages": cfg.num_stages}


def test_tunes_once_then_reads_the_disk_in_a_new_process(fake_gpu, tmp_path):
    launched = []
    cfg = _tuner().pick((1024, "fp16"), {"M": 1024}, launched.append)
    assert _chosen(cfg) == FAST and len(fake_gpu) == len(CONFIGS) and len(launched) == len(CONFIGS)
    (path,) = (tmp_path / "tuning").iterdir()
    record = json.loads(path.read_text())
    assert record["config"]["BLOCK"] == 64 and record["device"] == "Fake GPU"
    assert sum(t[1] is None for t in record["timings_us"]) == 1          # the failed candidate, recorded
    fake_gpu.clear()
    again = _tuner()                      # a new process: an empty in-memory cache
    assert _chosen(again.pick((1024, "fp16"), {"M": 1024}, launched.append)) == FAST
    assert fake_gpu == []                 # nothing timed: read from disk
    assert again.pick((1024, "fp16"), {"M": 1024}, None) is again.pick((1024, "fp16"), {"M": 1024}, None)


def test_the_first_rounds_closest_are_timed_again_and_their_close_times_decide(fake_gpu, monkeypatch):
    """The quick timer's round: the four within 10% of its fastest go to the close timer, which decides
    among them; a fifth within 10%, a slower one and a failed one are not timed again."""
    quick_us = [1.00, 1.05, 1.08, 1.09, 1.095, float("inf")]
    close_us = {1: 0.9}
    finals = []

    def quick(launch, cfg):
        return quick_us[CONFIGS.index(cfg)]

    def close(launch, cfg):
        finals.append(CONFIGS.index(cfg))
        return close_us.get(CONFIGS.index(cfg), 1.2)

    monkeypatch.setattr(tuning, "quick_time", quick)
    monkeypatch.setattr(tuning, "time_config", close)
    t = _tuner()
    cfg = t.pick((1024, "fp16"), {"M": 1024}, lambda c: None)
    assert cfg is CONFIGS[1] and sorted(finals) == [0, 1, 2, 3]
    assert t.spread((1024, "fp16")) == {"candidates": 6, "ran": 5, "fastest_us": 0.9, "slowest_us": 1.2}
    monkeypatch.setattr(tuning, "time_config", lambda launch, cfg: float("inf"))   # the close timer fails where
    # the quick one ran: the quick round's best
    assert _tuner().pick((2048, "fp16"), {"M": 2048}, lambda c: None) is CONFIGS[0]


def test_spread_of_the_candidates_in_memory_and_from_disk(fake_gpu):
    key = (1024, "fp16")
    t = _tuner()
    assert t.spread(key) is None                                       # not tuned yet
    t.pick(key, {"M": 1024}, lambda c: None)
    want = {"candidates": 6, "ran": 5, "fastest_us": 1.0, "slowest_us": 3.28}   # BLOCK 128, 2 stages failed
    assert t.spread(key) == want
    assert _tuner().pick(key, {"M": 1024}, lambda c: None) and fake_gpu[6:] == []
    again = _tuner()
    again.pick(key, {"M": 1024}, lambda c: None)                       # read from disk: the same figures
    assert again.spread(key) == want


def test_other_keys_configs_and_devices_tune_again(fake_gpu, monkeypatch, tmp_path):
    t = _tuner()
    t.pick((1024, "fp16"), {"M": 1024}, lambda c: None)
    n = len(fake_gpu)
    t.pick((64, "fp16"), {"M": 64}, lambda c: None)                  # another key: pruned to BLOCK <= 64
    assert len(fake_gpu) == n + 4
    other = tuning.Tuner("fake", _Kernel(), CONFIGS[:4], default=lambda s: CONFIGS[0],
                         interpreter=lambda s: CONFIGS[0])
    other.pick((1024, "fp16"), {"M": 1024}, lambda c: None)          # another candidate list
    monkeypatch.setattr(tuning, "device_identity", lambda: ("Other GPU", "9.0"))
    _tuner().pick((1024, "fp16"), {"M": 1024}, lambda c: None)        # another device
    assert len(list((tmp_path / "tuning").iterdir())) == 4


def test_unreadable_cache_file_is_tuned_again_and_replaced(fake_gpu, tmp_path):
    _tuner().pick((1024, "fp16"), {"M": 1024}, lambda c: None)
    (path,) = (tmp_path / "tuning").iterdir()
    path.write_text('{"config": ')        # torn or corrupt
    fake_gpu.clear()
    assert _chosen(_tuner().pick((1024, "fp16"), {"M": 1024}, lambda c: None)) == FAST
    assert fake_gpu and json.loads(path.read_text())["config"]["BLOCK"] == 64
    assert [p.name for p in (tmp_path / "tuning").iterdir()] == [path.name]   # no temporary file left


@pytest.mark.parametrize("entry", [{"timings_us": [1, 2]}, {"timings_us": [["x"]]}, {"timings_us": "fast"},
                                   {"config": [64]}, {"timings_us": [[{"BLOCK": 64}, "1.0"]]}, []])
def test_a_malformed_cache_entry_is_ignored_with_one_warning_and_tuned_again(fake_gpu, tmp_path, caplog, entry):
    """An entry another version or a crash left (valid JSON, wrong shape) is no TypeError or
    ValueError: one warning naming the file, tuned again, overwritten; spread() reads the new one."""
    _tuner().pick((1024, "fp16"), {"M": 1024}, lambda c: None)
    (path,) = (tmp_path / "tuning").iterdir()
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, **entry} if isinstance(entry, dict) else entry))
    fake_gpu.clear()
    t = _tuner()
    with caplog.at_level("WARNING", logger="accelc"), pytest.warns(UserWarning) as seen:
        assert _chosen(t.pick((1024, "fp16"), {"M": 1024}, lambda c: None)) == FAST
    assert fake_gpu and caplog.text.count("ignoring the tuning-cache file") == 1 and path.name in caplog.text
    said = [str(w.message) for w in seen if "ignoring the tuning-cache file" in str(w.message)]
    assert len(said) == 1 and path.name in said[0]      # a warning the user sees, not only the log
    assert t.spread((1024, "fp16"))["fastest_us"] == 1.0
    assert json.loads(path.read_text())["timings_us"][0][0]["BLOCK"] == 32


def test_no_timing_without_a_gpu_or_with_tuning_off(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "autotune_enabled", lambda: False)
    assert _tuner().pick((1024, "fp16"), {"M": 1024}, lambda c: None) is CONFIGS[0]
    monkeypatch.setattr(runtime, "interpreted", lambda: True)
    assert _tuner().pick((1024, "fp16"), {"M": 1024}, lambda c: None) is CONFIGS[1]
    assert fake_gpu == [] and not (tmp_path / "tuning").exists()


def test_progress_line_names_the_layer(fake_gpu, caplog):
    with caplog.at_level("INFO", logger="accelc"), tuning.task("layer 3/7 blocks.0.fc1+gelu"):
        _tuner().pick((1024, "fp16"), {"M": 1024}, lambda c: None)
    assert "tuning fake (M=1024) for layer 3/7 blocks.0.fc1+gelu: 6 candidates" in caplog.text


def test_a_read_only_cache_folder_still_tunes(fake_gpu, monkeypatch, tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("ACCELC_CACHE_DIR", str(blocked))   # tuning/ cannot be made under a file
    with caplog.at_level("WARNING", logger="accelc"):
        assert _chosen(_tuner().pick((1024, "fp16"), {"M": 1024}, lambda c: None)) == FAST
    assert "cannot use the cache folder" in caplog.text and "optimize goes on without it" in caplog.text


def test_force_runs_one_candidate_then_restores_the_choices(fake_gpu):
    tuner = _tuner()
    tuned = tuner.pick((1024, "fp16"), {"M": 1024}, lambda cfg: None)
    tuner.calls["sig"] = "remembered call"
    with tuner.force(CONFIGS[0]):
        assert tuner.pick((1024, "fp16"), {"M": 1024}, None) is CONFIGS[0]
        assert tuner.calls == {} and list(tuner.chosen) == [(1024, "fp16")]
        with pytest.raises(tuning.NotACandidate, match="not a candidate"):
            tuner.pick((16, "fp16"), {"M": 16}, None)        # BLOCK 32 is pruned for M=16
    assert tuner.pick((1024, "fp16"), {"M": 1024}, None) is tuned and tuner.calls == {"sig": "remembered call"}
    assert fake_gpu.count(CONFIGS[0]) == 1                      # forcing timed nothing


@pytest.mark.parametrize("watcher", ["injected", "hook"])
def test_a_profiler_tunes_for_this_process_only(fake_gpu, monkeypatch, tmp_path, caplog, watcher):
    """Under Nsight Compute / Systems (CUDA_INJECTION64_PATH) or a Triton launch hook the timings
    are not the kernels' own: the choice serves this process and is not written for later ones.
    A choice already on disk is still read."""
    key = (1024, "fp16")
    _tuner().pick((2048, "fp16"), {"M": 2048}, lambda c: None)          # tuned before, unwatched
    monkeypatch.setattr(tuning, "_warned_profiler", [])
    if watcher == "injected":
        monkeypatch.setenv("CUDA_INJECTION64_PATH", "/opt/nsight-compute/libInjection.so")
    else:
        monkeypatch.setattr(tuning, "_no_launch_hooks", lambda: False)
    assert tuning.profiler() is not None
    watched = _tuner()
    with caplog.at_level("WARNING", logger="accelc"):
        assert _chosen(watched.pick(key, {"M": 1024}, lambda c: None)) == FAST
        watched.pick((512, "fp16"), {"M": 512}, lambda c: None)
    assert caplog.text.count("not written to the tuning cache") == 1        # once a process
    assert len(list((tmp_path / "tuning").iterdir())) == 1                  # only the unwatched one
    fake_gpu.clear()
    assert _chosen(_tuner().pick((2048, "fp16"), {"M": 2048}, lambda c: None)) == FAST
    assert fake_gpu == []                                                   # read from disk
    monkeypatch.delenv("CUDA_INJECTION64_PATH", raising=False)
    monkeypatch.setattr(tuning, "_no_launch_hooks", lambda: True)
    assert tuning.profiler() is None
    _tuner().pick(key, {"M": 1024}, lambda c: None)                          # unwatched: tuned and written
    assert len(fake_gpu) == len(CONFIGS) and len(list((tmp_path / "tuning").iterdir())) == 2


def test_the_other_kernels_source_keys_the_cache(fake_gpu):
    """A tuner whose candidates launch a second kernel (the Gluon GEMM beside the tl one): a change to
    that kernel's source is a new cache file, as a change to the first one's is."""
    class _Other:
        def __init__(self, src):
            self.src = src

    def tuner(other_src):
        return tuning.Tuner("fake", _Kernel(), CONFIGS, default=lambda s: CONFIGS[0], interpreter=lambda s: CONFIGS[1],
                            other_kernels=lambda: [_Other(other_src)])

    key = (128, "fp16")
    same = tuner("def other(x): ...")._cache_file(key), tuner("def other(x): ...")._cache_file(key)
    assert same[0] == same[1]
    assert tuner("def other(x): return x")._cache_file(key) != same[0]
    assert _tuner()._cache_file(key) != same[0]


def test_the_launch_identity_keys_the_cache(fake_gpu):
    """What a candidate's time depends on beyond its config and the kernels' source (the conv's split
    reduce tile): a change to it is a new cache file; a tuner without one keeps the files it had."""
    def tuner(identity):
        return tuning.Tuner("fake", _Kernel(), CONFIGS, default=lambda s: CONFIGS[0], interpreter=lambda s: CONFIGS[1],
                            launch_identity=identity)

    key = (128, "fp16")
    assert tuner("reduce tile (16, 64)")._cache_file(key) == tuner("reduce tile (16, 64)")._cache_file(key)
    assert tuner("reduce tile (16, 64)")._cache_file(key) != tuner("reduce tile (64, 64)")._cache_file(key)
    assert tuner("")._cache_file(key) == tuning.Tuner("fake", _Kernel(), CONFIGS, default=lambda s: CONFIGS[0],
                                                      interpreter=lambda s: CONFIGS[1])._cache_file(key)
    assert tuner("")._cache_file(key) != tuner("reduce tile (16, 64)")._cache_file(key)


def test_calls_borrow_the_nearest_tuned_config_and_warm_up_tunes_them(fake_gpu, caplog):
    """A served call never stalls on tuning: a key not tuned takes the config of the nearest
    tuned key alike beyond its sizes (or the default with none), said in the log; after
    forget_borrowed, the next launch outside serving() tunes it."""
    t = tuning.Tuner("fake2", _Kernel(), CONFIGS, prune=lambda cs, sizes: cs,
                     default=lambda sizes: CONFIGS[0], interpreter=lambda sizes: CONFIGS[1])
    slow = {"BLOCK": 32, "num_stages": 2}
    t.chosen[(64, "fp16")] = CONFIGS[0]             # as tuned for 64 and 4096 (the nearest differ)
    t.chosen[(4096, "fp16")] = CONFIGS[3]
    with tuning.serving(), caplog.at_level("INFO", logger="accelc"):
        assert _chosen(t.pick((128, "fp16"), {"M": 128}, None)) == slow          # log2 distance 1 vs 5
        assert _chosen(t.pick((2048, "fp16"), {"M": 2048}, None)) == FAST
        assert _chosen(t.pick((128, "bf16"), {"M": 128}, None)) == slow          # nothing alike: the default
    assert fake_gpu == [] and t.borrowed == {(128, "fp16"): (64, "fp16"), (2048, "fp16"): (4096, "fp16"),
                                             (128, "bf16"): None}
    assert "fake2 at M=128 not tuned" in caplog.text and tuning.borrowed_count() >= 3
    t.calls["a launch"] = object()
    tuning.forget_borrowed()
    assert t.borrowed == {} and t.calls == {} and set(t.chosen) == {(64, "fp16"), (4096, "fp16")}
    assert _chosen(t.pick((128, "fp16"), {"M": 128}, lambda c: None)) == FAST and len(fake_gpu) == len(CONFIGS)
    with tuning.serving():     # a borrowed key does not borrow from another borrowed one
        t.pick((8, "fp32"), {"M": 8}, None)
        t.chosen[(16, "fp32")] = CONFIGS[5]
        t.borrowed[(16, "fp32")] = None
        assert t.pick((32, "fp32"), {"M": 32}, None) is CONFIGS[0]
    tuning.forget_borrowed()


def test_a_two_size_key_borrows_by_both_sizes(fake_gpu):
    t = tuning.Tuner("fake3", _Kernel(), CONFIGS, default=lambda sizes: CONFIGS[0],
                     interpreter=lambda sizes: CONFIGS[1], size_fields=2)
    t.chosen[(64, 64, 128)] = CONFIGS[2]
    t.chosen[(64, 1024, 128)] = CONFIGS[4]
    with tuning.serving():
        assert t.pick((128, 512, 128), {"L": 128, "S": 512}, None) is CONFIGS[4]
        assert t.pick((32, 128, 128), {"L": 32, "S": 128}, None) is CONFIGS[2]
    tuning.forget_borrowed()


class _Compiling:
    """A kernel whose warmup (compile only) and launch are recorded, each with the thread it ran on."""

    def __init__(self):
        self.warmed, self.ran = [], []

    def warmup(self, *args, grid, **constexprs):
        import threading
        self.warmed.append((constexprs["BLOCK"], threading.current_thread().name))

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.ran.append(constexprs["BLOCK"])


def test_candidates_compile_ahead_all_at_once_then_are_timed_one_by_one(fake_gpu, monkeypatch):
    """Where Triton has its async compile mode: every candidate's launch is first a warmup (compile
    only) inside that mode, then each is timed with a real launch."""
    pytest.importorskip("triton.runtime._async_compile")
    monkeypatch.setenv("ACCELC_COMPILE_THREADS", "4")
    kernel = _Compiling()

    def launch(cfg):
        compile_ahead.launch_kernel(kernel, (1,), (), dict(BLOCK=cfg.kwargs["BLOCK"]))
    cfg = _tuner().pick((1024, "fp16"), {"M": 1024}, launch)
    assert _chosen(cfg) == FAST
    assert len(kernel.warmed) == len(CONFIGS) and len(kernel.ran) == len(CONFIGS)
    assert not compile_ahead._precompiling.get()       # launches after it run again

    def refused(cfg):      # a candidate that cannot take the call: said by its timing, not by precompile
        raise ValueError("not a candidate for this call")
    compile_ahead.precompile(refused, CONFIGS)


def test_no_compiling_ahead_in_one_thread_or_the_interpreter(fake_gpu, monkeypatch):
    kernel = _Compiling()
    calls = []
    compile_ahead.precompile(lambda c: calls.append(c), CONFIGS)       # ACCELC_COMPILE_THREADS=1 (the fixture)
    monkeypatch.setenv("ACCELC_COMPILE_THREADS", "4")
    monkeypatch.setattr(runtime, "interpreted", lambda: True)
    compile_ahead.precompile(lambda c: calls.append(c), CONFIGS)
    assert calls == [] and kernel.warmed == []


def _table(monkeypatch, keys: dict, device="Fake GPU"):
    """Stand in for the shipped table: {key fields: [configs]} of kernel "fake" on `device`."""
    from accelc import tuning_table

    table = {"format": tuning_table.FORMAT, "kernels": {"fake": {device: {"capability": "9.0", "keys": {
        json.dumps([str(k) for k in key]): [tuning.config_dict(c) for c in cfgs] for key, cfgs in keys.items()}}}}}
    monkeypatch.setattr(tuning_table, "shipped", lambda: table)


def test_the_shipped_tables_winners_are_all_a_key_races_on_its_gpu(fake_gpu, monkeypatch):
    """A key the table holds races only its kept configs that the prune offers (one: none races); a key it
    lacks, another GPU, configs the prune no longer offers, or ACCELC_TUNE=all race every candidate."""
    slow = CONFIGS[0]
    _table(monkeypatch, {(1024, "fp16"): [CONFIGS[3], slow], (2048, "fp16"): [CONFIGS[2]],
                         (32, "fp16"): [CONFIGS[5]]})     # (BLOCK 128: not offered at M=32)
    t = _tuner()
    assert _chosen(t.pick((1024, "fp16"), {"M": 1024}, lambda c: None)) == FAST and fake_gpu == [slow, CONFIGS[3]]
    fake_gpu.clear()
    assert t.pick((2048, "fp16"), {"M": 2048}, lambda c: None) is CONFIGS[2] and fake_gpu == []
    assert _chosen(t.pick((4096, "fp16"), {"M": 4096}, lambda c: None)) == FAST and len(fake_gpu) == len(CONFIGS)
    fake_gpu.clear()
    t.pick((32, "fp16"), {"M": 32}, lambda c: None)
    assert {id(c) for c in fake_gpu} == {id(CONFIGS[0]), id(CONFIGS[1])}   # BLOCK 32's two: the table's is not offered
    fake_gpu.clear()
    monkeypatch.setenv("ACCELC_TUNE", "all")
    _tuner().pick((2048, "fp16"), {"M": 2048}, lambda c: None)
    assert len(fake_gpu) == len(CONFIGS)
    monkeypatch.delenv("ACCELC_TUNE")
    fake_gpu.clear()
    _table(monkeypatch, {(8192, "fp16"): [CONFIGS[2]]}, device="Other GPU")
    _tuner().pick((8192, "fp16"), {"M": 8192}, lambda c: None)
    assert len(fake_gpu) == len(CONFIGS)


def test_the_shipped_table_names_only_configs_its_kernels_offer():
    """Every config the shipped table keeps is one of its kernel's candidates today: a changed config list
    makes the table's entries dead (every key races all again) until bench/tuning_table.py builds it anew."""
    import importlib.util
    from pathlib import Path

    from accelc import tuning_table

    path = Path(__file__).parents[1] / "bench" / "tuning_table.py"      # (its offered_today: what build keeps)
    spec = importlib.util.spec_from_file_location("bench_tuning_table", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    table = json.loads(tuning_table.TABLE_FILE.read_text())
    assert table["format"] == tuning_table.FORMAT and table["kernels"]
    today = bench.offered_today()
    for kernel, devices in table["kernels"].items():
        offered = today[kernel]
        for device, entry in devices.items():
            for key, configs in entry["keys"].items():
                assert configs and all(c in offered for c in configs), (kernel, device, key)


def test_compiling_ahead_turns_tuned_launches_into_compiles_and_ends_quietly(monkeypatch):
    """Inside tuning.compiling_ahead a launch through launch_kernel is a compile (Triton's warmup), and what
    goes wrong in the block ends it without raising (nothing in it is a result); in the interpreter the
    block runs as it is (launches run)."""
    calls = []

    class Kernel:
        def warmup(self, *args, grid, **kw):
            calls.append(("compile", args, grid))

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(("run", args, grid))

    monkeypatch.setenv("ACCELC_COMPILE_THREADS", "4")
    monkeypatch.setattr(runtime, "interpreted", lambda: False)
    with compile_ahead.compiling_ahead() as ahead:
        assert ahead
        compile_ahead.launch_kernel(Kernel(), (2,), (1,), {})
        raise RuntimeError("a layer that fails at these sizes")
    assert calls == [("compile", (1,), (2,))]
    compile_ahead.launch_kernel(Kernel(), (3,), (1,), {})
    assert calls[-1] == ("run", (1,), (3,))
    monkeypatch.setattr(runtime, "interpreted", lambda: True)
    with compile_ahead.compiling_ahead() as ahead:
        assert not ahead
        compile_ahead.launch_kernel(Kernel(), (4,), (1,), {})
    assert calls[-1] == ("run", (1,), (4,))


def test_collecting_hands_over_the_candidates_and_keeps_no_choice(fake_gpu, monkeypatch):
    """tuning.collecting (the guard's pass before its first check, accelc.layer_compiles): a key to tune compiles
    its candidates only (handed to the compile workers), runs its first one, races nothing and leaves every
    tuner as it was; after the block the key is tuned as always."""
    monkeypatch.setenv("ACCELC_COMPILE_THREADS", "4")
    kernel = _Compiling()

    def launch(cfg):
        compile_ahead.launch_kernel(kernel, (1,), (), dict(BLOCK=cfg.kwargs["BLOCK"]))
    tuner = _tuner()
    with tuning.collecting() as jobs:
        first = tuner.pick((1024, "fp16"), {"M": 1024}, launch)
    assert jobs == []                         # (a stand-in kernel: Triton's hook hands over nothing)
    assert len(kernel.warmed) == len(CONFIGS) and kernel.ran == []   # compiled only, nothing timed
    assert _chosen(first) == _chosen(CONFIGS[0]) and tuner.chosen == {} and tuner.timings == {}
    assert _chosen(tuner.pick((1024, "fp16"), {"M": 1024}, launch)) == FAST


def test_the_table_is_built_from_the_configs_offered_today():
    """tuning_table.build with the tuners' configs of today leaves a raced config no longer offered out of its race,
    as if it had not run (a config taken out after the races ran came back when the table was rebuilt from them,
    and the shipped table then named a config its kernel no longer offers): the race's winners are chosen among
    the others, and a race left with one config keeps nothing."""
    from accelc import tuning_table

    a, b, c = ({"BLOCK": 16}, {"BLOCK": 32}, {"BLOCK": 64})
    runs = [{"device": "GPU", "capability": "9.0", "races": [
        {"kernel": "k", "key": ["1"], "timings_us": [[a, 1.0], [b, 1.5], [c, 1.9]]},
        {"kernel": "k", "key": ["2"], "timings_us": [[a, 1.0], [b, 2.0]]}]}]
    keys = tuning_table.build(runs)["kernels"]["k"]["GPU"]["keys"]
    assert keys['["1"]'] == [a, b, c] and keys['["2"]'] == [a, b]      # (at least LEAST kept)
    keys = tuning_table.build(runs, {"k": [b, c]})["kernels"]["k"]["GPU"]["keys"]
    assert keys == {'["1"]': [b, c]}, keys
    assert tuning_table.build(runs, {"other": [a]})["kernels"]["k"]["GPU"]["keys"]['["1"]'] == [a, b, c]


def test_a_filler_a_race_timed_far_behind_the_fastest_is_left_out_of_the_table():
    """build keeps each race's configs within MARGIN of its fastest and at least LEAST of them; a config only LEAST
    kept is left out where a race of its key (the same key met at another batch, or its own) timed it past SLOW x
    that race's fastest: a flash-attention candidate filled a batch-2 LM's three at 1.6x, ran 6.9x the fastest at
    batch 1, and its 5.5 s compile bound a cold optimize's wait. One within MARGIN in some race stays."""
    from accelc import tuning_table

    a, b, c, d = ({"BLOCK": 16}, {"BLOCK": 32}, {"BLOCK": 64}, {"BLOCK": 128})
    race = lambda key, *t: {"kernel": "k", "key": [key], "timings_us": [[cfg, us] for cfg, us in zip((a, b, c, d), t)]}
    runs = [{"device": "GPU", "capability": "9.0", "races": [race("x", 1.0, 1.1, 1.6, 3.0)]},     # batch 2
            {"device": "GPU", "capability": "9.0", "races": [race("x", 1.0, 1.5, 6.9, 1.05)]},    # batch 1
            {"device": "GPU", "capability": "9.0", "races": [race("y", 1.0, 1.9, 2.5, None)]}]    # a race of its own
    keys = tuning_table.build(runs)["kernels"]["k"]["GPU"]["keys"]
    # x: a fastest in both; b within MARGIN at batch 2; d within MARGIN at batch 1 (3.0x at batch 2, kept);
    # c only a filler, 6.9x at batch 1: out.  y: b a filler at 1.9x stays, c a filler at 2.5x goes
    assert keys == {'["x"]': [a, b, d], '["y"]': [a, b]}, keys
