"""How fast a tuner's candidates compile: one after another, in the tuner's pool of threads (Triton's async
compile mode), and in worker processes that share the Triton cache. The question behind it: is a cold
optimize's tuning bound by Triton compiles that threads do not spread (LLVM holding the GIL)?

    python bench/compile_scaling.py --out DIR [--shape 2048,768,3072] [--procs 16]

Each way compiles every candidate the linear kernel's prune keeps at the shape (fp16, bias + GELU), in a new
Triton cache folder; the parent then launches every candidate once against the folder the worker processes
filled, which must hit their cache entries (counted: Triton's compiles in the parent after the workers).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _operands(M, N, K):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(N, device="cuda", dtype=torch.float16, generator=g)
    return x, w, b


def _candidates(shape):
    """Indices of the linear kernel's configs its prune keeps for this call (as its tuner would race)."""
    import torch
    from accelc.kernels import gemm
    from accelc.tuning import config_dict

    M, N, K = shape
    x, w, b = _operands(*shape)
    out = torch.empty(M, N, device="cuda", dtype=torch.float16)
    gluon = gemm.gluon_problem(x, None, out) is None    # (where this Triton builds the Gluon GEMM)
    sizes = dict(M=M, N=N, K=K, tma=True, dtype=x.dtype, gluon=gluon, gemv=True, w8=False, gated=False)
    kept = [config_dict(c) for c in gemm.TUNER.prune(gemm.TUNER.configs, sizes)]
    return [i for i, c in enumerate(gemm.TUNER.configs) if config_dict(c) in kept]


def _launch(gemm, x, w, b, out, cfg):
    try:
        gemm.launch(x, w, b, None, out, "gelu", config=cfg)
    except ValueError:      # a config these operands cannot take (as the race skips it)
        pass


def _compile(shape, indices, ahead: bool) -> float:
    """Seconds to compile the candidates `indices` in this process (ahead: in the tuner's thread pool)."""
    import torch
    from accelc import compile_ahead
    from accelc.kernels import gemm

    x, w, b = _operands(*shape)
    out = torch.empty(shape[0], shape[1], device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with compile_ahead.compiling_ahead() if ahead else compile_ahead.compile_only() as on:
        assert on is not False, "no compiling ahead on this Triton"
        for i in indices:
            _launch(gemm, x, w, b, out, gemm.TUNER.configs[i])
    return time.perf_counter() - t0


def _worker(args):
    shape, indices = args
    import accelc  # noqa: F401  (before triton)
    t0 = time.perf_counter()
    import torch
    torch.zeros(1, device="cuda")
    ready = time.perf_counter() - t0
    return ready, _compile(shape, indices, ahead=False)


def _compiles_in_parent(shape, indices) -> int:
    """Triton compiles in this process while every candidate launches once (0: all were cache hits)."""
    from triton import knobs

    seen = []
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: seen.append(1)
    try:
        _compile(shape, indices, ahead=False)
    finally:
        knobs.runtime.jit_post_compile_hook = old
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="2048,768,3072")
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--way", default=None)      # (one way, in a process of its own)
    a = ap.parse_args()
    shape = tuple(int(s) for s in a.shape.split(","))
    if a.way:
        import torch
        import _common

        torch.zeros(1, device="cuda")
        indices = _candidates(shape)
        row = {"way": a.way, "candidates": len(indices), "threads": os.environ.get("ACCELC_COMPILE_THREADS")}
        if a.way in ("serial", "threads"):
            row["seconds"] = round(_compile(shape, indices, ahead=a.way == "threads"), 2)
        else:
            chunks = [indices[i::a.procs] for i in range(a.procs)]
            t0 = time.perf_counter()
            with mp.get_context("spawn").Pool(a.procs) as pool:
                parts = pool.map(_worker, [(shape, c) for c in chunks if c])
            row["seconds"] = round(time.perf_counter() - t0, 2)
            row["worker_start_s"] = round(max(p[0] for p in parts), 2)
            row["worker_compile_s"] = round(max(p[1] for p in parts), 2)
            row["parent_compiles_after"] = _compiles_in_parent(shape, indices)
        row["environment"] = _common.environment()
        print(json.dumps(row))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import subprocess

    rows = []
    for way, threads in (("serial", "1"), ("threads", "16"), ("threads", "4"), ("processes", "1")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache, ACCELC_CACHE_DIR=cache + "/accelc",
                       ACCELC_COMPILE_THREADS=threads)
            p = subprocess.run([sys.executable, __file__, "--out", a.out, "--shape", a.shape, "--procs", str(a.procs),
                                "--way", way], env=env, capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("{")]
            rows.append(json.loads(line[-1]) if line else {"way": way, "error": p.stderr[-2000:]})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "environment"}), flush=True)
    (out / "compile_scaling.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
