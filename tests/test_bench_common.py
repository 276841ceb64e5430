"""bench/_common.py's helpers that every benchmark's comparison depends on."""
import sys
from pathlib import Path

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
