"""The Gluon kernels' partition arguments, one named aggregate a kernel (Triton's tutorials' @aggregate): what
a warp-specialized kernel's partitions share, built once in the kernel and passed to each partition.

Written to build with Triton 3.6 (the device's) and later: the fields' types are real classes (no postponed
annotations in this module: an aggregate checks each field's value against its annotation), the constructor
is positional and ours (Triton's earlier aggregates call the class's own), and a scalar argument may arrive
as a constant (Triton passes an integer argument equal to 1 as one).
"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.language.core import _aggregate as aggregate

SCALAR = gl.tensor | gl.constexpr     # an integer or pointer argument of the kernel


def positional_init(cls):
    """The aggregate's constructor: its fields, in the order the class declares them."""
    names = tuple(cls.__annotations__)

    def __init__(self, *values):
        if len(values) != len(names):
            raise TypeError(f"{cls.__name__} takes {len(names)} values, got {len(values)}")
        for name, value in zip(names, values):
            setattr(self, name, value)

    __init__.__triton_builtin__ = True     # (not kernel code: Triton's cache key does not follow it)
    cls.__init__ = __init__
    return cls


@aggregate
@positional_init
class WsArgs:
    """What linear_ws_kernel's partitions share: the TMA descriptors, the ring (allocate_ring), the epilogue's
    pointers, the sizes and the kernel's constants."""
    x_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    out_desc: tma.tensor_descriptor
    res_desc: tma.tensor_descriptor
    x_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    c_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    res_ready: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor
    bias_ptr: SCALAR
    a_scale_ptr: SCALAR
    w_scale_ptr: SCALAR
    M: SCALAR
    N: SCALAR
    K: SCALAR
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_K: gl.constexpr
    STAGES: gl.constexpr
    GROUP_M: gl.constexpr
    HAS_BIAS: gl.constexpr
    HAS_RESIDUAL: gl.constexpr
    RESIDUAL_FIRST: gl.constexpr
    ACTIVATION: gl.constexpr
    QUANT: gl.constexpr
    W_T: gl.constexpr


@aggregate
@positional_init
class CoopArgs:
    """What linear_coop_kernel's partitions share: its seven TMA descriptors, its ring (WGS x boxes and the two
    weight boxes a slot, the output's two boxes a warpgroup) and barriers, the bias pointer, the sizes and the
    kernel's constants."""
    x_desc: tma.tensor_descriptor
    w1_desc: tma.tensor_descriptor
    w2_desc: tma.tensor_descriptor
    out1_desc: tma.tensor_descriptor
    out2_desc: tma.tensor_descriptor
    res1_desc: tma.tensor_descriptor
    res2_desc: tma.tensor_descriptor
    x_bufs: gl.shared_memory_descriptor
    w1_bufs: gl.shared_memory_descriptor
    w2_bufs: gl.shared_memory_descriptor
    c1_bufs: gl.shared_memory_descriptor
    c2_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    res_ready: gl.shared_memory_descriptor
    bias_ptr: SCALAR
    M: SCALAR
    N: SCALAR
    K: SCALAR
    BLOCK_K: gl.constexpr
    BN1: gl.constexpr
    BN2: gl.constexpr
    WGS: gl.constexpr
    STAGES: gl.constexpr
    GROUP_M: gl.constexpr
    HAS_BIAS: gl.constexpr
    HAS_RESIDUAL: gl.constexpr
    RESIDUAL_FIRST: gl.constexpr
    ACTIVATION: gl.constexpr
    W_T: gl.constexpr


@aggregate
@positional_init
class ConvArgs:
    """What conv_ws_kernel's partitions share: its TMA descriptors, the ring (gemm_hopper.allocate_ring), the bias
    pointer, the sizes and geometry, and the kernel's constants."""
    x_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    out_desc: tma.tensor_descriptor
    res_desc: tma.tensor_descriptor
    x_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    c_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    res_ready: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor
    bias_ptr: SCALAR
    N_IMG: SCALAR
    OH: SCALAR
    OW: SCALAR
    K: SCALAR
    C: SCALAR
    R: SCALAR
    S: SCALAR
    pad_h: SCALAR
    pad_w: SCALAR
    dil_h: SCALAR
    dil_w: SCALAR
    BLOCK_H: gl.constexpr
    BLOCK_W: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_K: gl.constexpr
    STAGES: gl.constexpr
    GROUP_M: gl.constexpr
    HAS_BIAS: gl.constexpr
    HAS_RESIDUAL: gl.constexpr
    RESIDUAL_FIRST: gl.constexpr
    ACTIVATION: gl.constexpr
    STRIDE: gl.constexpr


@aggregate
@positional_init
class AttnArgs:
    """What attention_ws_kernel's partitions share: q's, k's and v's TMA descriptors, their buffers (q's parts,
    the K / V ring) and barriers, the output and mask pointers, the sizes, the softmax scale, the strides, the
    e4m3 operands' scales (FP8) and the kernel's constants."""
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    q_bufs: gl.shared_memory_descriptor
    k_bufs: gl.shared_memory_descriptor
    v_bufs: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor
    out_ptr: SCALAR
    mask_ptr: SCALAR
    H: SCALAR
    GROUP: SCALAR
    L: SCALAR
    S: SCALAR
    qk_scale: SCALAR
    stride_ob: SCALAR
    stride_oh: SCALAR
    stride_om: SCALAR
    stride_mb: SCALAR
    stride_mh: SCALAR
    stride_mm: SCALAR
    stride_mn: SCALAR
    qs_ptr: SCALAR
    ks_ptr: SCALAR
    vs_ptr: SCALAR
    MASK_KIND: gl.constexpr
    MASK_ROW: gl.constexpr
    IS_CAUSAL: gl.constexpr
    EMPTY_NAN: gl.constexpr
    STAGES: gl.constexpr
    PINGPONG: gl.constexpr
    FOLD: gl.constexpr
    CONSUMERS: gl.constexpr
    FP8: gl.constexpr
