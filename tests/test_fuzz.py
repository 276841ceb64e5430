"""The differential fuzzer's seeded CPU sample (bench/fuzz_models.py; bench/fuzz.py runs it long on
the GPU): random models of the ops accelc rewrites and the ones it does not, optimized and
compared with eager against fp64 on new inputs and another batch size. A crash or a mismatch is
a bug; a clean refusal (an AccelcError) is fine."""
import sys
from pathlib import Path

import pytest

from conftest import DEVICE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))     # (the fuzzer is not installed with accelc)
from fuzz_models import CALLS, call_class, run_case  # noqa: E402

SEEDS = range(24)
# beyond those, two seeds of each way of calling a case (#57's classes: aliased inputs, a branch on the
# batch, keywords at their defaults, two threads at once)
CALL_SEEDS = [s for c in sorted(set(CALLS) - {"plain"}) for s in [x for x in range(24, 400) if call_class(x) == c][:2]]


@pytest.mark.parametrize("seed", [*SEEDS, *CALL_SEEDS])
def test_fuzzed_model_matches_eager_or_is_refused_cleanly(seed):
    rec = run_case(seed, "tiny", DEVICE)
    assert rec["status"] in ("ok", "refused"), rec


@pytest.mark.parametrize("seed", [3, 11, 17])
def test_reuse_across_processes_never_gives_a_stale_number(seed):
    """The reuse class (#88): the model's non-parameter state and a global it reads changed between two optimizes
    with reuse on; the second optimize, reading back what the first kept, must give eager's numbers."""
    rec = run_case(seed, "tiny", DEVICE, reuse=True)
    assert rec["status"] in ("ok", "refused") and rec["calls"] == "reuse", rec
