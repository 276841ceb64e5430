"""bench/_common.py's helpers that every benchmark's comparison depends on."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import _common  # noqa: E402


def test_compiled_is_static_for_every_row():
    """A benchmark defines the same function for row after row: each row's torch.compile must see
    static shapes (without the reset, the second shape recompiles with symbolic ones, and past
    dynamo's recompile limit the function runs eagerly)."""
    seen = []

    def recorder(gm, example_inputs):    # does the graph dynamo made take symbolic sizes?
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        seen.append(any(isinstance(d, torch.SymInt) for v in values if isinstance(v, torch.Tensor) for d in v.shape))
        return gm.forward

    for n in (3, 5, 7):
        x = torch.randn(n, 4)

        def row(x=x):
            return torch.relu(x) * 2

        _common.compiled(row, backend=recorder)()
    assert seen == [False, False, False]        # one static graph per row


def test_rel_l2_of_a_tensor_and_of_a_tuple_taken_together():
    ref = (torch.ones(4, dtype=torch.float64), torch.zeros(2, dtype=torch.float64) + 2)
    out = (torch.ones(4) * 1.5, torch.zeros(2) + 2)
    assert _common.rel_l2(out[0], ref[0]) == pytest.approx(0.5)
    assert _common.rel_l2(out, ref) == pytest.approx((4 * 0.25 / (4 + 8)) ** 0.5)
    with pytest.raises(ValueError):
        _common.rel_l2(out[:1], ref)


def test_tuned_reports_the_last_matching_key_and_its_spread():
    """_common.tuned: the config chosen for the last key a predicate accepts, with its spread."""
    class FakeTuner:
        chosen = {(1, "a"): "cfg-a", (2, "b"): "cfg-b", (1, "c"): "cfg-c"}

        def spread(self, key):
            return {"key": key}
    assert _common.tuned(FakeTuner(), lambda k: k[0] == 1) == ("cfg-c", {"key": (1, "c")})
    assert _common.tuned(FakeTuner(), lambda k: k[0] == 3) == (None, None)


def test_e2e_merge_joins_a_models_sides_across_runs_and_skips_merged_tables(tmp_path):
    """A model's sides split over two commands merge into one row; a merged table kept beside the runs
    (its JSON holds "rows") is not read as a run (it was: KeyError)."""
    import e2e
    env = dict(_common.environment(), date="2026-11-24 16:30 UTC")
    row = {"model": "bert", "family": "BERT", "batch": 8}
    (tmp_path / "b").mkdir()
    for path, sides in ((tmp_path / "e2e-bert-b8.json", {"eager_ms": 5.0, "accelc_ms": 2.0}),
                        (tmp_path / "b" / "e2e-bert-b8.json", {"compile_max_ms": 4.0})):
        path.write_text(json.dumps({"environment": env, "row": dict(row, **sides)}))
    e2e.merge(tmp_path, tmp_path / "out")
    (tmp_path / "e2e-merged.json").write_text((tmp_path / "out" / next(
        p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".json")).read_text())
    e2e.merge(tmp_path, tmp_path / "out2")
    md = next((tmp_path / "out2").glob("*.md")).read_text()
    line = next(x for x in md.splitlines() if x.startswith("| bert"))
    assert "| 5.000 |" in line and "| 4.000 |" in line and "| 2.000 |" in line and "2.00x" in line, line


def test_e2e_merge_mode_refuses_a_runs_options(monkeypatch, capsys, tmp_path):
    """`--merge DIR` only merges result folders: given with the options of a run (models, sides,
    batches) it would time nothing and say nothing, so it stops with a one-line reason instead."""
    import e2e
    merged = []
    monkeypatch.setattr(e2e, "merge", lambda src, out: merged.append((src, out)))
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--models", "llama", "--sides", "eager", "--merge", str(tmp_path)])
    with pytest.raises(SystemExit):
        e2e.main()
    assert "--merge DIR only merges result folders and times nothing; --models, --sides ask for a run" \
        in capsys.readouterr().err and not merged
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--merge", str(tmp_path), "--out", str(tmp_path / "out")])
    e2e.main()
    assert merged == [(str(tmp_path), str(tmp_path / "out"))]
