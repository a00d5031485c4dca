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

// kHeadDim: the head dim of Q and K (S = Q K^T); kHeadDimV: that of V and O (O = P V).
template <int kHeadDim_, int kHeadDimV_, typename Element_>
struct FwdTraits : TileCopies<kHeadDim_, Element_, fwd_tile(kHeadDim_, kHeadDimV_).warps * 32> {
    using Base = TileCopies<kHeadDim_, Element_, fwd_tile(kHeadDim_, kHeadDimV_).warps * 32>;
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = fwd_tile(kHeadDim, kHeadDimV).block_m;
    static constexpr int kBlockN = fwd_tile(kHeadDim, kHeadDimV).block_n;
    static constexpr int kNWarps = fwd_tile(kHeadDim, kHeadDimV).warps;
    static constexpr int kNThreads = kNWarps * 32;
    // The layouts and copies of V and O rows (the same types as Q's and K's where the dims are equal).
    using CopiesV = TileCopies<kHeadDimV, Element, kNThreads>;
    using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
    using TileK = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;
    using TileV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>>;
    using TileO = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>>;
    using TileS = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>;

    // Warps split the query rows; each warp's 16-row MMA atoms cover BlockM / (16 * warps) row groups.
    using TiledMma = cute::TiledMMA<cute::MMA_Atom<typename MmaAtomFor<Element>::type>,
                                    cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                    cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

    using SmemLayoutQ = decltype(cute::tile_to_shape(typename Base::SmemLayoutAtom{},
                                                     cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
    using SmemLayoutK = decltype(cute::tile_to_shape(typename Base::SmemLayoutAtom{},
                                                     cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
    using SmemLayoutV = decltype(cute::tile_to_shape(typename CopiesV::SmemLayoutAtom{},
                                                     cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>>{}));
    // V seen as (value head dim, key): the B operand of P * V, read with transposing ldmatrix.
    using SmemLayoutVt = decltype(cute::composition(
        SmemLayoutV{},
        cute::make_layout(cute::Shape<cute::Int<kHeadDimV>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
    // The output tile, staged in Q's buffer (sized for the larger of the two).
    using SmemLayoutO = decltype(cute::tile_to_shape(typename CopiesV::SmemLayoutAtom{},
                                                     cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>>{}));

    // The raw [BlockN, C] mask columns of one key block, staged for partially masked tiles.
    static constexpr int kSmemMaskInts = 4 * kBlockN;
    static constexpr int kSmemQElems = int(cute::cosize_v<SmemLayoutQ>);
    static constexpr int kSmemOElems = int(cute::cosize_v<SmemLayoutO>);
    static constexpr int kSmemQBytes = (kSmemQElems > kSmemOElems ? kSmemQElems : kSmemOElems) * int(sizeof(Element));
    static constexpr int kSmemKBytes = int(cute::cosize_v<SmemLayoutK>) * int(sizeof(Element));
    static constexpr int kSmemVBytes = int(cute::cosize_v<SmemLayoutV>) * int(sizeof(Element));
    static constexpr int kSmemBytes = kSmemQBytes + kSmemKBytes + kSmemVBytes + kSmemMaskInts * int(sizeof(int));
};

}  // namespace flashmask::sm80
