"""The differential fuzzer's seeded CPU sample (accelc.models.fuzz; bench/fuzz.py runs it long on
the GPU): random models of the ops accelc rewrites and the ones it does not, optimized and
compared with eager against fp64 on new inputs and another batch size. A crash or a mismatch is
a bug; a clean refusal (an AccelcError) is fine."""
import pytest

from accelc.models.fuzz import run_case
from conftest import DEVICE

SEEDS = range(24)


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_model_matches_eager_or_is_refused_cleanly(seed):
    rec = run_case(seed, "tiny", DEVICE)
    assert rec["status"] in ("ok", "refused"), rec
