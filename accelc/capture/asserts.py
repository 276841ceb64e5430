"""A model's own assertion messages, as eager shows them.

symbolic_trace formats a model's `torch._assert(cond, f"... {x.shape[1]} ...")` (timm's `_assert`)
while tracing, so the message holds `Proxy(getitem_1)` where eager shows 17. `format_at_run_time`
rewrites each such assert to `assert_formatted(cond, template, *values)`: the message formatted at the call,
from the graph's own values of the nodes the proxies name.
"""
from __future__ import annotations

import re

import torch
from torch import fx

_PROXY = re.compile(r"Proxy\(([A-Za-z_][A-Za-z0-9_]*)\)")


def assert_formatted(cond, template: str, *values) -> None:
    """torch._assert with its message formatted now (values: what the traced message's proxies stood for)."""
    if not cond:
        raise AssertionError(template.format(*values))


def format_at_run_time(gm: fx.GraphModule) -> bool:
    """Each torch._assert whose message names proxies of this graph's nodes -> assert_formatted(...). Returns
    whether anything changed."""
    nodes = {n.name: n for n in gm.graph.nodes}
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch._assert or len(n.args) != 2 or n.kwargs:
            continue
        cond, message = n.args
        if not isinstance(message, str) or not _PROXY.search(message):
            continue
        named = [m.group(1) for m in _PROXY.finditer(message)]
        if any(name not in nodes for name in named):
            continue
        template = _PROXY.sub("{}", message.replace("{", "{{").replace("}", "}}"))
        n.target, n.args = assert_formatted, (cond, template, *(nodes[name] for name in named))
        changed = True
    if changed:
        gm.recompile()
    return changed
