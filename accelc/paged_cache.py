"""A paged KV cache for generation (OptimizeConfig(kv_cache="paged")), vLLM's PagedAttention layout.

Each layer's keys and values live in a pool of blocks of `page` tokens, (blocks, page, Hkv, D),
shared by every sequence; a block table (B, pages) names each sequence's blocks in order. A
generate() takes for each sequence the blocks its prompt and new tokens need, nothing for left
padding or for rows the request leaves unused, and the step's attention reads each sequence's keys
through its table up to its own length (kernels/paged_attention.py): a batch of ragged prompts
does no work on padding, and a pool smaller than batch x max_cache_len (kv_cache_tokens) serves
requests whose tokens fit in it.

The step program: (input_ids (B, T), position_ids (B, T), lens (B,) keys each sequence holds before
the step, new (B,) its real tokens among the T columns (the last ones), block_table (B, pages)) ->
the last column's logits (B, vocab). It writes the real columns' keys and values to their slots
(a pad's to a scratch block no table names) and runs the model with HF's attention interface set
to accelc's paged attention for the call. A step of more than flash_decoding.MAX_QUERIES tokens
starts its sequences (a prompt): every caller here begins a generate() with one.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from accelc.errors import InputError
from accelc.step_module import StepModule, cache_keyword
from accelc.static_cache import kv_bytes, prompt_positions
from accelc.kernels.paged_attention import paged_attention, real_columns

ATTENTION = "accelc_paged"        # the name accelc's attention function has in HF's AttentionInterface
_ACTIVE: list = []                # the PagedCache of the step being run (a stack: a step runs no step)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               softcap=None, **kwargs):
    """HF's attention-function signature over the active step's paged cache (see the module docstring)."""
    if not _ACTIVE:
        raise RuntimeError("accelc's paged attention runs only inside its generation step")
    cache = _ACTIVE[-1]
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise InputError("the model's attention has a logit soft cap or sink tokens, which accelc's paged cache "
                         "does not take: use kv_cache='static'")
    if sliding_window is not None and sliding_window < cache.max_len:
        raise InputError(f"the model attends to a sliding window of {sliding_window} tokens, and accelc's paged "
                         f"cache holds {cache.max_len} a sequence: generation beyond the window is not supported yet")
    layer = cache.layers[module.layer_idx]
    table, lens, new = cache.step_tensors
    out = paged_attention(query, key, value, layer.pages(layer.keys), layer.pages(layer.values), table, lens, new,
                          scaling)
    return out.transpose(1, 2), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


@contextlib.contextmanager
def _paged_attention(lm: nn.Module, cache):
    """HF's attention interface set to accelc's paged attention for one call of `lm`, its configs
    (the model's and its submodules') put back after."""
    configs = {id(c): c for c in [lm.config, *(getattr(m, "config", None) for m in lm.modules())]
               if c is not None and hasattr(c, "_attn_implementation")}
    before = {k: c._attn_implementation for k, c in configs.items()}
    _ACTIVE.append(cache)
    try:
        for c in configs.values():
            c._attn_implementation = ATTENTION
        yield
    finally:
        _ACTIVE.pop()
        for k, c in configs.items():
            c._attn_implementation = before[k]


class PagedLayer(CacheLayerMixin):
    """One layer's pool of key and value slots, (blocks x page, Hkv, D), allocated at its first
    update; writes the step's real columns to their slots and gives the step's own keys and
    values to the attention, which reads the pool through the block table."""

    is_compileable = True

    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states):
        slots = self.owner.blocks_total * self.owner.page
        Hkv, D = key_states.shape[1], key_states.shape[3]
        self.keys = key_states.new_zeros((slots, Hkv, D))
        self.values = value_states.new_zeros((slots, Hkv, value_states.shape[3]))
        self.is_initialized = True

    def pages(self, pool):
        return pool.view(self.owner.blocks_total, self.owner.page, *pool.shape[1:])

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, Hkv, T, D = key_states.shape
        slots = self.owner.cache.slots
        self.keys.index_copy_(0, slots, key_states.transpose(1, 2).reshape(B * T, Hkv, D))
        self.values.index_copy_(0, slots, value_states.transpose(1, 2).reshape(B * T, Hkv, value_states.shape[3]))
        return key_states, value_states

    def get_mask_sizes(self, query_length):
        return self.owner.max_len, 0

    def get_seq_length(self):
        return self.owner.seen

    def get_max_length(self):
        return self.owner.max_len


class PagedCache(Cache):
    """The HF Cache a paged step's model sees (and HF's generate loop, which reads its length)."""

    def __init__(self, owner, n_layers):
        super().__init__(layers=[PagedLayer(owner) for _ in range(n_layers)])
        self.owner = owner
        self.max_len = owner.max_len
        self.slots = self.step_tensors = None     # the running step's (PagedStep.forward sets them)

    def get_seq_length(self, layer_idx=0):
        return self.owner.seen


def _n_layers(lm: nn.Module) -> int:
    config = lm.config.get_text_config()
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise InputError("the model's config names no number of layers to size a paged cache with")


class PagedStep(StepModule):
    """One forward step of a causal LM over accelc's paged KV cache (see the module docstring): the
    same role as accelc.static_cache.CacheStep, the same contract (accelc.step_module)."""

    replayable_state = True      # a step run again on the same inputs writes the same slots (runner.REPLAYABLE_STATE)

    def __init__(self, lm: nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_len: int, page: int,
                 pool_tokens: int | None, distinct: int):
        super().__init__()
        _register()
        self.lm, self.page, self.max_len = lm, page, max_len
        self.cache_keyword = cache_keyword(lm)
        self.batch = ids.shape[0]
        self.pages_per_seq = -(-max_len // page)
        self.blocks = -(-(pool_tokens or self.batch * max_len) // page)   # the pool's blocks, the scratch one apart
        self.blocks_total = self.blocks + 1
        self.scratch = self.blocks                                        # pads' keys land here; no table names it
        self.cache = PagedCache(self, _n_layers(lm))
        self.seen = 0
        # the example: its first `distinct` rows, each with the blocks of its prompt and one token, repeated
        # down the batch (a repeated row writes the same keys to the same slots)
        count = mask.long().sum(-1)
        table = self.allocate((count[:distinct] + 1).tolist(), ids.device)
        table = table[:distinct].repeat(-(-self.batch // distinct), 1)[:self.batch]
        self.example_inputs = (ids, prompt_positions(mask), torch.zeros_like(count, dtype=torch.int32), count.int(),
                               table)
        with torch.no_grad():
            self(*self.example_inputs)
        for i, layer in enumerate(self.cache.layers):
            if not layer.is_initialized:
                raise InputError(f"the model's layer {i} wrote no keys to accelc's paged cache (its attention does "
                                 "not go through HF's cache and attention interface)")
            layer.keys.zero_()
            layer.values.zero_()
            self.register_buffer(f"keys_{i}", layer.keys, persistent=False)
            self.register_buffer(f"values_{i}", layer.values, persistent=False)
        self.example_table = table
        self.reset()

    def forward(self, input_ids, position_ids, lens, new, block_table):
        B, T = input_ids.shape
        col = torch.arange(T, device=input_ids.device)
        pos = lens.long()[:, None] + col[None, :] - (T - new.long())[:, None]     # each column's place in its sequence
        real = real_columns(new, T)
        page_of = (pos.clamp(min=0) // self.page).clamp(max=block_table.shape[1] - 1)
        block = block_table.long().gather(1, page_of)
        cache = self.cache
        cache.slots = torch.where(real, block * self.page + pos % self.page, self.scratch * self.page).reshape(-1)
        cache.step_tensors = (block_table, lens + new, new)
        try:
            with _paged_attention(self.lm, cache):
                out = self.lm(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1,
                              **{self.cache_keyword: cache})
        finally:
            cache.slots = cache.step_tensors = None
        return out.logits[:, -1]

    # -- blocks -----------------------------------------------------------------------------------

    def allocate(self, tokens: list[int], device: torch.device) -> torch.Tensor:
        """A block table giving sequence b the blocks for tokens[b] tokens (0: none), the rest of its
        row the scratch block; InputError in one line when the pool cannot hold them."""
        need = [-(-n // self.page) for n in tokens]
        longest = max(tokens, default=0)
        if longest > self.pages_per_seq * self.page:
            raise InputError(f"a sequence of {longest} positions is past the {self.max_len} the optimized LM's cache "
                             "holds: optimize with OptimizeConfig(max_cache_len=...) or ask for fewer tokens")
        if sum(need) > self.blocks:
            raise InputError(f"the request needs {sum(need)} blocks of {self.page} tokens, and the paged cache holds "
                             f"{self.blocks}: optimize with a larger OptimizeConfig(kv_cache_tokens=...) or generate "
                             "in smaller batches")
        table = torch.full((self.batch, self.pages_per_seq), self.scratch, dtype=torch.int32)
        at = 0
        for b, n in enumerate(need):
            table[b, :n] = torch.arange(at, at + n, dtype=torch.int32)
            at += n
        return table.to(device)

    # -- the loops' inputs (OptimizedLM) ----------------------------------------------------------

    def begin(self, input_ids: torch.Tensor, mask: torch.Tensor, rows: int, total: int) -> None:
        """A generate() of `total` positions a sequence (prompt with its pads + new tokens) for the
        first `rows` of the cache's rows (the rest repeat the last one and take no block)."""
        self.reset()
        count = mask.long().sum(-1)
        self.live = (torch.arange(self.batch, device=input_ids.device) < rows).int()
        new_tokens = total - input_ids.shape[1]
        self.table = self.allocate([int(c) + new_tokens if b < rows else 0 for b, c in enumerate(count.tolist())],
                                   input_ids.device)
        self.count = count

    def prefill_inputs(self, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        new = (mask.long().sum(-1) * self.live).int()      # int32, as the example's (one graph signature)
        self.lens = new
        return input_ids, prompt_positions(mask), torch.zeros_like(new), new, self.table

    def decode_inputs(self, token: torch.Tensor, i: int) -> tuple:
        lens = self.lens
        self.lens = lens + self.live
        return token[:, None], (self.count + i)[:, None], lens, self.live, self.table

    def shell_inputs(self, input_ids, attention_mask, position_ids, past_key_values) -> tuple:
        """A step HF's generate loop asks for: its mask (2D of the tokens so far, the 4D one it builds
        for a static-size cache, or None) says which of the T columns are real tokens."""
        from accelc.static_cache import key_padding

        T = input_ids.shape[1]
        keys = key_padding(attention_mask, input_ids, self.max_len, self.seen)
        new = (keys[:, self.seen:self.seen + T].long().sum(-1) * self.live).int()
        if position_ids is None:     # the model's own default: the padded index
            position_ids = (self.seen + torch.arange(T, device=input_ids.device)).expand_as(input_ids)
        lens = self.lens if self.seen else torch.zeros_like(new)
        self.lens = lens + new
        self.seen += T
        return input_ids, position_ids, lens, new, self.table

    def race_inputs(self, input_ids, position_ids, lens, new, block_table) -> tuple[tuple, str]:
        """(inputs, what they are) the guard's speed race times each layer on: the decode step after
        this prompt, one token a sequence."""
        return ((input_ids[:, -1:].clone(), position_ids[:, -1:] + 1, (lens + new).clone(), torch.ones_like(new),
                 block_table.clone()), "a decode step's inputs (one token a sequence)")

    def reset(self) -> None:
        self.seen = 0
        self.lens = None
        self.table = self.example_table

    def describe(self) -> str:
        mib = kv_bytes(self.cache) / 2**20
        return (f"paged KV cache of {self.blocks} blocks of {self.page} tokens ({mib:.1f} MiB, "
                f"{len(self.cache.layers)} layers; a sequence takes the blocks of its prompt and new tokens, up to "
                f"{self.max_len} positions; a batch of up to {self.batch} sequences)")
