// Launch layer of the SM90 forward: TMA descriptors of Q, K, V and O over their real strides (no
// copies), the persistent grid, the shared memory and the compile-time mask modes.
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>

#include <cute/tensor.hpp>

#include "common/launch_utils.h"
#include "sm90/fwd_kernel.h"
#include "sm90/tma_views.h"

namespace flashmask::sm90 {

template <int kHeadDim, int kHeadDimV, typename Element>
void run_fwd(const AttnParams& p, cudaStream_t stream) {
    using namespace cute;
    using Traits = FwdTraits<kHeadDim, kHeadDimV, Element>;
    const auto gq =
        tma_view<Element, kHeadDim>(p.q, p.sq, p.d, p.hq, p.b, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
    const auto gk =
        tma_view<Element, kHeadDim>(p.k, p.sk, p.d, p.hk, p.b, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
    const auto gv =
        tma_view<Element, kHeadDimV>(p.v, p.sk, p.d_v, p.hk, p.b, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
    const auto sK = take<0, 2>(typename Traits::SmemLayoutKV{});
    auto tma_q = make_tma_copy(SM90_TMA_LOAD{}, gq, typename Traits::SmemLayoutQ{}, typename Traits::TileQ{}, _1{});
    auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, gk, sK, typename Traits::TileKV{}, _1{});
    auto tma_v =
        make_tma_copy(SM90_TMA_LOAD{}, gv, take<0, 2>(typename Traits::SmemLayoutV{}), typename Traits::TileV{}, _1{});
    const auto go =
        tma_view<Element, kHeadDimV>(p.o, p.sq, p.d_v, p.hq, p.b, p.o_row_stride, p.o_head_stride, p.o_batch_stride);
    auto tma_o = Traits::OutStore::make_tma(go);
    using Args = FwdArgs<decltype(tma_q), decltype(tma_k), decltype(tma_v), decltype(tma_o)>;
    const Args args{p, tma_q, tma_k, tma_v, tma_o};
    // One CTA per SM (the shared memory allows no more), none idle.
    const int64_t jobs = int64_t((p.sq + Traits::kBlockM - 1) / Traits::kBlockM) * p.hq * p.b * p.num_splits;
    TORCH_CHECK(p.job_counter != nullptr, "flashmask: the SM90 forward needs a job counter");
    TORCH_CHECK(jobs < (int64_t(1) << 31), "flashmask: too many (query tile, head, batch, split) jobs for one launch");
    TORCH_CHECK(
        (int64_t(p.sk) + Traits::kBlockN - 1) / Traits::kBlockN <= GroupTicket<Traits::kConsumerWarpgroups>::kMaxBlocks,
        "flashmask: Sk = ", p.sk, " is past what the SM90 forward's block tickets index (",
        int64_t(GroupTicket<Traits::kConsumerWarpgroups>::kMaxBlocks) * Traits::kBlockN, " keys)");
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const dim3 grid(unsigned(std::min<int64_t>(jobs, sms)));
    constexpr int kDecodeWarpKeys = fwd_tile(kHeadDim, kHeadDimV).decode_warp_keys;
    dispatch_bool(p.softcap_scale != 0.f, [&](auto softcap) {
        constexpr bool kSoftcap = decltype(softcap)::value;
        dispatch_mask_mode(p.causal, p.mask != nullptr ? p.mask_c : 0, [&](auto is_causal, auto mask_c) {
            constexpr bool kCausal = decltype(is_causal)::value;
            constexpr int kMaskC = decltype(mask_c)::value;
            if constexpr (kDecodeWarpKeys > 0) {
                if (p.decode_warp) {
                    launch_with_smem(&fwd_kernel<Traits, kCausal, kMaskC, Args, true, kSoftcap>, grid,
                                     Traits::kNThreads, Traits::kSmemBytes, args, stream);
                    return;
                }
            }
            launch_with_smem(&fwd_kernel<Traits, kCausal, kMaskC, Args, false, kSoftcap>, grid, Traits::kNThreads,
                             Traits::kSmemBytes, args, stream);
        });
    });
}

}  // namespace flashmask::sm90
