"""How the pass pipeline's time grows with a model's depth: Qwen2-shaped causal LMs of 20, 40 and 80 layers (narrow:
the passes' work follows the graph, not the widths), each captured, then its passes run and timed in this thread's
CPU time, the least of --repeat runs (a fresh capture each: the passes rewrite the graph). The CPU is enough: the
passes are Python over the graph (they run on meta values and a few small probes), as on a GPU's host.

    python bench/passes_scaling.py --out DIR [--depths 20,40,80] [--repeat 5]
    PYTHONPATH=base python bench/passes_scaling.py --out DIR     # another tree's accelc (base/accelc/{passes,...})

Writes DIR/passes_scaling.json and .md: per depth the graph's nodes, the passes' seconds, seconds a layer, and
the rewrites each pass made (the same in two trees, or the comparison is of different work).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import accelc  # noqa: E402
from accelc.capture.contract import CALL_SPEC  # noqa: E402
from accelc.capture.shapes import SHAPES  # noqa: E402
from accelc.capture.trace import capture  # noqa: E402
from accelc.pipeline import run_passes  # noqa: E402
from accelc.rewrite import PassContext  # noqa: E402


def _model(depth: int):
    cfg = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=depth,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def passes_once(model, ids) -> tuple[float, int, dict]:
    gm, _, _ = capture(model, (ids,))
    nodes = len(gm.graph.nodes)
    ctx = PassContext(accelc.OptimizeConfig(), gm.meta[CALL_SPEC].flat((ids,), {}), [(ids,)], torch.device("cpu"),
                      shapes=gm.meta.get(SHAPES))
    gc.collect()        # (each run from the same heap: the garbage of the run before is not this one's)
    t0 = time.thread_time()
    counts = run_passes(gm, ctx)
    return time.thread_time() - t0, nodes, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--depths", default="20,40,80")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    passes_once(_model(1), ids)         # the patterns' own graphs, traced once a process
    rows = []
    for depth in (int(d) for d in a.depths.split(",")):
        model = _model(depth)
        runs = [passes_once(model, ids) for _ in range(a.repeat)]
        seconds = min(r[0] for r in runs)
        rows.append({"layers": depth, "nodes": runs[0][1], "passes_s": round(seconds, 3),
                     "runs_s": [round(r[0], 3) for r in runs], "s_a_layer": round(seconds / depth, 4),
                     "rewrites": runs[0][2]})
        print(json.dumps(rows[-1]), flush=True)
    head = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "accelc": str(Path(accelc.__file__).parent), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "argv": sys.argv[1:]}
    (a.out / "passes_scaling.json").write_text(json.dumps({"head": head, "rows": rows}, indent=1))
    lines = [f"# The passes' time by depth ({head['date']}; {head['machine']}; torch {head['torch']}, "
             f"transformers {head['transformers']}, Python {head['python']}; accelc from {head['accelc']})", "",
             f"Qwen2-shaped LMs, 128 wide; this thread's CPU time, the least of {a.repeat} runs.", "",
             "| layers | graph nodes | passes s | runs s | s a layer |", "|---|---|---|---|---|"]
    lines += [f"| {r['layers']} | {r['nodes']} | {r['passes_s']} | {', '.join(map(str, r['runs_s']))} | "
              f"{r['s_a_layer']} |" for r in rows]
    (a.out / "passes_scaling.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
