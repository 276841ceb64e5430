"""Whether the main process still builds Triton launchers in a cold optimize (d4667c2: the compile workers build
each compiled kernel's launcher where Triton builds one per signature): BERT optimized with empty caches, every
host-compiler build in this process counted (triton.runtime.build._build) with the seconds it took, then the
phases. On triton 3.6 before d4667c2 a cold Qwen2-0.5B LM spent 7.5 s of its main thread there (py-spy). A
diagnosis, not a benchmark."""
import os
import sys
import time
import warnings

import triton.runtime.build as build

import accelc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")) # bench/
from optimize_time import build as build_model   # noqa: E402  (the benchmark's models, on the GPU in fp16)

builds = []
real = build._build


def counted(name, *a, **kw):
    t = time.perf_counter()
    try:
        return real(name, *a, **kw)
    finally:
        builds.append((name, round(time.perf_counter() - t, 3)))


build._build = counted
name = sys.argv[1] if len(sys.argv) > 1 else "bert"
model, args, kwargs = build_model(name)
t0 = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt = accelc.optimize(model, args, example_kwargs=kwargs or None)
print("optimize_s", round(time.perf_counter() - t0, 1), opt.info.seconds)
launchers = [b for b in builds if b[0] == "__triton_launcher"]
print("main-process launcher builds", len(launchers), "seconds", round(sum(s for _, s in launchers), 2))
print("other builds", [b for b in builds if b[0] != "__triton_launcher"])
