"""A model sharded with PyTorch's tensor parallelism, as plain modules of this rank: the first step of optimizing
one (issue: beyond one GPU).

`torch.distributed.tensor.parallel.parallelize_module` leaves each parallelized nn.Linear holding its weight as a
DTensor and hooks that move its inputs and outputs between layouts; a graph captured from that holds DTensor
dispatch, not the rank's GEMMs. `localize` replaces every such layer by a `ShardLinear` holding the rank's shard as
a plain tensor, with the collective PyTorch's plan implies as one of accelc's two collective ops in its forward
(accelc::tp_all_reduce, accelc::tp_all_gather: torch's functional collectives inside, one node each in a captured
graph, recorded by CUDA graphs on NCCL; local_collectives has them stand in locally while optimize decides):

  - ColwiseParallel (weight and bias Shard(0)): the input whole, the output the rank's columns; with
    output_layouts=Replicate() the columns all-gathered along the last dim.
  - RowwiseParallel (weight Shard(1), bias Replicate()): the input the rank's slice of the last dim (cut here
    where input_layouts=Replicate() says it comes whole), the partial products all-reduced (sum), then the bias.

The same layers sharded by transformers' tp_plan styles (a model loaded with `from_pretrained(tp_plan=...)`:
colwise, rowwise, colwise_gather_output, rowwise_split_input) are read from the style that replaced the layer's
forward, their layouts meaning the same. Anything else holding DTensor parameters (an embedding, sequence
parallelism, transformers' packed styles, a layer whose output stays a DTensor) is refused in one line naming the
layer. The result computes what the sharded model computes, on every rank.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import fx, nn

from accelc import fast_all_reduce
from accelc.errors import InputError, ModelFileError


_state = threading.local()
# the last CPU collectives' tensors (gloo's), referenced here until the interpreter clears this module: _kept
_KEPT: collections.deque = collections.deque(maxlen=4)


def _kept(*tensors: torch.Tensor) -> None:
    """A CPU (gloo) collective's tensors kept referenced past the caller's use. gloo's worker thread drops its
    reference to a finished collective's tensors after the caller's wait has returned; where that reference is the
    last and the interpreter is already exiting, freeing the tensor's Python object takes the GIL from a finalizing
    interpreter and the process aborts ("terminate called without an active exception", after the program's last
    line ran). Here the main thread frees them, at exit. A few tensors, CPU only (a GPU's may be a CUDA graph's)."""
    if tensors[0].device.type == "cpu":
        _KEPT.append(tensors)


@contextlib.contextmanager
def local_collectives():
    """Within: this thread's tensor-parallel collectives (the two ops below) stand in locally, without a word to
    the other ranks: an all-reduce returns its input, an all-gather the input repeated `world` times. optimize
    runs its checks, races and padding check so: each rank's verdicts are its own, and a rank that runs its
    graph more often than another (a layer checked again, a timer's count) cannot leave a collective unpaired
    (a hang on NCCL, another collective's numbers on gloo). What runs for the user (the end-to-end check, the
    warm-up's CUDA graphs, every call) runs the real collectives, the same number of times on every rank."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _local() -> bool:
    return getattr(_state, "depth", 0) > 0


@torch.library.custom_op("accelc::tp_all_reduce", mutates_args=())
def all_reduce(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """The ranks' tensors summed (torch's functional all-reduce, or for a small one on a GPU symmetric memory's
    one-shot kernel: accelc/fast_all_reduce.py; local_collectives: the rank's own). One op in a captured graph: the
    runner's glue calls it as it is, CUDA graphs record its kernel."""
    if _local():
        return t.clone()
    fast = fast_all_reduce.all_reduce(t, group_name)      # a small one: symmetric memory's one-shot kernel
    if fast is not None:
        return fast
    ops = torch.ops._c10d_functional
    out = ops.wait_tensor(ops.all_reduce(t, "sum", group_name))
    _kept(out)
    return out


@all_reduce.register_fake
def _(t, group_name):
    return torch.empty_like(t)


@torch.library.custom_op("accelc::tp_all_gather", mutates_args=())
def all_gather_last(t: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """The ranks' tensors side by side along the last dim, in rank order (local_collectives: the rank's own,
    `world` times)."""
    if _local():
        return t.repeat(*([1] * (t.dim() - 1)), world)
    ops = torch.ops._c10d_functional
    t = t.contiguous()
    g = ops.wait_tensor(ops.all_gather_into_tensor(t, world, group_name))
    _kept(t, g)
    return g.view(world, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], world * t.shape[-1])


@all_gather_last.register_fake
def _(t, world, group_name):
    return t.new_empty((*t.shape[:-1], world * t.shape[-1]))


COLLECTIVES = (torch.ops.accelc.tp_all_reduce.default, torch.ops.accelc.tp_all_gather.default)


def group_of(gm: fx.GraphModule) -> str | None:
    """The process group's name of a graph's tensor-parallel collectives, None for a graph that has none."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and is_collective(n.target):
            return n.args[-1]
    return None


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def shard_note(gm: fx.GraphModule) -> dict:
    """What a saved program records of its shard: {"tensor_parallel": {"rank", "world", "group"}} for a graph with
    collectives (this process's rank in their group), {} for one without."""
    name = group_of(gm)
    if name is None:
        return {}
    import torch.distributed as dist
    group = _group(name)
    return {"tensor_parallel": {"rank": dist.get_rank(group), "world": dist.get_world_size(group), "group": name}}


def program_file(out: str | os.PathLike, gm: fx.GraphModule) -> Path | None:
    """Where this process writes a program: a rank's shard (a graph with collectives) beside `out`, named by its
    rank (model.pt2 -> model.rank0-of-2.pt2: every rank writes its own); a program without collectives to `out`, or,
    under a launcher of several processes, by rank 0 alone (None here on the others: every rank optimized all of
    it)."""
    out = Path(out)
    note = shard_note(gm).get("tensor_parallel")
    if note is not None:
        return rank_file(out, note["rank"], note["world"])
    where = launched()
    return out if where is None or where[0] == 0 else None


def rank_file(out: Path, rank: int, world: int) -> Path:
    return out.with_name(f"{out.stem}.rank{rank}-of-{world}{out.suffix}")


def this_ranks_file(path: Path) -> Path | None:
    """The file this process's rank reads for `path` where `path` itself is not there: its rank file
    (program_file's name, the default group's rank and size), None outside a process group of several."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return rank_file(path, dist.get_rank(), dist.get_world_size())


def launched() -> tuple[int, int] | None:
    """(rank, world) where a launcher (torchrun) started this process as one of several, from its environment
    (RANK, WORLD_SIZE), else None."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    return (int(os.environ.get("RANK") or 0), world) if world > 1 else None


@contextlib.contextmanager
def launcher_group(device: torch.device):
    """For the command line under torchrun: the default process group of the launcher's processes, created on
    entry where none exists (NCCL on a GPU, the rank's GPU its LOCAL_RANK; gloo on the CPU) and destroyed on exit;
    a model builder (`package.module:name`) then shards the model on it (init_device_mesh). Nothing outside a
    launcher of several processes."""
    import torch.distributed as dist
    if launched() is None or dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK") or 0))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        fast_all_reduce.forget()
        dist.destroy_process_group()


def check_loaded(gm: fx.GraphModule, summary: dict | None, where: str) -> None:
    """A loaded program with collectives is one rank's shard: ModelFileError (one line) unless this process is
    that rank of a process group of that size, the group its collectives name created as when it was saved."""
    name = group_of(gm)
    if name is None:
        return
    note = (summary or {}).get("tensor_parallel") or {}
    rank, world = note.get("rank", "?"), note.get("world", "?")
    what = f"{where} is rank {rank} of a {world}-rank tensor-parallel program"
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise ModelFileError(f"{what}: load it in that rank of {world} processes with the process group initialized "
                             "(torchrun; torch.distributed.init_process_group, then the device mesh)")
    try:
        group = _group(name)
    except Exception:
        raise ModelFileError(f"{what}: its collectives use process group {name!r}, which this process has not "
                             "created; create the groups as when it was saved (the same device mesh)") from None
    here = (dist.get_rank(group), dist.get_world_size(group))
    if here != (rank, world):
        raise ModelFileError(f"{what}, and this process is rank {here[0]} of {here[1]}: each rank loads the program "
                             "it saved (its own shard of the weights)")


def is_collective(target) -> bool:
    """Whether a graph node's target is one of the two ops (an overload, or the packet fx.symbolic_trace keeps)."""
    return target in COLLECTIVES or getattr(target, "default", None) in COLLECTIVES


def on_every_rank(gm: fx.GraphModule, value) -> list:
    """`value` as each rank of gm's group has it, in rank order ([value] for a graph without collectives): a
    decision that must be the same on every rank (the calls' padding, whether generation runs accelc's step)
    is compared here. One collective, every rank calling it at the same point."""
    name = group_of(gm)
    if name is None:
        return [value]
    import torch.distributed as dist

    group = _group(name)
    if dist.get_backend(group) != "gloo":
        values = [None] * dist.get_world_size(group)
        dist.all_gather_object(values, value, group=group)
        return values
    return _gathered_on_cpu(value, group)


def _gathered_on_cpu(value, group) -> list:
    """all_gather_object on a gloo group with every tensor of its two collectives kept (_kept): those that
    all_gather_object makes inside are its own, and gloo's worker thread dropping the last reference to one at
    exit aborted a rank after its last line (one run of a two-rank optimize in CI)."""
    import pickle

    import torch.distributed as dist

    world = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    _kept(size, *sizes)
    most = max(int(n) for n in sizes)
    mine = torch.zeros(most, dtype=torch.uint8)
    mine[:data.numel()] = data
    outs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(outs, mine, group=group)
    _kept(mine, *outs)
    return [pickle.loads(out[:int(n)].numpy().tobytes()) for out, n in zip(outs, sizes)]


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
            return all_gather_last(y, self.world, self.group_name) if self.gather else y
        if self.cut:
            k = self.weight.shape[1]
            x = x.narrow(-1, self.rank * k, k)
        y = all_reduce(F.linear(x, self.weight), self.group_name)
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
    if isinstance(placement, Shard) and placement.dim < 0:      # (transformers' row-wise style: Shard(-1))
        placement = Shard(placement.dim % w.ndim)
    group = w.device_mesh.get_group()
    rank, world = w.device_mesh.get_local_rank(), w.device_mesh.size()
    layouts = _layouts(module)
    if layouts is None:
        style = _hf_style(module)
        what = (f"transformers' {type(style).__name__}" if style is not None else
                "a tensor-parallel style whose layouts accelc cannot read")
        raise InputError(f"{name}: sharded by {what}; accelc takes torch.distributed.tensor.parallel's "
                         "ColwiseParallel / RowwiseParallel (parallelize_module) and transformers' tp_plan styles "
                         "colwise / rowwise / colwise_gather_output / rowwise_split_input")
    inputs, outputs, local_out = layouts
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
        if gather and w.shape[0] % world:
            raise InputError(f"{name}: its {w.shape[0]} output features gathered from {world} ranks in unequal "
                             "shards; accelc gathers equal ones")
        return ShardLinear(w.to_local(), bias, "colwise", group.group_name, rank, world, gather=gather)
    if isinstance(placement, Shard) and placement.dim == 1:
        if not isinstance(out_layout, Replicate):
            raise InputError(f"{name}: RowwiseParallel with its output {out_layout} (sequence parallelism); accelc "
                             "takes a replicated output")
        if bias is not None and _is_dtensor(module.bias) and not isinstance(module.bias.placements[0], Replicate):
            raise InputError(f"{name}: a row-wise layer's bias sharded {module.bias.placements[0]}")
        cut = isinstance(in_layout, Replicate)
        if cut and w.shape[1] % world:
            raise InputError(f"{name}: its {w.shape[1]} input features cut for {world} ranks in unequal slices; "
                             "accelc cuts equal ones")
        if not cut and not (in_layout is None or isinstance(in_layout, Shard)):
            raise InputError(f"{name}: RowwiseParallel with its input {in_layout}")
        return ShardLinear(w.to_local(), bias, "rowwise", group.group_name, rank, world, cut=cut)
    raise InputError(f"{name}: a Linear whose weight is placed {placement}; accelc takes ColwiseParallel "
                     "(Shard(0)) and RowwiseParallel (Shard(1))")


# HF transformers' tensor-parallel styles (a model loaded with tp_plan: transformers.integrations.tensor_parallel)
# whose layouts mean what PyTorch's ColwiseParallel / RowwiseParallel's do; their packed forms shard a fused weight
# in halves of their own and are refused
_HF_STYLES = ("ColwiseParallel", "RowwiseParallel")


def _hf_style(module: nn.Module):
    """The transformers tensor-parallel style whose forward replaced `module`'s (its `forward` attribute's closure
    holds it), or None."""
    forward = module.__dict__.get("forward")
    for cell in getattr(forward, "__closure__", None) or ():
        value = cell.cell_contents
        if hasattr(value, "install_forward") and type(value).__module__.startswith("transformers."):
            return value
    return None


def _layouts(module: nn.Module) -> tuple[tuple, tuple, bool] | None:
    """(input_layouts, output_layouts, use_local_output) from the style's hooks (parallelize_module's), each with
    its default where its hook is not found, or from the transformers style that replaced its forward (tp_plan);
    None where neither is found, or the transformers style is not one of _HF_STYLES."""
    as_tuple = (lambda v: tuple(v) if isinstance(v, (tuple, list)) else ((v,) if v is not None else ()))
    ins, outs = _hook_args(module)
    if not ins and not outs:
        style = _hf_style(module)
        if style is None or type(style).__name__ not in _HF_STYLES:
            return None
        return as_tuple(style.input_layouts), as_tuple(style.output_layouts), bool(style.use_local_output)
    input_layouts = ins[0] if ins else None
    output_layouts, use_local = (outs[0], outs[1]) if len(outs) >= 2 else (None, True)
    return as_tuple(input_layouts), as_tuple(output_layouts), use_local


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
