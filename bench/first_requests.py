"""Where a first request of a new shape spends its time: bench/dynamic.py's model and trace, optimized with the
default settings, then the trace's first requests one by one, each with its ms and what was logged while it
ran (accelc's log at INFO: kernels run with a borrowed or default config, graphs captured; torch's
recompilations and Inductor's compiles), and the seconds Triton spent compiling in it.

    python bench/first_requests.py [--model bert] [--requests 30] [--over-ms 50] [--then-wait] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402
import dynamic  # noqa: E402


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}"[:400])


def _triton_compile_seconds():
    """[seconds, count, kernel names, specializations] of Triton's compiles from now on (installed before any kernel's
    first launch: a kernel's binder takes triton.compiler.compile when it is made). A specialization is what made the
    binary differ from another of the same kernel: the argument types (pointers' and descriptors' included), the
    constexprs and the attributes (an int's divisibility by 16, a pointer's alignment)."""
    import triton.compiler
    import triton.compiler.compiler as cc

    spent = [0.0, 0, [], []]
    real = cc.compile

    def timed(src, *a, **k):
        t0 = time.perf_counter()
        try:
            return real(src, *a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1
            fn = getattr(src, "fn", None)
            name = getattr(fn, "__name__", None) or getattr(src, "name", None) or str(src)[:80]
            spent[2].append(name)
            spent[3].append({"kernel": name, **{f: str(getattr(src, f, None))[:2000]
                                                for f in ("signature", "constants", "attrs")}})
    cc.compile = triton.compiler.compile = timed
    return spent


def _tuner_keys() -> set:
    """(tuner, key, the key its config was borrowed from, the config) of every key a tuner has chosen so far."""
    from accelc import tuning
    from accelc.tuning import config_dict

    return {(t.name, str(k), str(t.borrowed.get(k, "tuned")), json.dumps(config_dict(c), sort_keys=True))
            for t in tuning.all_tuners() for k, c in t.chosen.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--over-ms", type=float, default=50.0, help="log lines kept for requests slower than this")
    ap.add_argument("--then-wait", action="store_true",
                    help="with the glue compiling in the background (ACCELC_OTHER_SHAPES=background): after the "
                         "requests, wait for that compile and send the same requests again")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    spent = _triton_compile_seconds()
    import accelc

    env = _common.environment()
    print(_common.env_line(env), flush=True)
    build, make, text = dynamic.models(False)[a.model]
    torch.manual_seed(0)
    model = build().cuda().half().eval()
    example = {k: v.cuda() for k, v in make(2, 64 if text else 0).items()}
    example = {k: (v.half() if v.is_floating_point() else v) for k, v in example.items()}
    t0 = time.perf_counter()
    opt = accelc.optimize(model, example)
    optimize_s = time.perf_counter() - t0
    later = opt.config.other_shapes == "background"    # (ACCELC_OTHER_SHAPES: the first requests meet it in flight)
    print(f"optimize {optimize_s:.1f} s, phases {opt.info.seconds}"
          + (", the glue for other shapes compiling in the background" if later else ""), flush=True)
    handler = _Lines()
    for name in ("accelc", "torch._dynamo", "torch._inductor"):
        logging.getLogger(name).addHandler(handler)
    logging.getLogger("accelc").setLevel(logging.INFO)
    torch._logging.set_logs(recompiles=True)
    torch.manual_seed(1)
    rows, waited = [], None
    trace = list(dynamic.trace(a.requests, text, False))
    with torch.no_grad():
        for i, (b, n) in enumerate(trace + (trace if a.then_wait and later else [])):
            if i == len(trace):
                waited = _common.other_shapes_wait_s(opt)
                print(f"waited {waited} s for the background compile; the same requests again", flush=True)
            f = {k: v.cuda() for k, v in make(b, n).items()}
            f = {k: (v.half() if v.is_floating_point() else v) for k, v in f.items()}
            handler.lines.clear()
            before = [spent[0], spent[1], len(spent[2])]
            keys_before = _tuner_keys()
            compiling = later and not opt.wait_for_other_shapes(0)     # (the background compile still running)
            t0 = time.perf_counter()
            opt(**f)
            torch.cuda.current_stream().synchronize()    # (the caller's stream, as a copy of the output waits for:
            # not a background compile's work on a stream of its own, which a whole-device synchronize also waited on)
            ms = (time.perf_counter() - t0) * 1e3
            row = {"request": i, "batch": b, "length": n, "ms": round(ms, 1),
                   "triton_compile_s": round(spent[0] - before[0], 2), "triton_compiles": spent[1] - before[1],
                   "compiled": spent[2][before[2]:], "background_compiling": compiling}
            if ms > a.over_ms:
                row["log"] = list(handler.lines)
            if row["compiled"]:   # this binary's specialization and those the same kernels had before it
                row["tuner_keys_new"] = sorted(_tuner_keys() - keys_before)   # (kernel, key, borrowed from) chosen in it
                row["specializations"] = spent[3][before[2]:]
                row["earlier_of_these_kernels"] = [sp for sp in spent[3][:before[2]] if sp["kernel"] in row["compiled"]]
            rows.append(row)
            print(json.dumps(row)[:3000], flush=True)
    md = (f"# First requests of a new shape, {a.model} ({env['device']})\n\n{_common.env_line(env)}\n\n"
          f"optimize {optimize_s:.1f} s, default settings (its phases, s: {opt.info.seconds}); the trace of bench/dynamic.py (seed 0), its first "
          f"{a.requests} requests; a request's ms: from the call until the caller's CUDA stream has its output."
          + (f" Then {waited} s waited for the background compile, and the same requests again (requests "
             f"{len(trace)} on)." if waited is not None else "") + "\n\n"
          + _common.md_table(["request", "batch", "length", "ms", "Triton compiles (s)", "what was logged (slow ones)"],
                             [[r["request"], r["batch"], r["length"],
                               f"{r['ms']}" + (" (background compile running)" if r["background_compiling"] else ""),
                               f"{r['triton_compiles']} ({r['triton_compile_s']}) {' '.join(r['compiled'])}",
                               "<br>".join(x.replace("|", "/") for x in r.get("log", [])[:12])] for r in rows]))
    _common.write(a.out, f"first_requests-{a.model}", env, rows, md)


if __name__ == "__main__":
    main()
