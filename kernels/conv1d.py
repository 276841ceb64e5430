"""accelc::conv1d: act(conv1d(x, weight) + bias) (+ residual) as the height-1 2-D conv.

x (N, C, L); the weight packed once at optimize time as the 2-D kernels take it: (K, 1, S, C / groups)
(accelc::conv2d's implicit GEMM, grouped or not), (1, S, C) for a depthwise conv (groups = C = K,
accelc::conv2d_depthwise). stride, dilation: ints; padding: (left, right). The output is (N, K, OL)
with the channels innermost in memory (strides (OL * K, 1, K): the 2-D kernels' channels-last
output, height 1): a following transpose(1, 2), what audio and speech encoders do before their
linears, is then a plain row-major view; conv_gemm makes it contiguous where a reader needs it.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from accelc import runtime
from accelc.kernels import conv, depthwise_conv


def pack_weight(weight: torch.Tensor, depthwise: bool) -> torch.Tensor:
    """(K, C, S) as nn.Conv1d stores it -> the 2-D kernels' packed weight of the height-1 conv."""
    w4 = weight.unsqueeze(2)
    return depthwise_conv.pack_weight(w4) if depthwise else conv.pack_weight(w4)


def _as_2d(x, residual, stride, padding, dilation):
    return (x.unsqueeze(2), None if residual is None else residual.unsqueeze(2), [1, stride],
            [0, 0, padding[0], padding[1]], [1, dilation])


def why_unsupported(x, weight, bias=None, residual=None, stride=1, padding=(0, 0), dilation=1, activation="none",
                    depthwise=False) -> str | None:
    """Why accelc::conv1d cannot take these operands (weight packed by pack_weight), or None. Works
    on meta tensors."""
    if x.dim() != 3:
        return f"x must be (N, C, L), got {tuple(x.shape)}"
    x4, r4, st, pad, dil = _as_2d(x, residual, stride, padding, dilation)
    return (depthwise_conv if depthwise else conv).why_unsupported(x4, weight, bias, r4, st, pad, dil, activation)


def _height_1(conv2d, depthwise2d, x, weight, bias, residual, stride, padding, dilation, activation, residual_first,
              allow_tf32, depthwise):
    """The 2-D op (`conv2d` or `depthwise2d`: launchers or references) on the height-1 view, squeezed back."""
    x4, r4, st, pad, dil = _as_2d(x, residual, stride, padding, dilation)
    if depthwise:
        return depthwise2d(x4, weight, bias, r4, st, pad, dil, activation, residual_first).squeeze(2)
    return conv2d(x4, weight, bias, r4, st, pad, dil, activation, residual_first, allow_tf32).squeeze(2)


def conv1d_launch(x, weight, bias, residual, stride, padding, dilation, activation="none", residual_first=False,
                  allow_tf32=False, depthwise=False):
    return _height_1(conv.conv2d_launch, depthwise_conv.conv2d_depthwise_launch, x, weight, bias, residual, stride,
                     padding, dilation, activation, residual_first, allow_tf32, depthwise)


def conv1d_ref(x, weight, bias, residual, stride, padding, dilation, activation="none", residual_first=False,
               allow_tf32=False, depthwise=False):
    """Pure-PyTorch reference on the packed weight (the 2-D references'), the same layout."""
    return _height_1(conv.conv2d_ref, depthwise_conv.conv2d_depthwise_ref, x, weight, bias, residual, stride,
                     padding, dilation, activation, residual_first, allow_tf32, depthwise)


def _out_length(x, weight, stride, padding, dilation, depthwise):
    S = weight.shape[1] if depthwise else weight.shape[2]
    return conv.output_size(1, x.shape[2], 1, S, (1, stride), (0, 0, padding[0], padding[1]), (1, dilation))[1]


@torch.library.custom_op("accelc::conv1d", mutates_args=())
def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
           stride: int, padding: List[int], dilation: int, activation: str = "none", residual_first: bool = False,
           allow_tf32: bool = False, depthwise: bool = False) -> torch.Tensor:
    """act(conv1d(x, weight) + bias) (+ residual): see the module docstring."""
    return runtime.launch_or_fallback("conv1d", x.device, conv1d_launch, conv1d_ref, x, weight, bias, residual,
                                      stride, padding, dilation, activation, residual_first, allow_tf32, depthwise)


@conv1d.register_fake
def _(x, weight, bias, residual, stride, padding, dilation, activation="none", residual_first=False,
      allow_tf32=False, depthwise=False):
    N, _, _ = x.shape
    K = weight.shape[2] if depthwise else weight.shape[0]
    OL = _out_length(x, weight, stride, padding, dilation, depthwise)
    return x.new_empty((N, K, 1, OL)).contiguous(memory_format=torch.channels_last).squeeze(2)
