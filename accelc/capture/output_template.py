"""A saved program's output structure: where a model returns tensors inside objects a torch.export program cannot
return (HF's DynamicCache in a CausalLMOutputWithPast), the program returns them as a flat tuple, and the structure
around them (capture.contract's output template) is written beside the program so that accelc.load gives back what
the model returned (`out.logits`, `out.past_key_values`), as the optimized module does.

The template is pickled, and read back by an unpickler that builds nothing but the output and cache classes of
transformers, accelc's slots, plain containers, torch dtypes and devices: a program file stays data (loading it runs
no code of the file's choosing). A template of any other class (a user's own output object) is not written: the
saved program returns the flat tuple, and save says so; a template that cannot be read back (transformers missing,
a class it no longer has) gives the flat tuple too, and load says so.
"""
from __future__ import annotations

import base64
import importlib
import io
import pickle

import torch

TEMPLATE_FILE = "accelc_output_template.b64"
_CONTAINERS = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset")} | {
    ("collections", "OrderedDict"), ("accelc.capture.contract", "_Slot"), ("torch", "device")}


class _Refused(pickle.UnpicklingError):
    pass


def _transformers_class(module: str, name: str):
    """The class module.name where it is one of transformers' outputs (ModelOutput) or caches (cache_utils)."""
    if not (module == "transformers" or module.startswith("transformers.")):
        return None
    try:
        cls = getattr(importlib.import_module(module), name)
        from transformers.utils import ModelOutput
    except (ImportError, AttributeError):
        return None
    if isinstance(cls, type) and (issubclass(cls, ModelOutput) or cls.__module__ == "transformers.cache_utils"):
        return cls
    return None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _CONTAINERS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        cls = _transformers_class(module, name)
        if cls is None:
            raise _Refused(f"{module}.{name}")
        return cls


def written(template) -> tuple[str | None, str | None]:
    """(the template as text to write beside the program, None) or (None, why it is not written)."""
    if template is None:
        return None, None
    try:
        data = pickle.dumps(template, protocol=4)
        read(data)
    except Exception as e:      # a class of the user's own, or one that does not pickle
        what = str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"
        return None, f"its output holds {what}, which a program file does not rebuild"
    return base64.b64encode(data).decode("ascii"), None


def read(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


def read_text(text: str):
    """The template written as text; raises where it holds a class this unpickler does not build."""
    return read(base64.b64decode(text.encode("ascii")))

