"""The README is a user's guide: short, opening with the two commands CI runs, every result file it names
present (the figures traceable through bench/results/README.md)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_under_300_lines():
    assert len(README.splitlines()) < 300


def test_it_opens_with_the_two_commands_ci_runs():
    first = README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    ci = (ROOT / ".ci" / "run").read_text()
    assert first[0].startswith("pip install torch==2.13.0 && pip install -e \".[test]\" && accelc optimize mlp")
    assert first[1].startswith("python -m pytest -q")
    assert 'pip install -q torch==2.13.0 && pip install -q -e ".[test]" && accelc optimize mlp' in ci
    assert "python -m pytest -q" in ci


def test_every_result_file_it_names_exists_and_is_indexed():
    index = (ROOT / "bench" / "results" / "README.md").read_text()
    named = set(re.findall(r"bench/results/([\w./-]+?)[`)]", README))
    assert named
    for rel in named:
        assert (ROOT / "bench" / "results" / rel).exists(), rel
        if rel not in ("README.md", "history.md"):
            assert rel.rstrip("/").split("/")[-1] in index or rel.split("/merged")[0].split("runs/")[-1] in index, rel
