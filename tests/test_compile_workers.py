"""The candidates' compiles in worker processes (accelc.compile_workers): what a launch would compile is collected
without compiling it, a worker's compile of it lands in Triton's disk cache under the key the launch's own compile
then finds (so the launch loads it), the worker processes do it for a tuner's candidates inside an optimize (not
outside one) and end with it, and with the workers off nothing changes. Triton compiles for sm90 here
without a GPU through bench/gluon_compile.py's stand-in driver, in a process of its own (the suite runs in the
interpreter)."""
import os
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import os, sys, time
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(ROOT, "bench"))
from gluon_compile import Sm90Driver
import torch
from triton.runtime import driver
driver.set_active(Sm90Driver())
from accelc import compile_workers
from accelc.compile_ahead import compile_only, launch_kernel
from accelc.kernels import layernorm

x = torch.empty(64, 768, dtype=torch.float16); y = torch.empty_like(x); w = torch.empty(768, dtype=torch.float16)

def launch(cfg):
    rows, warps = cfg
    launch_kernel(layernorm._layer_norm_kernel, (64 // rows,), (x, x, w, w, y, 64, 768, 768, 768, 1e-5),
                  dict(HAS_RES=False, HAS_W=True, HAS_B=True, RMS=False, ROWS=rows, BLOCK_N=1024, num_warps=warps))

cache = os.environ["TRITON_CACHE_DIR"]
def binaries():
    return sorted(d for d in os.listdir(cache) if any(f.endswith(".cubin") for f in os.listdir(os.path.join(cache, d)))) \
        if os.path.isdir(cache) else []

cfgs = [(1, 4), (2, 8)]
jobs = compile_workers.collect(launch, cfgs, compile_only)
print("collected", len(jobs), sorted({name for name, _ in jobs}), "binaries", len(binaries()))
print("worker compiles", [compile_workers.compile_one(*job) for job in jobs], "binaries", len(binaries()))
before = binaries()
t0 = time.perf_counter()
with compile_only():
    for c in cfgs:
        launch(c)
print("launch compiles found them", binaries() == before, round(time.perf_counter() - t0, 2))
print("collected again", len(compile_workers.collect(launch, cfgs, compile_only)))
# the workers themselves: processes of their own, the target sent with each job
os.environ["ACCELC_COMPILE_PROCS"] = "2"
more = [(4, 4), (8, 4), (16, 4)]
print("outside an optimize", compile_workers.compile_all(launch, more, compile_only), "binaries", len(binaries()))
compile_workers.hold()
print("workers", compile_workers.enabled(), compile_workers.compile_all(launch, more, compile_only),
      "binaries", len(binaries()))
compile_workers.release()
print("closed with it", compile_workers._workers == [])
before = binaries()
with compile_only():
    for c in more:
        launch(c)
print("launch found them", binaries() == before)
os.environ["ACCELC_COMPILE_PROCS"] = "0"
print("off", compile_workers.enabled(), compile_workers.compile_all(launch, [(32, 4)], compile_only))
"""


def test_collected_compiles_land_where_the_launch_finds_them(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_INTERPRET": "0",
           "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines()
             if line.split(" ")[0] in ("collected", "worker", "launch", "workers", "off", "outside", "closed")]
    assert out.returncode == 0, out.stderr[-3000:]
    # two specializations asked for, nothing compiled while collecting
    assert lines[0] == "collected 2 ['accelc.kernels.layernorm._layer_norm_kernel'] binaries 0", lines
    assert lines[1] == "worker compiles [True, True] binaries 2", lines
    assert lines[2].startswith("launch compiles found them True"), lines      # loaded, no binary of its own
    assert lines[3] == "collected again 0", lines                            # compiled in this process now
    assert lines[4] == "outside an optimize 0 binaries 2", lines            # (a later call's few: the threads)
    assert lines[5] == "workers True 3 binaries 5", lines                   # three more, by two processes
    assert lines[6] == "closed with it True", lines
    assert lines[7] == "launch found them True", lines
    assert lines[8] == "off False 0", lines


POISON = r"""
import os
import triton
import triton.language as tl

if os.environ.get("MAIN_PID") and os.getpid() != int(os.environ["MAIN_PID"]):
    os.abort()      # in a compile worker: as Triton's LLVM aborting on one kernel's code


@triton.jit
def copy_kernel(x, y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, tl.load(x + i))
"""

# a process with the stand-in sm90 driver, two compile workers, poison.copy_kernel aborting in a worker
POISONED = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
os.environ["MAIN_PID"] = str(os.getpid())
os.environ["ACCELC_COMPILE_PROCS"] = "2"
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, KDIR)
from gluon_compile import Sm90Driver
import torch
from triton.runtime import driver
driver.set_active(Sm90Driver())
import poison
from accelc import compile_workers
compile_workers.FIRST_BY_A_WORKER += ("poison",)     # (this test's kernel stands for one of accelc's)
"""

# a kernel of accelc's that compiles (fine) and one that ends the worker compiling it (aborting)
LAUNCHES = r"""
from accelc.compile_ahead import compile_only, launch_kernel
from accelc.kernels import layernorm

x = torch.empty(64, 768, dtype=torch.float16); y = torch.empty_like(x); w = torch.empty(768, dtype=torch.float16)

def fine(rows):
    launch_kernel(layernorm._layer_norm_kernel, (64 // rows,), (x, x, w, w, y, 64, 768, 768, 768, 1e-5),
                  dict(HAS_RES=False, HAS_W=True, HAS_B=True, RMS=False, ROWS=rows, BLOCK_N=1024, num_warps=4))

def aborting(n):
    launch_kernel(poison.copy_kernel, (1,), (x, y), dict(N=n))
"""

CRASH_SCRIPT = POISONED + LAUNCHES + r"""
compile_workers.hold()
jobs = compile_workers.collect(aborting, [64], compile_only) + compile_workers.collect(fine, [1, 2], compile_only)
print("jobs", len(jobs), "compiled", compile_workers.compile_jobs(jobs))
print("crashed", sorted(compile_workers.crashed().values()))
try:
    with compile_only():
        aborting(64)
    print("refused no")
except compile_workers.CompilerCrashed as e:
    print("refused", e)
with compile_only():
    fine(1)
print("others compile here")
# a launch whose compile no worker was handed (a kernel at a new size): a worker makes it first
try:
    with compile_only():
        aborting(32)
    print("first no")
except compile_workers.CompilerCrashed as e:
    print("first", len(compile_workers.crashed()), e)
before = len(compile_workers._sent)
with compile_only():
    fine(4)
print("fine first", len(compile_workers._sent) - before)
compile_workers.release()
with compile_only():
    aborting(16)        # outside an optimize: compiled here (no worker), as before
print("outside compiled")
"""


def _poisoned_run(tmp_path, script: str) -> str:
    """`script` (POISONED's process, ROOT and KDIR set) run with poison.py in tmp_path's kernels/ and Triton's cache
    in tmp_path's cache/: its stdout."""
    kdir = tmp_path / "kernels"
    kdir.mkdir(exist_ok=True)
    (kdir / "poison.py").write_text(POISON)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_INTERPRET": "0",
           "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": os.pathsep.join([str(kdir), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\nKDIR = {str(kdir)!r}\n" + script],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_compile_that_ends_its_worker_is_refused_here(tmp_path):
    """A compile that ends the worker running it (Triton's LLVM aborting on one kernel's code, seen with triton
    3.6 on a causal LM's step program) would end this process too: its specialization is refused here with a
    CompilerCrashed naming it (the guard leaves the layer in PyTorch, a race drops the candidate); the other jobs
    still compile. Inside an optimize a compile no worker was handed goes to one first (refused the same where
    it ends the worker; compiled there, then loaded here, where not); outside one, compiles are made here."""
    out = _poisoned_run(tmp_path, CRASH_SCRIPT)
    lines = [line for line in out.splitlines()
             if line.split(" ")[0] in ("jobs", "crashed", "refused", "others", "first", "fine", "outside")]
    assert lines[0] == "jobs 3 compiled 2", lines
    assert lines[1] == "crashed ['signal SIGABRT']", lines
    assert lines[2].startswith("refused Triton's compiler ended the process compiling copy_kernel"), lines
    assert "signal SIGABRT" in lines[2], lines
    assert lines[3] == "others compile here", lines
    assert lines[4].startswith("first 2 Triton's compiler ended the process compiling copy_kernel"), lines
    assert lines[5] == "fine first 1", lines         # handed to a worker, then loaded here
    assert lines[6] == "outside compiled", lines


def test_handing_the_guards_other_sizes_to_the_workers_leaves_the_tuners_as_they_were(monkeypatch):
    """sizes_ahead's pass that hands a layer's kernels at new sizes to the workers launches nothing and compiles
    nothing in this process: what the tuners remember from it (a call whose kernel was not compiled would launch
    through Triton from then on) is dropped when it ends."""
    import contextlib
    import warnings

    import torch

    import accelc
    from accelc import compile_ahead, compile_workers, layer_compiles
    from accelc.kernels import gemm
    from accelc.rewrite import layers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = accelc.optimize(model, (torch.randn(4, 16),))
    gm = opt.graph_module
    handed = []
    monkeypatch.setattr(compile_workers, "active", lambda: True)
    monkeypatch.setattr(compile_workers, "compile_jobs", lambda jobs, fill=False: handed.append(jobs) or 0)
    monkeypatch.setattr(compile_ahead, "compiling_ahead", lambda most=None: contextlib.nullcontext(False))
    before = dict(gemm.TUNER.calls)
    layer_compiles.sizes_ahead(gm, (torch.randn(7, 16),), set(layers(gm)))
    assert handed, "the pass ran"
    assert gemm.TUNER.calls == before


SUBMIT_SCRIPT = POISONED + r"""
from accelc.compile_ahead import compile_only, launch_kernel

x = torch.empty(64, dtype=torch.float16); y = torch.empty_like(x)

def aborting(n):
    launch_kernel(poison.copy_kernel, (1,), (x, y), dict(N=n))

compile_workers.hold()
pending = compile_workers.submit(compile_workers.collect(aborting, [8, 16], compile_only))
print("in flight", len(compile_workers._inflight))      # (the workers are still importing: seconds)
for n in (8, 16):
    try:
        with compile_only():
            aborting(n)
        print("refused no")
    except compile_workers.CompilerCrashed as e:
        print("refused", n, "SIGABRT" in str(e))
print("waited", pending.wait(), "in flight", len(compile_workers._inflight))
compile_workers.release()
"""


def test_a_launch_meeting_a_compile_handed_over_without_waiting_waits_for_its_outcome(tmp_path):
    """compile_workers.submit returns while the workers compile (the guard's other sizes, layer_compiles.
    others_ahead): a launch here that meets one of those specializations first waits for the worker's compile, so
    that one that ends its worker is still never compiled in this process (it would end this process too)."""
    lines = [line for line in _poisoned_run(tmp_path, SUBMIT_SCRIPT).splitlines() if line.split(" ")[0] in ("in", "refused", "waited")]
    assert lines == ["in flight 2", "refused 8 True", "refused 16 True", "waited 0 in flight 0"], lines


def test_the_guard_hands_every_other_sizes_kernels_over_at_once_after_the_examples_checks(monkeypatch):
    """check_layers: the other sizes' kernels go to the workers in one batch, collected once the example's check
    pass has tuned its kernels (the configs the checks at other sizes serve), without waiting; each size's own
    pass then collects nothing again, and the batch is waited for before the guard goes on."""
    import warnings

    import torch

    import accelc
    from accelc import guard, layer_compiles

    events = []

    class Batch:
        def wait(self):
            events.append("waited")
            return 0

    def others_ahead(gm, others, only):
        events.append(("handed", tuple(label for label, _, _ in others), len(only)))
        return Batch()
    check_pass = guard._check_pass

    def recorded_pass(gm, args, config, only, repeat):
        events.append(("checked", tuple(args[0].shape)))
        return check_pass(gm, args, config, only, repeat)
    monkeypatch.setattr(layer_compiles, "others_ahead", others_ahead)
    monkeypatch.setattr(layer_compiles, "sizes_ahead", lambda gm, args, only, handed: events.append(("ahead", handed)))
    monkeypatch.setattr(guard, "_check_pass", recorded_pass)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelc.optimize(model, (torch.randn(4, 16),), accelc.OptimizeConfig(only_if_faster=False))
    first = events.index(("checked", (4, 16)))
    handed = events[first + 1]
    assert handed[0] == "handed" and handed[1][0] == "on a second draw of the inputs" and handed[2] == 2, events
    sizes = len(handed[1])
    others = events[first + 2:first + 2 + 2 * sizes]
    assert others[0::2] == [("ahead", True)] * sizes and all(e[0] == "checked" for e in others[1::2]), events
    assert events[first + 2 + 2 * sizes] == "waited", events


RECORD_SCRIPT = POISONED + LAUNCHES + r"""
compile_workers.hold()
if FIRST:
    jobs = compile_workers.collect(fine, [1, 2], compile_only) + compile_workers.collect(aborting, [64], compile_only)
    print("first compiled", compile_workers.compile_jobs(jobs))
else:
    with compile_only():
        fine(1)
        fine(2)
    print("again handed", len(compile_workers._sent))
    try:
        with compile_only():
            aborting(64)
        print("again refused no")
    except compile_workers.CompilerCrashed:
        print("again refused", len(compile_workers._sent))
compile_workers.release()
"""


def test_a_later_process_loads_what_a_worker_compiled_without_handing_it_to_a_worker_again(tmp_path):
    """The workers' successful compiles are recorded in the Triton cache folder: a second process (a warm optimize)
    launching those kernels loads them from there, no worker's round trip; a compile that ended a worker is never
    recorded, so it still goes to a worker first and is refused again."""
    lines = []
    for first in (True, False):
        lines += [line for line in _poisoned_run(tmp_path, f"FIRST = {first}\n" + RECORD_SCRIPT).splitlines()
                  if line.split(" ")[0] in ("first", "again")]
    assert lines == ["first compiled 2", "again handed 0", "again refused 1"], lines
    assert len((tmp_path / "cache" / "accelc" / "worker-compiled.txt").read_text().split()) == 2


def test_a_speed_race_hands_its_keys_candidates_over_in_one_batch_before_timing(monkeypatch):
    """guard._race on inputs the checks did not tune (a generation step's decode rows: ahead): the raced layers'
    kernels on them go to the workers at once, before any layer is timed; on the example's, nothing is."""
    import warnings

    import torch

    import accelc
    from accelc import guard, layer_compiles
    from accelc.rewrite import layers

    events = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = accelc.optimize(model, (torch.randn(4, 16),)).graph_module
    monkeypatch.setattr(layer_compiles, "candidates_ahead",
                        lambda g, args, only: events.append(("handed", tuple(args[0].shape), len(only))))
    monkeypatch.setattr(guard, "layer_ms", lambda fn, device, rep_ms: events.append("timed") or (1.0, True))
    times = guard._race(gm, (torch.randn(1, 16),), layers(gm), "original", ahead=True)
    assert len(times) == len(layers(gm)) > 0
    assert events[0] == ("handed", (1, 16), len(layers(gm))) and "handed" not in str(events[1:]), events
    events.clear()     # the example's sizes, tuned by the checks: nothing to hand over, no pass over the layers for it
    guard._race(gm, (torch.randn(4, 16),), layers(gm), "original")
    assert "handed" not in str(events), events


def test_an_optimize_on_a_gpu_computes_tritons_installation_key_in_a_thread(monkeypatch):
    """hold(True) (an optimize on a GPU) computes Triton's key of its installation once, in a thread of its own,
    not in the main thread's first launch; hold(False) (the CPU) and a second hold do not; a key that fails to
    compute there is left to the launch (no exception escapes)."""
    import threading
    import triton.runtime.cache as cache
    from accelc import compile_workers, triton_cache

    where = []

    def key():
        where.append(threading.current_thread().name)
        raise OSError("libtriton unreadable")
    monkeypatch.setattr(cache, "triton_key", key)
    monkeypatch.setattr(triton_cache, "_key_thread", [])
    monkeypatch.setattr(compile_workers, "enabled", lambda: False)
    compile_workers.hold(False)
    compile_workers.release()
    assert not triton_cache._key_thread and not where
    for _ in range(2):
        compile_workers.hold(True)
        compile_workers.release()
    triton_cache._key_thread[0].join(10)
    assert where == ["accelc-triton-key"]


def test_no_compile_ahead_fails_across_optimizes_of_models_whose_originals_let_go_of_their_weights(monkeypatch,
                                                                                                  caplog):
    """Every hand-over to the compile workers in an optimize (the guard's example, other and padded sizes, the
    padding check's, made to run here as on a GPU) reaches the layers of models whose originals the guard
    released: gate and up packed (Qwen2's gated MLP), a batch norm folded (cnn_small), int8 weights. A hand-over
    that raises is dropped with a debug line, and its compiles happen one key at a time in the races: the padding
    check did so on every gated-MLP LM and conv+BN model, unnoticed (a sibling would be, too)."""
    import logging
    import warnings
    import torch
    import transformers as T
    import accelc
    from accelc import compile_workers, layer_compiles, meta
    from accelc.models.cnn_small import SmallCNN
    from accelc.rewrite import layers
    from conftest import DEVICE, CausalLogits, padding_check_as_on_a_gpu

    padding_check_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(compile_workers, "active", lambda: True)
    monkeypatch.setattr(compile_workers, "compile_jobs", lambda jobs, fill=False: 0)
    monkeypatch.setattr(compile_workers, "submit", lambda jobs: None)
    ahead = []
    real_collected = layer_compiles._collected
    monkeypatch.setattr(layer_compiles, "_collected",
                        lambda gm, args, only: (ahead.append(1), real_collected(gm, args, only))[1])
    cfg = T.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=1)
    torch.manual_seed(0)
    cnn = SmallCNN().to(DEVICE).eval()
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(DEVICE).eval()
    cases = [(CausalLogits(T.Qwen2ForCausalLM(cfg)).to(DEVICE).eval(), (torch.randint(0, 128, (1, 12), device=DEVICE),),
              accelc.OptimizeConfig()),
             (cnn, cnn.example_inputs(2), accelc.OptimizeConfig()),
             (mlp, (torch.randn(8, 64, device=DEVICE),),
              accelc.OptimizeConfig(only_if_faster=False, int8=accelc.Int8Config(skip_first_last=False)))]
    for model, args, config in cases:
        ahead.clear()
        with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="accelc"):
            warnings.simplefilter("ignore")
            opt = accelc.optimize(model, args, config)
        name = type(model).__name__
        assert "padding check" in opt.info.seconds, name
        assert len(ahead) >= 2, name          # the guard's at the example, at the padded sizes, ...
        assert any(meta.rewrite_of(n).released for n in layers(opt.graph_module)), name
        assert "not compiled ahead" not in caplog.text, caplog.text[-2000:]
        caplog.clear()


def test_a_worker_builds_a_compiled_kernels_launcher_where_triton_builds_one_per_signature(monkeypatch):
    """triton_cache.launcher_ahead (a worker, after each compile): where this Triton's CUDA launcher is a module
    built per signature (its constructor compiles one from source: triton 3.6), the launcher is made for the
    compiled kernel's source and metadata, so that its build lands in Triton's cache folder before the main
    process's first launch; a Triton with one launcher for every kernel builds nothing; a failure is left to the
    launch (False, nothing raised)."""
    from types import SimpleNamespace
    from triton.backends.nvidia import driver
    from accelc import triton_cache

    made = []

    def compile_module_from_src(src, name):
        made.append((src, name))

    class PerSignature:
        def __init__(self, src, metadata):
            compile_module_from_src((src, metadata), "__triton_launcher")

    class Generic:
        def __init__(self, src, metadata):
            made.append("generic")

    class Failing:
        def __init__(self, src, metadata):
            compile_module_from_src(src, "x")
            raise OSError("no host compiler")

    kernel = SimpleNamespace(src="source", metadata="metadata")
    monkeypatch.setattr(driver, "CudaLauncher", PerSignature)
    assert triton_cache.launcher_ahead(kernel) and made == [(("source", "metadata"), "__triton_launcher")]
    made.clear()
    monkeypatch.setattr(driver, "CudaLauncher", Generic)
    assert not triton_cache.launcher_ahead(kernel) and made == []
    monkeypatch.setattr(driver, "CudaLauncher", Failing)
    assert not triton_cache.launcher_ahead(kernel) and made == [("source", "x")]


def test_a_launch_whose_hand_over_to_a_worker_fails_compiles_here(monkeypatch):
    """Inside an optimize Triton's hook (refuse_crashed) hands a compile no worker was handed to one first; where
    that hand-over itself fails (a worker's pipe, a wait that raises), the launch goes on and this process compiles
    the kernel, as outside an optimize: it is not refused. (A hand-over that raised failed every layer's launch,
    each layer then left in PyTorch.)"""
    from triton import knobs

    from accelc import compile_workers

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append("previous") or None)
    compile_workers.refuse_crashed()
    hook = knobs.runtime.jit_cache_hook
    assert getattr(hook, "accelc_refuses_crashed", False)

    def failing(jobs, fill=False):
        calls.append(("handed", [name for name, _ in jobs]))
        raise BrokenPipeError("the worker's pipe closed")

    monkeypatch.setattr(compile_workers, "active", lambda: True)
    monkeypatch.setattr(compile_workers, "compiled", lambda: set())
    monkeypatch.setattr(compile_workers, "compile_jobs", failing)

    class Fn:
        module, name = "accelc.kernels.layernorm", "_layer_norm_kernel"

    assert hook(fn=Fn(), compile={"specialization_data": '{"key": "a new specialization"}'}) is None
    assert calls == [("handed", ["accelc.kernels.layernorm._layer_norm_kernel"]), "previous"], calls
    # a crashed specialization is still refused
    monkeypatch.setitem(compile_workers._crashed, '{"key": "crashed"}', "signal SIGABRT")
    monkeypatch.setattr(compile_workers, "_sent", {'{"key": "crashed"}'}, raising=False)
    with pytest.raises(compile_workers.CompilerCrashed, match="SIGABRT"):
        hook(fn=Fn(), compile={"specialization_data": '{"key": "crashed"}'})
