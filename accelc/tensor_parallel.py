"""A model sharded with PyTorch's tensor parallelism, as plain modules of this rank: the first step of optimizing
one (issue: beyond one GPU).

`torch.distributed.tensor.parallel.parallelize_module` leaves each parallelized nn.Linear holding its weight as a
DTensor and hooks that move its inputs and outputs between layouts; a graph captured from that holds DTensor
dispatch, not the rank's GEMMs. `localize` replaces every such layer by a `ShardLinear` holding the rank's shard as
a plain tensor, with the collective PyTorch's plan implies written as a functional collective in its forward
(torch.ops._c10d_functional: capturable by torch.export and fx, and by CUDA graphs on NCCL):

  - ColwiseParallel (weight and bias Shard(0)): the input whole, the output the rank's columns; with
    output_layouts=Replicate() the columns all-gathered along the last dim.
  - RowwiseParallel (weight Shard(1), bias Replicate()): the input the rank's slice of the last dim (cut here
    where input_layouts=Replicate() says it comes whole), the partial products all-reduced (sum), then the bias.

Anything else holding DTensor parameters (an embedding, sequence parallelism, a layer whose output stays a DTensor)
is refused in one line naming the layer. The result computes what the sharded model computes, on every rank.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from accelc.errors import InputError


def _all_reduce(t: torch.Tensor, group_name: str) -> torch.Tensor:
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(t, "sum", group_name))


def _all_gather_last(t: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """The ranks' tensors side by side along the last dim, in rank order."""
    ops = torch.ops._c10d_functional
    g = ops.wait_tensor(ops.all_gather_into_tensor(t.contiguous(), world, group_name))
    return g.view(world, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], world * t.shape[-1])


class ShardLinear(nn.Module):
    """This rank's shard of a tensor-parallel nn.Linear (see the module docstring). mode: "colwise" or "rowwise";
    gather: colwise, the output all-gathered; cut: rowwise, the input arrives whole and this rank takes its slice."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str, group_name: str, rank: int,
                 world: int, gather: bool = False, cut: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.mode, self.group_name, self.rank, self.world, self.gather, self.cut = \
            mode, group_name, rank, world, gather, cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "colwise":
            y = F.linear(x, self.weight, self.bias)
            return _all_gather_last(y, self.world, self.group_name) if self.gather else y
        if self.cut:
            k = self.weight.shape[1]
            x = x.narrow(-1, self.rank * k, k)
        y = _all_reduce(F.linear(x, self.weight), self.group_name)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"{self.mode}, local {tuple(self.weight.shape)}, rank {self.rank} of {self.world}"
                + (", gathered" if self.gather else "") + (", input cut" if self.cut else ""))


def _hook_args(module: nn.Module) -> tuple[tuple, tuple]:
    """(input partial's args, output partial's args) of the hooks parallelize_module registered on `module`: the
    styles' (input_layouts, desired_input_layouts) and (output_layouts, use_local_output)."""
    def found(hooks):
        for hook in hooks.values():
            for cell in getattr(hook, "__closure__", None) or ():
                value = cell.cell_contents
                if isinstance(value, functools.partial):
                    return value.args
        return ()
    return found(module._forward_pre_hooks), found(module._forward_hooks)


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:     # a PyTorch built without torch.distributed: nothing is sharded
        return False
    return isinstance(t, DTensor)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is a DTensor (a model parallelize_module went over)."""
    return any(_is_dtensor(t) for t in (*model.parameters(), *model.buffers()))


def _shard_linear(name: str, module: nn.Linear) -> ShardLinear:
    from torch.distributed.tensor import Replicate, Shard

    w = module.weight
    if w.device_mesh.ndim != 1:
        raise InputError(f"{name}: sharded over a {w.device_mesh.ndim}-D device mesh; accelc takes one dim of "
                         "tensor parallelism")
    placement = w.placements[0]
    group = w.device_mesh.get_group()
    rank, world = w.device_mesh.get_local_rank(), w.device_mesh.size()
    (inputs, _), (outputs, local_out) = _pair(module)
    bias = module.bias.to_local() if module.bias is not None and _is_dtensor(module.bias) else module.bias
    out_layout = outputs[0] if outputs else None
    in_layout = inputs[0] if inputs else None
    if not local_out:
        raise InputError(f"{name}: its output stays a DTensor (use_local_output=False); accelc takes plans whose "
                         "layers return plain tensors")
    if isinstance(placement, Shard) and placement.dim == 0:
        if not (in_layout is None or isinstance(in_layout, Replicate)):
            raise InputError(f"{name}: ColwiseParallel with its input {in_layout} (sequence parallelism); accelc "
                             "takes a replicated input")
        gather = isinstance(out_layout, Replicate)
        if not gather and not (isinstance(out_layout, Shard) and out_layout.dim in (-1, w.ndim - 1)):
            raise InputError(f"{name}: ColwiseParallel with its output {out_layout}; accelc takes Shard(-1) or "
                             "Replicate()")
        return ShardLinear(w.to_local(), bias, "colwise", group.group_name, rank, world, gather=gather)
    if isinstance(placement, Shard) and placement.dim == 1:
        if not isinstance(out_layout, Replicate):
            raise InputError(f"{name}: RowwiseParallel with its output {out_layout} (sequence parallelism); accelc "
                             "takes a replicated output")
        if bias is not None and _is_dtensor(module.bias) and not isinstance(module.bias.placements[0], Replicate):
            raise InputError(f"{name}: a row-wise layer's bias sharded {module.bias.placements[0]}")
        cut = isinstance(in_layout, Replicate)
        if not cut and not (in_layout is None or isinstance(in_layout, Shard)):
            raise InputError(f"{name}: RowwiseParallel with its input {in_layout}")
        return ShardLinear(w.to_local(), bias, "rowwise", group.group_name, rank, world, cut=cut)
    raise InputError(f"{name}: a Linear whose weight is placed {placement}; accelc takes ColwiseParallel "
                     "(Shard(0)) and RowwiseParallel (Shard(1))")


def _pair(module: nn.Module) -> tuple[tuple, tuple]:
    """((input_layouts,), (output_layouts, use_local_output)) from the style's hooks, each with its default
    where the hook is not found."""
    ins, outs = _hook_args(module)
    input_layouts = ins[0] if ins else None
    output_layouts, use_local = (outs[0], outs[1]) if len(outs) >= 2 else (None, True)
    as_tuple = (lambda v: tuple(v) if isinstance(v, (tuple, list)) else ((v,) if v is not None else ()))
    return (as_tuple(input_layouts), ()), (as_tuple(output_layouts), use_local)


def localize(model: nn.Module) -> nn.Module:
    """`model` (sharded by parallelize_module) with every tensor-parallel nn.Linear replaced, in place, by this
    rank's ShardLinear (the module docstring); the model returned. InputError naming the layer for a sharded module
    of another kind or layout. A model with no DTensor comes back as it is."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and _is_dtensor(module.weight):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, _shard_linear(name, module))
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if _is_dtensor(t):
            owner = name.rpartition(".")[0]
            raise InputError(f"{owner or 'the model'} ({type(model.get_submodule(owner)).__name__}) holds DTensor "
                             "parameters; accelc takes tensor-parallel nn.Linear layers (ColwiseParallel / "
                             "RowwiseParallel)")
    return model
