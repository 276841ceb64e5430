"""accelc::conv2d_depthwise — a depthwise Conv2d (groups = in channels = out channels: MobileNet,
EfficientNet, ConvNeXt's 7x7) with the fused epilogue of kernels/epilogue.py.

x (N, C, H, W) in any memory format, read through its strides; weight packed at optimize time as
(R, S, C) contiguous (pack_weight); bias (C,) (a folded BatchNorm's included); residual (N, C, OH,
OW) any format. Output (N, C, OH, OW) in channels-last memory, as accelc::conv2d's.

    out = act(dwconv(x, w) + bias) + residual      residual_first=False
    out = act(dwconv(x, w) + bias + residual)      residual_first=True

No reduction across channels, so no tensor cores: each program takes BLOCK_P output pixels
(flattened over N, OH, OW) x BLOCK_C channels and walks the R x S taps (unrolled), loading one
input value and one weight per tap and channel, accumulating in fp32; the epilogue follows, then
one store. The kernel is bound by memory traffic; with channels-last input each pixel's channels
are one contiguous run.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl

from accelc import runtime
from accelc.kernels.conv import MAX_KERNEL, operands_problem, output_size
from accelc.kernels.epilogue import activation_code, epilogue, epilogue_ref, residual_as
from accelc.tuning import CompiledCall, Tuner, check_once
from accelc.compile_ahead import launch_kernel


@triton.jit(do_not_specialize=["P"])  # sizes that follow the batch or length: one binary for every size
def _dw_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
    C, H, W, OH, OW, P,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    sxn, sxc, sxh, sxw, srn, src, srh, srw, son, soc, soh, sow,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_FIRST: tl.constexpr, ACTIVATION: tl.constexpr,
    R: tl.constexpr, S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = offs_p < P
    c_ok = offs_c < C
    ow = offs_p % OW
    t = offs_p // OW
    oh = t % OH
    n = (t // OH).to(tl.int64)
    x_base = x_ptr + n[:, None] * sxn + offs_c[None, :].to(tl.int64) * sxc
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for r in tl.static_range(R):
        ih = oh * stride_h - pad_h + r * dil_h
        h_ok = p_ok & (ih >= 0) & (ih < H)
        for s in tl.static_range(S):
            iw = ow * stride_w - pad_w + s * dil_w
            ok = h_ok & (iw >= 0) & (iw < W)
            xv = tl.load(x_base + (ih * sxh + iw * sxw).to(tl.int64)[:, None], mask=ok[:, None] & c_ok[None, :],
                         other=0.0)
            wv = tl.load(w_ptr + (r * S + s) * C + offs_c, mask=c_ok, other=0.0)
            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    mask = p_ok[:, None] & c_ok[None, :]
    pix_r = n * srn + (oh * srh + ow * srw).to(tl.int64)
    res_ptrs = res_ptr + pix_r[:, None] + offs_c[None, :].to(tl.int64) * src
    acc = epilogue(acc, bias_ptr, res_ptrs, mask, offs_c, C, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION)
    pix_o = n * son + (oh * soh + ow * sow).to(tl.int64)
    tl.store(out_ptr + pix_o[:, None] + offs_c[None, :].to(tl.int64) * soc, acc.to(out_ptr.dtype.element_ty),
             mask=mask)


def config(bp, bc, warps) -> triton.Config:
    return triton.Config({"BLOCK_P": bp, "BLOCK_C": bc}, num_warps=warps)


CONFIGS = [config(32, 64, 4), config(64, 64, 4), config(128, 32, 4), config(16, 128, 4), config(32, 128, 4),
           config(64, 128, 8), config(128, 64, 8), config(256, 32, 8)]


def _prune(configs, sizes):
    widest = max(32, triton.next_power_of_2(sizes["C"]))
    return [c for c in configs if c.kwargs["BLOCK_C"] <= widest]


def _interpreter_config(sizes) -> triton.Config:
    """One or a few programs of up to 1024 pixels x 128 channels: the interpreter's time goes by the
    programs, not by their size (one launch at 2 x 48 x 16 x 16: 6.0 s in 16 x 16 blocks, 0.51 s in
    64 x 64, 0.087 s in one 512 x 64; a whole HF MobileNetV2's layers are such). The kernel's own
    tests force 32 x 16 blocks, so that their shapes span several programs with tails."""
    pixels = sizes["N"] * sizes["H"] * sizes["W"] // sizes["stride"] ** 2
    return config(min(1024, triton.next_power_of_2(pixels)), min(128, triton.next_power_of_2(sizes["C"])), 4)


TUNER = Tuner("conv2d_depthwise", _dw_kernel, CONFIGS, prune=_prune,
              default=lambda sizes: config(32, 64, 4), interpreter=_interpreter_config)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(C, 1, R, S) as nn.Conv2d(groups=C) stores it -> (R, S, C) contiguous, once at optimize time."""
    return weight[:, 0].permute(1, 2, 0).contiguous()


def why_unsupported(x, weight, bias=None, residual=None, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1),
                    activation="none") -> str | None:
    """Why accelc::conv2d_depthwise cannot take these operands (weight packed (R, S, C); padding
    (top, bottom, left, right)), or None. Works on meta tensors."""
    if x.dim() != 4 or weight.dim() != 3:
        return f"x must be (N, C, H, W) and weight packed (R, S, C), got {tuple(x.shape)}, {tuple(weight.shape)}"
    N, C, H, W = x.shape
    R, S, Cw = weight.shape
    if Cw != C:
        return f"x has {C} channels but the packed depthwise weight {tuple(weight.shape)} has {Cw}"
    if R > MAX_KERNEL or S > MAX_KERNEL:
        return f"depthwise kernel {R}x{S} over {MAX_KERNEL}x{MAX_KERNEL}"
    return operands_problem(x, weight, bias, residual, C, output_size(H, W, R, S, stride, padding, dilation),
                            activation)


_CHECKED: set = set()


def conv2d_depthwise_launch(x, weight, bias, residual, stride, padding, dilation, activation="none",
                            residual_first=False):
    """Checks, allocates, launches; returns (N, C, OH, OW) in channels-last memory."""
    sig = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.dtype,
           None if bias is None else (bias.shape, bias.dtype, bias.device),
           None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device),
           tuple(stride), tuple(padding), tuple(dilation), activation, bool(residual_first))
    check_once(_CHECKED, sig, lambda: why_unsupported(x, weight, bias, residual, stride, padding, dilation,
                                                       activation), "conv2d_depthwise")
    N, C, H, W = x.shape
    R, S, _ = weight.shape
    OH, OW = output_size(H, W, R, S, stride, padding, dilation)
    out = torch.empty((N, C, OH, OW), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    residual = residual_as(residual, out.shape, memory_format=torch.channels_last)
    res = residual if residual is not None else out
    tensors = (x, weight, bias if bias is not None else out, res, out)
    P = N * OH * OW
    args = (*tensors, C, H, W, OH, OW, P, stride[0], stride[1], padding[0], padding[2], dilation[0], dilation[1],
            *x.stride(), *res.stride(), *out.stride())
    call_key = (sig, tuple(t.data_ptr() % 16 for t in tensors))   # Triton specializes on pointer alignment
    with runtime.device_guard(x):
        known = TUNER.calls.get(call_key)
        if known is not None:
            known(args, x.device.index or 0)
            return out
        meta = dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                    RESIDUAL_FIRST=bool(residual_first), ACTIVATION=activation_code(activation), R=R, S=S)

        def grid(kw):
            return (triton.cdiv(P, kw["BLOCK_P"]), triton.cdiv(C, kw["BLOCK_C"]))

        def run(cfg):
            kw = cfg.all_kwargs()
            launch_kernel(_dw_kernel, grid(kw), args, dict(meta, **kw))

        cl = x.is_contiguous(memory_format=torch.channels_last)
        key = (triton.next_power_of_2(P), C, R, S, stride[0], cl, x.dtype)
        cfg = TUNER.pick(key, dict(N=N, C=C, H=H, W=W, R=R, S=S, stride=stride[0], channels_last=cl), run)
        kw = cfg.all_kwargs()
        # a CompiledCall per call signature: every integer argument follows from the shapes and strides in it
        TUNER.calls[call_key] = CompiledCall(_dw_kernel, grid(kw), args, dict(meta, **kw))
    return out


def conv2d_depthwise_ref(x, weight, bias, residual, stride, padding, dilation, activation="none",
                         residual_first=False):
    """Pure-PyTorch reference on the packed weight: fp32 (fp64 for fp64) math, channels-last result; an unbatched
    image (C, H, W) gives its unbatched result, as F.conv2d (conv.conv2d_ref)."""
    if x.dim() == 3:
        return conv2d_depthwise_ref(x[None], weight, bias, None if residual is None else residual[None], stride,
                                    padding, dilation, activation, residual_first)[0].contiguous()
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    C = x.shape[1]
    w = weight.to(acc).permute(2, 0, 1).unsqueeze(1)          # (C, 1, R, S)
    xp = torch.nn.functional.pad(x.to(acc), (padding[2], padding[3], padding[0], padding[1]))
    y = torch.nn.functional.conv2d(xp, w, None, tuple(stride), 0, tuple(dilation), C)
    y = epilogue_ref(y.permute(0, 2, 3, 1), None if bias is None else bias.to(acc),
                     None if residual is None else residual.to(acc).permute(0, 2, 3, 1), activation, residual_first)
    return y.permute(0, 3, 1, 2).to(x.dtype).contiguous(memory_format=torch.channels_last)


@torch.library.custom_op("accelc::conv2d_depthwise", mutates_args=())
def conv2d_depthwise(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     residual: Optional[torch.Tensor], stride: List[int], padding: List[int], dilation: List[int],
                     activation: str = "none", residual_first: bool = False) -> torch.Tensor:
    """act(dwconv(x, weight) + bias) (+ residual): see the module docstring."""
    reason = why_unsupported(x, weight, bias, residual, stride, padding, dilation, activation)
    if reason is not None:
        raise ValueError(f"accelc::conv2d_depthwise: {reason}")
    return runtime.launch_or_fallback("conv2d_depthwise", x.device, conv2d_depthwise_launch, conv2d_depthwise_ref,
                                      x, weight, bias, residual, stride, padding, dilation, activation,
                                      residual_first)


@conv2d_depthwise.register_fake
def _(x, weight, bias, residual, stride, padding, dilation, activation="none", residual_first=False):
    N, C, H, W = x.shape
    R, S, _ = weight.shape
    OH, OW = output_size(H, W, R, S, stride, padding, dilation)
    return x.new_empty((N, C, OH, OW)).contiguous(memory_format=torch.channels_last)


__all__ = ["conv2d_depthwise", "conv2d_depthwise_launch", "conv2d_depthwise_ref", "pack_weight",
           "why_unsupported"]
