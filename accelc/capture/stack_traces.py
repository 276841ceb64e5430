"""torch.export without FX's per-node stack traces: the tracer takes each node's Python stack as it records it
(a traceback walked and formatted a node), 10-20% of a 24-layer LM's export on the CPU, and accelc reads none
(error messages name the model's modules from their paths). Where the installed torch has the setting
(torch.fx.config.do_not_emit_stack_traces) it is set for the export; a torch without it (2.11, the GPU host's)
records them in its non-strict export's module-stack tracer unconditionally, which is told not to instead (its
`record_stack_traces` set off after it is made). Either way what was there before is put back at the end, the
export failing or not."""
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
    init = tracer.__init__

    def quiet(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.record_stack_traces = False

    tracer.__init__ = quiet
    try:
        yield
    finally:
        tracer.__init__ = init
