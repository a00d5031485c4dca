// Tile shapes, shared-memory layouts, MMA and copy atoms of the backward kernels.
#pragma once
#include "sm80/kernel_traits.h"

namespace flashmask::sm80 {

// kHeadDim: the head dim of Q and K (S = Q K^T, dQ, dK); kHeadDimV: that of V and dO (dP = dO V^T,
// dV).
template <int kHeadDim_, int kHeadDimV_, typename Element_>
struct BwdTraits : TileCopies<kHeadDim_, Element_, bwd_tile(kHeadDim_, kHeadDimV_).warps * 32> {
    using Base = TileCopies<kHeadDim_, Element_, bwd_tile(kHeadDim_, kHeadDimV_).warps * 32>;
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = bwd_tile(kHeadDim, kHeadDimV).block_m;
    static constexpr int kBlockN = bwd_tile(kHeadDim, kHeadDimV).block_n;
    static constexpr int kNWarps = bwd_tile(kHeadDim, kHeadDimV).warps;
    static constexpr int kNThreads = kNWarps * 32;
    // The layouts and copies of V and dO rows (the same types as K's and Q's where the dims are equal).
    using CopiesV = TileCopies<kHeadDimV, Element, kNThreads>;
    using Atom = cute::MMA_Atom<typename MmaAtomFor<Element>::type>;
    using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
    using TileKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;
    using TileDO = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>>;
    using TileV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>>;
    using TileS = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>;

    // S = Q K^T and dP = dO V^T over (BlockM, BlockN): 2 x 4 warps.
    using TiledMmaSdP = cute::TiledMMA<Atom, cute::Layout<cute::Shape<cute::_2, cute::Int<kNWarps / 2>, cute::_1>>,
                                       cute::Tile<cute::_32, cute::Int<16 * kNWarps / 2>, cute::_16>>;
    // dK = dS^T Q over (BlockN, D) and dV = P^T dO over (BlockN, Dv): 4 x 2 warps.
    using TiledMmaKV = cute::TiledMMA<Atom, cute::Layout<cute::Shape<cute::_4, cute::Int<kNWarps / 4>, cute::_1>>,
                                      cute::Tile<cute::_64, cute::Int<16 * kNWarps / 4>, cute::_16>>;
    // dQ = dS K over (BlockM, D): 2 x 4 warps, or 4 x 2 where D is not a multiple of 64.
    static constexpr int kWarpsMQ = kHeadDim % 64 == 0 ? 2 : 4;
    using TiledMmaQ =
        cute::TiledMMA<Atom, cute::Layout<cute::Shape<cute::Int<kWarpsMQ>, cute::Int<kNWarps / kWarpsMQ>, cute::_1>>,
                       cute::Tile<cute::Int<16 * kWarpsMQ>, cute::Int<16 * kNWarps / kWarpsMQ>, cute::_16>>;

    using SmemLayoutQ = decltype(cute::tile_to_shape(typename Base::SmemLayoutAtom{},
                                                     cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
    using SmemLayoutKV = decltype(cute::tile_to_shape(typename Base::SmemLayoutAtom{},
                                                      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
    using SmemLayoutDO = decltype(cute::tile_to_shape(typename CopiesV::SmemLayoutAtom{},
                                                      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>>{}));
    using SmemLayoutV = decltype(cute::tile_to_shape(typename CopiesV::SmemLayoutAtom{},
                                                     cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>>{}));
    // Transposed views: Q^T and dO^T (B operands of dK, dV), K^T (B operand of dQ).
    using SmemLayoutQt = decltype(cute::composition(
        SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
    using SmemLayoutDOt = decltype(cute::composition(
        SmemLayoutDO{},
        cute::make_layout(cute::Shape<cute::Int<kHeadDimV>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
    using SmemLayoutKt = decltype(cute::composition(
        SmemLayoutKV{},
        cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
    // P and dS (BlockM, BlockN), and their transposes (A operands of dV and dK).
    using SmemLayoutAtomPdS = decltype(cute::composition(
        cute::Swizzle<3, 3, 3>{}, cute::Layout<cute::Shape<cute::_8, cute::_64>, cute::Stride<cute::_64, cute::_1>>{}));
    using SmemLayoutPdS =
        decltype(cute::tile_to_shape(SmemLayoutAtomPdS{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
    using SmemLayoutPdSt = decltype(cute::composition(
        SmemLayoutPdS{},
        cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));

    static constexpr int kSmemQBytes = int(cute::cosize_v<SmemLayoutQ>) * int(sizeof(Element));
    static constexpr int kSmemDOBytes = int(cute::cosize_v<SmemLayoutDO>) * int(sizeof(Element));
    static constexpr int kSmemKVBytes = int(cute::cosize_v<SmemLayoutKV>) * int(sizeof(Element));
    static constexpr int kSmemVBytes = int(cute::cosize_v<SmemLayoutV>) * int(sizeof(Element));
    static constexpr int kSmemPBytes = int(cute::cosize_v<SmemLayoutPdS>) * int(sizeof(Element));
    // The raw mask columns of the key block (C <= 4 per key), its 8 bounds, and the LSE and D of
    // the query block's rows.
    static constexpr int kSmemMaskBytes = (4 * kBlockN + 8 + 2 * kBlockM) * int(sizeof(int));
    // Q and dO are double-buffered (the next query block loads during this one) where that fits
    // the 163 KB an SM80 CTA may use.
    static constexpr int kSmemQdOBytes = kSmemQBytes + kSmemDOBytes;
    static constexpr int kSmemSingle = kSmemQdOBytes + kSmemKVBytes + kSmemVBytes + 2 * kSmemPBytes + kSmemMaskBytes;
    static constexpr int kQStages = kSmemSingle + kSmemQdOBytes <= 163 * 1024 ? 2 : 1;
    static constexpr int kSmemBytes = kSmemSingle + (kQStages - 1) * kSmemQdOBytes;
    // The dQ kernel keeps one Q and dO, K, V and dS.
    static constexpr int kSmemDqBytes = kSmemQdOBytes + kSmemKVBytes + kSmemVBytes + kSmemPBytes + kSmemMaskBytes;
};

}  // namespace flashmask::sm80
