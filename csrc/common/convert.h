// A register fragment converted element-wise to another type (fp32 accumulators to fp16/bf16
// operands), keeping its layout; vectorised by CUTLASS's array converter.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flashmask {

template <typename To, typename Engine, typename Layout>
__forceinline__ __device__ auto convert_to(cute::Tensor<Engine, Layout> const& in) {
    using From = typename Engine::value_type;
    constexpr int N = decltype(cute::size(in))::value;
    cute::Tensor out = cute::make_tensor<To>(in.layout());
    cutlass::NumericArrayConverter<To, From, N> convert;
    *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
        convert(*reinterpret_cast<cutlass::Array<From, N> const*>(in.data()));
    return out;
}

}  // namespace flashmask
