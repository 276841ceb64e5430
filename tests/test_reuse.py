"""accelc/reuse.py: a second optimize of the same model replays the first one's guard verdicts (no checks, no
races) and computes what the first one computes; anything the verdicts depend on, changed, checks again; a
damaged record is said, removed, and the guard runs."""
import logging
import warnings

import pytest
import torch

import accelc
from accelc import guard, reuse, tuning
from accelc.kernels import gemm
from conftest import DEVICE, count_calls


@pytest.fixture
def reusing(monkeypatch, tmp_path):
    """Reuse on, over a cache folder of the test's own; yields a counter of the guard's check passes."""
    monkeypatch.setenv("ACCELC_REUSE", "1")
    monkeypatch.setenv("ACCELC_CACHE_DIR", str(tmp_path))
    return count_calls(monkeypatch, guard, "check_layers")


def _optimize(model, inputs, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelc.optimize(model, inputs, accelc.OptimizeConfig(glue="eager", cuda_graphs=False, **config))


def _lines(opt):
    """The summary's lines but the reuse line, the plain calls' timing and optimize's own time (measured anew each
    time), and without the note that the captured graph was the one the first optimize kept (accelc.capture.stored)."""
    return [line.replace(", the graph an earlier optimize kept", "") for line in opt.summary().splitlines()
            if not line.startswith(("guard: the verdicts", "speed on this GPU", "time: "))]


def test_a_second_optimize_replays_the_verdicts_and_computes_the_same(reusing, monkeypatch):
    """One layer's kernel wrong (put back), one slower than PyTorch (kept as PyTorch): the second optimize runs
    no check and no race, and makes the same graph, the same records, the same numbers."""
    def wrong_for_one(*args, **kwargs):
        out = gemm.linear_ref(*args[:6])
        return out + 1.0 if out.shape[-1] == 4 else out      # the mlp's head alone

    races = []

    def race(gm, args, nodes, against, ahead=False):
        races.append(1)
        return {n: ((0.02, 0.01) if i == 0 else (0.01, 0.02)) for i, n in enumerate(sorted(nodes, key=str))}
    from accelc import runtime
    monkeypatch.setattr(gemm, "linear_launch", lambda *a, **k: wrong_for_one(*a, **k))
    monkeypatch.setattr(runtime, "can_time", lambda device: True)
    monkeypatch.setattr(runtime, "can_run_on", lambda device: True)
    monkeypatch.setattr(guard, "_race", race)
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs()
    first = _optimize(model, (x,), only_if_faster=True)
    assert reusing and races and first.info.reused == ""
    statuses = sorted(r.status for r in first.layers if r.kernel)
    assert "reverted" in statuses and "kept" in statuses and "rewritten" in statuses
    reusing.clear(), races.clear()
    second = _optimize(model, (x,), only_if_faster=True)
    assert not reusing and not races        # no check, no race
    assert second.info.reused and "guard: verdicts reused" in second.info.seconds
    assert "guard: the verdicts of an identical optimize" in second.summary()
    assert _lines(second) == _lines(first)
    assert [(r.name, r.status, r.reason) for r in second.layers] == [(r.name, r.status, r.reason) for r in first.layers]
    assert second.graph_module.code == first.graph_module.code
    with torch.no_grad():
        assert torch.equal(second(x), first(x))


def _bert_ids():
    model = accelc.models.get("bert").to(DEVICE)
    return model, model.example_inputs()


def test_what_the_verdicts_depend_on_changed_checks_again(reusing):
    """A weight (one value), the integer inputs' values (ids a mask or branch may read), a shape, the config:
    each checks again; new float inputs of the same shapes (a fresh torch.randn) do not."""
    model = accelc.models.get("transformer_mlp").to(DEVICE)
    (x,) = model.example_inputs()
    _optimize(model, (x,))
    reusing.clear()
    _optimize(model, (torch.randn_like(x),))
    assert not reusing, "new float values of the same shapes: the verdicts stand"
    changed = {
        "a weight": lambda: (_nudged(model), (x,), {}),
        "the example's shape": lambda: (model, (x[:1],), {}),
        "the config": lambda: (model, (x,), {"tolerance": 1e-2}),
    }
    for what, make in changed.items():
        m, inputs, config = make()
        reusing.clear()
        opt = _optimize(m, inputs, **config)
        assert reusing and not opt.info.reused, what
    ids_model, (ids, mask) = _bert_ids()
    _optimize(ids_model, (ids, mask))
    reusing.clear()
    other = ids.clone()
    other[0, 0] = (ids[0, 0] + 1) % 100
    _optimize(ids_model, (other, mask))
    assert reusing, "other token ids: checked again"


def _nudged(model):
    import copy
    m = copy.deepcopy(model)
    w = next(p for p in m.parameters() if p.dim() == 2)
    with torch.no_grad():
        w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf"), dtype=w.dtype, device=w.device))
    return m


def test_another_accelc_source_or_reuse_off_checks_again(reusing, monkeypatch):
    """A changed kernel (any change to accelc's source) or ACCELC_REUSE=0: the guard runs."""
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs()
    _optimize(model, (x,))
    reusing.clear()
    monkeypatch.setattr(reuse, "source_digest", lambda: "another accelc")
    _optimize(model, (x,))
    assert reusing


def test_with_int8_new_float_inputs_check_again(reusing):
    """int8 scales read the example's (the calibration's) values: new float inputs check again."""
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs()
    _optimize(model, (x,), int8=accelc.Int8Config())
    reusing.clear()
    assert _optimize(model, (x,), int8=accelc.Int8Config()).info.reused and not reusing
    assert not _optimize(model, (torch.randn_like(x),), int8=accelc.Int8Config()).info.reused and reusing


def test_reuse_off_runs_the_guard(reusing, monkeypatch):
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs()
    _optimize(model, (x,))
    monkeypatch.setenv("ACCELC_REUSE", "0")
    reusing.clear()
    _optimize(model, (x,))
    assert reusing


def test_a_damaged_record_is_said_removed_and_the_guard_runs(reusing, caplog):
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs()
    _optimize(model, (x,))
    (record,) = reuse.folder().glob("*.pkl")
    record.write_bytes(b"not a record")
    reusing.clear()
    with caplog.at_level(logging.WARNING, logger="accelc"):
        opt = _optimize(model, (x,))
    assert reusing and not opt.info.reused
    assert any("cannot be read" in r.getMessage() and "the guard runs" in r.getMessage() for r in caplog.records)
    assert record.exists() and record.read_bytes() != b"not a record"     # written again by the guard's run
    reusing.clear()
    assert _optimize(model, (x,)).info.reused and not reusing


def test_a_record_of_other_layers_is_not_replayed(reusing, monkeypatch):
    """The passes made other layers than the record judged (a pass changed): the guard runs."""
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs()
    _optimize(model, (x,))
    (record,) = reuse.folder().glob("*.pkl")
    import pickle
    memo = pickle.loads(record.read_bytes())
    memo.layers = memo.layers[:-1]
    record.write_bytes(pickle.dumps(memo))
    reusing.clear()
    assert not _optimize(model, (x,)).info.reused and reusing


def test_a_causal_lm_reuses_its_forward_and_step_verdicts_and_generates_the_same_tokens(reusing, monkeypatch):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=64, vocab_size=100, max_position_embeddings=64,
                                              num_key_value_heads=1)).to(DEVICE).eval()
    ids = torch.randint(1, 100, (2, 6), device=DEVICE)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    first = _optimize(lm, inputs)
    assert len(list(reuse.folder().glob("*.pkl"))) == 2      # the forward's and the generation step's
    reusing.clear()
    for t in tuning.all_tuners():     # as in a new process: no kernel config chosen yet (the record's are)
        monkeypatch.setattr(t, "chosen", {})
        monkeypatch.setattr(t, "borrowed", {})
    second = _optimize(lm, inputs)
    assert not reusing and second.info.reused and second.step.info.reused
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = first.generate(**inputs, max_new_tokens=5, do_sample=False)
        b = second.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)


_NEW_PROCESS = """
import json, logging, sys, warnings
import torch, transformers as T
import accelc
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(message)s")
for name in ("torch", "transformers", "urllib3", "filelock"):
    logging.getLogger(name).setLevel(logging.WARNING)
warnings.simplefilter("ignore")
torch.manual_seed(0)
device = sys.argv[1]
lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                      vocab_size=100, max_position_embeddings=64, num_key_value_heads=1)).to(device).eval()
ids = torch.randint(1, 100, (2, 6), device=device)
opt = accelc.optimize(lm, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                      accelc.OptimizeConfig(glue="eager", cuda_graphs=False))
print(json.dumps([bool(opt.info.reused), bool(opt.step.info.reused)]))
"""


def test_a_new_process_reuses_the_verdicts_of_the_forward_and_the_generation_step(tmp_path):
    """What a user meets: the second run of a script (a new process; nothing chosen or imported yet) reuses the
    first one's verdicts for the forward and the generation step (the key's parts stable across processes)."""
    import json
    import os
    import subprocess
    import sys
    pytest.importorskip("transformers")
    env = dict(os.environ, ACCELC_REUSE="1", ACCELC_CACHE_DIR=str(tmp_path))
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _NEW_PROCESS, DEVICE.type], env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        keys = [line for line in p.stderr.splitlines() if "reuse key" in line]
        runs.append((json.loads(p.stdout.strip().splitlines()[-1]), keys))
    assert runs[0][0] == [False, False]
    assert runs[1][0] == [True, True], "\n".join(["first:", *runs[0][1], "second:", *runs[1][1]])


def test_paths_set_in_the_environment_keep_the_key_and_switches_change_it(reusing, monkeypatch):
    """Inductor sets TRITON_PTXAS_PATH, TRITON_LIBDEVICE_PATH and TRITON_CACHE_DIR when it compiles (a process that
    compiled glue before a generation step's optimize keyed it apart from one that loaded the glue: measured on an
    H200): paths and cache folders are no switch; a switch (TRITON_DEFAULT_FP_FUSION) checks again."""
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs()
    _optimize(model, (x,))
    for name in ("TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(name, "/somewhere/else")
    reusing.clear()
    assert _optimize(model, (x,)).info.reused and not reusing
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert not _optimize(model, (x,)).info.reused and reusing


@pytest.mark.parametrize("name", accelc.models.names())
def test_every_builtin_model_reuses_its_verdicts_and_computes_the_same(reusing, name):
    """optimize twice, as a user's second run: the second reuses the first one's verdicts (and the graph the first
    exported) and gives the same outputs (BatchNorm folding, written-out attention, the export-captured and the
    traced models alike)."""
    model = accelc.models.get(name).to(DEVICE)
    inputs = model.example_inputs(batch_size=1)
    first = _optimize(model, inputs)
    reusing.clear()
    second = _optimize(model, inputs)
    assert second.info.reused and not reusing, name
    # the graph torch.export made the first time, read back (accelc.capture.stored); a traced one traced again
    assert second.info.capture_kept == (first.info.capture_method == "torch.export"), name
    assert _lines(second) == _lines(first)
    other = model.example_inputs(batch_size=3)      # and at a batch other than the example's
    for args in (inputs, other):
        with torch.no_grad():
            a, b = first(*args), second(*args)
        assert all(torch.equal(x, y) for x, y in zip(torch.utils._pytree.tree_leaves(a),
                                                     torch.utils._pytree.tree_leaves(b)))


def test_the_records_folder_keeps_the_most_recent_within_its_bounds(reusing, monkeypatch):
    """Past MAX_RECORDS records the least recently used go (accelc.files.trim_folder, as for kept captures)."""
    monkeypatch.setattr(reuse, "MAX_RECORDS", 1)
    model = accelc.models.get("mlp").to(DEVICE)
    (x,) = model.example_inputs()
    _optimize(model, (x,))
    (older,) = reuse.folder().glob("*.pkl")
    _optimize(model, (torch.randn(x.shape[0] + 1, *x.shape[1:], device=DEVICE),))
    (newer,) = reuse.folder().glob("*.pkl")
    assert newer != older
