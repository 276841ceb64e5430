"""The tuning table accelc ships: the configs that won real models' kernel races, so that a first optimize on
the same GPU compiles and times only those.

A kernel's tuner races every candidate its prune function offers for a key (accelc.tuning). `tuning_table.json`
beside this file holds the races bench/tuning_table.py ran on the e2e and generation models, per kernel and
GPU: each raced key's configs within MARGIN of its fastest (at least its LEAST fastest). A model with a
layer of that key on that GPU races only those. The key holds the layer's sizes (N, K, the bucket of M, dtypes), so
a model nobody raced shares entries where its layers have the same shapes (a BERT-base-wide encoder, a
Llama-width decoder).

What the table keeps is only ever a subset of what the prune offers; where none of it is offered (another
kernel version, a config list that changed) every candidate races as before. ACCELC_TUNE=all races every
candidate whatever the table says (bench/tuning_table.py collects its races so). Shortlists for keys the table
lacks (by shape class) were measured, each model left out, and lost too much to keep; and a key is shared by
layers of other epilogues (it holds no activation), hence the wide margin (bench/tuning_table.py build says
what a table gives a model left out of it).
"""
from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

MARGIN = 0.20          # a race's configs within 20% of its fastest are kept for its key, and at least LEAST
LEAST = 3              # (another model's layer of the same key may have another epilogue: see the docstring)
SLOW = 2.0             # ... but a config only LEAST kept is left out where a race of its key timed it past SLOW x the
#                        fastest (the key holds no batch: one flash-attention candidate filled a batch-2 LM's three at
#                        1.6x and ran 6.9x the fastest at batch 1, and its compile, 5.5 s, bound a cold optimize's wait)
FORMAT = 1
TABLE_FILE = Path(__file__).with_name("tuning_table.json")


def enabled() -> bool:
    return os.environ.get("ACCELC_TUNE", "").strip().lower() != "all"


def winners(timings: list) -> list:
    """The configs (dicts) of one race kept for its key: within MARGIN of its fastest, and at least the
    LEAST fastest; fastest first."""
    ran = sorted((us, i) for i, (_, us) in enumerate(timings) if us is not None)
    if not ran:
        return []
    best = ran[0][0]
    return [timings[i][0] for n, (us, i) in enumerate(ran) if us <= best * (1 + MARGIN) or n < LEAST]


def build(runs: list, offered: dict | None = None) -> dict:
    """The table from bench/tuning_table.py's collected runs ({device, capability, races: [{kernel, key,
    timings_us}]}). offered: per kernel, the configs (dicts) its tuner offers today: a raced config no longer among
    them (a config list changed since the races ran) is left out of the race, as if it had not run."""
    kernels: dict = {}
    slowness: dict = {}     # (kernel, device, key) -> each race's {config: time / fastest}
    for run in runs:
        for race in run["races"]:
            timings = race["timings_us"]
            if offered is not None and race["kernel"] in offered:
                timings = [(c, us) for c, us in timings if c in offered[race["kernel"]]]
            won = winners(timings)
            if not won or len(timings) < 2:
                continue
            entry = kernels.setdefault(race["kernel"], {}).setdefault(run["device"], {"capability": run["capability"],
                                                                                      "keys": {}})
            key = json.dumps(race["key"])
            entry["keys"][key] = _union(entry["keys"].get(key, []), won)
            ratios = slowness.setdefault((race["kernel"], run["device"], key), [])
            ratios.append(_ratios(timings))
    for (kernel, device, key), races in slowness.items():     # a filler past SLOW x the fastest in any race: left out
        keys = kernels.get(kernel, {}).get(device, {}).get("keys", {})
        if key in keys:
            keys[key] = [c for c in keys[key] if any(r.get(json.dumps(c, sort_keys=True), math.inf) <= 1 + MARGIN
                                                     for r in races)
                         or all(r.get(json.dumps(c, sort_keys=True), 0.0) <= SLOW for r in races)]
    return {"format": FORMAT, "margin": MARGIN, "kernels": kernels}


def _ratios(timings: list) -> dict:
    """{config as JSON: its time over the race's fastest} of one race's timed configs."""
    times = [us for _, us in timings if us is not None]
    best = min(times) if times else None
    return {json.dumps(c, sort_keys=True): us / best for c, us in timings if us is not None and best}


def _union(a: list, b: list) -> list:
    return a + [c for c in b if c not in a]


@functools.lru_cache(maxsize=1)
def shipped() -> dict:
    try:
        table = json.loads(TABLE_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) and table.get("format") == FORMAT else {}


def shortlist_in(table: dict, kernel: str, device: str, key: list, offered: list) -> list | None:
    """The offered configs (dicts) worth racing for `key` on this GPU by `table` (the key's winners where this
    GPU raced it), or None: race them all."""
    own = ((table.get("kernels") or {}).get(kernel) or {}).get(device)
    kept = [c for c in own["keys"].get(json.dumps(key), []) if c in offered] if own is not None else []
    return kept or None


def shortlist(kernel: str, device: str, key: list, offered: list) -> list | None:
    """shortlist_in of the shipped table (None when ACCELC_TUNE=all or the table has nothing for it)."""
    if not enabled():
        return None
    return shortlist_in(shipped(), kernel, device, key, offered)
