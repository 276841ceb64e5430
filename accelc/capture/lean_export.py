"""torch.export made leaner, two costs of its own that accelc does not need:

- FX's per-node stack traces: the tracer takes each node's Python stack as it records it (a traceback walked and
  formatted a node), 10-20% of a 24-layer LM's export on the CPU, and accelc reads none (error messages name the
  model's modules from their paths). Where the installed torch has the setting
  (torch.fx.config.do_not_emit_stack_traces) it is set for the export; a torch without it (2.11, the GPU host's)
  records them in its non-strict export's module-stack tracer unconditionally, which is told not to instead (its
  `record_stack_traces` set off after it is made).
- the code of every intermediate graph module: export's own passes (the split and inlining around grad-mode
  regions, the runtime assertions) regenerate a whole graph's Python code at each step (39 regenerations of a
  16-layer LM's graph on the CPU); with torch's lazy graph modules (what Dynamo compiles with) the code is made
  when a module is first called or read, once.

Either way what was there before is put back at the end, the export failing or not.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def uncollected(use_setting: bool = True):
    """Inside the block, an export (non-strict) collects no stack trace for its nodes. use_setting=False: the
    tracer told directly even where the setting exists (how a torch without it is served, tested on one with)."""
    import torch.fx.config as fx_config

    before = getattr(fx_config, "do_not_emit_stack_traces", None)
    if use_setting and before is not None:
        fx_config.do_not_emit_stack_traces = True
        try:
            yield
        finally:
            fx_config.do_not_emit_stack_traces = before
        return
    from torch.fx.experimental import proxy_tensor

    tracer = getattr(proxy_tensor, "_ModuleStackTracer", None)
    if tracer is None:      # (a torch without that tracer: nothing to tell)
        yield
        return
    own, init = tracer.__dict__.get("__init__"), tracer.__init__

    def quiet(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.record_stack_traces = False

    tracer.__init__ = quiet
    try:
        yield
    finally:
        if own is None:       # (an __init__ it inherits: the class is left without one of its own, as it was)
            del tracer.__init__
        else:
            tracer.__init__ = own


@contextlib.contextmanager
def lazy_recompiles():
    """Inside the block, a graph module's code is generated when it is first needed, not at each recompile
    (torch.fx._lazy_graph_module; nothing changes where this torch has none)."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:
        yield
        return
    with _use_lazy_graph_module(True):
        yield


@contextlib.contextmanager
def lean():
    """Both: no stack traces, code generated lazily."""
    with uncollected(), lazy_recompiles():
        yield
