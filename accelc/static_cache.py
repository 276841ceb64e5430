"""The static KV cache of generation (accelc.generation): HF's StaticCache, with the layers accelc's
step program writes.

CacheStep is one forward step of a causal LM over it (the step program's module; see
accelc.generation for the step's inputs and the loops that call it). Its layers are StepLayers,
HF's StaticLayer with two changes that take kernels out of every layer of a decode step (a profile of
the Llama-3-8B shape's step showed four glue kernels a layer around the cache):
  - one length for all layers. HF's layers each hold a length, which the step set from `start`
    and each layer's update advanced: a copy and an add a layer. A StepLayer reads the cache's one
    length (the step's `start`) and leaves it as it is; CacheStep.forward sets it once before the
    model and advances it once after (HF's generate loop reads it for its next call).
  - keys and values in one tensor, (2, B, Hkv, max_cache_len, D), where their head dims and dtypes
    agree (every family here): the layer's `keys` and `values` are its two halves, and an update
    writes both with one index_copy_ of the stacked pair, which the Inductor glue compiles to one
    kernel with the rotary embedding before it (two kernels and their reads of the step's
    projections before). Layers whose keys and values differ in head dim keep two tensors.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import StaticCache, StaticLayer

from accelc.errors import InputError
from accelc.step_module import StepModule, cache_keyword
from accelc.kernels import greedy


class StepLayer(StaticLayer):
    """A static cache layer of accelc's step program (see the module docstring): `length` is the
    cache's one length, shared by its layers; `step` the positions a step writes, computed once a step by
    CacheStep.forward for every layer (a kernel a layer before)."""

    def __init__(self, max_cache_len: int, length: torch.Tensor, step: dict | None = None):
        super().__init__(max_cache_len=max_cache_len)
        self.cumulative_length = length
        self.step = step if step is not None else {}
        self.kv = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        if self.k_head_dim == self.v_head_dim and key_states.dtype == value_states.dtype:
            self.kv = key_states.new_zeros((2, *shape, self.k_head_dim))
            self.bind_views()
        else:
            self.keys = key_states.new_zeros((*shape, self.k_head_dim))
            self.values = value_states.new_zeros((*shape, self.v_head_dim))
        self.is_initialized = True

    def bind_views(self) -> None:
        """keys and values: the halves of kv (again, after kv was replaced by a copy)."""
        if self.kv is not None:
            self.keys, self.values = self.kv[0], self.kv[1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = self.step.get("positions")
        if positions is None:       # (an update outside CacheStep.forward)
            positions = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        if self.kv is None:
            self.keys.index_copy_(2, positions, key_states)
            self.values.index_copy_(2, positions, value_states)
            return self.keys, self.values
        # the halves are read from index_copy_'s result (not from the views made before it), so a
        # captured graph orders the attention's reads after the write
        kv = self.kv.index_copy_(3, positions, torch.stack((key_states, value_states)))
        return kv[0], kv[1]

    def reset(self) -> None:
        if self.is_initialized:
            for t in (self.kv,) if self.kv is not None else (self.keys, self.values):
                t.zero_()
        self.cumulative_length.zero_()


class CacheStep(StepModule):
    """One forward step of a causal LM over a static KV cache (see the module docstring). Built by
    running the model once on `ids` (the cache allocates its tensors at their first use, with the
    model's own head counts, head dims, dtype and device), whose keys and values are then cleared."""

    # its in-place updates set rather than accumulate (the length copied from `start` first and advanced
    # once after, the keys and values written at the step's positions): a call run again on the same
    # inputs leaves the same cache, so CUDA graphs' warm-up runs and Inductor may run the step
    # (runner.REPLAYABLE_STATE)
    replayable_state = True

    def __init__(self, lm: nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_len: int):
        super().__init__()
        self.lm, self.cache_keyword = lm, cache_keyword(lm)
        self.cache = StaticCache(config=lm.config, max_cache_len=max_len)
        sliding = [i for i, layer in enumerate(self.cache.layers) if getattr(layer, "is_sliding", False)]
        window = getattr(lm.config.get_text_config(), "sliding_window", None)
        if sliding and not (window is not None and window >= max_len):
            raise InputError(f"layers {sliding[:4]} attend to a sliding window of {window} tokens, and accelc's static "
                             f"cache holds {max_len}: generation beyond the window is not supported yet")
        # HF's static layers (and its sliding ones: the window never slides within the cache) become
        # StepLayers over one length; a layer of another kind stays, and is refused below
        self.register_buffer("length", torch.zeros((), dtype=torch.long, device=ids.device), persistent=False)
        self.step = {}      # what a call computes once for every layer (StepLayer)
        for i, layer in enumerate(self.cache.layers):
            if type(layer) is StaticLayer or i in sliding:
                self.cache.layers[i] = StepLayer(max_len, self.length, self.step)
        with torch.no_grad():
            self(ids, padded(mask, max_len), prompt_positions(mask), self.length)
        for i, layer in enumerate(self.cache.layers):
            if not isinstance(layer, StepLayer) or not layer.is_initialized:
                raise InputError(f"the model's cache layer {i} ({type(layer).__name__}) is not a static one accelc "
                                 "can hold")
            layer.reset()
            for name in ("kv",) if layer.kv is not None else ("keys", "values"):
                self.register_buffer(f"{name}_{i}", getattr(layer, name), persistent=False)
        self.batch, self.max_len = ids.shape[0], max_len

    def forward(self, input_ids, attention_mask, position_ids, start):
        # the length through the cache, as the layers read it: a capture then holds it as one tensor
        # (reached as the module's buffer as well, it held two over the same memory, and a compiler
        # was free to order the layers' reads before this write)
        length = self.cache.layers[0].cumulative_length
        length.copy_(start)
        self.step["positions"] = torch.arange(input_ids.shape[1], device=input_ids.device) + length
        try:
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, logits_to_keep=1, **{self.cache_keyword: self.cache})
        finally:
            self.step.clear()
        length.add_(input_ids.shape[1])
        return out.logits[:, -1]

    def race_inputs(self, input_ids, attention_mask, position_ids, start) -> tuple[tuple, str]:
        """(inputs, what they are) the guard's speed race times each layer on (accelc.guard): the
        decode step after this prompt, one token a sequence, the call a generation makes all but
        once (a kernel that loses at the prompt's rows may win at one row, and the other way)."""
        n = input_ids.shape[1]
        keys = attention_mask.clone()
        keys[:, n] = 1
        return ((input_ids[:, -1:].clone(), keys, position_ids[:, -1:] + 1, torch.full_like(start, n)),
                "a decode step's inputs (one token a sequence)")

    def reset(self) -> None:
        """Positions start at 0 again (stale keys and values past a sequence's length are masked)."""
        self.length.zero_()

    def describe(self) -> str:
        return (f"static KV cache for {self.batch} sequence(s) of {self.max_len} tokens "
                f"({kv_bytes(self.cache) / 2**20:.1f} MiB, {len(self.cache.layers)} layers)")

    # -- the loops' inputs (accelc.step_module declares them) -------------------------------------

    def begin(self, input_ids: torch.Tensor, mask: torch.Tensor, rows: int, total: int) -> None:
        """A generate() of `total` positions a sequence for the first `rows` of the cache's rows."""
        self.reset()

    def prefill_inputs(self, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        """The step's inputs for the prompt, and the greedy loop's state for decode_inputs."""
        keys = padded(mask.long(), self.max_len)
        start = torch.zeros((), dtype=torch.long, device=input_ids.device)
        count = mask.long().sum(-1)
        # prompt length, real tokens a row, and the decode steps' inputs, rewritten in place each step
        self.loop = (input_ids.shape[1], count, (input_ids[:, -1:].clone(), keys, count[:, None].clone(), start))
        return input_ids, keys, prompt_positions(mask), start

    def decode_inputs(self, token: torch.Tensor, i: int) -> tuple:
        """The step's inputs for the i-th new token (0: the first after the prompt): the new column of
        the key mask, each row's position and the start, written in one kernel."""
        n, count, (ids, keys, positions, start) = self.loop
        greedy.static_inputs(token, ids, keys, positions, count, start, n + i, i)
        return ids, keys, positions, start

    def shell_inputs(self, input_ids, attention_mask, position_ids, cache) -> tuple:
        """The step's inputs for a forward call of HF's generate loop (see OptimizedLM._shell)."""
        start = cache.layers[0].cumulative_length
        if position_ids is None:     # the model's own default
            position_ids = (start + torch.arange(input_ids.shape[1], device=input_ids.device)).expand_as(input_ids)
        return input_ids, key_padding(attention_mask, input_ids, self.max_len, start), position_ids, start


def kv_bytes(cache) -> int:
    """The bytes of an HF Cache's keys and values (a static or a paged one)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def prompt_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded prompt, as HF's generate derives them from the attention
    mask: each real token's index among the real ones, pads at 1."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def padded(mask: torch.Tensor, length: int) -> torch.Tensor:
    """A (B, n) key padding mask as (B, length): the positions past n masked."""
    out = mask.new_zeros(mask.shape[0], length)
    out[:, :mask.shape[1]] = mask
    return out


def key_padding(mask, input_ids, length: int, start) -> torch.Tensor:
    """The (B, length) key padding mask (1: a real token) of what HF's generate passes: a 2D mask
    of the tokens so far, the 4D mask it builds for a static cache (its last query row: the real
    keys up to the newest position), or None (no padding)."""
    if isinstance(mask, dict):    # one per layer type (full, sliding): within the cache the window never slides
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    if mask is None:   # no padding: every key up to the newest position
        end = start + input_ids.shape[1]
        return (torch.arange(length, device=input_ids.device) < end).long().expand(input_ids.shape[0], length)
    if mask.dim() == 4:
        row = mask[:, 0, -1, :]
        keep = row if row.dtype == torch.bool else row == 0
        return padded(keep.long(), length)
    return padded(mask.long(), length)
