// Pieces both backward kernels share: the pointers of a (batch, head), the global->shared loads
// of its tiles, the shared->register copies of their GEMMs, and the per-element steps
// P = exp(S - LSE) and dS = P (dP - D).
#pragma once
#include <cute/tensor.hpp>

#include <utility>

#include "common/params.h"
#include "common/softcap.h"
#include "sm80/bwd_traits.h"
#include "sm80/tile_ops.h"

namespace flashmask::sm80 {
using namespace cute;

// Row 0 of every tensor a (batch, query head) reads; K and V of its KV head.
template <typename Element>
struct BwdHead {
    const Element* q;
    const Element* dout;
    const Element* k;
    const Element* v;
    const float* lse;
    const float* dsum;

    __forceinline__ __device__ BwdHead(const BwdParams& p, int b, int h) {
        const int kv_h = h / p.q_per_kv_head;
        q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
        dout = static_cast<const Element*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
        k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_h * p.k_head_stride;
        v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_h * p.v_head_stride;
        lse = p.lse + (int64_t(b) * p.hq + h) * p.sq;
        dsum = p.dsum + (int64_t(b) * p.hq + h) * p.stats_stride;
    }
};

// A (rows, head dim) tile of a [S, D] tensor with row stride `stride`, starting at row `row0`.
template <typename Tile, typename Element>
__forceinline__ __device__ auto gmem_rows(const Element* base, int64_t stride, int row0) {
    return make_tensor(make_gmem_ptr(base + int64_t(row0) * stride), Tile{}, make_stride(stride, _1{}));
}

// The zero-filling global -> shared copies of a (batch, head)'s row tiles: Q and K rows are p.d
// wide, dO and V rows p.d_v. Each takes the tile's first row and how many rows from it exist.
template <typename Traits>
struct BwdGmemLoads {
    using Element = typename Traits::Element;
    using CopyQK = typename Traits::GmemTiledCopy;
    using CopyV = typename Traits::CopiesV::GmemTiledCopy;
    template <typename Copy>
    using Thr = decltype(std::declval<Copy&>().get_thread_slice(0));
    template <typename Copy, typename Tile>
    using Coords = decltype(std::declval<Thr<Copy>&>().partition_S(make_identity_tensor(Tile{})));

    CopyQK qk;
    CopyV v_do;
    Thr<CopyQK> thr_qk;
    Thr<CopyV> thr_v_do;
    // Each thread's (row, column) of its vectors, which decide what is zero-filled.
    Coords<CopyQK, typename Traits::TileKV> k_coords;
    Coords<CopyQK, typename Traits::TileQ> q_coords;
    Coords<CopyV, typename Traits::TileV> v_coords;
    Coords<CopyV, typename Traits::TileDO> do_coords;
    const BwdHead<Element>& head;
    const BwdParams& p;

    __forceinline__ __device__ BwdGmemLoads(const BwdHead<Element>& head_, const BwdParams& p_, int tidx)
        : thr_qk(qk.get_thread_slice(tidx)),
          thr_v_do(v_do.get_thread_slice(tidx)),
          k_coords(thr_qk.partition_S(make_identity_tensor(typename Traits::TileKV{}))),
          q_coords(thr_qk.partition_S(make_identity_tensor(typename Traits::TileQ{}))),
          v_coords(thr_v_do.partition_S(make_identity_tensor(typename Traits::TileV{}))),
          do_coords(thr_v_do.partition_S(make_identity_tensor(typename Traits::TileDO{}))),
          head(head_),
          p(p_) {}

    template <typename Smem>
    __forceinline__ __device__ void q(int row0, Smem&& dst, int rows) const {
        load<typename Traits::TileQ>(qk, thr_qk, q_coords, head.q, p.q_row_stride, row0, dst, rows, p.d);
    }
    template <typename Smem>
    __forceinline__ __device__ void k(int row0, Smem&& dst, int rows) const {
        load<typename Traits::TileKV>(qk, thr_qk, k_coords, head.k, p.k_row_stride, row0, dst, rows, p.d);
    }
    template <typename Smem>
    __forceinline__ __device__ void dout(int row0, Smem&& dst, int rows) const {
        load<typename Traits::TileDO>(v_do, thr_v_do, do_coords, head.dout, p.do_row_stride, row0, dst, rows, p.d_v);
    }
    template <typename Smem>
    __forceinline__ __device__ void v(int row0, Smem&& dst, int rows) const {
        load<typename Traits::TileV>(v_do, thr_v_do, v_coords, head.v, p.v_row_stride, row0, dst, rows, p.d_v);
    }

private:
    // Rows [row0, row0 + rows) of a [S, cols] tensor with row stride `stride` into the tile `dst`.
    template <typename Tile, typename Copy, typename Thr, typename C, typename Smem>
    __forceinline__ __device__ static void load(Copy const& copy, Thr const& thr, C const& coords, const Element* base,
                                                int64_t stride, int row0, Smem&& dst, int rows, int cols) {
        copy_zfill(copy, thr.partition_S(gmem_rows<Tile>(base, stride, row0)), thr.partition_D(dst), coords, rows,
                   cols);
    }
};

// The ldmatrix copies (and this thread's slices) of S = Q K^T and dP = dO V^T (sdp), dQ = dS K (q),
// and the accumulator -> shared stores of P and dS (c).
template <typename Traits>
struct BwdSmemCopies {
    using CopySdpA = decltype(make_tiled_copy_A(typename Traits::SmemCopyAtom{}, typename Traits::TiledMmaSdP{}));
    using CopySdpB = decltype(make_tiled_copy_B(typename Traits::SmemCopyAtom{}, typename Traits::TiledMmaSdP{}));
    using CopyQA = decltype(make_tiled_copy_A(typename Traits::SmemCopyAtom{}, typename Traits::TiledMmaQ{}));
    using CopyQB = decltype(make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, typename Traits::TiledMmaQ{}));
    using CopyC = decltype(make_tiled_copy_C(typename Traits::SmemCopyAtomC{}, typename Traits::TiledMmaSdP{}));
    template <typename Copy>
    using Thr = decltype(std::declval<Copy&>().get_thread_slice(0));

    CopySdpA sdp_a;
    CopySdpB sdp_b;
    CopyQA q_a;
    CopyQB q_b;
    CopyC c;
    Thr<CopySdpA> thr_sdp_a;
    Thr<CopySdpB> thr_sdp_b;
    Thr<CopyQA> thr_q_a;
    Thr<CopyQB> thr_q_b;
    Thr<CopyC> thr_c;

    __forceinline__ __device__ explicit BwdSmemCopies(int tidx)
        : thr_sdp_a(sdp_a.get_thread_slice(tidx)),
          thr_sdp_b(sdp_b.get_thread_slice(tidx)),
          thr_q_a(q_a.get_thread_slice(tidx)),
          thr_q_b(q_b.get_thread_slice(tidx)),
          thr_c(c.get_thread_slice(tidx)) {}
};

// The LSE (in log2 units) and D of the rows a thread holds in a score tile, in registers; rows
// past the end of the queries get LSE = +inf (so P = 0). Loaded before the GEMMs that precede
// their use.
template <int kRows>
struct RowStats {
    float lse_log2_[kRows];
    float dsum_[kRows];

    template <typename Coords>
    __forceinline__ __device__ RowStats(Coords const& coords, const float* lse, const float* d, int r0, int sq) {
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
            const int row = r0 + get<0>(coords(mi, 0));
            const bool in = row < sq;
            lse_log2_[mi] = in ? lse[row] * float(M_LOG2E) : INFINITY;
            dsum_[mi] = in ? d[row] : 0.f;
        }
    }
    __forceinline__ __device__ float lse_log2(int mi) const { return lse_log2_[mi]; }
    __forceinline__ __device__ float dsum(int mi) const { return dsum_[mi]; }
};

// The same, read at each use from a query block's rows staged in shared memory (LSE at
// [0, BlockM), D at [BlockM, 2 BlockM)): the key-block walk cannot spare the registers.
template <int kBlockM, typename Coords>
struct SmemRowStats {
    const float* rows;
    Coords const& coords;
    __forceinline__ __device__ float lse_log2(int mi) const { return rows[get<0>(coords(mi, 0))] * float(M_LOG2E); }
    __forceinline__ __device__ float dsum(int mi) const { return rows[kBlockM + get<0>(coords(mi, 0))]; }
};

// P = exp(S * scale - LSE), in place on the (rows, cols) view of a score tile.
template <typename S, typename Rows>
__forceinline__ __device__ void probs(S& s, Rows const& rows, float scale_log2) {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(s); ++mi) {
        const float lse = rows.lse_log2(mi);
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(s); ++ni) s(mi, ni) = exp2f(s(mi, ni) * scale_log2 - lse);
    }
}

// dS = P * (dP - D), in place on dP; with kSoftcap times the soft-cap's slope (common/softcap.h).
template <bool kSoftcap, typename DP, typename P, typename Rows>
__forceinline__ __device__ void dscores(DP& dp, P const& pr, Rows const& rows, float inv_scale_log2) {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(dp); ++mi) {
        const float d = rows.dsum(mi);
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(dp); ++ni) dp(mi, ni) = pr(mi, ni) * (dp(mi, ni) - d);
        if constexpr (kSoftcap) {
            const float lse_log2 = rows.lse_log2(mi);
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(dp); ++ni) dp(mi, ni) *= softcap_slope(pr(mi, ni), lse_log2, inv_scale_log2);
        }
    }
}

}  // namespace flashmask::sm80
