"""accelc's Triton kernels; importing this package registers every torch.ops.accelc.* op."""
from accelc import runtime as _runtime  # noqa: F401  (chooses interpreter or GPU before any @triton.jit)
from accelc.kernels import conv, flash_attention, gemm, int8_gemm, quantize  # noqa: F401

__all__ = ["conv", "flash_attention", "gemm", "int8_gemm", "quantize"]
