"""accelc/capture/stored.py: a second optimize of the same model reads back the graph torch.export made the first
time (no export), checked on the example as a fresh capture is, and computes what the first one computes; an edited
forward, another example shape or a changed setting captures again; a kept graph that does not reproduce the
model, or a damaged file, is said, removed, and the model captured again."""
import importlib
import logging
import os
import sys
import warnings

import pytest
import torch
import transformers as T

import accelc
from accelc import reuse
from accelc.capture import capture, stored, trace
from conftest import DEVICE, count_calls

SOURCE = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        if x.shape[0] > 1:     # a branch on a size: symbolic_trace cannot take it, torch.export does
            x = x * SCALE
        return self.out(torch.relu(self.fc(x)))
'''


@pytest.fixture
def exports(monkeypatch, tmp_path):
    """Reuse on, over a cache folder of the test's own, modules imported from source (no bytecode: an edit within
    the same second is read); yields a list that grows at each torch.export."""
    monkeypatch.setenv("ACCELC_REUSE", "1")
    monkeypatch.setenv("ACCELC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield count_calls(monkeypatch, trace, "_export_once")
    sys.modules.pop("user_model", None)


def _user_model(tmp_path, scale, seed=0):
    """Model of a user's file (user_model.py, written with SCALE = scale), its weights drawn from `seed`."""
    (tmp_path / "user_model.py").write_text(f"SCALE = {scale}\n" + SOURCE)
    sys.modules.pop("user_model", None)
    importlib.invalidate_caches()
    module = importlib.import_module("user_model")
    torch.manual_seed(seed)
    return module.Model().to(DEVICE).eval()


def _optimize(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelc.optimize(model, inputs, accelc.OptimizeConfig(glue="eager", cuda_graphs=False))


def _kept_files():
    folder = reuse.captures()
    return sorted(folder.glob("*.pkl")) if folder.is_dir() else []


def test_a_second_optimize_reads_the_graph_back_and_computes_the_same(exports, tmp_path, caplog):
    """The first optimize says no graph is kept under its key, with the key's parts (what tells two processes'
    keys of one model apart, bench/optimize_time.py's capture_log); the second reads it back."""
    model = _user_model(tmp_path, 2.0)
    x = torch.randn(3, 16, device=DEVICE)
    with caplog.at_level(logging.INFO, logger="accelc"):
        first = _optimize(model, (x,))
    assert exports and len(_kept_files()) == 1 and not first.info.capture_kept
    assert "capture: no graph kept under key" in caplog.text and "'globals': " in caplog.text, caplog.text
    exports.clear()
    second = _optimize(model, (x,))
    assert not exports      # read back, not exported
    assert second.info.capture_kept and "the graph an earlier optimize kept" in second.summary()
    assert second.info.capture_method == "torch.export"
    assert second.info.reused       # the same graph: the guard's verdicts of the first replayed
    assert second.graph_module.code == first.graph_module.code
    with torch.no_grad():
        for batch in (3, 5, 2):     # the shapes the export let vary still vary
            xb = torch.randn(batch, 16, device=DEVICE)
            assert torch.equal(second(xb), first(xb))
            assert torch.allclose(second(xb), model(xb), atol=1e-5, rtol=1e-5)


def test_other_weights_of_the_same_model_read_the_graph_back_with_their_own_values(exports, tmp_path):
    x = torch.randn(3, 16, device=DEVICE)
    _optimize(_user_model(tmp_path, 2.0, seed=0), (x,))
    exports.clear()
    other = _user_model(tmp_path, 2.0, seed=1)
    opt = _optimize(other, (x,))
    assert not exports and opt.info.capture_kept
    with torch.no_grad():
        assert torch.allclose(opt(x), other(x), atol=1e-5, rtol=1e-5)


def test_an_edited_forward_is_captured_again(exports, tmp_path):
    """The file the forward runs changed (SCALE 2 -> 3): a new key, a new export, the edited model's numbers."""
    x = torch.randn(3, 16, device=DEVICE)
    _optimize(_user_model(tmp_path, 2.0), (x,))
    exports.clear()
    edited = _user_model(tmp_path, 3.0)
    opt = _optimize(edited, (x,))
    assert exports and not opt.info.capture_kept and len(_kept_files()) == 2
    with torch.no_grad():
        assert torch.allclose(opt(x), edited(x), atol=1e-5, rtol=1e-5)


def test_the_key_follows_what_the_graph_depends_on(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = _user_model(tmp_path, 2.0)

    def key_of(m, x, dynamic=True):
        with stored.files_run() as files:
            expected = m(x)
        spec = trace.CallSpec.of(m, (x,), {}, expected)
        return stored.key(m, spec, (x,), expected, dynamic, files)
    x = torch.randn(3, 16, device=DEVICE)
    base = key_of(model, x)
    assert base is not None and key_of(model, x.clone()) == base
    assert key_of(model, torch.randn(4, 16, device=DEVICE)) != base         # another example shape
    assert key_of(model, x, dynamic=False) != base                          # another shape option
    model.double()
    assert key_of(model, x.double()) != base                                # other dtypes
    model.float()
    model.fc.threshold = 0.5                                                # a Python value a forward may read
    assert key_of(model, x) != base
    del model.fc.threshold
    assert key_of(model, x) == base
    model.fc.pad = (1, 1)                                                   # a tuple of them (a conv's stride)
    assert key_of(model, x) != base
    del model.fc.pad
    handle = model.out.register_forward_hook(lambda mod, args, out: out * 2)   # a hook, traced into the graph
    assert key_of(model, x) != base
    handle.remove()
    assert key_of(model, x) == base
    sys.modules.pop("user_model", None)


def test_code_typed_in_or_a_profiler_keeps_nothing(monkeypatch):
    """A forward from <stdin> has no file an edit shows in: no key. A profiler already set: none either, and it
    is left set."""
    assert stored._files_digest({"<stdin>"}) is None
    assert stored._files_digest({"<string>", "<frozen os>"}) == []

    def profiler(frame, event, arg):
        return None
    sys.setprofile(profiler)
    try:
        with stored.files_run() as files:
            pass
        assert files is None and sys.getprofile() is profiler
    finally:
        sys.setprofile(None)


def test_a_kept_graph_that_does_not_reproduce_the_model_is_dropped(exports, tmp_path, monkeypatch, caplog):
    """The key blind to the edit (the files and their globals not digested): the SCALE 2 graph is read for the
    SCALE 3 model, its check on the example fails, and the model is exported again, its own numbers kept."""
    monkeypatch.setattr(stored, "_files_digest", lambda files: [])
    monkeypatch.setattr(stored, "_globals", lambda *a: [])
    x = torch.randn(3, 16, device=DEVICE)
    _optimize(_user_model(tmp_path, 2.0), (x,))
    exports.clear()
    edited = _user_model(tmp_path, 3.0)
    with caplog.at_level(logging.INFO, logger="accelc"):
        opt = _optimize(edited, (x,))
    assert exports and not opt.info.capture_kept
    assert "does not reproduce the model" in caplog.text
    with torch.no_grad():
        assert torch.allclose(opt(x), edited(x), atol=1e-5, rtol=1e-5)


def test_a_damaged_file_is_said_removed_and_captured_again(exports, tmp_path, caplog):
    model = _user_model(tmp_path, 2.0)
    x = torch.randn(3, 16, device=DEVICE)
    _optimize(model, (x,))
    (path,) = _kept_files()
    path.write_bytes(b"not a pickle")
    exports.clear()
    with caplog.at_level(logging.WARNING, logger="accelc"):
        opt = _optimize(model, (x,))
    assert exports and "cannot be read" in caplog.text and not opt.info.capture_kept
    assert _kept_files() == [path] and path.read_bytes() != b"not a pickle"     # written anew by the export
    with torch.no_grad():
        assert torch.allclose(opt(x), model(x), atol=1e-5, rtol=1e-5)


def test_reuse_off_keeps_nothing(exports, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELC_REUSE", "0")
    model = _user_model(tmp_path, 2.0)
    x = torch.randn(3, 16, device=DEVICE)
    _optimize(model, (x,))
    exports.clear()
    _optimize(model, (x,))
    assert exports and not (tmp_path / "cache" / "captures").exists()


def test_the_graph_keeps_its_tensors_by_name_and_constants_by_value():
    """The model's parameters and buffers are named, never written (a kept file does not grow with the weights);
    tensors the export made are kept by value; the read-back module holds the model's own tensor objects."""
    cfg = T.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1)
    lm = T.Qwen2ForCausalLM(cfg).to(DEVICE).eval()
    ids = torch.randint(0, 128, (1, 12), device=DEVICE)
    gm, method, _ = capture(lm, (ids,), {})
    assert method == "torch.export"
    entry = stored.written(gm, lm)
    sources = {}
    for _, kind, source in entry["state"]:
        sources.setdefault(kind, set()).add(source[0])
    assert sources["parameter"] == {"model"} and sources["constant"] == {"value"}
    assert all(sources[kind] == {"model"} for kind in sources if kind.startswith("buffer"))
    back = stored.rebuilt(entry, lm)
    assert back.code == gm.code
    own = {id(t) for t in lm.parameters()}
    assert all(id(t) in own for t in back.parameters())
    with torch.no_grad():
        other = torch.randint(0, 128, (2, 9), device=DEVICE)
        assert all(torch.equal(a, b) for a, b in zip(back(other), gm(other)))


def test_a_causal_lm_reads_both_programs_back_and_generates_the_same(exports):
    """The forward and the generation step: both kept, both read back (no export at all the second time)."""
    cfg = T.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1)
    lm = T.Qwen2ForCausalLM(cfg).to(DEVICE).eval()
    ids = torch.randint(0, 128, (1, 12), device=DEVICE)
    first = _optimize(lm, (ids,))
    tokens = first.generate(ids, max_new_tokens=4, do_sample=False)
    assert len(_kept_files()) == 2
    exports.clear()
    second = _optimize(lm, (ids,))
    assert not exports and second.info.capture_kept
    assert torch.equal(second.generate(ids, max_new_tokens=4, do_sample=False), tokens)
    with torch.no_grad():
        expected = lm.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, expected)


def test_the_folder_keeps_the_most_recently_used_within_its_bounds(exports, tmp_path, monkeypatch):
    """Past MAX_KEPT graphs the least recently used go; one read back counts as used."""
    monkeypatch.setattr(stored, "MAX_KEPT", 2)
    model = _user_model(tmp_path, 2.0)
    examples = {batch: (torch.randn(batch, 16, device=DEVICE),) for batch in (3, 4, 5)}
    _optimize(model, examples[3])
    (of_3,) = _kept_files()
    _optimize(model, examples[4])
    (of_4,) = [p for p in _kept_files() if p != of_3]
    for age, path in enumerate((of_3, of_4)):      # both written long ago, batch 3's first
        os.utime(path, (1000 + age, 1000 + age))
    exports.clear()
    _optimize(model, examples[3])        # read back: now the most recently used
    assert not exports
    _optimize(model, examples[5])
    kept = _kept_files()
    assert len(kept) == 2 and of_3 in kept and of_4 not in kept


def test_the_compile_workers_start_as_a_capture_traces_and_not_in_a_warm_optimize(exports, tmp_path, monkeypatch):
    """An optimize on a GPU starts its compile workers as its capture begins to trace (their imports are done by the
    time the guard's first tuner asks), not at its beginning; one whose graph is read back (a warm optimize: its
    kernels compiled before) starts none, 16 processes importing torch beside its passes and warm-up for nothing.
    Here an optimize's hold is made a GPU's, the workers' start recorded."""
    from accelc import compile_workers
    events = []
    hold = compile_workers.hold
    monkeypatch.setattr(compile_workers, "hold", lambda on=True: (events.append("hold"), hold(True))[1])
    monkeypatch.setattr(compile_workers, "enabled", lambda: True)
    monkeypatch.setattr(compile_workers, "refuse_crashed", lambda: None)     # (Triton's hook left as it is)
    monkeypatch.setattr(compile_workers, "_running", lambda: events.append("workers") or [])
    tracers = trace._try_tracers
    monkeypatch.setattr(trace, "_try_tracers", lambda *a, **k: (events.append("trace"), tracers(*a, **k))[1])
    model = _user_model(tmp_path, 2.0)
    x = torch.randn(3, 16, device=DEVICE)
    _optimize(model, (x,))
    assert events == ["hold", "workers", "trace"], events
    events.clear()
    second = _optimize(model, (x,))
    assert second.info.capture_kept and events == ["hold"], events

# ---------------------------------------------------------------------------------------------
# What the key must see, and what a kept graph is checked on before it is trusted: a value the export baked into the
# graph (a plain tensor attribute), a limit from outside the model's code (an environment variable, a module global,
# a class attribute the key cannot see), a record put in another's place. Each was a silent wrong number: the graph
# read back answered with the first process's value or branch.

def _module(tmp_path, source: str):
    (tmp_path / "user_model.py").write_text(source)
    sys.modules.pop("user_model", None)
    importlib.invalidate_caches()
    return importlib.import_module("user_model")


def _same_or_refused(opt, model, x):
    """opt(x) is eager's, or refused with accelc's error: never another number."""
    try:
        with torch.no_grad():
            got = opt(x)
    except accelc.AccelcError:
        return "refused"
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)
    return "same"


ATTRIBUTE = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, offset):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.offset = torch.full((8,), float(offset))     # a plain tensor attribute: no parameter, no buffer

    def forward(self, x):
        if x.shape[0] > 1:      # (a branch on a size: torch.export captures it, symbolic_trace cannot)
            x = x + 0
        # the offset reaches the output only for large inputs: the example never shows it
        return self.fc(x) + self.offset * (x.abs().amax() > 1e3)
'''


def test_a_changed_tensor_attribute_is_captured_again(exports, tmp_path):
    module = _module(tmp_path, ATTRIBUTE)
    x = torch.randn(3, 16, device=DEVICE)
    torch.manual_seed(0)
    _optimize(module.Model(10.0).to(DEVICE).eval(), (x,))
    assert exports
    exports.clear()
    torch.manual_seed(0)
    model = module.Model(0.0).to(DEVICE).eval()       # the same weights, the attribute changed (a new process's)
    opt = _optimize(model, (x,))
    assert exports and not opt.info.capture_kept and not opt.info.reused
    big = torch.randn(3, 16, device=DEVICE) * 1e4
    assert _same_or_refused(opt, model, big) == "same"


# a model doubling its input past a batch limit read from outside its own code
LIMITED = '''
import os
import sys
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        if x.shape[0] > {limit}:
            x = x * 2
        return self.fc(x)
'''
ENVIRONMENT = LIMITED.format(limit='int(os.environ.get("REUSE_TEST_LIMIT", "8"))')     # a setting
# an attribute of another module, which no key sees
OUTSIDE_LIMIT = LIMITED.format(limit='getattr(sys, "reuse_test_limit", 8)')


def test_a_size_limit_from_the_environment_changes_the_key(exports, tmp_path, monkeypatch):
    module = _module(tmp_path, ENVIRONMENT)
    x = torch.randn(3, 16, device=DEVICE)
    torch.manual_seed(0)
    model = module.Model().to(DEVICE).eval()
    monkeypatch.setenv("REUSE_TEST_LIMIT", "8")
    _optimize(model, (x,))
    exports.clear()
    monkeypatch.setenv("REUSE_TEST_LIMIT", "4")
    opt = _optimize(model, (x,))
    assert exports and not opt.info.capture_kept
    for batch in (2, 3, 4, 5, 7, 8):
        _same_or_refused(opt, model, torch.randn(batch, 16, device=DEVICE))


def test_the_key_holds_the_environment_variables_the_models_own_code_reads(monkeypatch):
    """Read by the model's code (directly, or through os.getenv / environ.get): in the key; read by torch (its
    version is in the key) at a first use or in passing: not, as it may differ between two processes of one model."""
    import torch.hub
    monkeypatch.setenv("REUSE_TEST_SETTING", "1")
    with stored.files_run() as files:
        torch.hub._get_torch_home()                      # torch reads TORCH_HOME / XDG_CACHE_HOME
        os.getenv("REUSE_TEST_SETTING")
        "REUSE_TEST_OTHER" in os.environ
    assert files.env == {"REUSE_TEST_SETTING", "REUSE_TEST_OTHER"}, files.env
    assert any(c.co_name == "_get_torch_home" for c in files.codes)


def test_a_limit_the_key_cannot_see_is_found_at_the_ends_of_the_range(exports, tmp_path, monkeypatch, caplog):
    """The kept graph claims batches up to 8 without the doubling; the model now doubles past 4: the kept graph is
    checked at the ends of its range before it is trusted, dropped, and the model exported again."""
    module = _module(tmp_path, OUTSIDE_LIMIT)
    x = torch.randn(3, 16, device=DEVICE)
    torch.manual_seed(0)
    model = module.Model().to(DEVICE).eval()
    _optimize(model, (x,))
    exports.clear()
    monkeypatch.setattr(sys, "reuse_test_limit", 4, raising=False)
    with caplog.at_level(logging.INFO, logger="accelc"):
        opt = _optimize(model, (x,))
    assert "does not reproduce the model (ValueError: at " in caplog.text, caplog.text     # (a size besides the example)
    assert exports and not opt.info.capture_kept
    for b in (2, 3, 4, 5, 8):
        _same_or_refused(opt, model, torch.randn(b, 16, device=DEVICE))


def test_the_key_sees_globals_a_python_and_tensor_attributes(exports, tmp_path, monkeypatch):
    """The globals the forward's code names, not the module's others (a cache a library fills as its process goes
    on: two processes of one model told apart by it never reused a capture)."""
    module = _module(tmp_path, ATTRIBUTE.replace("x = x + 0", "x = x * SCALE") + "\nSCALE = 2.0\nOTHER = 1\n")
    model = module.Model(1.0).to(DEVICE).eval()
    x = torch.randn(3, 16, device=DEVICE)

    def key_of():
        with stored.files_run() as files:
            expected = model(x)
        spec = trace.CallSpec.of(model, (x,), {}, expected)
        return stored.key(model, spec, (x,), expected, True, files)
    base = key_of()
    assert base is not None and key_of() == base
    module.SCALE = 3.0                                   # a module global changed at run time, the file as it was
    assert key_of() != base
    module.SCALE = 2.0
    module.OTHER = 2                                     # a global no code of the forward names
    assert key_of() == base
    model.offset[0] = 5.0                                # one value of a plain tensor attribute
    assert key_of() != base
    model.offset[0] = 1.0
    assert key_of() == base
    monkeypatch.setattr(sys, "version", sys.version + " (another build)")    # another Python
    assert key_of() != base


def test_a_record_under_another_key_is_not_replayed(exports, tmp_path):
    """A record copied or renamed into another key's place (a synced or restored cache folder): read as no record,
    said and removed, for the guard's verdicts and for kept graphs alike."""
    memo = reuse.Memo(layers=[], decisions=[], checks={}, eager_ms={}, eager_gpu_ms=None, shapes=None, padding=None,
                      picks=[])
    reuse.keep("a" * 40, memo)
    assert reuse.lookup("a" * 40) is not None
    folder = reuse.folder()
    (folder / ("b" * 40 + ".pkl")).write_bytes((folder / ("a" * 40 + ".pkl")).read_bytes())
    assert reuse.lookup("b" * 40) is None and not (folder / ("b" * 40 + ".pkl")).exists()

    module = _module(tmp_path, ATTRIBUTE)
    model = module.Model(1.0).to(DEVICE).eval()
    _optimize(model, (torch.randn(3, 16, device=DEVICE),))
    (kept,) = sorted(reuse.captures().glob("*.pkl"))
    other = kept.with_name("c" * 40 + ".pkl")
    other.write_bytes(kept.read_bytes())
    assert stored.read(reuse.captures(), kept.stem, model) is not None
    assert stored.read(reuse.captures(), "c" * 40, model) is None and not other.exists()
