// Global tensors as the TMA unit reads them: [S, D, H, B] views (rows, head dim, heads, batch) of
// the kernels' strided [B, S, H, D] inputs, without copies.
#pragma once
#include <cute/tensor.hpp>

#include <cstdint>

namespace flashmask::sm90 {

// The head dim is contiguous and zero-filled past d, as are rows past s. The binding lets a
// dimension of size 1 have any stride, which a TMA descriptor would reject: such a stride is never
// followed, so it is replaced by a valid one.
template <typename Element, int kHeadDim>
auto tma_view(const void* ptr, int s, int d, int h, int b, int64_t row, int64_t head, int64_t batch) {
    using namespace cute;
    const int64_t rows = s == 1 ? int64_t(kHeadDim) : row;
    const int64_t heads = h == 1 ? rows * s : head;
    const int64_t batches = b == 1 ? heads * h : batch;
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), make_shape(s, d, h, b),
                       make_stride(rows, _1{}, heads, batches));
}

}  // namespace flashmask::sm90
