"""Text generation with an optimized causal LM (an HF transformers model that can generate).

accelc.optimize(lm, inputs) of a causal LM returns an OptimizedLM: called, it is the optimized
model as any other (logits for every token); its generate() runs HF's own generation loop (greedy,
sampling, logits processors, stopping criteria, streamers: the same arguments, the same tokens) with
every forward step served by one optimized program over a static KV cache:
  - the cache: HF's StaticCache (accelc.static_cache), owned by the OptimizedLM, allocated once for max_batch_size
    sequences of max_cache_len tokens (OptimizeConfig; by default the example's batch and the
    model's positions, at most 2048); or, with OptimizeConfig(kv_cache="paged"), accelc's paged
    cache (accelc.paged_cache: blocks taken per sequence, attention reading no padding), whose step
    takes (input_ids, position_ids, lens, new, block_table) instead, through the same loops;
  - the step: (input_ids (B, T), key padding mask (B, max_cache_len), position_ids (B, T), start
    ()) -> the last position's logits (B, vocab), writing the T tokens' keys and values at cache
    slots start .. start + T - 1; prefill (T = the prompt) and decode (T = 1) are the same
    program, T varying. position_ids are what HF's generate passes (from the attention mask, for
    models that take them so: GPT-2), else the model's own default, start .. start + T - 1.
Greedy decoding with nothing else asked (stop tokens, min_new_tokens, max_new_tokens / max_length,
pad_token_id) runs accelc's own loop over the step program instead of HF's: the same tokens, with
no host sync per token; the stop condition is read every STOP_CHECK_EVERY tokens, the tokens past
the stop cut off. Anything else (sampling, logits processors, streamers, stopping criteria, scores
asked back) runs HF's loop over the step program.
A generate() the step cannot serve (beam search, hidden states or attentions asked back, a cache of
the caller's) runs the original model's generate, with the reason as a warning; a request of more
sequences than the cache holds has the step optimized again for them (its cost in a warning, as HF's
static cache grows); prompt + new tokens past max_cache_len raise InputError in one line. One generate()
at a time runs over the cache: calls from several threads take turns.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
import types
import warnings
import weakref

import torch
from torch import nn

from accelc import runtime
from accelc.errors import InputError
from accelc.kernels import greedy
from accelc.kernels.argmax import argmax_rows
from accelc.step_module import CACHE_KEYWORDS, StepModule, cache_keyword, given_cache, output_cache_field
from accelc.step_summary import step_lines
from accelc.optimized import OptimizedModule

log = logging.getLogger("accelc")

DEFAULT_MAX_CACHE = 2048
CACHE_TENSORS = ("cumulative_length", "kv", "keys", "values")   # a cache layer's tensors the step graph holds
DEFAULT_NEW_TOKENS = 20   # HF's generate: new tokens when neither max_new_tokens nor max_length is set
STOP_CHECK_EVERY = 16     # accelc's greedy loop reads its stop condition (a host sync) every this many tokens
# generate() arguments accelc's greedy loop serves; any other sends the call to HF's loop
_GREEDY_ARGS = {"max_new_tokens", "min_new_tokens", "max_length", "min_length", "do_sample", "eos_token_id",
                "pad_token_id", "use_cache", "num_beams"}
# generation-config fields that make HF's loop do more than argmax (their defaults: nothing more)
_GREEDY_FIELDS = {"do_sample": False, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
                  "no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "suppress_tokens": None,
                  "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                  "exponential_decay_length_penalty": None, "sequence_bias": None, "guidance_scale": None,
                  "renormalize_logits": False, "return_dict_in_generate": False, "output_scores": False,
                  "output_logits": False, "watermarking_config": None, "stop_strings": None, "max_time": None}
# generate() settings the step program serves as HF's generate does (the rest fall back, said)
# (return_dict_in_generate with output_logits / output_scores: HF's loop over the step program records them)
_UNSUPPORTED = {"num_beams": 1, "num_beam_groups": 1, "output_attentions": False, "output_hidden_states": False,
                "penalty_alpha": None, "assistant_model": None, "prompt_lookup_num_tokens": None}


def is_causal_lm(model: nn.Module) -> bool:
    """An HF transformers model that generates text with a decoder only (GPT-2, Llama, Qwen2, ...)."""
    config = getattr(model, "config", None)
    can = getattr(model, "can_generate", None)
    return (config is not None and callable(can) and _safe(can) and not getattr(config, "is_encoder_decoder", False)
            and hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None)


def _safe(fn) -> bool:
    try:
        return bool(fn())
    except Exception:
        return False


def make_step(lm: nn.Module, args: tuple, kwargs: dict, config) -> tuple[nn.Module, tuple]:
    """The step module of `lm` (a CacheStep, or a paged_cache.PagedStep with kv_cache="paged")
    sized by `config` (max_cache_len, max_batch_size, kv_page_size, kv_cache_tokens) and its example
    inputs (from the prompt of the example call: input_ids, attention_mask)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InputError("the example holds no input_ids (batch x length) to size the cache with")
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    positions = getattr(lm.config.get_text_config(), "max_position_embeddings", None) or DEFAULT_MAX_CACHE
    max_len = config.max_cache_len or min(positions, DEFAULT_MAX_CACHE)
    if max_len <= ids.shape[1]:
        raise InputError(f"max_cache_len {max_len} holds no token beyond the example's {ids.shape[1]}")
    batch = config.max_batch_size or ids.shape[0]
    n_example = ids.shape[0]
    reps = -(-batch // ids.shape[0])
    ids, mask = ids.repeat(reps, 1)[:batch], mask.repeat(reps, 1)[:batch]
    if config.kv_cache == "paged":
        from accelc.paged_cache import PagedStep

        step = PagedStep(lm, ids[:batch], mask[:batch], max_len, config.kv_page_size, config.kv_cache_tokens,
                         distinct=min(batch, n_example))
        return step, step.example_inputs
    # here, not at the module's top: the static cache subclasses HF's, and `import accelc` must not need
    # transformers (not a dependency: timm's and users' own models run without it)
    from accelc.static_cache import CacheStep, padded, prompt_positions

    step = CacheStep(lm, ids, mask, max_len)
    positions = prompt_positions(mask)
    return step, (ids, padded(mask, max_len), positions, torch.zeros((), dtype=torch.long, device=ids.device))


@dataclasses.dataclass
class GenerationParts:
    """What an OptimizedLM generates with besides its step program: the cache step (accelc.step_module), the
    model generate() falls back to, and how a larger cache's step is made. Not submodules: the cache step
    holds the model, whose weights the step program shares."""
    original: nn.Module | None = None
    cache_step: StepModule | None = None
    build_step: object = None      # (model, args, kwargs, config) -> (step program, cache step): api.build_step


@dataclasses.dataclass
class GreedyPicks:
    """What greedy decoding keeps from step to step: the tokens picked (out), the rows finished, whether every
    row had finished at each step (all_done), the stop tokens and pad, and the stop tokens' ban until
    min_new tokens."""
    out: torch.Tensor
    finished: torch.Tensor
    all_done: torch.Tensor
    eos: torch.Tensor | None
    pad: int
    min_new: int
    banned: torch.Tensor | None = None

    @classmethod
    def start(cls, gen, input_ids, new: int) -> GreedyPicks:
        batch, n = input_ids.shape
        device = input_ids.device
        eos = gen.eos_token_id
        eos = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), device=device)
        pad = gen.pad_token_id if gen.pad_token_id is not None else (int(eos[0]) if eos is not None else 0)
        return cls(out=torch.empty(batch, new, dtype=torch.long, device=device),
                   finished=torch.zeros(batch, dtype=torch.bool, device=device),
                   all_done=torch.zeros(new, dtype=torch.bool, device=device), eos=eos, pad=pad,
                   min_new=max(gen.min_new_tokens or 0, (gen.min_length or 0) - n))

    def pick(self, logits, i: int) -> torch.Tensor:
        """Token i of each row: the argmax of its logits (the stop tokens banned before min_new), recorded."""
        if self.banned is None and self.eos is not None:
            # the stop tokens banned until min_new_tokens, as HF's processor bans them: the vocabulary's
            # entries among them (a stop id past the vocabulary, which a config may name, is never produced;
            # indexing the scores with it was a device-side assert on a GPU)
            self.banned = torch.isin(torch.arange(logits.shape[-1], device=logits.device), self.eos)
        # argmax of the logits as they are: widening to fp32 changes no value or order (the first of tied
        # maxima either way), and the copy cost a kernel a token; accelc's own argmax (kernels/argmax.py:
        # torch's reduced a 128k vocabulary in 28 us a token)
        scores = logits
        if self.banned is not None and i < self.min_new:
            scores = scores.masked_fill(self.banned, float("-inf"))
        token = argmax_rows(scores)
        greedy.pick(token, self.finished, self.eos, self.pad, self.out, self.all_done, i)   # one kernel for six
        return token

    def stopped(self, i: int) -> bool:
        """Whether every row had stopped by token i, read (a host sync) every STOP_CHECK_EVERY tokens only."""
        return self.eos is not None and (i + 1) % STOP_CHECK_EVERY == 0 and bool(self.all_done[i])

    def length(self, new: int) -> int:
        """The tokens kept: up to the first step where every row had stopped, else all `new`."""
        done = self.all_done.nonzero()
        return int(done[0, 0]) + 1 if done.numel() else new


class OptimizedLM(OptimizedModule):
    """An OptimizedModule of a causal LM that also generates (see the module docstring). `step`:
    the optimized step program (an OptimizedModule; its summary is in this one's), None where there
    is none (generate() then runs the original model, and says why); `original`: the model generate()
    falls back to (the same weights, not a copy); `cache_step`: the step module over the cache."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step = None
        self.parts = GenerationParts()
        self.cache_tensors: list = []     # (cache layer, its attribute, the step graph's buffer holding it)

    @property
    def original(self) -> nn.Module | None:
        return self.parts.original

    @property
    def cache_step(self) -> StepModule | None:
        return self.parts.cache_step

    def attach_generation(self, step: OptimizedModule, cache: StepModule, original: nn.Module,
                          build_step=None) -> None:
        """build_step(model, args, kwargs, config) -> (step program, cache step): how a larger cache's
        step is made (accelc.api.build_step)."""
        self.step = step
        self.parts = GenerationParts(original, cache, build_step)
        # the cache's lengths, keys and values are the step graph's own tensors (it sets them each step;
        # HF's loop reads the lengths): which ones, so that a copy of the graph's tensors (.to(),
        # unpickling) is re-bound, and the tensors copied from are not kept alive by the cache
        named = {_where(t): name for name, t in step.graph_module.named_buffers()}
        held = [(i, attr, getattr(layer, attr, None)) for i, layer in enumerate(cache.cache.layers)
                for attr in CACHE_TENSORS]
        self.cache_tensors = [(i, attr, named[_where(t)]) for i, attr, t in held
                              if isinstance(t, torch.Tensor) and _where(t) in named]
        self.info.generation = (f"generation: {cache.describe()}; one step program for prefill and decode: "
                                f"{step.info.shapes or ''}; greedy decoding runs accelc's "
                                f"own loop (the stop condition read every {STOP_CHECK_EVERY} tokens, no host sync per "
                                "token), other decoding HF's loop over the step program"
                                + (f"; decode: {step.info.decode_step}" if step.info.decode_step else ""))

    def wait_for_other_shapes(self, timeout: float | None = None) -> bool:
        """OptimizedModule's, for the forward and the generation step (whose glue for other prompt lengths and
        batches compiles in the background too, writing copies of its cache)."""
        mine = super().wait_for_other_shapes(timeout)
        return (self.step is None or self.step.wait_for_other_shapes(timeout)) and mine

    def _rebind_cache(self) -> None:
        """Point the cache's tensors (its layers' and the cache step's buffers) at the step graph's
        tensors again (after they were copied)."""
        if self.step is None or self.cache_step is None:
            return
        buffers = dict(self.step.graph_module.named_buffers())
        held = self.cache_step._buffers
        for i, attr, name in self.cache_tensors:
            layer = self.cache_step.cache.layers[i]
            old, new = getattr(layer, attr), buffers[name]
            setattr(layer, attr, new)
            for key, t in held.items():
                if t is old:
                    held[key] = new
        for layer in self.cache_step.cache.layers:    # keys and values: views of a rebound kv
            getattr(layer, "bind_views", lambda: None)()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._rebind_cache()
        return out

    def __setstate__(self, state):
        if "parts" not in state:     # pickled before GenerationParts: its three attributes, by name
            state = dict(state, cache_tensors=state.get("cache_tensors", []), parts=GenerationParts(
                *(state.get(k) for k in ("original", "cache_step", "build_step"))))
            for k in ("original", "cache_step", "build_step"):
                state.pop(k, None)
        super().__setstate__(state)
        self._rebind_cache()

    def release_graphs(self) -> None:
        """The forward's CUDA graphs and the step program's dropped (OptimizedModule.release_graphs)."""
        if self.step is not None:
            self.step.release_graphs()
        super().release_graphs()

    def no_generation(self, original: nn.Module, why: str) -> None:
        self.step = None
        self.parts = GenerationParts(original)
        self.info.generation = f"generation: generate() runs the original model (no step program: {why})"
        warnings.warn(f"accelc: {self.info.generation}", stacklevel=4)

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        """HF's generate (same arguments, same output) with each forward step run by the step program."""
        if kwargs.get("inputs_embeds") is not None:     # (HF generates from embeddings; the step takes token ids)
            warnings.warn("accelc: generate() runs the original model (inputs_embeds: accelc's step program takes "
                          "token ids)", stacklevel=2)
            return self.original.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if input_ids is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InputError("generate() takes input_ids (batch x prompt length), as a tokenizer gives them")
        # HF's own default, said out loud
        kwargs = {k: v for k, v in kwargs.items() if not (k in CACHE_KEYWORDS and v is None)}
        gen = copy.deepcopy(kwargs.get("generation_config") or self.original.generation_config)
        gen.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
        why = self._fallback_reason(gen, kwargs)
        if why:
            warnings.warn(f"accelc: generate() runs the original model ({why})", stacklevel=2)
            return self.original.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        b, n = input_ids.shape
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        total = self._length(gen, n)
        if total > self.cache_step.max_len:
            raise InputError(f"prompt {n} + {total - n} new tokens = {total} positions, past the "
                             f"{self.cache_step.max_len} the optimized LM's cache holds: optimize with "
                             "OptimizeConfig(max_cache_len=...) or ask for fewer tokens")
        # one generate at a time over the one cache (two threads' steps interleaved wrote each other's keys)
        with runtime.EXPORTS.call(), _lock_of(self):
            if b > self.cache_step.batch:
                self._grow(input_ids, mask)
            cache = self.cache_step
            greedy = self._greedy_alone(gen, kwargs) and total > n
            self.last_loop = "accelc" if greedy else "hf"
            # the cache's rows beyond the request repeat its last one; HF's loop sees the request's rows
            # alone (its sampling draws for them as it would without accelc) and its steps are padded
            padded_ids, padded_mask = _rows_to(input_ids, cache.batch), _rows_to(mask, cache.batch)
            cache.begin(padded_ids, padded_mask, b, total)
            try:
                with torch.no_grad():
                    if greedy:
                        return self._greedy(padded_ids, padded_mask, gen, total - n)[:b]
                    return self._shell().generate(input_ids=input_ids, attention_mask=mask,
                                                  **{cache_keyword(self.original): cache.cache}, **kwargs)
            finally:
                cache.reset()

    def _grow(self, input_ids, mask) -> None:
        """A request of more sequences than the cache holds: the step program optimized again for them
        (HF's static cache grows likewise), its cost said once."""
        b, old = input_ids.shape[0], self.cache_step.batch
        t0 = time.perf_counter()
        config = dataclasses.replace(self.config, max_batch_size=b, max_cache_len=self.cache_step.max_len)
        program, step = self.parts.build_step(self.original, (), {"input_ids": input_ids, "attention_mask": mask}, config)
        self.attach_generation(program, step, self.original, self.parts.build_step)
        self.config = config
        warnings.warn(f"accelc: generate() of {b} sequences, past the {old} the cache held: the step program was "
                      f"optimized again for {b} ({time.perf_counter() - t0:.1f} s); optimize with "
                      f"OptimizeConfig(max_batch_size={b}) to do this once, at optimize", stacklevel=3)

    def _length(self, gen, n: int) -> int:
        """The positions a sequence ends at, as HF's generate decides: the prompt and max_new_tokens, else
        max_length, else HF's default of DEFAULT_NEW_TOKENS new tokens within the model's positions."""
        if gen.max_new_tokens is not None:
            return n + gen.max_new_tokens
        if gen.max_length is not None:
            return gen.max_length
        positions = getattr(self.original.config.get_text_config(), "max_position_embeddings", None)
        return min(n + DEFAULT_NEW_TOKENS, positions) if positions else n + DEFAULT_NEW_TOKENS

    @staticmethod
    def _greedy_alone(gen, kwargs) -> bool:
        """Whether the request is greedy decoding and nothing else accelc's loop does not do."""
        if set(kwargs) - _GREEDY_ARGS - {"generation_config"} or (kwargs.get("num_beams") or 1) != 1:
            return False
        return all(getattr(gen, k, v) in (v, None) if v is not None else getattr(gen, k, None) is None
                   for k, v in _GREEDY_FIELDS.items())

    def _greedy(self, input_ids, mask, gen, new: int) -> torch.Tensor:
        """HF's greedy decoding over the step program, without HF's loop (gpt-fast's steps: prefill,
        decode one token, decode n tokens): argmax of each step's logits fed back on the device; stop
        tokens end a row (pad after it, as HF pads), the stop condition read every STOP_CHECK_EVERY
        tokens and the tokens past it cut off."""
        picks = GreedyPicks.start(gen, input_ids, new)
        length = self._decode_n(self._prefill(input_ids, mask), picks, new)
        return torch.cat([input_ids, picks.out[:, :length]], dim=1)

    def _prefill(self, input_ids, mask) -> torch.Tensor:
        """The prompt's keys and values into the cache: the logits of its last position, a row each."""
        return self.step(*self.cache_step.prefill_inputs(input_ids, mask))

    @staticmethod
    def _decode_one(step, cache: StepModule, token, i: int) -> torch.Tensor:
        """Token i of each row into the cache: the logits that pick the next one."""
        return step(*cache.decode_inputs(token, i))

    def _decode_n(self, logits, picks: GreedyPicks, new: int) -> int:
        """Up to `new` tokens picked from the prefill's logits on: how many were kept (up to the step
        where every row stopped, read every STOP_CHECK_EVERY tokens)."""
        step, cache = self.step, self.cache_step     # (once: a submodule's lookup is host time every token)
        for i in range(new):
            token = picks.pick(logits, i)
            if i == new - 1 or picks.stopped(i):
                break
            logits = self._decode_one(step, cache, token, i)
        return picks.length(new)

    def _fallback_reason(self, gen, kwargs) -> str:
        for key, default in _UNSUPPORTED.items():
            value = kwargs.get(key, getattr(gen, key, default))
            if value is not None and value != default:
                return f"{key}={value!r} is not served by accelc's static-cache step yet"
        if given_cache(kwargs) is not None:
            return "a cache of the caller's was given"
        if self.step is None:
            return self.info.generation.removeprefix("generation: generate() runs the original model ")
        return ""

    def _shell(self) -> nn.Module:
        """The original model with its forward replaced by the step program: what HF's generate calls."""
        shell = copy.copy(self.original)
        step = self.step

        def forward(model, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            from transformers.modeling_outputs import CausalLMOutputWithPast

            cache, rows, kv = self.cache_step, input_ids.shape[0], given_cache(kwargs)   # (by either name)
            padded = (_rows_to(v, cache.batch, rows) for v in (input_ids, attention_mask, position_ids))
            logits = step(*cache.shell_inputs(*padded, kv))[:rows]
            return CausalLMOutputWithPast(logits=logits[:, None, :], **{output_cache_field(): kv})
        shell.forward = types.MethodType(forward, shell)
        # HF's loop compiles the forward itself over a static cache on a GPU (torch.compile, CUDA
        # graphs): the step program already is compiled and replayed, and Dynamo would trace through
        # accelc's runner (decode steps bypassing its graphs)
        shell._valid_auto_compile_criteria = lambda *args, **kwargs: False
        return shell

    def measure(self, input_ids, attention_mask, new: int = 32) -> tuple[float, float]:
        """(ms to the first token, decode tokens/s a sequence) of greedy generate() on this prompt:
        one generate of 1 token and one of `new` to warm up (each count's first call may capture or
        compile), then the same two timed twice with the device synchronised, the faster of each kept (a
        stall of the host in one run, another process taking the CPU, does not make the rate). optimize
        measures it on a GPU for the summary. ValueError where the `new` tokens took no longer than the
        first (no rate to tell)."""
        sync = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, do_sample=False)
        times = []
        for count in (1, new, 1, new, 1, new):
            sync()
            t0 = time.perf_counter()
            self.generate(**kwargs, max_new_tokens=count, min_new_tokens=count)
            sync()
            times.append(time.perf_counter() - t0)
        first, total = min(times[2::2]), min(times[3::2])
        if total <= first:
            raise ValueError(f"{new} tokens took {total * 1e3:.1f} ms, the first alone {first * 1e3:.1f} ms")
        return first * 1e3, (new - 1) / (total - first)

    def note_speed(self, input_ids, attention_mask) -> None:
        """The summary's generation line gets greedy decoding's speed on the example prompt (measured
        where the device can be timed: a GPU)."""
        room = self.cache_step.max_len - input_ids.shape[1]
        new = min(33, room)
        if new < 2:
            return
        try:
            ttft, rate = self.measure(input_ids, attention_mask, new)
        except Exception as e:   # a measurement, not a verdict: generate()'s own failure shows at the user's call
            self.info.generation += f"; not timed at optimize ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
            return
        # a prompt's glue held for the background compile (regions.Glue.hold_later) ran uncompiled: no first token
        first = ("first token not timed (the prompt's glue compiles in the background after optimize)"
                 if self.step is not None and self.step.other_shapes_deferred() else f"first token {ttft:.1f} ms")
        self.info.generation += (f"; measured at optimize on the example prompt ({input_ids.shape[0]} x "
                                 f"{input_ids.shape[1]}, greedy): {first}, decode {rate:.1f} tokens/s a sequence")

    def summary(self) -> str:
        text = super().summary()
        step = self.step
        if step is None:
            return text
        return text + f"\n{self.info.generation}\n" + "\n".join(step_lines(self.layers, step))


def loop_ahead(logits, model: nn.Module, kv_cache: str) -> None:
    """The greedy loop's kernels at a generation's sizes (`logits`: the step's output at capture, the model's stop
    tokens) handed to the compile workers before the step's optimize (kernels/greedy.py loop_ahead), so that the
    speed optimize measures at its end finds them compiled."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(logits, torch.Tensor):
        greedy.loop_ahead(logits, 0 if eos is None else 1 if isinstance(eos, int) else len(eos),
                          static=kv_cache != "paged")


def _where(t: torch.Tensor) -> tuple:
    """A tensor's memory and shape: the step graph holds the cache's tensors as constants of its own
    (other tensor objects over the same memory)."""
    return t.device, t.data_ptr(), tuple(t.shape), t.dtype


def _rows_to(v, batch: int, rows: int | None = None):
    """v (a tensor of `rows` rows, a dict of them, or None) with its last row repeated up to `batch`
    rows: a request's inputs as the cache's rows take them."""
    if isinstance(v, dict):
        return {k: _rows_to(x, batch, rows) for k, x in v.items()}
    if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] >= batch or (rows is not None and v.shape[0] != rows):
        return v
    return torch.cat([v, v[-1:].expand(batch - v.shape[0], *v.shape[1:])])


_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _lock_of(lm: nn.Module) -> threading.Lock:
    """The lock of an OptimizedLM's generate() (kept beside it: a lock neither pickles nor deep-copies)."""
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(lm, threading.Lock())
