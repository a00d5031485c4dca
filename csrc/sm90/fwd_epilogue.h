// The SM90 forward's epilogue: a consumer warpgroup's rows of a job, normalised, leave by TMA
// store through the warpgroup's own shared-memory buffer (tile_store.h), which runs while the
// warpgroup starts its next job, or, where that buffer does not fit beside the pipelines (head dim
// 256), straight from the registers; the LSE goes out from registers. A split-KV job writes its
// normalised fp32 partial output and LSE from registers for the merge. A job with no visible key
// block writes zeros and +inf or the sink (common/fwd_output.h).
#pragma once
#include <cute/tensor.hpp>

#include "common/fwd_output.h"
#include "common/params.h"
#include "mask/mask_head.h"
#include "sm90/fwd_barriers.h"
#include "sm90/wgmma_ops.h"

namespace flashmask::sm90 {
using namespace cute;

template <typename Traits>
struct FwdEpilogue {
    using Element = typename Traits::Element;
    using Barriers = FwdBarriers<Traits::kConsumerWarpgroups>;

    template <typename Tma, typename Job, typename AccO, typename Softmax>
    __forceinline__ __device__ static void store(const Tma& tma_o, const AttnParams& p, const Job& tile, AccO& acc_o,
                                                 Softmax& softmax, typename Traits::SharedStorage& shared, int cwg,
                                                 int ctid) {
        typename Traits::TiledMmaPV mma_pv;
        Tensor cO = rowcol(mma_pv.get_thread_slice(ctid).partition_C(make_identity_tensor(typename Traits::TileO{})));
        const bool split = p.num_splits > 1;
        const FwdOutput<Element> output(p, tile.b, tile.h, tile.split);
        float lse[Softmax::kRowCount];
        Tensor o_rc = rowcol(acc_o);
        // A split's empty row may see keys in other splits: the merge tells hidden rows apart.
        softmax.finalize(o_rc, p.score_scale, lse, output.sink,
                         [&](int mi) { return split || row_hidden(p, tile.b, tile.h, tile.r0 + get<0>(cO(mi, 0))); });
        if (split) {
            output.write_partial(o_rc, cO, lse, tile.r0, tile.r1, ctid);
            return;
        }
        if constexpr (Traits::kOThroughSmem) {
            Traits::OutStore::template store<Traits::kBlockM>(
                tma_o, make_shape(p.sq, p.d_v, p.hq, p.b), acc_o, mma_pv, shared.o.data(),
                tile.m_block * Traits::kConsumerWarpgroups, tile.h, tile.b, ctid, Barriers::buffers(cwg));
        } else {
            output.write_rows(o_rc, cO, tile.r0, tile.r1);
        }
        output.write_lse(cO, lse, tile.r0, tile.r1, ctid);
    }

    // A job no key reaches: output 0 and LSE +inf (or the sink).
    template <typename Job>
    __forceinline__ __device__ static void store_empty(const AttnParams& p, const Job& tile, int ctid) {
        const FwdOutput<Element> output(p, tile.b, tile.h, tile.split);
        output.write_empty(tile.r0, tile.r1, ctid, Traits::kConsumerThreads);
    }

    // Before the CTA exits: the TMA unit has read every output buffer.
    __forceinline__ __device__ static void drain(int ctid) {
        if constexpr (Traits::kOThroughSmem) Traits::OutStore::drain(ctid);
    }
};

}  // namespace flashmask::sm90
