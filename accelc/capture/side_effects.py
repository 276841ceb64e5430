"""What a model's forward does besides computing tensors, said while accelc captures it: printing, changing a
Python attribute of a module (such effects run at capture, never in the optimized model's calls)."""
from __future__ import annotations

import contextlib
import io
import sys
import warnings

from torch import nn


class _Tee(io.TextIOBase):
    """stdout as it was, and a count of what went through."""

    def __init__(self, out):
        self.out, self.written = out, 0

    def write(self, text):
        self.written += len(text)
        return self.out.write(text)

    def flush(self):
        self.out.flush()


def plain_state(model: nn.Module) -> dict:
    """Python numbers, strings and flags held by the model's modules and their classes."""
    state = {}
    for name, mod in model.named_modules():
        for owner, where in ((vars(mod), name or type(mod).__name__), (vars(type(mod)), type(mod).__name__)):
            for k, v in owner.items():
                if isinstance(v, (bool, int, float, str)) and not k.startswith("__"):
                    state[(where, k)] = v
    return state


@contextlib.contextmanager
def side_effects(model: nn.Module):
    """Warn once where the model's forward, run eagerly here, printed or changed a Python
    attribute of a module or its class: such side effects happen while accelc captures the model
    and never in the optimized model's calls (as torch.export and torch.compile's graphs treat
    them). What it printed still goes to stdout."""
    before = plain_state(model)
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        yield
    finally:
        sys.stdout = tee.out
    after = plain_state(model)
    changed = sorted(f"{where}.{k}" for (where, k), v in after.items() if before.get((where, k), v) != v)
    said = (["printed to stdout"] if tee.written else []) + (
        [f"changed {', '.join(changed[:3])}" + (" ..." if len(changed) > 3 else "")] if changed else [])
    if said:
        warnings.warn(f"accelc: the model's forward {' and '.join(said)} while accelc captured it: Python side "
                      "effects run at capture, not in the optimized model's calls (its graph holds only tensor "
                      "operations)", stacklevel=5)
