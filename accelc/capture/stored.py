"""Captured graphs kept across processes: a second optimize of the same model on the same example reads the graph
torch.export made the first time instead of exporting again (half to two thirds of a warm optimize was the export).

What is kept (`<cache>/captures/<key>.pkl`, beside the guard's verdicts): the graph as the capture hands it on
(canonical form, module paths on every node, the input shape contract), its nodes written out one by one (op,
target, arguments, accelc's node metadata), and where each tensor it holds comes from: the model's own parameters
and buffers are named, never written; only tensors the export made (lifted constants) are kept by value.

The key (`key`) digests what the graph depends on: the source of every Python file the model's forward ran (the
eager call capture makes anyway, watched with sys.setprofile: a changed line of modeling code is a new key), the
values of the plain module-level globals its code names and the environment variables its own code read (a limit or a
setting from outside the model's code), the model's module tree, tensors' names, shapes and dtypes, the values of
tensors its modules hold as plain attributes (not parameters or buffers: the export bakes them into the graph as
constants), its modules' plain attributes (numbers, strings, flags, tuples of them, enums, dtypes) and forward hooks,
the configs its modules hold (HF's), the example's structure, shapes and dtypes, the call's fixed values, the shape
option, accelc's own source and the versions of Python and PyTorch. A kept graph carries its key, and is checked
against the model as a fresh capture is (capture.check) on the example and at the other sizes its shape contract
claims (the ends of its ranges: a branch on a size whose limit the key cannot see), before it is trusted: one that
does not reproduce the model is removed and the model captured again.
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from accelc import meta
from accelc.capture.pickling import ShapeGuards
from accelc.capture.shapes import SHAPES
from accelc.capture.side_effects import plain_state
from accelc.files import read_record, remove, write_record
from accelc.layer_signature import values_digest
from accelc.version import source_digest

log = logging.getLogger("accelc")

FORMAT = 1
KEPT = "accelc_capture_kept"    # gm.meta: True on a graph read back here (the summary says so)
# node metadata kept: accelc's own (capture.trace sets them) and the export's module stacks
_NODE_META = (meta.PATH, meta.MODULE_TYPE, meta.IS_NONE, meta.VALUE, "nn_module_stack")
_CONSTANT_BYTES = 64 << 20     # tensors the export made, kept by value up to this many bytes in all
# the folder's bounds: past either, the least recently used graphs go (a 32-layer LM's two programs take ~3 MB)
MAX_KEPT = 256
MAX_KEPT_BYTES = 1 << 30


class _Ref:
    """Stands for a node in a kept node's arguments."""

    def __init__(self, name: str):
        self.name = name


# ---------------------------------------------------------------------------------------------
# the files a forward runs

class Seen(set):
    """The source files of the Python functions a block ran, (`codes`) their code objects, and (`env`) the
    environment variables the model's own code read there (not torch's, Python's or accelc's: their versions are in
    the key, and what they read in passing, lazily or at a first use, is no setting of the model's)."""

    def __init__(self):
        super().__init__()
        self.codes: set = set()
        self.env: set = set()


_ENV_READ = type(os.environ).__getitem__.__code__     # (os.getenv, environ.get and `in` all come through it)


@contextlib.contextmanager
def files_run():
    """Yields a Seen that collects the source files of the Python functions run in the block (this thread) and the
    environment variables read there, or None where a profiler is already set (a profiled optimize keeps no graph)."""
    if sys.getprofile() is not None:
        yield None
        return
    files = Seen()
    add, code_of, env = files.add, files.codes.add, files.env.add
    roots, stdlib = _library_roots(), _stdlib_root()
    where: dict = {}

    def library(name: str, under) -> bool:
        if name not in where:
            path = os.path.realpath(name)       # (os, posixpath, _collections_abc: "<frozen os>", Python's own)
            where[name] = (name.startswith("<frozen ") or path.startswith(stdlib), path.startswith(roots))
        return where[name][under]

    def seen(frame, event, arg):
        if event == "call":
            code = frame.f_code
            add(code.co_filename)
            code_of(code)
            if code is _ENV_READ:
                caller = frame.f_back       # past os.getenv, Mapping.get / __contains__ to the code that asked
                while caller is not None and library(caller.f_code.co_filename, 0):
                    caller = caller.f_back
                if caller is not None and not library(caller.f_code.co_filename, 1):
                    env(frame.f_locals.get("key"))
    sys.setprofile(seen)
    try:
        yield files
    finally:
        sys.setprofile(None)


def _stdlib_root() -> str:
    import sysconfig
    return os.path.join(os.path.realpath(sysconfig.get_paths()["stdlib"]), "")


def _library_roots() -> tuple[str, ...]:
    """Folders whose files the versions in the key stand for: torch's, Python's own library, accelc's."""
    import accelc
    packages = (os.path.join(os.path.realpath(os.path.dirname(m.__file__)), "") for m in (torch, accelc))
    return (*packages, _stdlib_root())


def _files_digest(files: set) -> list | None:
    """[(file, digest of its contents)] of the model's own code among `files` (not torch's, Python's or accelc's);
    None where one cannot be read (code made at run time from a file that is gone)."""
    roots = _library_roots()
    out = []
    for name in sorted(files):
        if name.startswith(("<string>", "<frozen ")):   # made by exec from a file's source (dataclass and namedtuple
            continue                                    # methods: their class's file counts), Python's frozen modules
        if name.startswith("<"):      # typed in (<stdin>, a notebook's cell): nothing to tell an edit by
            return None
        path = os.path.realpath(name)
        if path.startswith(roots):
            continue
        try:
            out.append((name, hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]))
        except OSError:
            return None
    return out


# ---------------------------------------------------------------------------------------------
# the key

class Key(str):
    """A key, with (`parts`) a digest of each part: said where no graph is kept under it."""

    def __new__(cls, text: str, parts: dict):
        k = super().__new__(cls, text)
        k.parts = parts
        return k


def key(model: nn.Module, spec, flat: tuple, expected, dynamic, files: set | None) -> str | None:
    """The digest of what the model's captured graph depends on (module docstring), or None where something cannot
    be told apart by value (an object printed by address) or the files are unknown: nothing kept or read."""
    if files is None or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        log.debug("accelc: capture: no kept graph (%s)", "a profiler set" if files is None else "a tensor-parallel rank")
        return None      # (a tensor-parallel rank's graph holds its collectives: captured each time)
    try:
        code = _files_digest(files)
        if code is None:
            log.debug("accelc: capture: no kept graph (the forward ran code typed in, or from a file now gone)")
            return None
        h = hashlib.sha256()
        parts = [
            ("format", (FORMAT, source_digest(), sys.version, torch.__version__)),
            ("code", code),
            ("modules", [(name, f"{type(m).__module__}.{type(m).__qualname__}") for name, m in
                         model.named_modules(remove_duplicate=False)]),
            ("tensors", [(name, tuple(t.shape), t.dtype, t.stride(), t.device.type, isinstance(t, nn.Parameter))
                         for name, t in _named_tensors(model)]),
            ("plain", sorted((repr(k), repr(v)) for k, v in plain_state(model).items())),
            ("attributes", _attributes(model)),
            ("tensor attributes", _tensor_attributes(model)),
            ("globals", _globals([name for name, _ in code], files.codes)),
            ("environment", sorted((repr(k), os.environ.get(k)) for k in files.env if isinstance(k, str))),
            ("hooks", _hooks(model)),
            ("configs", _configs(model)),
            ("flags", (torch.get_default_dtype(), torch.is_grad_enabled())),
            ("call", (spec.n_args, spec.kw_names, repr(sorted(spec.constants.items())), spec.arg_names,
                      repr(sorted(spec.defaults.items())), spec.template is not None)),
            ("output", str(pytree.tree_structure(spec.flat_output(expected)))),
            ("inputs", [(tuple(x.shape), x.dtype, x.stride(), x.device.type) if isinstance(x, torch.Tensor)
                        else repr(x) for x in flat]),
            ("dynamic", repr(dynamic)),
        ]
        digests = {}     # (per part, for -v: which part told two processes' keys apart)
        for label, value in parts:
            text = str(value)
            if " at 0x" in text:
                log.debug("accelc: capture: no kept graph (the key's %s hold an object printed by address: %s)",
                          label, text[max(0, text.find(" at 0x") - 80):text.find(" at 0x") + 20])
                return None
            h.update(label.encode() + b"\0" + text.encode() + b"\0")
            digests[label] = hashlib.sha256(text.encode()).hexdigest()[:8]
        log.debug("accelc: capture: key %s, its parts %s", h.hexdigest()[:12], digests)
        return Key(h.hexdigest()[:40], digests)
    except Exception as e:     # nothing the key cannot read is worth a failed optimize: the model is captured
        log.debug("accelc: capture: no kept graph (%s: %s)", type(e).__name__, e)
        return None


def _named_tensors(model: nn.Module) -> list:
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


_INTERNAL = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def _plain(v) -> bool:
    """Whether v is told apart by its repr: None, numbers, strings, enums, dtypes, devices, and containers of them."""
    if v is None or isinstance(v, (bool, int, float, str, enum.Enum, torch.dtype, torch.device)):
        return True
    if isinstance(v, (tuple, list, set, frozenset)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(k) and _plain(x) for k, x in v.items())
    return False


def _attributes(model: nn.Module) -> list:
    """The modules' own attributes of plain values other than plain_state's numbers and strings (a conv's stride
    tuple, an enum, a dtype), by module path and name."""
    out = []
    for name, mod in model.named_modules():
        for k, v in vars(mod).items():
            if k not in _INTERNAL and "hooks" not in k and not isinstance(v, (bool, int, float, str)) \
                    and v is not None and _plain(v):
                out.append((name, k, repr(sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v)))
    return out


def _tensor_attributes(model: nn.Module) -> list:
    """(module path, attribute, shape, dtype, digest of the values) of every tensor the modules hold as plain
    attributes, alone or in lists, tuples and dicts (not parameters or buffers: the export bakes them in as values)."""
    found = []
    for name, mod in model.named_modules():
        for k, v in vars(mod).items():
            if k in _INTERNAL:
                continue
            items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, (list, tuple)) else [(None, v)]
            found += [(name, k, repr(i), t) for i, t in items if isinstance(t, torch.Tensor)]
    sums = values_digest([t for *_, t in found])
    return [(name, k, i, tuple(t.shape), t.dtype, s) for (name, k, i, t), s in zip(found, sums)]


def _globals(own_files: list, codes: set) -> list:
    """(file, name, value) of the plain module-level globals (numbers, strings, flags and containers of them;
    tensors by a digest of their values) of the modules whose source is among the model's own files run
    (_files_digest's), those the code run from each file names (its functions' global and attribute names): a
    module's other globals, a cache it fills as a process goes on, are no input of the forward."""
    own = {os.path.realpath(name) for name in own_files}
    names = {os.path.basename(name) for name in own}     # (a module's path resolved only where its name matches)
    by_file: dict = {}
    for code in codes:
        by_file.setdefault(code.co_filename, set()).update(code.co_names)
    named: dict = {}
    for name, used in by_file.items():
        named.setdefault(os.path.realpath(name), set()).update(used)
    out = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or os.path.basename(path) not in names or os.path.realpath(path) not in own:
            continue
        used = named.get(os.path.realpath(path), set())
        for k, v in sorted(vars(module).items()):
            if k.startswith("__") or isinstance(v, type) or callable(v) or k not in used:
                continue
            if isinstance(v, torch.Tensor):
                out.append((path, k, tuple(v.shape), v.dtype, values_digest([v])[0]))
            elif _plain(v):
                out.append((path, k, repr(sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v)))
    return sorted(out, key=repr)


def _hooks(model: nn.Module) -> list:
    """The forward hooks on the model's modules and every module's (a hook's work is traced into the graph)."""
    def named(hooks) -> list:
        return [f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
                for fn in hooks.values()]
    from torch.nn.modules import module as torch_module
    out = [("*", named(torch_module._global_forward_pre_hooks), named(torch_module._global_forward_hooks))]
    for name, mod in model.named_modules():
        if mod._forward_pre_hooks or mod._forward_hooks:
            out.append((name, named(mod._forward_pre_hooks), named(mod._forward_hooks)))
    return out


def _configs(model: nn.Module) -> list:
    """The configs the model's modules hold (an HF PretrainedConfig: its to_dict), as sorted JSON."""
    out, seen = [], set()
    for name, mod in model.named_modules():
        for k, v in vars(mod).items():
            to_dict = getattr(v, "to_dict", None)
            if callable(to_dict) and not isinstance(v, (nn.Module, torch.Tensor)) and id(v) not in seen:
                seen.add(id(v))
                out.append((name, k, json.dumps(to_dict(), sort_keys=True, default=repr)))
    return out


# ---------------------------------------------------------------------------------------------
# a graph written out and read back

def _target(target):
    if isinstance(target, torch._ops.OpOverload):
        ns, _, name = target._schema.name.partition("::")
        return ("op", ns, name, target._overloadname)
    return target


def _op(target):
    if isinstance(target, tuple) and target[:1] == ("op",):
        _, ns, name, overload = target
        return getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
    return target


def written(gm: fx.GraphModule, model: nn.Module) -> dict | None:
    """gm (a capture's graph module) as plain data, its tensors named by where they are in `model`; None where
    it holds something that cannot be kept (a submodule other than its shape checks, too many bytes of tensors
    of its own). (Whether all of it pickles, keep finds.)"""
    owned = {}
    for name, t in _named_tensors(model):
        owned.setdefault(id(t), name)
    state, constant_bytes = [], 0
    buffers = dict(gm.named_buffers(remove_duplicate=False))
    held = [*gm.named_parameters(remove_duplicate=False), *buffers.items()]
    names = {name for name, _ in held}
    held += [(n.target, _attr(gm, n.target)) for n in gm.graph.nodes       # the export's constants: plain attributes
             if n.op == "get_attr" and n.target not in names and isinstance(_attr(gm, n.target), torch.Tensor)]
    for name, t in held:
        mod_name, _, field = name.rpartition(".")
        kind = "parameter" if name in names and name not in buffers else "constant" if name not in names else (
            "buffer" if field not in gm.get_submodule(mod_name)._non_persistent_buffers_set else "buffer-np")
        if id(t) in owned:
            state.append((name, kind, ("model", owned[id(t)])))
        else:
            constant_bytes += t.numel() * t.element_size()
            state.append((name, kind, ("value", t.detach().cpu().clone(), str(t.device))))
    if constant_bytes > _CONSTANT_BYTES:
        return None
    known = {name for name, _, _ in state}
    modules = []
    for name, mod in gm.named_modules(remove_duplicate=False):
        if not name:
            continue
        if isinstance(mod, ShapeGuards):
            modules.append((name, mod))
        elif type(mod) is nn.Module:
            modules.append((name, None))
        else:
            return None
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target not in known and not isinstance(_attr(gm, n.target), ShapeGuards):
            return None      # an attribute that is neither state nor the shape checks (a sub-graph)
        kept = {k: n.meta[k] for k in _NODE_META if k in n.meta}
        nodes.append((n.name, n.op, _target(n.target), fx.node.map_arg(n.args, lambda a: _Ref(a.name)),
                      fx.node.map_arg(n.kwargs, lambda a: _Ref(a.name)), kept))
    graph_meta = {k: v for k, v in gm.meta.items() if k == SHAPES}
    entry = {"format": FORMAT, "nodes": nodes, "state": state, "modules": modules, "meta": graph_meta,
             "codegen": gm.graph._codegen, "specs": {k: gm.__dict__[k] for k in ("_in_spec", "_out_spec")
                                                      if k in gm.__dict__}}
    return entry


def _attr(gm: nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def rebuilt(entry: dict, model: nn.Module) -> fx.GraphModule:
    """The graph module `written` wrote, its tensors the model's own (the same objects)."""
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    model_device = next((t.device for _, t in _named_tensors(model)), None)
    for name, mod in entry["modules"]:
        parent, _, field = name.rpartition(".")
        gm.get_submodule(parent).add_module(field, mod if mod is not None else nn.Module())
    for name, kind, source in entry["state"]:
        if source[0] == "model":
            value = _attr(model, source[1])
            if not isinstance(value, torch.Tensor):
                raise LookupError(f"the model has no tensor {source[1]}")
        else:     # (on the model's device where it is of the kind the constant was on: the key holds kinds)
            device = torch.device(source[2])
            value = source[1].to(model_device if model_device is not None and model_device.type == device.type
                                  else device)
        parent, _, field = name.rpartition(".")
        owner = gm.get_submodule(parent)
        if kind == "parameter":
            owner.register_parameter(field, value if isinstance(value, nn.Parameter)
                                     else nn.Parameter(value, requires_grad=False))
        elif kind == "constant":
            setattr(owner, field, value)
        else:
            owner.register_buffer(field, value, persistent=kind == "buffer")
    for k, v in entry["specs"].items():
        gm.__dict__[k] = v
    graph = fx.Graph()
    env: dict = {}
    for name, op, target, args, kwargs, kept in entry["nodes"]:
        def node_of(a):
            return env[a.name] if isinstance(a, _Ref) else a
        # (map_aggregate: the structures map_arg wrote them in; pytree's tree_map took 0.25 s of a 24-layer LM's)
        node = graph.create_node(op, _op(target), fx.node.map_aggregate(args, node_of),
                                 fx.node.map_aggregate(kwargs, node_of), name=name)
        if node.name != name:
            raise ValueError(f"node {name} read back as {node.name}")
        node.meta.update(kept)
        env[name] = node
    graph._codegen = entry["codegen"]
    gm.graph = graph
    gm.meta.update(entry["meta"])
    return gm


# ---------------------------------------------------------------------------------------------
# the files

def read(folder: Path, k: str, model: nn.Module) -> fx.GraphModule | None:
    """The graph kept under key k, rebuilt on the model's tensors; None where there is none (said in the log with
    the key's parts: two processes' keys of one model told apart by a part). One that cannot be read (another
    accelc's format, a damaged file) is said once and removed."""
    if not (folder / f"{k}.pkl").exists():
        log.info("accelc: capture: no graph kept under key %s (its parts %s)", k[:12], getattr(k, "parts", "?"))
        return None
    def load(entry) -> fx.GraphModule:
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            raise TypeError("not a kept graph of this accelc")
        if entry.get("key") != k:      # (a file copied or renamed into another's place: another model's graph)
            raise TypeError(f"a graph kept under another key ({str(entry.get('key'))[:12]})")
        return rebuilt(entry, model)
    return read_record(folder / f"{k}.pkl", load, "the kept capture", "the model is captured again")


def keep(folder: Path, k: str, gm: fx.GraphModule, model: nn.Module) -> None:
    """Writes gm under key k (whole or not at all); a graph that cannot be kept, or a cache that cannot be
    written, only means the next optimize captures again (said in the log)."""
    entry = written(gm, model)
    if entry is None:
        log.debug("accelc: capture: the graph holds what cannot be kept (a sub-graph, large constants)")
        return
    entry["key"] = str(k)
    write_record(folder / f"{k}.pkl", entry, MAX_KEPT, MAX_KEPT_BYTES,
                 "the captured graph not kept for the next optimize")


def drop(folder: Path, k: str) -> None:
    remove(folder / f"{k}.pkl")
