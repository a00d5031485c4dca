// Tile shapes, shared-memory layouts, MMA and copy atoms of the kernels (SM80 mma.sync; runs on SM90).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>

#include "sm80/tile_config.h"

namespace flashmask::sm80 {

template <typename Element>
struct MmaAtomFor;
template <>
struct MmaAtomFor<cutlass::half_t> {
    using type = cute::SM80_16x8x16_F32F16F16F32_TN;
};
template <>
struct MmaAtomFor<cutlass::bfloat16_t> {
    using type = cute::SM80_16x8x16_F32BF16BF16F32_TN;
};

// The shared-memory layout of (rows, head dim) tiles and the copies that fill and drain them,
// common to every kernel. Rows are cut into 64- (or 32-) element chunks, XOR-swizzled so that the
// 16-byte cp.async writes and ldmatrix reads of a warp fall in distinct banks.
template <int kHeadDim, typename Element, int kNThreads>
struct TileCopies {
    static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
    static constexpr int kSwizzleBits = kBlockKSmem == 64 ? 3 : 2;
    using SmemLayoutAtom = decltype(cute::composition(
        cute::Swizzle<kSwizzleBits, 3, 3>{},
        cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>, cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));

    using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
    using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
    // Accumulator fragments -> shared memory, in 4-byte pairs.
    using SmemCopyAtomC = cute::Copy_Atom<cute::UniversalCopy<uint32_t>, Element>;

    // Global <-> shared: 16 bytes per thread per copy; loads zero-fill outside the tensor.
    static constexpr int kGmemElemsPerLoad = 16 / sizeof(Element);
    static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
    using GmemLayoutAtom =
        cute::Layout<cute::Shape<cute::Int<kNThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
                     cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
    using GmemTiledCopy = decltype(cute::make_tiled_copy(
        cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
        cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerLoad>>>{}));
    using GmemTiledCopyOut = decltype(cute::make_tiled_copy(
        cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
        cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerLoad>>>{}));
};

template <int kHeadDim_, typename Element_>
struct FwdTraits : TileCopies<kHeadDim_, Element_, fwd_tile(kHeadDim_).warps * 32> {
    using Base = TileCopies<kHeadDim_, Element_, fwd_tile(kHeadDim_).warps * 32>;
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = fwd_tile(kHeadDim).block_m;
    static constexpr int kBlockN = fwd_tile(kHeadDim).block_n;
    static constexpr int kNWarps = fwd_tile(kHeadDim).warps;
    static constexpr int kNThreads = kNWarps * 32;
    using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
    using TileKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;
    using TileS = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>;

    // Warps split the query rows; each warp's 16-row MMA atoms cover BlockM / (16 * warps) row groups.
    using TiledMma = cute::TiledMMA<cute::MMA_Atom<typename MmaAtomFor<Element>::type>,
                                    cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                    cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

    using SmemLayoutQ = decltype(cute::tile_to_shape(typename Base::SmemLayoutAtom{},
                                                     cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
    using SmemLayoutKV = decltype(cute::tile_to_shape(typename Base::SmemLayoutAtom{},
                                                      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
    // V seen as (head dim, key): the B operand of P * V, read with transposing ldmatrix.
    using SmemLayoutVt = decltype(cute::composition(
        SmemLayoutKV{},
        cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));

    // The raw [BlockN, C] mask columns of one key block, staged for partially masked tiles.
    static constexpr int kSmemMaskInts = 4 * kBlockN;
    static constexpr int kSmemQBytes = int(cute::cosize_v<SmemLayoutQ>) * int(sizeof(Element));
    static constexpr int kSmemKVBytes = int(cute::cosize_v<SmemLayoutKV>) * int(sizeof(Element));
    static constexpr int kSmemBytes = kSmemQBytes + 2 * kSmemKVBytes + kSmemMaskInts * int(sizeof(int));
};

}  // namespace flashmask::sm80
