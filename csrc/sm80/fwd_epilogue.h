// The SM80 forward's output store: through shared memory, as 16-byte coalesced stores.
#pragma once
#include <cute/tensor.hpp>

#include "common/fwd_output.h"
#include "sm80/tile_ops.h"

namespace flashmask::sm80 {
using namespace cute;

// acc_o (BlockM x value head dim) goes through shared memory sTile (free by now); the LSE from the
// first lane of each quad.
template <typename Traits, typename Element, typename Acc, typename TiledMma, typename STile, typename Coords>
__forceinline__ __device__ void write_output(FwdOutput<Element> const& out, Acc const& acc_o, TiledMma const& mma,
                                             STile& sTile, Coords const& coords, const float* row_lse, int r0, int r1,
                                             int tidx) {
    Tensor gO = make_tensor(make_gmem_ptr(out.o + r0 * out.row_stride), typename Traits::TileO{},
                            make_stride(out.row_stride, _1{}));
    store_tile<typename Traits::SmemCopyAtomC, typename Traits::CopiesV::GmemTiledCopyOut, Element>(
        acc_o, mma, sTile, gO, r1 - r0, out.d, tidx);
    out.write_lse(coords, row_lse, r0, r1, tidx);
}

}  // namespace flashmask::sm80
