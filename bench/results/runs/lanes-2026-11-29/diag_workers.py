"""What the main thread's waits for the compile workers wait on, in a cold optimize (empty caches): every batch
handed to the workers (compile_workers.Pending) with its jobs' kernel names, seconds and start offsets in the
batch, and every wait's seconds; printed as JSON lines, a summary per batch (jobs, workers, the longest job, the
sum over jobs / workers: whether a wait is bound by one long compile or by the workers' throughput). Model name
argument (optimize_time.py's). A diagnosis, not a benchmark."""
import json
import os
import sys
import threading
import time
import warnings

import accelc
from accelc import compile_workers as cw

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # bench/
from optimize_time import build as build_model   # noqa: E402  (the benchmark's models, on the GPU in fp16)

T0 = time.perf_counter()
batches = []
local = threading.local()
real_init, real_compile, real_wait = cw.Pending.__init__, cw._Worker.compile, cw.Pending.wait


def init(self, todo, running):
    self._diag = {"t": round(time.perf_counter() - T0, 3), "jobs": [], "workers": len(running), "waits": []}
    batches.append(self._diag)
    real_init(self, todo, running)


def compile(self, job):
    t = time.perf_counter()
    try:
        return real_compile(self, job)
    finally:
        spec = json.loads(job[1]) if job[1].startswith("{") else {}
        names = list(spec.get("signature") or {})
        consts = {names[k[0]] if k and k[0] < len(names) else str(k): v
                  for k, v in zip(spec.get("constant_keys", []), spec.get("constant_vals", []))}
        options = spec.get("options") or {}
        consts.update({k: options[k] for k in ("num_warps", "num_stages") if k in options})
        consts = dict(sorted(consts.items(), key=lambda kv: not kv[0].startswith(("BLOCK", "num_"))))  # sizes first
        getattr(local, "batch", batches[-1])["jobs"].append(
            {"name": job[0].rsplit(".", 1)[-1], "s": round(time.perf_counter() - t, 3),
             "start": round(t - T0, 3), "consts": str(consts)})


def feed(self, worker):
    local.batch = self._diag
    return real_feed(self, worker)


def wait(self, timeout=300, fill=False):
    t = time.perf_counter()
    try:
        return real_wait(self, timeout, fill)
    finally:
        self._diag["waits"].append({"at": round(t - T0, 3), "s": round(time.perf_counter() - t, 3)})


real_feed = cw.Pending._feed
cw.Pending.__init__, cw._Worker.compile, cw.Pending.wait, cw.Pending._feed = init, compile, wait, feed
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2-0.5b-lm-b1"
model, args, kwargs = build_model(name)
T0 = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt = accelc.optimize(model, args, example_kwargs=kwargs or None)
print("optimize_s", round(time.perf_counter() - T0, 1), json.dumps(opt.info.seconds))
print("call_ms (eager, accelc)", opt.info.call_ms)
for label, o in (("forward", opt), ("step", getattr(opt, "step", None))):
    records = getattr(o, "layers", None) or []
    status = {}
    for r in records:
        status[r.status] = status.get(r.status, 0) + 1
    print(label, "layers", json.dumps(status), json.dumps(sorted({r.reason[:120] for r in records if r.status == "reverted"})))
for b in batches:
    jobs = b["jobs"]
    if not jobs:
        continue
    longest = max(jobs, key=lambda j: j["s"])
    print(json.dumps({"batch_at": b["t"], "jobs": len(jobs), "workers": b["workers"], "waits": b["waits"],
                      "longest": longest, "sum_over_workers": round(sum(j["s"] for j in jobs) / max(b["workers"], 1), 2),
                      "end": round(max(j["start"] + j["s"] for j in jobs), 3)}))
    for j in sorted(jobs, key=lambda j: -j["s"])[:8]:
        print("   ", json.dumps(j))
