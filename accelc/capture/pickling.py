"""Modules of torch.export programs, made to pickle (`pickle.dumps`, `torch.save` of an optimized model).

1. Shape checks. `ExportedProgram.module()` gives a GraphModule whose first call is a `_guards_fn`
   submodule: the program's shape guards (`flat_0.size()[0] == 2`, a range a model's own branch
   pins) as a function torch.export generates from source with `exec`, a local object pickle
   refuses. Dropping the check instead would let a call of a shape the program was not traced for
   run the wrong branch silently. ShapeGuards keeps the same function and pickles its compiled
   code (marshal: read back by the same Python version, as any pickle of code is) with the
   namespace torch.export gives it rebuilt on load.
2. Output structure. A GraphModule pickles its generated code, not its graph, and re-traces that
   code when read back; a program's code builds its output (an HF ModelOutput) with pytree, which
   re-tracing turns into a plain dict; and a graph whose inputs carry type annotations names them
   by globals fx's pickler cannot import. graph_state pickles a graph module's code in flat form
   (flat inputs, flat outputs, no annotations) with its pytree code generator beside it, put back
   after the re-trace. (A deep copy keeps the graph itself: OptimizedModule.__deepcopy__.)
"""
from __future__ import annotations

import builtins
import marshal
import math
import types

import torch
from torch import nn
from torch.fx.graph import CodeGen
from torch.fx.graph_module import _format_import_block, reduce_graph_module, sys_importer


class ShapeGuards(nn.Module):
    """A program's shape checks (torch.export's `_guards_fn`) that survive pickling."""

    def __init__(self, code: types.CodeType):
        super().__init__()
        self._is_impure = True        # a call with no users: never removed as dead code
        self._set(code)

    def _set(self, code: types.CodeType) -> None:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        # the namespace torch.export's exec gives it, __builtins__ included (Dynamo, tracing the
        # guards under torch.compile, reads it from the function's globals: without it, every compile
        # of the glue failed with KeyError: '__builtins__' and the glue ran uncompiled)
        fn = types.FunctionType(code, {**SYMPY_INTERP, "math": math, "inf": float("inf"), "__builtins__": builtins},
                                "_guards")
        trace = getattr(torch._dynamo, "dont_skip_tracing", None)   # torch.compile re-reads the guards
        self.__dict__["_code"] = code
        self.__dict__["_fn"] = trace(fn) if trace is not None else fn

    def forward(self, *args):
        return self._fn(*args)

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("_code", "_fn")}
        state["_code_bytes"] = marshal.dumps(self._code)
        return state

    def __setstate__(self, state):
        code = marshal.loads(state.pop("_code_bytes"))
        self.__dict__.update(state)
        self._set(code)


def _generated_code(fn) -> types.CodeType | None:
    """The code of torch.export's generated guard function under its wrappers (Dynamo's
    dont_skip_tracing context-manager wrapper keeps it in a closure cell)."""
    seen = 0
    while fn is not None and seen < 8:
        seen += 1
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_filename == "<string>":
            return code
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]
            inner = next((c for c in cells if callable(c) and hasattr(c, "__code__")), None)
        fn = inner
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def picklable(gm: nn.Module) -> nn.Module:
    """gm with its `_guards_fn` (if any) replaced by a ShapeGuards running the same function (gm's
    as it is where the function is not torch.export's generated one), and fx's plain tracer named
    for re-reading its code when unpickled (a GraphModule pickles its code, not its graph, and
    torch.export's tracer takes arguments fx does not keep)."""
    if isinstance(gm, torch.fx.GraphModule):
        gm.graph._tracer_cls = None
        gm._tracer_cls = None
        gm._tracer_extras = {}
    guards = getattr(gm, "_guards_fn", None)
    if guards is None or isinstance(guards, ShapeGuards):
        return gm
    code = _generated_code(guards.__dict__.get("forward"))
    if code is not None:
        gm._guards_fn = ShapeGuards(code)
    return gm


def program_module(ep: torch.export.ExportedProgram) -> nn.Module:
    """ep.module(), its shape checks picklable (accelc's one way to make a module of a program)."""
    return picklable(ep.module())


class _GraphPickle:
    """Stands for a GraphModule in a pickle (see the module docstring, 2)."""

    def __init__(self, gm: torch.fx.GraphModule):
        codegen = gm.graph._codegen
        types_ = {n: n.type for n in gm.graph.nodes}
        gm.graph._codegen = CodeGen()
        for n in gm.graph.nodes:     # annotations (`x: torch.Tensor`) become globals fx cannot name
            n.type = None
        try:
            code = gm.recompile()
            body = {k: v for k, v in gm.__dict__.items() if k != "_graph"}
            self.args = (body, _format_import_block(code.globals, sys_importer),
                         codegen if type(codegen) is not CodeGen else None)
        finally:
            gm.graph._codegen = codegen
            for n, t in types_.items():
                n.type = t
            gm.recompile()

    def __reduce__(self):
        return _rebuild, self.args


def _rebuild(body: dict, import_block: str, codegen) -> torch.fx.GraphModule:
    gm = reduce_graph_module(body, import_block)
    if codegen is not None:
        gm.graph._codegen = codegen
        gm.recompile()
    return gm


def graph_state(state: dict) -> dict:
    """A module's __getstate__ dict with each GraphModule among its submodules pickled as
    _GraphPickle (their own __reduce__ loses a pytree output's type)."""
    modules = state.get("_modules", {})
    if not any(isinstance(m, torch.fx.GraphModule) for m in modules.values()):
        return state
    return {**state, "_modules": {k: _GraphPickle(m) if isinstance(m, torch.fx.GraphModule) else m
                                  for k, m in modules.items()}}
