// The sm_90a entry points (wgmma_entry.cuh) in a build without sm_90a code: no device runs
// them, and the launchers never choose them.
#include "cuda_common.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

bool wgmma_usable() { return false; }
int q4conv_wgmma_blocks_per_sm(int) { return 0; }
size_t q4gemm_wgmma_smem(int) { return 0; }
bie_status q4gemm_wgmma_launch(int64_t, int64_t, int64_t, const uint8_t *, const uint8_t *, int64_t,
                               const Epilogue &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda 4-bit gemm: built without sm_90a code");
}
bie_status q4conv_wgmma_launch(int, int64_t, int64_t, const ConvA &, const uint8_t *, int64_t,
                               const Epilogue &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda 4-bit conv: built without sm_90a code");
}

size_t bgemm_wgmma_smem() { return 0; }
size_t bgemm_tma_smem() { return 0; }
bool bgemm_tma_usable() { return false; }
bie_status bgemm_tma_launch(int64_t, int64_t, int64_t, const uint8_t *, const uint8_t *, int64_t,
                            const int *, int, const int *, int, const Epilogue &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda binary gemm: built without sm_90a code");
}
bie_status q4gemm_tma_launch(int64_t, int64_t, int64_t, const int8_t *, const int8_t *, int64_t,
                             const Epilogue &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda 4-bit gemm (TMA): built without sm_90a code");
}
bie_status bgemm_wgmma_launch(int64_t, int64_t, int64_t, const uint8_t *, const uint8_t *, int64_t,
                              const int *, int, const int *, int, const Epilogue &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda binary gemm: built without sm_90a code");
}

bool bwd_gemm_tma_usable() { return false; }
bool bwd_gemm_q4_usable() { return false; }
bool bwd_gemm_side_taken(const BwdGemmArgs &) { return false; }
int64_t bwd_gemm_parts(int64_t M) { return 2 * ((M + 127) / 128); }
bie_status bwd_gemm_tma_launch(const BwdGemmArgs &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda linear backward gemm: built without sm_90a code");
}

bool linear_wgrad16_usable() { return false; }
bie_status linear_wgrad16_launch(const WgradArgs &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda linear grad_w (wgmma): built without sm_90a code");
}

size_t dgrad_halo_wgmma_smem(int, int, int, int, int, int) { return 0; }
bie_status dgrad_halo_wgmma_launch(const DgradHaloArgs &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda conv grad_x (wgmma): built without sm_90a code");
}
size_t dgrad_phase_wgmma_smem(int) { return 0; }
bie_status dgrad_phase_wgmma_launch(const DgradHaloArgs &, const DgradPhaseSplit &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda conv grad_x (wgmma): built without sm_90a code");
}
bool dgrad_tma_tiles(const bie_conv_geom &, DgradTmaTiles *) { return false; }
bie_status dgrad_tma_launch(const DgradHaloArgs &, const DgradTmaTiles &) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda conv grad_x (TMA): built without sm_90a code");
}
bool wgrad_tma_plan(const bie_conv_geom &, int64_t, WgradTmaTiles *) { return false; }
size_t wgrad_tma_xs_bytes(const bie_conv_geom &) { return 0; }
bie_status wgrad_tma_launch(const bie_cuda_bconv_backward_args &, const void *, int, void *,
                            const WgradTmaTiles &, float *) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda conv grad_w (TMA): built without sm_90a code");
}
bie_status wgrad_tma_run(bool, const bie_conv_geom &, const void *, int, const void *,
                         const WgradTmaTiles &, float *) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda conv grad_w (TMA): built without sm_90a code");
}
bie_status conv_wgrad_wgmma(const bie_cuda_bconv_backward_args &, const void *, int, int, int,
                            float *) {
    return bie_fail(BIE_ERR_UNSUPPORTED, "cuda conv grad_w (wgmma): built without sm_90a code");
}

}  // namespace bie_cuda
