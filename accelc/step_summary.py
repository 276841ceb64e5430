"""The generation step program's part of a causal LM's summary: how its layers compare with the forward's."""
from __future__ import annotations

import re

from accelc.optimized import without_rule
from accelc.step_launches import count


_BLOCK = re.compile(r"\.\d+\.")     # a repeated block's index in a layer's name (model.layers.3.mlp)


def step_lines(forward: list, step) -> list[str]:
    """The step program in the LM's summary: a line for its layers that are the forward's (same kernel, same
    status), one for each that is not (one for all the repeated blocks' layers that differ alike: the step's fused
    q / k / v layers of every decoder layer), then its coverage, error and runtime (its whole table: step.summary())."""
    def of(r):
        return r.status, r.kernel or r.kind
    mine = {r.name: of(r) for r in forward}
    rows = [r for r in step.layers if not without_rule(r)]
    prefix = "lm." if rows and all(r.name.startswith("lm.") for r in rows) else ""   # (the step module's lm)
    other = [r for r in rows if mine.get(r.name.removeprefix(prefix)) != of(r)]
    lines = [f"the step program: {len(rows) - len(other)} of its {len(rows)} layers as the forward's (same kernel, "
             f"same status){', the others:' if other else ''}"]
    groups: dict = {}        # the same difference in every repeated block (model.layers.*.x): one line
    for r in other:
        name = r.name.removeprefix(prefix)
        was = mine.get(name)
        text = f"{r.status} {r.kernel or r.kind}" + (f" ({r.reason})" if r.reason else "") \
            + (f"; in the forward {was[0]} {was[1]}" if was else "; not in the forward")
        groups.setdefault((_BLOCK.sub(".*.", name, count=1), text), []).append(name)
    for (pattern, text), names in groups.items():
        lines.append(f"  {names[0]}: {text}" if len(names) == 1 else f"  {pattern} ({len(names)} layers): {text}")
    lines += ["  " + line for line in step.coverage_lines()[:1]]
    lines.append("  " + count(step.graph_module).line())
    lines.append(f"  end-to-end relative L2 error vs eager: {step.info.end_to_end_rel_error:.1e}")
    if step.info.runtime:
        lines.append(f"  runtime: {step.info.runtime}")
    return lines
