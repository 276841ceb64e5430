"""The generation step program's part of a causal LM's summary: how its layers compare with the forward's."""
from __future__ import annotations

from accelc.optimized import without_rule
from accelc.step_launches import count


def step_lines(forward: list, step) -> list[str]:
    """The step program in the LM's summary: a line for its layers that are the forward's (same kernel, same
    status), one for each that is not, then its coverage, error and runtime (its whole table: step.summary())."""
    def of(r):
        return r.status, r.kernel or r.kind
    mine = {r.name: of(r) for r in forward}
    rows = [r for r in step.layers if not without_rule(r)]
    prefix = "lm." if rows and all(r.name.startswith("lm.") for r in rows) else ""   # (the step module's lm)
    other = [r for r in rows if mine.get(r.name.removeprefix(prefix)) != of(r)]
    lines = [f"the step program: {len(rows) - len(other)} of its {len(rows)} layers as the forward's (same kernel, "
             f"same status){', the others:' if other else ''}"]
    for r in other:
        name = r.name.removeprefix(prefix)
        was = mine.get(name)
        lines.append(f"  {name}: {r.status} {r.kernel or r.kind}" + (f" ({r.reason})" if r.reason else "")
                     + (f"; in the forward {was[0]} {was[1]}" if was else "; not in the forward"))
    lines += ["  " + line for line in step.coverage_lines()[:1]]
    lines.append("  " + count(step.graph_module).line())
    lines.append(f"  end-to-end relative L2 error vs eager: {step.info.end_to_end_rel_error:.1e}")
    if step.info.runtime:
        lines.append(f"  runtime: {step.info.runtime}")
    return lines
