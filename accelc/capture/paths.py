"""Where a graph's nodes came from: the module path and class of each (the summary's layer names)."""
from __future__ import annotations

import re

from torch import fx

from accelc import meta


def keep_module_stacks(model, gm: fx.GraphModule) -> None:
    """A graph traced from a graph module (a torch.export program's module, whose nodes carry the model's
    nn_module_stack) gets each call's stack from the same call there (the same op, in the same order: a
    trace names its nodes anew): the summary names its layers by their modules (features.0+1+2), not by
    their ops (conv2d++relu#2)."""
    if not isinstance(model, fx.GraphModule):
        return
    queues: dict = {}
    for n in model.graph.nodes:
        if n.op == "call_function":
            queues.setdefault(n.target, []).append(n.meta.get("nn_module_stack"))
    for n in gm.graph.nodes:
        queue = queues.get(n.target) if n.op == "call_function" else None
        if queue:
            stack = queue.pop(0)
            if stack and not n.meta.get("nn_module_stack"):
                n.meta["nn_module_stack"] = stack


def annotate_paths(gm: fx.GraphModule) -> None:
    """meta.PATH: the module path a node came from; meta.MODULE_TYPE: that module's original
    class, qualified name (graph modules keep only stand-in containers)."""
    modules = dict(gm.named_modules())
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        if n.op == "call_module":
            path, cls = n.target, type(modules[n.target])
        elif n.op == "get_attr":
            path, cls = n.target.rpartition(".")[0], None
        else:
            path, cls = (_clean_path(list(stack.values())[-1][0]), list(stack.values())[-1][1]) if stack else ("", None)
        n.meta[meta.PATH] = path
        n.meta[meta.MODULE_TYPE] = cls if cls is None or isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


_TRACER_ROOT = re.compile(r"^(L\['[^']*'\]|L__self__)\.?")


def _clean_path(path: str) -> str:
    """Drop the tracer's name for the root module: L['self'].blocks.0 (strict export),
    L['fn'].0 (torch.compile), L__self__.fc -> blocks.0, 0, fc."""
    return _TRACER_ROOT.sub("", path)
