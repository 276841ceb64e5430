"""accelc.capture: nn.Module -> torch.fx.GraphModule in accelc's canonical form, and the contract
between a user's call and the captured graph.

    trace.py      tracing (symbolic_trace, torch.export), the check against the model, module paths
                  and value metadata on every node
    contract.py   CallSpec: a call's arguments -> the graph's flat inputs, its flat output -> the
                  model's output; the model's buffers (what a forward updates in place)
    canonical.py  the canonical form: one spelling per operation
    pickling.py   modules of exported programs made to pickle: their shape checks and output structure
    written.py    operations written out in elementary ops, told by evaluating them (the one probe
                  evaluator that activations here, RoPE and RMSNorm in their passes use)
    nodes.py      node-level helpers: views, in-place ops, reshapes, swapping and erasing nodes
"""
from accelc.capture.canonical import canonicalize
from accelc.capture.contract import (CALL_SPEC, CallSpec, aliased_state, buffer_state, left_out, mutated_state,
                                     restore_buffers)
from accelc.capture.pickling import program_module
from accelc.capture.nodes import VIEW_OPS, erase_dead, reshape_of
from accelc.capture.trace import (capture, export_program, flat_module, make_canonical, quiet_torch_logs,
                                  record_meta, reference)

__all__ = ["CALL_SPEC", "CallSpec", "VIEW_OPS", "aliased_state", "buffer_state", "canonicalize", "capture", "erase_dead", "export_program",
           "flat_module", "left_out", "make_canonical", "mutated_state", "program_module", "quiet_torch_logs", "record_meta",
           "reference", "reshape_of", "restore_buffers"]
