"""What a generation step over a KV cache declares: the contract between optimize, the step program and
OptimizedLM's loops (accelc.generation), met by accelc.static_cache.CacheStep and accelc.paged_cache.PagedStep.

A step module is one forward step of a causal LM over its cache: `forward(*inputs)` -> the last position's
logits, writing the inputs' keys and values into the cache. optimize captures it as a program as any model;
what it reads from the module is declared here, not found by attribute lookups:
  - `replayable_state`: its in-place cache writes set rather than accumulate (runner.REPLAYABLE_STATE);
  - `race_inputs(*inputs)`: the call the program serves most (a decode step), which the guard's speed race
    times layers on.
The loops (OptimizedLM.generate and its greedy loop) call, in the order gpt-fast names its steps:
  - `begin(ids, mask, rows, total)`: a generate() of `total` positions for the first `rows` sequences;
  - `prefill_inputs(ids, mask)`: the step's inputs for the prompt (the prefill);
  - `decode_inputs(token, i)`: the step's inputs for the i-th new token (decode one token; the greedy loop
    calls it n times: decode n tokens);
  - `shell_inputs(...)`: the step's inputs for a forward call of HF's own loop;
and read `max_len` (positions a sequence holds), `batch` (sequences), `cache` (the HF Cache whose layers hold
the keys and values), `describe()` (the cache in words) and `reset()` (positions from 0 again).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from torch import nn

# the names a causal LM's forward takes its KV cache by: `cache` from transformers 5.24 (`past_key_values` kept as a
# deprecated alias, said in a warning at every call), `past_key_values` before it and in models of their own code
CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_keyword(model: nn.Module) -> str:
    """The keyword `model`'s forward takes its KV cache by (CACHE_KEYWORDS): `cache` where it declares one."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


@functools.cache
def output_cache_field() -> str:
    """The field of HF's CausalLMOutputWithPast that holds the cache: `cache` from transformers 5.24 (its
    `past_key_values` a deprecated alias), `past_key_values` before."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def given_cache(kwargs: dict):
    """The KV cache in a call's keywords under either name (CACHE_KEYWORDS), None where none is given."""
    return next((kwargs[k] for k in CACHE_KEYWORDS if kwargs.get(k) is not None), None)


class StepModule(nn.Module):
    """The base of a generation step module (see the module docstring); each method says what it returns."""

    replayable_state = True
    max_len: int
    batch: int

    def race_inputs(self, *inputs) -> tuple[tuple, str]:
        """(inputs, what they are in words): the call the guard's speed race times each layer on."""
        raise NotImplementedError

    def reset(self) -> None:
        """Positions start at 0 again."""
        raise NotImplementedError

    def describe(self) -> str:
        """The cache in words (the summary's generation line)."""
        raise NotImplementedError

    def begin(self, input_ids: torch.Tensor, mask: torch.Tensor, rows: int, total: int) -> None:
        """A generate() of `total` positions a sequence for the first `rows` of the cache's rows."""
        raise NotImplementedError

    def prefill_inputs(self, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        """The step's inputs for the prompt, and the greedy loop's state for decode_inputs."""
        raise NotImplementedError

    def decode_inputs(self, token: torch.Tensor, i: int) -> tuple:
        """The step's inputs for the i-th new token (0: the first after the prompt)."""
        raise NotImplementedError

    def shell_inputs(self, input_ids, attention_mask, position_ids, cache) -> tuple:
        """The step's inputs for a forward call of HF's generate loop."""
        raise NotImplementedError
