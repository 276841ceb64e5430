"""Where an optimize's main thread goes, from py-spy's raw stacks (`py-spy record --threads -f raw`, as the lanes'
`prof` commands record them): the samples of the main thread inside accelc.optimize, in seconds at the sampling
rate, as a tree of accelc's own frames (`tree`), by the last accelc frame and what it called (`last`, waits left
out: the main thread blocked on a thread, an event or a condition), or under one frame (`under FRAME`).

    python bench/spy_summary.py tree bench/results/runs/optimize_time/run26-h200-cold-profile/cold-bert.txt.gz
    python bench/spy_summary.py last FILE [--top 40]
    python bench/spy_summary.py under FILE "candidates_ahead (accelc/layer_compiles.py" [--depth 2]
    python bench/spy_summary.py under FILE "check_layers (accelc/guard.py:251)"     # one call site: its line
"""
from __future__ import annotations

import argparse
import collections
import gzip
import re

ENTRY = "optimize (accelc/api.py"
WAITS = ("Thread.join", "Condition.wait", "Event.wait")
OWN = ("(accelc/", "(kernels/", "(passes/", "(models/")


def main_samples(path: str):
    """(frames, count) of each main-thread stack inside optimize."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if frames and "MainThread" in frames[0] and ENTRY in stack:
                yield frames[1:], int(n)


def _bare(frame: str) -> str:
    return re.sub(r":\d+\)", ")", frame)


def tree(path: str, depth: int, least: float, rate: float) -> None:
    counts: collections.Counter = collections.Counter()
    for frames, n in main_samples(path):
        own = [f for f in frames if any(o in f for o in OWN)]
        start = next(i for i, f in enumerate(own) if ENTRY in f)
        own = own[start:]
        for d in range(1, min(depth, len(own)) + 1):
            counts[tuple(own[:d])] += n
    for key in sorted(counts):
        if counts[key] / rate >= least:
            print("  " * (len(key) - 1) + f"{counts[key] / rate:.2f}s {key[-1]}")


def last(path: str, top: int, rate: float) -> None:
    counts: collections.Counter = collections.Counter()
    total = 0
    for frames, n in main_samples(path):
        if any(w in f for f in frames for w in WAITS):
            continue
        total += n
        own = [i for i, f in enumerate(frames) if any(o in f for o in OWN)]
        at = own[-1] if own else None
        callee = frames[at + 1].split(" (")[0] if at is not None and at + 1 < len(frames) else "<self>"
        counts[(frames[at] if at is not None else "?", callee)] += n
    print(f"{total / rate:.2f} s not waiting")
    for (frame, callee), n in counts.most_common(top):
        print(f"{n / rate:6.2f} {frame[:80]} -> {callee[:60]}")


def under(path: str, target: str, depth: int, rate: float) -> None:
    counts: collections.Counter = collections.Counter()
    total = 0
    exact = re.search(r":\d+\)?$", target) is not None     # a frame named with its line (as `tree` prints it)
    for frames, n in main_samples(path):
        bare = [_bare(f) for f in frames]
        at = next((i for i, f in enumerate(frames if exact else bare) if target in f), None)
        if at is None:
            continue
        total += n
        counts[" ; ".join(f.split(" (")[0] for f in bare[at + 1:at + 1 + depth]) or "<self>"] += n
    print(f"{total / rate:.2f} s under {target}")
    for k, n in counts.most_common(25):
        print(f"{n / rate:6.2f} {k[-200:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("view", choices=("tree", "last", "under"))
    p.add_argument("file")
    p.add_argument("frame", nargs="?", help="under: a frame's text, e.g. 'settle (accelc/guard.py', or one call "
                                            "site with its line: 'settle (accelc/guard.py:76)'")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--least", type=float, default=0.4, help="tree: the fewest seconds a row shows")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--rate", type=float, default=40.0, help="py-spy's samples a second (the lanes record at 40)")
    a = p.parse_args()
    if a.view == "tree":
        tree(a.file, a.depth, a.least, a.rate)
    elif a.view == "last":
        last(a.file, a.top, a.rate)
    else:
        if not a.frame:
            p.error("under needs a frame")
        under(a.file, a.frame, min(a.depth, 4), a.rate)


if __name__ == "__main__":
    main()
