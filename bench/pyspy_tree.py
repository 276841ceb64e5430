"""A py-spy raw profile (`py-spy record -f raw`, gzipped or not) read as a tree of the library's frames: the main
thread's samples, each stack cut to its frames in accelc/ and the benchmark script, summed by prefix; seconds at the
sampling rate. The stage breakdowns of bench/results/runs/optimize_time/*profile*/ READMEs come from it.

    python bench/pyspy_tree.py PROFILE [--rate 40] [--depth 9] [--min-s 1.5] [--keep accelc/,generate.py]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import sys


def read(path: str):
    """(stack frames, samples) of each line of the MainThread's raw profile."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if frames and "MainThread" in frames[0] and n.isdigit():
                yield frames[1:], int(n)


def tree(rows, keep: tuple[str, ...], depth: int) -> collections.Counter:
    """Samples by prefix of the kept frames (a frame kept where its text holds one of `keep`)."""
    out = collections.Counter()
    for frames, n in rows:
        kept = [f for f in frames if any(k in f for k in keep)]
        for d in range(1, min(depth, len(kept)) + 1):
            out[tuple(kept[:d])] += n
    return out


def lines(counts: collections.Counter, rate: float, min_s: float) -> list[str]:
    return ["  " * (len(k) - 1) + f"{counts[k] / rate:.1f}s {k[-1]}" for k in sorted(counts)
            if counts[k] / rate >= min_s]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--rate", type=float, default=40.0, help="py-spy's --rate")
    ap.add_argument("--depth", type=int, default=9)
    ap.add_argument("--min-s", type=float, default=1.5)
    ap.add_argument("--keep", default="(accelc/,generate.py,optimize_time.py")
    a = ap.parse_args(argv)
    rows = list(read(a.profile))
    print(f"main thread: {sum(n for _, n in rows) / a.rate:.1f} s sampled")
    print("\n".join(lines(tree(rows, tuple(a.keep.split(",")), a.depth), a.rate, a.min_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
