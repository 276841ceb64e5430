"""The results shelf kept small: what travels to the device is the tracked tree (64 MiB in all, ONNX Runtime's
CUDA provider 45 MB of it), so the tree beside it stays under SHELF_LIMIT. `pack` gzips the superseded runs' large
files (under bench/results/runs/, over --over bytes; a tuning table's races stay plain, `bench/tuning_table.py
build` reads them) and rewrites every reference to them in the shelf's Markdown and the README (a path that names
the file from the referring file's folder, bench/results/ or the repository root gains `.gz`); the figures stay
traceable, each file one `zcat` away. `size` prints the tracked tree's bytes against the limit.

    python bench/shelf.py size
    python bench/shelf.py pack [--over BYTES] [--dry-run]
"""
from __future__ import annotations

import argparse
import gzip
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RUNS = RESULTS / "runs"
SHELF_LIMIT = 18 * 2**20      # the tracked tree, beside what a device command carries
PACKED = (".json", ".log", ".txt", ".csv")
KEPT_PLAIN = ("tuning_table",)    # runs/<family>/ whose files a script reads back


def tracked(root: Path = ROOT) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return [root / p for p in out.decode().split("\0") if p]


def tree_bytes(root: Path = ROOT) -> int:
    return sum(p.stat().st_size for p in tracked(root) if p.is_file())


def to_pack(files: list[Path], over: int, runs: Path = RUNS) -> list[Path]:
    """The superseded runs' files worth packing: under `runs`, a packed suffix, over `over` bytes, outside the
    families whose files a script reads back."""
    picked = []
    for p in files:
        try:
            rel = p.relative_to(runs)
        except ValueError:
            continue
        if p.suffix in PACKED and rel.parts[0] not in KEPT_PLAIN and p.is_file() and p.stat().st_size > over:
            picked.append(p)
    return sorted(picked)


def gzip_file(p: Path) -> Path:
    """p as p.gz (mtime 0: the same bytes every time), p removed."""
    gz = p.with_name(p.name + ".gz")
    with open(p, "rb") as src, open(gz, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9,
                                                                     filename="", mtime=0) as dst:
        dst.write(src.read())
    p.unlink()
    return gz


def rewrite_references(text: str, here: Path, packed: set[Path], roots: tuple[Path, ...]) -> tuple[str, int]:
    """`text` (a Markdown file in folder `here`) with every path naming a packed file (from `here` or one of
    `roots`) given `.gz`; and how many were."""
    names = {p.name for p in packed}
    if not names:
        return text, 0
    pattern = re.compile(r"[\w./-]*(?:%s)(?!\.\w|[\w-])" % "|".join(re.escape(n) for n in sorted(names, key=len,
                                                                                                   reverse=True)))
    count = 0

    def sub(m):
        nonlocal count
        token = m.group(0)
        for base in (here, *roots):
            if (base / token).resolve() in packed:
                count += 1
                return token + ".gz"
        return token

    return pattern.sub(sub, text), count


def pack(over: int, dry_run: bool = False, root: Path = ROOT) -> list[tuple[Path, int, int]]:
    """Gzip the runs' large files and rewrite the references; (file, bytes before, after) each."""
    files = tracked(root)
    picked = to_pack(files, over, root / "bench" / "results" / "runs")
    if dry_run:
        return [(p, p.stat().st_size, 0) for p in picked]
    packed = {p.resolve() for p in picked}
    roots = (root / "bench" / "results", root)
    for md in [p for p in files if p.suffix == ".md" and p.is_file()]:
        text = md.read_text()
        new, n = rewrite_references(text, md.parent, packed, roots)
        if n:
            md.write_text(new)
    done = []
    for p in picked:
        before = p.stat().st_size
        gz = gzip_file(p)
        done.append((p, before, gz.stat().st_size))
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("size")
    p = sub.add_parser("pack")
    p.add_argument("--over", type=int, default=50_000)
    p.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "size":
        n = tree_bytes()
        print(f"tracked tree {n / 2**20:.1f} MiB, limit {SHELF_LIMIT / 2**20:.0f} MiB")
        return 0 if n <= SHELF_LIMIT else 1
    done = pack(a.over, a.dry_run)
    for path, before, after in done:
        print(f"{path.relative_to(ROOT)}  {before} -> {after}")
    print(f"{len(done)} file(s), {sum(b for _, b, _ in done)} -> {sum(a for _, _, a in done)} bytes"
          + (" (dry run)" if a.dry_run else "; `git add -A bench/results` records the move"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
