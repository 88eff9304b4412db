"""pith-ops: Triton and PyTorch operators for Mixture-of-Experts training; the imports below are its API."""

from pith_ops.adamw import adamw_, adamw_reference_, step_constants
from pith_ops.cast import cast, drop_grad, grad, keep, keep_grads, kept_copy, stand_in, weight_grad
from pith_ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from pith_ops.fp8_grouped_gemm import fp8_grouped_gemm, fp8_grouped_gemm_reference
from pith_ops.fp8_linear import fp8_linear, fp8_linear_reference
from pith_ops.fp8_quant import (
    FP8Rows,
    cols_from_rows,
    cols_from_rows_reference,
    copies_of_quantized,
    fp8_rows,
    quantize_rows,
    quantize_rows_reference,
    quantize_weight,
    quantize_weight_reference,
)
from pith_ops.grouped_gemm import grouped_gemm, grouped_gemm_backward, grouped_gemm_reference
from pith_ops.moe_permute import moe_permute, moe_permute_reference, moe_unpermute, moe_unpermute_reference
from pith_ops.rmsnorm import rms_norm, rms_norm_reference
from pith_ops.rope import apply_rope, apply_rope_reference
from pith_ops.swiglu import swiglu, swiglu_fp8, swiglu_oss, swiglu_oss_reference, swiglu_reference
