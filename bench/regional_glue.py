"""The glue compiled by region (accelc/regions.py) against the glue compiled whole, on one optimized model:
the seconds a warm-up takes (Inductor's compile and the CUDA graph's capture of the example) and the ms a
call takes after it, each way in turn over the same optimized graph, in one process.

    python bench/regional_glue.py --out DIR [--models bert,vit_base,gpt2,llama,resnet50] [--rounds 3]

Each model is built as bench/e2e.py builds it (fp16, random weights, its batch) and optimized once; then for
each round, each way: a new runner (torch._dynamo reset first, Inductor's cache in a new folder: a cold
compile), its warm-up timed, then its calls (accelc.latency.back_to_back_ms, e2e's timer). The ways
alternate within a round, so drift on the machine falls on both. Last, each way's output and eager fp16's
against the model run in fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def measure(name: str, rounds: int) -> dict:
    import torch

    import _common
    import accelc
    import e2e
    from accelc import regions
    from accelc.latency import back_to_back_ms

    model, inputs = e2e.build(name, e2e.MODELS[name][1][0])
    t0 = time.perf_counter()
    opt = accelc.optimize(model, inputs)
    row = {"model": name, "optimize_s": round(time.perf_counter() - t0, 1), "ways": {}}
    opt.wait_for_other_shapes()  # (its background compile ends before the runner and Dynamo's caches are reset)
    cut = regions.plan(opt.graph_module)
    row["cut"] = None if cut is None else {"regions": len(cut.segments), "kinds": cut.kinds,
                                            "compiled_nodes": cut.compiled_nodes, "nodes": cut.total_nodes}
    with torch.no_grad():
        want = opt(*inputs)
    for _ in range(rounds):
        for way, flag in (("regions", "1"), ("whole", "0")):
            os.environ["ACCELC_REGIONAL_GLUE"] = flag
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"inductor-{way}-")
            torch._dynamo.reset()
            opt.runner = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.warm_up(inputs)
            torch.cuda.synchronize()
            warm = time.perf_counter() - t0
            with torch.no_grad():
                ms = back_to_back_ms(lambda: opt(*inputs))
                got = opt(*inputs)
            side = row["ways"].setdefault(way, {"warm_up_s": [], "ms": [], "status": opt.runner.status()})
            side["warm_up_s"].append(round(warm, 2))
            side["ms"].append(round(ms, 4))
            side["rel_to_first"] = e2e._rel(got, want)
            side["_out"] = got
    # accuracy: each way's output and eager fp16's against the model in fp32 (after every timing: the model's
    # weights become fp32 here, and the optimized module may share them)
    with torch.no_grad():
        eager = model(*inputs)
        ref = model.float()(*(t.float() if t.is_floating_point() else t for t in inputs))
    row["eager_fp16_rel_to_fp32"] = e2e._rel(eager, ref)
    for side in row["ways"].values():
        side["rel_to_fp32"] = e2e._rel(side.pop("_out"), ref)
    row["environment"] = _common.environment()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="bert,vit_base,gpt2,llama,resnet50")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)       # (one model, in a process of its own)
    a = ap.parse_args()
    if a.model:
        print(json.dumps(measure(a.model, a.rounds)))
        return
    import subprocess

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in a.models.split(","):
        p = subprocess.run([sys.executable, __file__, "--out", a.out, "--model", name, "--rounds", str(a.rounds)],
                           capture_output=True, text=True)
        lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"model": name, "error": p.stderr[-3000:]}
        (out / f"regional_glue-{name}.json").write_text(json.dumps(row, indent=1))
        ways = row.get("ways", {})
        print(name, row.get("cut"), {w: (v["warm_up_s"], v["ms"]) for w, v in ways.items()}, row.get("error", "")[-500:],
              flush=True)


if __name__ == "__main__":
    main()
