// Launch layer of the SM90 backward: TMA descriptors of Q, dO, K, V, dK and dV over their real
// strides, the persistent grid, then the dQ conversion. p.dq_accum must be zeroed fp32
// [B, Hq, query blocks, BlockM * head dim] (each tile in the kernel's staging order, bwd_mainloop.h).
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>

#include <cute/tensor.hpp>

#include "common/launch_utils.h"
#include "sm90/bwd_kernel.h"
#include "sm90/dq_convert.h"
#include "sm90/tma_views.h"

namespace flashmask::sm90 {

// V, dO and dV at kHeadDimV, their columns bounded by p.d_v (a smaller pair that fits).
template <int kHeadDim, int kHeadDimV, typename Element>
void run_bwd(const BwdParams& p, cudaStream_t stream) {
    using namespace cute;
    using Traits = BwdTraits<kHeadDim, kHeadDimV, Element>;
    TORCH_CHECK(p.dq_accum != nullptr, "flashmask: the SM90 backward accumulates dQ with atomics only");
    const auto sQ = take<0, 2>(typename Traits::SmemLayoutQ{});
    const auto gq =
        tma_view<Element, kHeadDim>(p.q, p.sq, p.d, p.hq, p.b, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
    const auto gdo = tma_view<Element, kHeadDimV>(p.dout, p.sq, p.d_v, p.hq, p.b, p.do_row_stride, p.do_head_stride,
                                                  p.do_batch_stride);
    const auto gk =
        tma_view<Element, kHeadDim>(p.k, p.sk, p.d, p.hk, p.b, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
    const auto gv =
        tma_view<Element, kHeadDimV>(p.v, p.sk, p.d_v, p.hk, p.b, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
    auto tma_q = make_tma_copy(SM90_TMA_LOAD{}, gq, sQ, typename Traits::TileQ{}, _1{});
    auto tma_do = make_tma_copy(SM90_TMA_LOAD{}, gdo, take<0, 2>(typename Traits::SmemLayoutDO{}),
                                typename Traits::TileDO{}, _1{});
    auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, gk, typename Traits::SmemLayoutK{}, typename Traits::TileK{}, _1{});
    auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, gv, typename Traits::SmemLayoutV{}, typename Traits::TileV{}, _1{});
    const auto gdk =
        tma_view<Element, kHeadDim>(p.dk, p.sk, p.d, p.hq, p.b, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride);
    const auto gdv = tma_view<Element, kHeadDimV>(p.dv, p.sk, p.d_v, p.hq, p.b, p.dv_row_stride, p.dv_head_stride,
                                                  p.dv_batch_stride);
    auto tma_dk = Traits::KStore::make_tma(gdk);
    auto tma_dv = Traits::VStore::make_tma(gdv);
    using Args = BwdArgs<decltype(tma_q), decltype(tma_do), decltype(tma_k), decltype(tma_v), decltype(tma_dk),
                         decltype(tma_dv)>;
    const Args args{p, tma_q, tma_do, tma_k, tma_v, tma_dk, tma_dv};
    // One CTA per SM (the registers allow no more), none idle.
    const int64_t jobs = int64_t((p.sk + Traits::kBlockN - 1) / Traits::kBlockN) * p.hq * p.b;
    TORCH_CHECK(jobs < (int64_t(1) << 31), "flashmask: too many (key block, head, batch) jobs for one launch");
    TORCH_CHECK(p.job_counter != nullptr, "flashmask: the SM90 backward needs a job counter");
    const dim3 grid{unsigned(std::min<int64_t>(jobs, at::cuda::getCurrentDeviceProperties()->multiProcessorCount))};
    dispatch_bool(p.softcap_scale != 0.f, [&](auto softcap) {
        dispatch_mask_mode(p.causal, p.mask != nullptr ? p.mask_c : 0, [&](auto is_causal, auto mask_c) {
            launch_with_smem(&bwd_kernel<Traits, decltype(is_causal)::value, decltype(mask_c)::value, Args,
                                         decltype(softcap)::value>,
                             grid, Traits::kNThreads, Traits::kSmemBytes, args, stream);
        });
    });
    if (int64_t(p.b) * p.hq * p.sq == 0) return;
    const dim3 tiles((p.sq + Traits::kBlockM - 1) / Traits::kBlockM, p.hq, p.b);
    dq_convert_kernel<Traits><<<tiles, Traits::kConsumerThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashmask::sm90
