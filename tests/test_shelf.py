"""bench/shelf.py: the results shelf kept small enough that what a device command carries fits beside the tree."""
import gzip
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import shelf  # noqa: E402


def _repo(tmp_path):
    """A git repository with a shelf: one large run file, one small, one of a tuning table, a current file."""
    runs = tmp_path / "bench" / "results" / "runs"
    (runs / "gen" / "run1").mkdir(parents=True)
    (runs / "tuning_table" / "run1").mkdir(parents=True)
    big = '{"rows": [%s]}' % ", ".join('{"tok_s": %d.5}' % i for i in range(3000))
    (runs / "gen" / "run1" / "gen-h200.json").write_text(big)
    (runs / "gen" / "run1" / "small.json").write_text('{"a": 1}')
    (runs / "tuning_table" / "run1" / "races.json").write_text(big)
    (tmp_path / "bench" / "results" / "gen-h200.json").write_text(big)
    (runs / "gen" / "run1" / "README.md").write_text("`gen-h200.json`: the rows; `small.json`; `gen-h200.json.md`\n")
    (tmp_path / "bench" / "results" / "README.md").write_text(
        "| `runs/gen/run1/gen-h200.json` | current: `gen-h200.json` |\n")
    (tmp_path / "README.md").write_text("see bench/results/runs/gen/run1/gen-h200.json.\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    return tmp_path, big


def test_pack_gzips_the_runs_large_files_and_rewrites_every_reference_that_names_them(tmp_path):
    root, big = _repo(tmp_path)
    done = shelf.pack(10_000, root=root)
    run1 = root / "bench" / "results" / "runs" / "gen" / "run1"
    assert [p.name for p, _, _ in done] == ["gen-h200.json"]
    assert not (run1 / "gen-h200.json").exists()
    assert gzip.decompress((run1 / "gen-h200.json.gz").read_bytes()).decode() == big
    # the same bytes every time (no timestamp in the header)
    assert (run1 / "gen-h200.json.gz").read_bytes()[4:8] == bytes(4)
    assert (run1 / "README.md").read_text() == "`gen-h200.json.gz`: the rows; `small.json`; `gen-h200.json.md`\n"
    # from the index: the run's path rewritten, the bare name (the current file beside the index) not
    assert (root / "bench" / "results" / "README.md").read_text() == \
        "| `runs/gen/run1/gen-h200.json.gz` | current: `gen-h200.json` |\n"
    assert (root / "README.md").read_text() == "see bench/results/runs/gen/run1/gen-h200.json.gz.\n"
    # a tuning table's races stay plain (bench/tuning_table.py build reads them), as do current files
    assert (root / "bench" / "results" / "runs" / "tuning_table" / "run1" / "races.json").exists()
    assert (root / "bench" / "results" / "gen-h200.json").exists()


def test_pack_dry_run_changes_nothing(tmp_path):
    root, _ = _repo(tmp_path)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}
    assert [p.name for p, _, _ in shelf.pack(10_000, dry_run=True, root=root)] == ["gen-h200.json"]
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts} == before


def test_the_tracked_tree_stays_under_the_shelf_limit():
    """What a device command carries is the tracked tree plus ONNX Runtime's provider (45 MB) within 64 MiB."""
    root = Path(__file__).parent.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    assert shelf.tree_bytes(root) <= shelf.SHELF_LIMIT, "python bench/shelf.py pack"
