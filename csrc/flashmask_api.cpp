// Python binding: argument checks, output allocation, mask-bound preprocessing and dispatch to
// the (head dim, dtype) instantiations that this build compiled.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "launch.h"
#include "mask_bounds.h"
#include "tile_config.h"

namespace flashmask {
namespace {

constexpr int kHeadDims[] = {
#ifdef FLASHMASK_HDIM32
    32,
#endif
#ifdef FLASHMASK_HDIM64
    64,
#endif
#ifdef FLASHMASK_HDIM96
    96,
#endif
#ifdef FLASHMASK_HDIM128
    128,
#endif
#ifdef FLASHMASK_HDIM192
    192,
#endif
#ifdef FLASHMASK_HDIM256
    256,
#endif
    0};  // sentinel: a build may compile no head dim at all

std::vector<int64_t> compiled_head_dims() {
    std::vector<int64_t> dims;
    for (int d : kHeadDims) if (d) dims.push_back(d);
    return dims;
}

std::vector<std::string> compiled_dtypes() {
    std::vector<std::string> names;
#ifdef FLASHMASK_FP16
    names.push_back("float16");
#endif
#ifdef FLASHMASK_BF16
    names.push_back("bfloat16");
#endif
    return names;
}

bool dtype_compiled(at::ScalarType t) {
#ifdef FLASHMASK_FP16
    if (t == at::kHalf) return true;
#endif
#ifdef FLASHMASK_BF16
    if (t == at::kBFloat16) return true;
#endif
    return false;
}

// Numbers in error messages go through std::to_string, never through c10::str's ostream: built
// by a g++ newer than the libstdc++ it runs with (the H100 machine's /opt/gcc), the extension
// carries its own copy of ostream's integer insertion, and streaming an int there crashed the
// process (cuda-gdb: SIGSEGV in basic_ostream::_M_insert<long> under TORCH_CHECK).
std::string num_str(int64_t x) { return std::to_string(x); }

// The smallest compiled head dim that holds d (inputs are zero-padded up to it inside the kernel).
int kernel_head_dim(int d) {
    std::string dims;
    for (int k : kHeadDims) {
        if (k && d <= k) return k;
        if (k) dims += (dims.empty() ? "" : ", ") + num_str(k);
    }
    TORCH_CHECK(false, "flashmask: head dim ", num_str(d), " is larger than every head dim this build compiled (", dims,
                "); rebuild with FLASHMASK_HEAD_DIMS including a larger one");
}

// The (forward, backward) entry points of a compiled (head dim, dtype), or an error naming what
// this build lacks.
struct Kernels {
    void (*fwd)(const AttnParams&, cudaStream_t);
    void (*bwd_kv)(const BwdParams&, cudaStream_t);
    void (*bwd_dq)(const BwdParams&, cudaStream_t);
};

Kernels kernels_for(int head_dim, at::ScalarType dtype) {
    const bool half = dtype == at::kHalf;
#define FLASHMASK_CASE(HDIM, DTYPE)                                                              \
    if (head_dim == HDIM && half == (std::string(#DTYPE) == "fp16"))                              \
        return {&run_fwd_hdim##HDIM##_##DTYPE, &run_bwd_kv_hdim##HDIM##_##DTYPE, &run_bwd_dq_hdim##HDIM##_##DTYPE};
#if defined(FLASHMASK_HDIM32) && defined(FLASHMASK_FP16)
    FLASHMASK_CASE(32, fp16)
#endif
#if defined(FLASHMASK_HDIM32) && defined(FLASHMASK_BF16)
    FLASHMASK_CASE(32, bf16)
#endif
#if defined(FLASHMASK_HDIM64) && defined(FLASHMASK_FP16)
    FLASHMASK_CASE(64, fp16)
#endif
#if defined(FLASHMASK_HDIM64) && defined(FLASHMASK_BF16)
    FLASHMASK_CASE(64, bf16)
#endif
#if defined(FLASHMASK_HDIM96) && defined(FLASHMASK_FP16)
    FLASHMASK_CASE(96, fp16)
#endif
#if defined(FLASHMASK_HDIM96) && defined(FLASHMASK_BF16)
    FLASHMASK_CASE(96, bf16)
#endif
#if defined(FLASHMASK_HDIM128) && defined(FLASHMASK_FP16)
    FLASHMASK_CASE(128, fp16)
#endif
#if defined(FLASHMASK_HDIM128) && defined(FLASHMASK_BF16)
    FLASHMASK_CASE(128, bf16)
#endif
#if defined(FLASHMASK_HDIM192) && defined(FLASHMASK_FP16)
    FLASHMASK_CASE(192, fp16)
#endif
#if defined(FLASHMASK_HDIM192) && defined(FLASHMASK_BF16)
    FLASHMASK_CASE(192, bf16)
#endif
#if defined(FLASHMASK_HDIM256) && defined(FLASHMASK_FP16)
    FLASHMASK_CASE(256, fp16)
#endif
#if defined(FLASHMASK_HDIM256) && defined(FLASHMASK_BF16)
    FLASHMASK_CASE(256, bf16)
#endif
#undef FLASHMASK_CASE
    TORCH_CHECK(false, "flashmask: no kernel compiled for head dim ", num_str(head_dim), " and dtype ", c10::toString(dtype));
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    for (const at::Tensor* t : {&q, &k, &v}) {
        TORCH_CHECK(t->is_cuda(), "flashmask: q, k, v must be CUDA tensors");
        TORCH_CHECK(t->dim() == 4, "flashmask: q, k, v must be [B, S, H, D]");
        TORCH_CHECK(t->stride(-1) == 1, "flashmask: the last dimension of q, k, v must be contiguous");
        TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "flashmask: q, k, v must be 16-byte aligned");
        for (int i = 0; i < 3; ++i) {
            TORCH_CHECK(t->size(i) == 1 || t->stride(i) % 8 == 0,
                        "flashmask: the strides of q, k, v must be multiples of 8 elements");
        }
        TORCH_CHECK(t->scalar_type() == q.scalar_type(), "flashmask: q, k, v must share a dtype");
        TORCH_CHECK(t->get_device() == q.get_device(), "flashmask: q, k, v must be on one device");
    }
    TORCH_CHECK(dtype_compiled(q.scalar_type()), "flashmask: dtype ", c10::toString(q.scalar_type()),
                " is not compiled; this build has ", c10::Join(", ", compiled_dtypes()));
    TORCH_CHECK(k.sizes() == v.sizes(), "flashmask: k and v must have the same shape");
    TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "flashmask: q and k must share B and D");
    TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, "flashmask: Hq must be a multiple of Hk");
    const int64_t d = q.size(3);
    TORCH_CHECK(d % 8 == 0 && d <= 256, "flashmask: head dim must be a multiple of 8 up to 256, got ", num_str(d));
}

void set_strides(const at::Tensor& t, int64_t& batch, int64_t& row, int64_t& head) {
    batch = t.stride(0);
    row = t.stride(1);
    head = t.stride(2);
}

}  // namespace

// Fills the fields shared by forward and backward; allocates the mask bounds for key blocks of
// block_n columns (kept alive by `bounds`).
void fill_common(AttnParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& startend_row_indices, bool causal, double softmax_scale, int block_n,
                 at::Tensor& mask, at::Tensor& bounds, cudaStream_t stream) {
    const int b = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
    const int sk = k.size(1), hk = k.size(2);
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    set_strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
    set_strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
    set_strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
    p.b = b; p.sq = sq; p.sk = sk; p.hq = hq; p.hk = hk; p.d = d;
    p.q_per_kv_head = hq / hk;
    p.softmax_scale = float(softmax_scale);
    p.scale_log2 = float(softmax_scale * M_LOG2E);
    p.causal = causal;
    p.n_key_blocks = (sk + block_n - 1) / block_n;
    if (!startend_row_indices.has_value()) return;
    mask = startend_row_indices->contiguous();
    TORCH_CHECK(mask.scalar_type() == at::kInt && mask.dim() == 4, "flashmask: startend_row_indices must be int32 [B, Hm, Sk, C]");
    TORCH_CHECK(mask.is_cuda() && mask.get_device() == q.get_device(), "flashmask: startend_row_indices must be on the device of q");
    const int hm = mask.size(1), c = mask.size(3);
    TORCH_CHECK(mask.size(0) == b && mask.size(2) == sk, "flashmask: startend_row_indices must be [B, Hm, Sk, C]");
    TORCH_CHECK(hm == 1 || hm == hk || hm == hq, "flashmask: mask heads must be 1, Hk or Hq");
    TORCH_CHECK(causal ? (c == 1 || c == 2) : (c == 2 || c == 4), "flashmask: C=", num_str(c), " is invalid for causal=",
                causal ? "True" : "False");
    bounds = at::empty({b, hm, p.n_key_blocks, kNumBounds}, mask.options());
    launch_mask_bounds(mask.data_ptr<int>(), bounds.data_ptr<int>(), b * hm, sk, c, causal, sq, block_n, stream);
    p.mask = mask.data_ptr<int>();
    p.bounds = bounds.data_ptr<int>();
    p.mask_c = c;
    p.hm = hm;
    p.q_per_mask_head = hq / hm;
}

// Split-KV pays off when the (query tile, head, batch) CTAs cannot fill the GPU, typically short
// queries against long keys: then each tile's key blocks are shared among up to 64 CTAs, keeping
// at least 4 key blocks per split.
int choose_num_splits(int ctas, int n_key_blocks) {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int resident = 2 * sms;  // the forward runs two CTAs per SM
    if (ctas >= resident || n_key_blocks < 8) return 1;
    const int want = (resident + ctas - 1) / ctas;
    return std::max(1, std::min({want, n_key_blocks / 4, 64}));
}

// How many heads the launch interleaves (AttnParams::head_group). Without a mask every head's
// jobs weigh the same, and fewer heads in flight means more CTAs of one head streaming the same
// K/V (forward) or Q/dO (backward) blocks together: the largest divisor of hq whose heads stream
// at most half of L2 (H100, full attention at 128K: forward 302 -> 336 TFLOP/s, backward 283 ->
// 338). A mask makes some jobs far heavier (global tokens, long documents); only interleaving all
// heads starts the heaviest of every head first (global + sliding window at 32K lost a third with
// one head at a time). FLASHMASK_HEAD_GROUP overrides the choice (tuning and tests).
int choose_head_group(int hq, int64_t bytes_per_head, bool masked) {
    if (const char* env = std::getenv("FLASHMASK_HEAD_GROUP")) {
        int g = std::max(1, std::min(hq, std::atoi(env)));
        while (hq % g) --g;
        return g;
    }
    if (masked) return hq;
    const int64_t budget = at::cuda::getCurrentDeviceProperties()->l2CacheSize / 2;
    int g = hq;
    while (g > 1 && (hq % g != 0 || g * bytes_per_head > budget)) --g;
    return g;
}

// Returns {out [B, Sq, Hq, D], lse [B, Hq, Sq] float32}. num_splits: 0 chooses, 1 disables split-KV.
std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& startend_row_indices, bool causal, double softmax_scale,
                            int64_t num_splits) {
    check_qkv(q, k, v);
    const c10::cuda::CUDAGuard guard(q.device());
    const int b = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
    at::Tensor out = at::empty({b, sq, hq, d}, q.options());
    at::Tensor lse = at::empty({b, hq, sq}, q.options().dtype(at::kFloat));
    if (b == 0 || sq == 0 || hq == 0) return {out, lse};
    const int head_dim = kernel_head_dim(d);
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    AttnParams p{};
    at::Tensor mask, bounds;
    fill_common(p, q, k, v, startend_row_indices, causal, softmax_scale, fwd_tile(head_dim).block_n, mask, bounds, stream);
    p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    set_strides(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
    const FwdTile tile = fwd_tile(head_dim);
    const int ctas = b * hq * ((sq + tile.block_m - 1) / tile.block_m);
    TORCH_CHECK(num_splits >= 0 && num_splits <= 256, "flashmask: num_splits must be in [0, 256]");
    p.num_splits = num_splits == 0 ? choose_num_splits(ctas, p.n_key_blocks) : int(num_splits);
    // The K and V of a GQA group are shared by its query heads.
    p.head_group = choose_head_group(hq, int64_t(2) * p.sk * d * q.element_size() / p.q_per_kv_head, p.mask != nullptr);
    at::Tensor o_partial, lse_partial;
    if (p.num_splits > 1) {
        o_partial = at::empty({p.num_splits, b, hq, sq, d}, q.options().dtype(at::kFloat));
        lse_partial = at::empty({p.num_splits, b, hq, sq}, q.options().dtype(at::kFloat));
        p.o_partial = o_partial.data_ptr<float>();
        p.lse_partial = lse_partial.data_ptr<float>();
    }
    at::Tensor order;
    if (p.mask != nullptr) {
        // Longest tiles first: a few tiles may see far more keys than the rest (global tokens,
        // a prefix), and started last they would finish alone.
        const int m_tiles = (sq + tile.block_m - 1) / tile.block_m;
        at::Tensor work = at::empty({b * p.hm, m_tiles}, bounds.options());
        launch_tile_work(p.bounds, work.data_ptr<int>(), b * p.hm, p.n_key_blocks, m_tiles, tile.block_m, tile.block_n,
                         sq, p.sk, causal, stream);
        order = work.argsort(/*stable=*/true, /*dim=*/1, /*descending=*/true).to(at::kInt);
        p.tile_order = order.data_ptr<int>();
    }
    kernels_for(head_dim, q.scalar_type()).fwd(p, stream);
    if (p.num_splits > 1) {
        if (q.scalar_type() == at::kHalf) run_fwd_combine_fp16(p, stream);
        else run_fwd_combine_bf16(p, stream);
    }
    return {out, lse};
}

// Returns {dq, dk, dv} shaped like q, k, v. dlse (optional, [B, Hq, Sq]) is the gradient reaching
// the returned LSE.
std::vector<at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
                            const std::optional<at::Tensor>& startend_row_indices, bool causal, double softmax_scale,
                            bool deterministic) {
    check_qkv(q, k, v);
    TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "flashmask: dout and out must be shaped like q");
    TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                "flashmask: dout and out must have the dtype of q");
    TORCH_CHECK(dout.is_contiguous() && out.stride(-1) == 1, "flashmask: dout must be contiguous and out needs a contiguous last dimension");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(dout.data_ptr()) % 16 == 0, "flashmask: dout must be 16-byte aligned");
    const c10::cuda::CUDAGuard guard(q.device());
    const int b = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
    const int sk = k.size(1), hk = k.size(2);
    at::Tensor dq = at::empty_like(q);
    at::Tensor dk = at::empty_like(k);
    at::Tensor dv = at::empty_like(v);
    if (b == 0 || hq == 0 || sk == 0) {
        dq.zero_(); dk.zero_(); dv.zero_();
        return {dq, dk, dv};
    }
    if (sq == 0) {
        dk.zero_(); dv.zero_();
        return {dq, dk, dv};
    }
    const at::Tensor lse_c = lse.contiguous();
    TORCH_CHECK(lse_c.scalar_type() == at::kFloat && lse_c.dim() == 3 && lse_c.size(0) == b && lse_c.size(1) == hq &&
                lse_c.size(2) == sq, "flashmask: lse must be float32 [B, Hq, Sq]");
    at::Tensor dlse_c;
    if (dlse.has_value()) {
        dlse_c = dlse->to(at::kFloat).contiguous();
        TORCH_CHECK(dlse_c.sizes() == lse_c.sizes(), "flashmask: dlse must be shaped like lse");
    }
    const int head_dim = kernel_head_dim(d);
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    BwdParams p{};
    at::Tensor mask, bounds;
    fill_common(p, q, k, v, startend_row_indices, causal, softmax_scale, bwd_tile(head_dim).block_n, mask, bounds, stream);
    p.o = out.data_ptr();
    set_strides(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
    p.lse = lse_c.data_ptr<float>();
    p.dout = dout.data_ptr();
    set_strides(dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);

    at::Tensor dsum = at::empty({b, hq, sq}, q.options().dtype(at::kFloat));
    p.dsum = dsum.data_ptr<float>();
    const float* dlse_ptr = dlse.has_value() ? dlse_c.data_ptr<float>() : nullptr;
    if (q.scalar_type() == at::kHalf) run_bwd_dsum_fp16(p, dlse_ptr, stream);
    else run_bwd_dsum_bf16(p, dlse_ptr, stream);

    // GQA: each query head writes its own dK, dV slice; the group is summed below.
    const bool expand = hq != hk;
    at::Tensor dk_h = expand ? at::empty({b, sk, hq, d}, k.options()) : dk;
    at::Tensor dv_h = expand ? at::empty({b, sk, hq, d}, v.options()) : dv;
    p.dk = dk_h.data_ptr();
    p.dv = dv_h.data_ptr();
    set_strides(dk_h, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
    set_strides(dv_h, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
    p.dq = dq.data_ptr();
    set_strides(dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
    at::Tensor dq_accum;
    if (!deterministic) {
        const int block_m = bwd_tile(head_dim).block_m;
        dq_accum = at::zeros({b, hq, (sq + block_m - 1) / block_m, block_m * head_dim}, q.options().dtype(at::kFloat));
        p.dq_accum = dq_accum.data_ptr<float>();
    }
    p.head_group = choose_head_group(hq, int64_t(2) * sq * d * q.element_size(), p.mask != nullptr);
    const Kernels kernels = kernels_for(head_dim, q.scalar_type());
    kernels.bwd_kv(p, stream);
    if (deterministic) kernels.bwd_dq(p, stream);
    if (expand) {
        dk.copy_(dk_h.view({b, sk, hk, hq / hk, d}).sum(3, /*keepdim=*/false, at::kFloat));
        dv.copy_(dv_h.view({b, sk, hk, hq / hk, d}).sum(3, /*keepdim=*/false, at::kFloat));
    }
    return {dq, dk, dv};
}

}  // namespace flashmask

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "flashmask CUDA kernels";
    m.def("fwd", &flashmask::fwd, "FlashMask attention forward", py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("startend_row_indices"), py::arg("causal"), py::arg("softmax_scale"), py::arg("num_splits") = 0);
    m.def("bwd", &flashmask::bwd, "FlashMask attention backward", py::arg("dout"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dlse"), py::arg("startend_row_indices"),
          py::arg("causal"), py::arg("softmax_scale"), py::arg("deterministic"));
    m.def("head_dims", &flashmask::compiled_head_dims);
    m.def("dtypes", &flashmask::compiled_dtypes);
}
