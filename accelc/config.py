"""OptimizeConfig: what accelc.optimize does, validated once when it is made."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from accelc.numerics import REL_L2_FLOOR

# Names accepted for `dtype`, as the CLI and configs spell them.
DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}

GLUES = ("auto", "inductor", "eager")

# The passes, in the order the pipeline runs them (accelc/pipeline.py holds the passes themselves
# and checks that their names are these): data here, so that a config needs no pass or kernel.
PASS_NAMES = ("fold_weights", "fold_bn", "conv_gemm", "rotary", "attention", "gated_mlp", "sibling_linears",
              "linear_act", "norms", "int8", "norm_linear", "qkv_rotary")

# Guard floor: largest relative L2 error (||out - ref|| / ||ref||, ref in higher precision) a
# rewritten layer may have whatever eager's own error is: numerics.REL_L2_FLOOR for half
# precisions. fp32 "ieee" accumulates in fp32 like eager, in another order over reductions of
# thousands (1e-4); "tf32" rounds operands to 10 mantissa bits, about fp16's error.
DEFAULT_TOLERANCES = {
    torch.float32: 1e-4,
    "tf32": REL_L2_FLOOR[torch.float16],
    torch.float16: REL_L2_FLOOR[torch.float16],
    torch.bfloat16: REL_L2_FLOOR[torch.bfloat16],
}


def _layer_choice(cfg) -> None:
    """An Int8Config's or Fp8Config's layer patterns as tuples (a string: one pattern), its floor, rows and output
    error budget checked."""
    for name in ("layers", "exclude", "types"):
        v = getattr(cfg, name)
        if isinstance(v, str):
            object.__setattr__(cfg, name, (v,))
        elif v is not None:
            object.__setattr__(cfg, name, tuple(v))
    if not cfg.sqnr_floor > 0:
        raise ValueError(f"sqnr_floor must be > 0 dB, not {cfg.sqnr_floor}")
    if cfg.min_rows < 0:
        raise ValueError(f"min_rows must be >= 0, not {cfg.min_rows}")
    if cfg.output_error is not None and not cfg.output_error >= 1:
        raise ValueError(f"output_error is a multiple of eager's own error (>= 1), not {cfg.output_error}")


@dataclass(frozen=True)
class Int8Config:
    """int8 (W8A8) rewriting, opt-in through OptimizeConfig(int8=True or Int8Config(...)).

    Linear layers the float pass rewrote become accelc::linear_w8a8: weights quantized once,
    per output channel; activations per token, dynamically at run time (or with one static
    scale per layer from calibration). Attention's q @ k^T can run in int8 too (`attention`).

    layers / exclude: fnmatch patterns on layer names or module paths ("blocks.*.fc1");
                    a layer is taken when it matches one of `layers` (None: every layer) and
                    none of `exclude`.
    types:          module class names to take ("Linear"; "functional" for F.linear / matmul
                    written in a forward); None: any.
    skip_first_last: leave the model's first and last linear layers in float (they see the raw
                    input and produce the output, where quantization error shows most).
    static:         one activation scale per layer from the calibration batches instead of a
                    per-token scale computed at run time (values past it saturate).
    smoothing:      SmoothQuant's migration strength alpha in (0, 1] (0.5 in the paper), or None:
                    per-input-channel factors from calibration data move activation outliers
                    into the weights.
    attention:      q and k quantized per token to int8 for q @ k^T in the flash kernel
                    (softmax and p @ v stay fp16 / bf16). Not a speed option: the kernel
                    quantizes each K block in every program and runs at about 0.5x-0.65x the
                    fp16 kernel on an H100, so with only_if_faster the guard puts every such
                    layer back in fp16.
    sqnr_floor:     the guard's floor in dB (int8 vs the float layer); a layer below it is put
                    back in float and reported.
    min_rows:       below this many rows (tokens) in the example inputs a linear layer stays in
                    float.
    weights_only:   int8 weights (per output channel) with activations left in the model's dtype
                    (accelc::linear_w8a16, and gated MLPs' gate / up pair as accelc::gated_linear_w8a16):
                    no activation quantization, so the error is the weights' alone and every linear
                    and gated layer qualifies; what pays in decoding, where a step reads each weight
                    once for a few rows (a generation step's race is timed on a decode step). static,
                    smoothing and attention are W8A8 options and cannot be combined with it.
    only_if_faster: on a GPU, time each int8 layer against its float kernel on the example
                    inputs and keep the faster (the summary says which and by how much): the int8
                    path pays an extra quantization kernel and wins only on large GEMMs
                    (about 0.5-1.1x eager at BERT-base widths, 1.1-1.3x at 4096-wide layers).
    output_error:   the whole output's error budget, a multiple of eager's own (each against the model run in
                    higher precision on the example inputs; 3.0: within three times eager's error), or None
                    (each layer's SQNR floor alone): past it, the quantized layers go back to float, the lowest
                    SQNR first, until the output is within it (each said in its note).
    """

    layers: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    types: tuple[str, ...] | None = None
    skip_first_last: bool = True
    static: bool = False
    smoothing: float | None = None
    attention: bool = False
    sqnr_floor: float = 20.0
    min_rows: int = 0
    weights_only: bool = False
    only_if_faster: bool = True
    output_error: float | None = None

    def __post_init__(self):
        _layer_choice(self)
        if self.smoothing is not None and not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing (SmoothQuant alpha) must be in (0, 1], not {self.smoothing}")
        w8a8 = [name for name in ("static", "attention") if getattr(self, name)]
        w8a8 += ["smoothing"] if self.smoothing is not None else []
        if self.weights_only and w8a8:
            raise ValueError(f"weights_only keeps the activations in float: {', '.join(w8a8)} (W8A8 options) "
                             "cannot be combined with it")


@dataclass(frozen=True)
class Fp8Config:
    """fp8 (e4m3) weights, opt-in through OptimizeConfig(fp8=True or Fp8Config(...)).

    Linear and gated layers the float passes rewrote become accelc::linear_fp8w / accelc::gated_linear_fp8w
    (kernels/fp8_weight.py): each weight quantized once to float8_e4m3fn with one scale per output channel,
    the activations left in the model's dtype. What pays in decoding, where a step reads each weight once for a
    few rows: half of fp16's bytes, as int8 weights (Int8Config(weights_only=True)), with e4m3's floating grid.

    layers / exclude / types / skip_first_last / min_rows: which layers, as Int8Config's.
    weights_only:   True: the weights alone (linear and gated layers). False: linear and gated layers on fp8
                    weights and activations (accelc::linear_fp8 / accelc::gated_linear_fp8, kernels/fp8_gemm.py:
                    each input row quantized to e4m3 at run time, one scale a row; the product on fp8 tensor
                    cores, twice fp16's rate on Hopper): what pays for prompts and whole models.
    sqnr_floor:     the guard's floor in dB (fp8 vs the float layer); a layer under it goes back to float, said.
    only_if_faster: on a GPU, each fp8 layer against its float kernel on the example inputs (a generation step's:
                    a decode step), the faster kept.
    attention:      the attention layers' two products on e4m3 operands too (accelc::flash_attention with fp8=True:
                    q, K, V quantized once before the kernel, p in it; fp16 / bf16, head dims in multiples of 32),
                    judged by SQNR and raced against the float kernel as the linear layers are.
    output_error:   the whole output's error budget, as Int8Config's: past it, fp8 layers back to float, the
                    lowest SQNR first.
    """

    layers: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    types: tuple[str, ...] | None = None
    skip_first_last: bool = True
    sqnr_floor: float = 20.0
    min_rows: int = 0
    weights_only: bool = True
    only_if_faster: bool = True
    attention: bool = False
    output_error: float | None = None

    def __post_init__(self):
        _layer_choice(self)


KV_CACHES = ("static", "paged")
OTHER_SHAPES = ("now", "background")


@dataclass(frozen=True)
class OptimizeConfig:
    """How accelc.optimize rewrites a model.

    dtype:          run the model in this dtype (fp32 / fp16 / bf16, or a torch.dtype); None
                    keeps the model's own. The caller's model is never converted in place.
    passes:         which rewrites run, in pipeline order (accelc.pipeline.PASSES names).
    fp32_precision: "ieee" (true fp32 products, as PyTorch's default) or "tf32" (tensor cores,
                    ~2x faster on fp32 models, ~1e-3 relative error).
    guard:          check every rewritten layer on the example inputs and revert those over
                    tolerance. Leave on; off is for debugging the guard itself.
    tolerance:      overrides the guard's relative-L2 floor for the model's dtype.
    eager_error_factor: a layer also passes when its error is at most this many times eager
                    PyTorch's own error in the same dtype (both against the higher-precision
                    reference).
    int8:           False (float only), True (int8 with Int8Config's defaults) or an Int8Config.
    fp8:            False, True (fp8 weights with Fp8Config's defaults) or an Fp8Config; not with int8.
    only_if_faster: on a GPU, time every rewritten layer against the original PyTorch layer on the
                    example inputs (the guard, after the numbers check) and keep it only where it is
                    faster; the summary gives both times for the layers put back. Its default
                    comes from ACCELC_ONLY_IF_FASTER (unset or 1: on; 0: off, for tests and fuzzing
                    on a GPU, where tiny layers would stay PyTorch).
    glue:           how what accelc did not rewrite runs: "inductor" (compiled by torch.compile's
                    Inductor, accelc's kernels opaque inside), "eager", or "auto" (Inductor on a CUDA
                    device, eager elsewhere).
    cuda_graphs:    on a CUDA device, capture the model in a CUDA graph per input signature and
                    replay it (accelc.runner); off: plain calls.
    dynamic:        which input shapes the optimized model takes. True (the default): every dim
                    may vary (batch, sequence) up to the model's own limits, fixed only where the
                    model pins it; False: the example's shapes only; {input name: {dim: (lo, hi)}}
                    (hi None: no limit): these dims vary over these ranges, as TensorRT's
                    optimization profiles declare them, and every other dim is the example's. The
                    summary says which dims vary and why one is fixed.
    padding:        with CUDA graphs and dims that vary: a call's batch and length are padded up to
                    bucket sizes (1, 2, 4, 8, 12, 16, 24, 32, ...) so that a few graphs serve every
                    size, where the guard finds the pad inert (accelc.buckets); "auto": the same,
                    and a call large enough to be GPU-bound runs at its own size instead, a plain
                    call, where its bucket graph's measured times say the padding costs more than
                    launching its kernels one by one (accelc.runner.exact_pays). Measured (H100,
                    bench/dynamic.py): 4% off a Llama-1.1B shape's requests of 8k+ tokens, 4% more
                    on BERT's and GPT-2's (their plain calls' dynamic glue costs what the padding
                    did), and a plain call at a size unlike those met before may compile kernels
                    for it (2.5 s, once in a 300-request trace), which a bucket's graph never does
                    after its capture. False: a graph per exact size, captured at its second call.
    max_cache_len, max_batch_size: a causal LM's generate() (accelc.generation): the static KV
                    cache's tokens per sequence (default: the model's positions, at most 2048) and
                    sequences (default: the example's batch).
    kv_cache:       a causal LM's KV cache for generate(): "static" (HF's StaticCache: every sequence
                    holds max_cache_len slots, a left-padded batch attends over its pads masked) or
                    "paged" (accelc.paged_cache: blocks of kv_page_size tokens, a sequence takes those
                    its prompt and new tokens need, attention reads no padding).
    kv_page_size:   tokens a block of the paged cache (a power of two).
    kv_cache_tokens: the paged cache's pool in tokens, shared by the sequences of a request
                    (default: max_batch_size x max_cache_len, what the static cache holds).
    decode_step:    a Llama-like generation step's decode of one token: "auto" (one persistent
                    kernel, accelc::decode_step, where it gives the chain of kernels' step and is
                    faster on the GPU: raced at optimize, said in the summary), "persistent" (kept
                    wherever it gives the chain's step, not raced) or "chain" (five kernels a layer).
    warmup_shapes:  shapes whose CUDA graphs are captured at optimize time rather than at their
                    first call: a list of {input name: shape} (the other inputs follow, as the
                    mask follows the ids), or "buckets" (every bucket of the padded dims' ranges,
                    each range with an upper end). The time it takes is in the summary.
    other_shapes:   when the glue that serves shapes other than the example's (Inductor's dynamic
                    compile, and its batch-of-one variant) is compiled: "background" (the default: in a thread of
                    its own after optimize returns, optimize 6-15 s sooner on an H200: until it is done, a call
                    at another shape runs its glue uncompiled, slower (BERT's: up to ~0.2 s), no compile waited
                    for, and every call shares the host's Python with that thread, the interpreter's switch
                    interval lowered meanwhile so that a call's ops do not queue behind it;
                    OptimizedModule.wait_for_other_shapes() waits for it, as accelc.save, a conversion
                    (.to(), .half()) and the report do) or "now" (inside optimize, so that no request waits for
                    a compile). A causal LM's generation step's compiles on copies of its cache (a glue cut
                    into regions; else, or where the copies would take more than half the free memory, now),
                    started once its forward's optimize is done; not for a tensor-parallel program or with
                    warmup_shapes (compiled now). Its default comes from ACCELC_OTHER_SHAPES (unset:
                    "background").
    """

    dtype: torch.dtype | str | None = None
    passes: tuple[str, ...] = PASS_NAMES
    fp32_precision: str = "ieee"
    guard: bool = True
    tolerance: float | None = None
    eager_error_factor: float = 2.0
    int8: bool | Int8Config = False
    fp8: bool | Fp8Config = False
    only_if_faster: bool = field(default_factory=lambda: os.environ.get("ACCELC_ONLY_IF_FASTER", "1") != "0")
    glue: str = "auto"
    cuda_graphs: bool = True
    dynamic: bool | dict = True
    padding: bool | str = True
    warmup_shapes: tuple | str = ()
    max_cache_len: int | None = None
    max_batch_size: int | None = None
    kv_cache: str = "static"
    kv_page_size: int = 16
    kv_cache_tokens: int | None = None
    decode_step: str = "auto"
    other_shapes: str = field(default_factory=lambda: os.environ.get("ACCELC_OTHER_SHAPES", "background"))

    def __post_init__(self):
        if self.int8 is True:
            object.__setattr__(self, "int8", Int8Config())
        elif self.int8 is False or self.int8 is None:
            object.__setattr__(self, "int8", None)
        elif not isinstance(self.int8, Int8Config):
            raise TypeError(f"int8 must be a bool or an Int8Config, not {type(self.int8).__name__}")
        if self.fp8 is True:
            object.__setattr__(self, "fp8", Fp8Config())
        elif self.fp8 is False or self.fp8 is None:
            object.__setattr__(self, "fp8", None)
        elif not isinstance(self.fp8, Fp8Config):
            raise TypeError(f"fp8 must be a bool or an Fp8Config, not {type(self.fp8).__name__}")
        if self.int8 is not None and self.fp8 is not None:
            raise ValueError("int8 and fp8 are both set: a layer's weights take one format; choose one")
        if isinstance(self.dtype, str):
            if self.dtype.lower() not in DTYPES:
                raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(set(DTYPES))}")
            object.__setattr__(self, "dtype", DTYPES[self.dtype.lower()])
        if self.dtype is not None and self.dtype not in DEFAULT_TOLERANCES:
            raise ValueError(f"dtype must be float32, float16 or bfloat16, not {self.dtype}")
        if isinstance(self.passes, str):
            object.__setattr__(self, "passes", (self.passes,))
        object.__setattr__(self, "passes", tuple(self.passes))
        unknown = [p for p in self.passes if p not in PASS_NAMES]
        if unknown:
            raise ValueError(f"unknown pass(es) {unknown}; known passes, in order: {list(PASS_NAMES)}")
        if self.fp32_precision not in ("ieee", "tf32"):
            raise ValueError(f"fp32_precision must be 'ieee' or 'tf32', not {self.fp32_precision!r}")
        if self.tolerance is not None and not self.tolerance > 0:
            raise ValueError(f"tolerance must be > 0, not {self.tolerance}")
        if self.padding not in (True, False, "auto"):
            raise ValueError(f'padding must be True, False or "auto", not {self.padding!r}')
        if self.glue not in GLUES:
            raise ValueError(f"glue must be one of {GLUES}, not {self.glue!r}")
        if not self.eager_error_factor >= 1:
            raise ValueError(f"eager_error_factor must be >= 1, not {self.eager_error_factor}")
        object.__setattr__(self, "dynamic", _dynamic(self.dynamic))
        object.__setattr__(self, "warmup_shapes", _warmup_shapes(self.warmup_shapes))
        for name in ("max_cache_len", "max_batch_size", "kv_cache_tokens"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")
        if self.other_shapes not in OTHER_SHAPES:
            raise ValueError(f"other_shapes must be one of {OTHER_SHAPES}, not {self.other_shapes!r}")
        if self.decode_step not in ("auto", "persistent", "chain"):
            raise ValueError(f"decode_step must be 'auto', 'persistent' or 'chain', not {self.decode_step!r}")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, not {self.kv_cache!r}")
        page = self.kv_page_size
        if not (isinstance(page, int) and not isinstance(page, bool) and page >= 1 and page & (page - 1) == 0):
            raise ValueError(f"kv_page_size must be a power of two, not {page!r}")

    @property
    def quantized(self) -> "Int8Config | Fp8Config | None":
        """The quantization asked for (the Int8Config or the Fp8Config), None for float only."""
        return self.int8 if self.int8 is not None else self.fp8

    def tolerance_for(self, dtype: torch.dtype) -> float:
        """The guard's relative-L2 floor for a layer computing in `dtype`."""
        if self.tolerance is not None:
            return self.tolerance
        if dtype == torch.float32 and self.fp32_precision == "tf32":
            return DEFAULT_TOLERANCES["tf32"]
        return DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])


def _dynamic(value):
    """OptimizeConfig.dynamic checked: True, False, or {input name: {dim: (lo, hi)}} with ints, 1 <= lo,
    lo <= hi (hi None: no limit); ValueError naming what is wrong."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"dynamic must be True, False or {{input name: {{dim: (lo, hi)}}}}, not {value!r}")
    out = {}
    for name, dims in value.items():
        if not isinstance(name, str) or not isinstance(dims, dict):
            raise ValueError(f"dynamic[{name!r}] must map dims to (lo, hi) ranges, as {{0: (1, 64)}}; got {dims!r}")
        out[name] = {}
        for d, rng in dims.items():
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise ValueError(f"dynamic[{name!r}] names dim {d!r}: dims are counted from 0 (the batch), "
                                 "as in the input's shape")
            ok = (isinstance(rng, (tuple, list)) and len(rng) == 2
                  and isinstance(rng[0], int) and (rng[1] is None or isinstance(rng[1], int)))
            if not ok or rng[0] < 1 or (rng[1] is not None and rng[1] < rng[0]):
                raise ValueError(f"dynamic[{name!r}][{d!r}] must be a (lo, hi) range with 1 <= lo <= hi "
                                 f"(hi None for no limit); got {rng!r}")
            out[name][d] = (rng[0], rng[1])
    return out


def _warmup_shapes(value):
    """OptimizeConfig.warmup_shapes checked: "buckets", or a tuple of {input name: shape}."""
    if value == "buckets":
        return value
    if isinstance(value, dict):
        value = (value,)
    ok = isinstance(value, (tuple, list)) and all(
        isinstance(x, dict) and x and all(isinstance(k, str) and isinstance(v, (tuple, list, torch.Size))
                                          and all(isinstance(n, int) and n >= 1 for n in v) for k, v in x.items())
        for x in value)
    if not ok:
        raise ValueError('warmup_shapes must be "buckets" or a list of {input name: shape}, as '
                         f'[{{"input_ids": (8, 128)}}]; got {value!r}')
    return tuple({k: tuple(v) for k, v in x.items()} for x in value)


PRESETS = {
    "default": OptimizeConfig,
    "fp16": lambda: OptimizeConfig(dtype=torch.float16),
    "bf16": lambda: OptimizeConfig(dtype=torch.bfloat16),
    "fp32-tf32": lambda: OptimizeConfig(dtype=torch.float32, fp32_precision="tf32"),
    "int8": lambda: OptimizeConfig(dtype=torch.float16, int8=True),
}
