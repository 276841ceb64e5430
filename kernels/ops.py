"""Every torch.ops.accelc.* op registered (importing accelc.kernels imports this), and the tables of them.

LAUNCHERS maps each op to its launcher, which takes the same arguments: the optimized module's
plain calls use them directly (accelc.runner), skipping the op dispatcher's host cost. REFERENCES
maps each op to its pure-PyTorch reference, what an ONNX export records in its place.
"""
import torch

from accelc import runtime as _runtime  # noqa: F401  (chooses interpreter or GPU before any @triton.jit)
from accelc.kernels import (conv, conv1d, decode_step, depthwise_conv, flash_attention, fp8_gemm, fp8_weight, gated_linear, gemm,
                            int8_gemm, int8_weight, layernorm, paged_attention, qkv_rotary, quantize, rotary)

LAUNCHERS = {
    torch.ops.accelc.linear.default: gemm.linear_launch,
    torch.ops.accelc.conv2d.default: conv.conv2d_launch,
    torch.ops.accelc.conv2d_depthwise.default: depthwise_conv.conv2d_depthwise_launch,
    torch.ops.accelc.conv1d.default: conv1d.conv1d_launch,
    torch.ops.accelc.flash_attention.default: flash_attention.flash_attention_launch,
    torch.ops.accelc.linear_w8a8.default: int8_gemm.linear_w8a8_launch,
    torch.ops.accelc.quantize_per_token.default: quantize.quantize_launch,
    torch.ops.accelc.layer_norm.default: layernorm.layer_norm_launch,
    torch.ops.accelc.rms_norm.default: layernorm.rms_norm_launch,
    torch.ops.accelc.gated_linear.default: gated_linear.gated_linear_launch,
    torch.ops.accelc.rotary_embedding.default: rotary.rotary_embedding_launch,
    torch.ops.accelc.linear_w8a16.default: int8_weight.linear_w8a16_launch,
    torch.ops.accelc.gated_linear_w8a16.default: int8_weight.gated_linear_w8a16_launch,
    torch.ops.accelc.linear_fp8w.default: fp8_weight.linear_fp8w_launch,
    torch.ops.accelc.gated_linear_fp8w.default: fp8_weight.gated_linear_fp8w_launch,
    torch.ops.accelc.linear_fp8.default: fp8_gemm.linear_fp8_launch,
    torch.ops.accelc.gated_linear_fp8.default: fp8_gemm.gated_linear_fp8_launch,
    torch.ops.accelc.paged_attention.default: paged_attention.paged_attention_launch,
    torch.ops.accelc.qkv_rotary.default: qkv_rotary.qkv_rotary_launch,
    torch.ops.accelc.decode_step.default: decode_step.decode_step_launch,
}

# each op's pure-PyTorch reference (same arguments): what an ONNX export of an optimized module
# records in the op's place (ONNX has no accelc ops; the references are standard ATen)
REFERENCES = {
    torch.ops.accelc.linear.default: gemm.linear_ref,
    torch.ops.accelc.conv2d.default: conv.conv2d_ref,
    torch.ops.accelc.conv2d_depthwise.default: depthwise_conv.conv2d_depthwise_ref,
    torch.ops.accelc.conv1d.default: conv1d.conv1d_ref,
    torch.ops.accelc.flash_attention.default: flash_attention.flash_attention_ref,
    torch.ops.accelc.linear_w8a8.default: int8_gemm.linear_w8a8_ref,
    torch.ops.accelc.quantize_per_token.default: quantize.quantize_ref,
    torch.ops.accelc.layer_norm.default: layernorm.layer_norm_ref,
    torch.ops.accelc.rms_norm.default: layernorm.rms_norm_ref,
    torch.ops.accelc.gated_linear.default: gated_linear.gated_linear_ref,
    torch.ops.accelc.rotary_embedding.default: rotary.rotary_embedding_ref,
    torch.ops.accelc.linear_w8a16.default: int8_weight.linear_w8a16_ref,
    torch.ops.accelc.gated_linear_w8a16.default: int8_weight.gated_linear_w8a16_ref,
    torch.ops.accelc.linear_fp8w.default: fp8_weight.linear_fp8w_ref,
    torch.ops.accelc.gated_linear_fp8w.default: fp8_weight.gated_linear_fp8w_ref,
    torch.ops.accelc.linear_fp8.default: fp8_gemm.linear_fp8_ref,
    torch.ops.accelc.gated_linear_fp8.default: fp8_gemm.gated_linear_fp8_ref,
    torch.ops.accelc.paged_attention.default: paged_attention.paged_attention_ref,
    torch.ops.accelc.qkv_rotary.default: qkv_rotary.qkv_rotary_ref,
    torch.ops.accelc.decode_step.default: decode_step.decode_step_ref,
}
assert set(REFERENCES) == set(LAUNCHERS)

__all__ = ["LAUNCHERS", "REFERENCES", "conv", "conv1d", "decode_step", "depthwise_conv", "flash_attention", "fp8_gemm", "fp8_weight", "gated_linear", "gemm",
           "int8_gemm", "int8_weight", "layernorm",
           "paged_attention", "qkv_rotary", "quantize", "rotary"]
