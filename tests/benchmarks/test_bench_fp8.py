"""benchmarks/bench_fp8.py's split of GPU time into GEMMs and the rest, on kernel names from an H100 profile."""

from benchmarks.bench_fp8 import is_gemm


def test_gemm_classifier_on_profiled_kernel_names():
    gemms = ["nvjet_sm90_qqtst_128x256_128x4_2x1_v_bz_coopA_TNN", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "cutlass3x_sm90_tensorop_gemm_e4m3"]
    others = ["triton_poi_fused__scaled_mm__to_copy_clamp_clone_div_expand_mul_pow_reciprocal_t_10",
              "triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_clone_div_exp2_expand_floor_log2_mul_p",
              "triton_poi_fused__to_copy_clamp_exp2_floor_log2_mul_reciprocal_t_26",
              "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>",
              "Memset (Device)"]
    assert all(is_gemm(n) for n in gemms)
    assert not any(is_gemm(n) for n in others)
