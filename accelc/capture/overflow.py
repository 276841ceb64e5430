"""HF's fp16 overflow guard, captured as what it computes.

Encoder and decoder layers of many transformers families (BART, mBART, Pegasus, Marian, Blenderbot,
LED, PLBart, detection models...) end with

    if hidden_states.dtype == torch.float16 and not torch.isfinite(hidden_states).all():
        clamp_value = torch.finfo(hidden_states.dtype).max - 1000
        hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)

(or `torch.isinf(hidden_states).any()`): a branch on tensor values, which torch.export cannot trace.
While accelc captures, `finite_branches()` answers the branch's test so that its clamp is traced, and
turns that clamp into `torch.where(test, clamp(h), h)`, the test computed from `h` in the graph: the
program clamps exactly when eager does, on the device, with no host sync. Only this shape of branch
is taken: a test of a tensor's finiteness whose body is one clamp of that tensor. Any other op run
between the test and the clamp, or a test whose body does no clamp, is refused (the branch would
otherwise run unconditionally) and capture reports the branch as before.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor
_FINITE = {torch.isfinite, Tensor.isfinite}
_NON_FINITE = {torch.isinf, Tensor.isinf, torch.isnan, Tensor.isnan}
_ALL = {torch.all, Tensor.all}
_ANY = {torch.any, Tensor.any}
_CLAMPS = {torch.clamp, Tensor.clamp, torch.clip, Tensor.clip}
# what torch.export itself asks of tensors between the test and the clamp (metadata, no values)
_METADATA = {"size", "stride", "storage_offset", "dim", "numel", "__get__", "__set__", "is_contiguous",
             "element_size", "is_floating_point", "data_ptr", "requires_grad_", "__len__"}


class UnsupportedBranch(RuntimeError):
    """A finiteness test whose branch is not one clamp of the tested tensor."""


class _FiniteBranches(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.tests = {}          # id(result) -> (result, kind, tested tensor): isfinite / isinf / all / any
        self.pending = None      # (condition tensor: True where eager clamps, tested tensor)
        self.taken = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.__bool__ and args and id(args[0]) in self.tests:
            return self._answer(args[0])
        if self.pending is not None:
            cond, src = self.pending
            if func in _CLAMPS and args and args[0] is src:
                self.pending = None
                self.taken += 1
                return torch.where(cond, func(*args, **kwargs), src)
            if getattr(func, "__name__", "") not in _METADATA:
                raise UnsupportedBranch(
                    f"{getattr(func, '__name__', func)} runs inside a branch on whether a tensor is finite: only "
                    "a clamp of that tensor (HF's fp16 overflow guard) is captured as the branch computes it")
        out = func(*args, **kwargs)
        x = args[0] if args else None
        if func in _FINITE | _NON_FINITE and isinstance(out, Tensor):
            self.tests[id(out)] = (out, "finite" if func in _FINITE else "non_finite", x)
        elif (func in _ALL | _ANY and len(args) == 1 and not kwargs and id(x) in self.tests
              and isinstance(out, Tensor)):
            _, kind, src = self.tests[id(x)]
            if (kind, func in _ALL) in (("finite", True), ("non_finite", False)):
                self.tests[id(out)] = (out, "all_finite" if kind == "finite" else "any_non_finite", src)
        return out

    def _answer(self, t) -> bool:
        """bool(test): the answer that enters the clamp's branch, remembering when eager takes it."""
        _, kind, src = self.tests[id(t)]
        if kind not in ("all_finite", "any_non_finite") or self.pending is not None:
            raise UnsupportedBranch("a branch on a tensor's finiteness other than HF's fp16 overflow guard")
        self.pending = (torch.logical_not(t) if kind == "all_finite" else t, src)
        # `not isfinite(h).all()` enters the branch on False, `isinf(h).any()` on True
        return kind == "any_non_finite"


@contextlib.contextmanager
def finite_branches():
    """Inside: HF's fp16 overflow guards trace as torch.where(test, clamp(h), h) (module docstring)."""
    mode = _FiniteBranches()
    with mode:
        yield mode
    if mode.pending is not None:
        raise UnsupportedBranch("a branch on whether a tensor is finite does no clamp of it: it cannot be "
                                "captured as eager computes it")
