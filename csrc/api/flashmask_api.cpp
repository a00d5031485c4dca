// Python binding: argument checks, output allocation, the mask's metadata (per-block bounds and
// tile order, cached per mask: mask_cache.h) and dispatch to the (architecture, head dim, value head
// dim, dtype) instantiations that this build compiled (registry.h).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "api/launch_policy.h"
#include "api/mask_cache.h"
#include "api/overrides.h"
#include "api/registry.h"
#include "common/row_kernels.h"
#include "common/softcap_max.h"

namespace flashmask {
namespace {

// See registry.cpp: numbers in messages go through std::to_string.
std::string num_str(int64_t x) { return std::to_string(x); }

DType dtype_of(const at::Tensor& t) { return t.scalar_type() == at::kHalf ? DType::fp16 : DType::bf16; }

int device_cc(const at::Tensor& t) {
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(t.get_device());
    return prop->major * 10 + prop->minor;
}

std::string shape_str(at::IntArrayRef sizes) {
    std::string s;
    for (int64_t x : sizes) s += (s.empty() ? "[" : ", ") + num_str(x);
    return s.empty() ? "[]" : s + "]";
}

// q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]: D is the head dim of q and k, Dv that of v
// and the output.
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
    TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                "flashmask: the kernels take float16 or bfloat16, not ", c10::toString(q.scalar_type()));
    TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3),
                "flashmask: k must be [B, Sk, Hk, D] with the B and D of q ", shape_str(q.sizes()), ", got ",
                shape_str(k.sizes()));
    TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2),
                "flashmask: v must be [B, Sk, Hk, Dv] with the B, Sk and Hk of k ", shape_str(k.sizes()), ", got ",
                shape_str(v.sizes()));
    TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, "flashmask: Hq must be a multiple of Hk");
    const int64_t d = q.size(3), d_v = v.size(3);
    TORCH_CHECK(d % 8 == 0 && d <= 256, "flashmask: head dim must be a multiple of 8 up to 256, got ", num_str(d));
    TORCH_CHECK(d_v % 8 == 0 && d_v <= 256,
                "flashmask: the value head dim (the last dim of v) must be a multiple of 8 up to 256, got ",
                num_str(d_v));
}

void set_strides(const at::Tensor& t, int64_t& batch, int64_t& row, int64_t& head) {
    batch = t.stride(0);
    row = t.stride(1);
    head = t.stride(2);
}

}  // namespace

// Fills the fields shared by forward and backward; takes the mask bounds for key blocks of block_n
// columns and, for the forward (query tiles of block_m rows), the order of its query tiles from the
// mask cache (mask_cache.h; `meta` keeps them alive through the call), and the job list `jobs`: the
// persistent forward's query tiles, or the SM90 backward's key blocks (walking query blocks of
// block_m rows); with keys_seen (the forward), the per-row key counts that tell a row the mask hides
// from one whose scores were all -inf.
void fill_common(AttnParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& startend_row_indices, bool causal, double softmax_scale,
                 double softcap, int block_m, int block_n, Jobs jobs, bool keys_seen, MaskMeta& meta,
                 cudaStream_t stream) {
    const int b = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
    const int sk = k.size(1), hk = k.size(2);
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    set_strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
    set_strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
    set_strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
    p.b = b;
    p.sq = sq;
    p.sk = sk;
    p.hq = hq;
    p.hk = hk;
    p.d = d;
    p.d_v = v.size(3);
    p.q_per_kv_head = hq / hk;
    TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "flashmask: softcap must be finite and >= 0 (0: off), got ",
                softcap);
    p.softmax_scale = float(softmax_scale);
    // Soft-capped scores are tanh(q.k * softmax_scale / softcap), whose softmax runs at scale softcap.
    p.softcap_scale = softcap > 0.0 ? float(softmax_scale / softcap) : 0.f;
    p.score_scale = float(softcap > 0.0 ? softcap : softmax_scale);
    p.scale_log2 = float(p.score_scale * M_LOG2E);
    p.softcap_max = softcap > 0.0 && q.scalar_type() == at::kBFloat16 ? softcap_fixed_max(p.scale_log2) : -1.f;
    p.causal = causal;
    p.n_key_blocks = (sk + block_n - 1) / block_n;
    if (!startend_row_indices.has_value()) return;
    const at::Tensor& mask = *startend_row_indices;
    TORCH_CHECK(mask.scalar_type() == at::kInt && mask.dim() == 4,
                "flashmask: startend_row_indices must be int32 [B, Hm, Sk, C]");
    TORCH_CHECK(mask.is_cuda() && mask.get_device() == q.get_device(),
                "flashmask: startend_row_indices must be on the device of q");
    const int hm = mask.size(1), c = mask.size(3);
    TORCH_CHECK(mask.size(0) == b && mask.size(2) == sk, "flashmask: startend_row_indices must be [B, Hm, Sk, C]");
    TORCH_CHECK(hm == 1 || hm == hk || hm == hq, "flashmask: mask heads must be 1, Hk or Hq");
    TORCH_CHECK(causal ? (c == 1 || c == 2) : (c == 2 || c == 4), "flashmask: C=", num_str(c),
                " is invalid for causal=", causal ? "True" : "False");
    meta = mask_metadata(mask, causal, sq, block_m, block_n, hq, jobs, keys_seen, stream);
    p.mask = meta.mask.data_ptr<int>();
    p.bounds = meta.bounds.data_ptr<int>();
    p.tile_order = meta.order.defined() ? meta.order.data_ptr<int>() : nullptr;
    p.tile_floor = meta.floor.defined() ? meta.floor.data_ptr<int>() : nullptr;
    p.job_list = jobs != Jobs::none ? meta.jobs.data_ptr<int>() : nullptr;
    p.keys_seen = keys_seen ? meta.keys_seen.data_ptr<int>() : nullptr;
    p.mask_c = c;
    p.hm = hm;
    p.q_per_mask_head = hq / hm;
}

// Returns {out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32}. num_splits: 0 chooses, 1 disables split-KV.
std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& startend_row_indices, bool causal, double softmax_scale,
                            int64_t num_splits, int64_t arch, double softcap, const std::optional<at::Tensor>& sinks) {
    check_qkv(q, k, v);
    const c10::cuda::CUDAGuard guard(q.device());
    const int b = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3), d_v = v.size(3);
    at::Tensor out = at::empty({b, sq, hq, d_v}, q.options());
    at::Tensor lse = at::empty({b, hq, sq}, q.options().dtype(at::kFloat));
    if (b == 0 || sq == 0 || hq == 0) return {out, lse};
    const Selection sel = select_kernels(d, d_v, dtype_of(q), device_cc(q), int(arch), Slot::fwd);
    TORCH_CHECK(num_splits >= 0 && num_splits <= 256, "flashmask: num_splits must be in [0, 256]");
    if (num_splits == 0) {  // split-KV for short query blocks against long keys
        const int tiles = b * hq * ((sq + sel.tiles.fwd_block_m - 1) / sel.tiles.fwd_block_m);
        const int n_key_blocks = (k.size(1) + sel.tiles.fwd_block_n - 1) / sel.tiles.fwd_block_n;
        num_splits = choose_num_splits(tiles, n_key_blocks, sel.kernels->arch == 90 ? 1 : 2);
    }
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    AttnParams p{};
    MaskMeta meta;
    // The SM90 forward is persistent: its CTAs draw jobs from a counter.
    const bool persistent = sel.kernels->arch == 90;
    fill_common(p, q, k, v, startend_row_indices, causal, softmax_scale, softcap, sel.tiles.fwd_block_m,
                sel.tiles.fwd_block_n, persistent ? Jobs::query_tiles : Jobs::none, /*keys_seen=*/true, meta, stream);
    at::Tensor sinks_f;
    if (sinks.has_value()) {
        TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == hq && sinks->is_floating_point(),
                    "flashmask: sinks must be a float tensor [Hq] = [", hq, "], got ", sinks->scalar_type(), " ",
                    shape_str(sinks->sizes()));
        TORCH_CHECK(sinks->device() == q.device(), "flashmask: sinks must be on the device of q");
        sinks_f = sinks->to(at::kFloat).contiguous();
        p.sinks = sinks_f.data_ptr<float>();
    }
    at::Tensor job_counter;
    if (persistent) {  // a memset, not at::zeros: a fill kernel through the dispatcher costs more host time
        job_counter = at::empty({1}, q.options().dtype(at::kInt));
        p.job_counter = job_counter.data_ptr<int>();
        C10_CUDA_CHECK(cudaMemsetAsync(p.job_counter, 0, sizeof(int), stream));
    }
    p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    set_strides(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
    p.num_splits = int(num_splits);
    p.decode_warp = use_decode_warp(p.sk, sel.tiles.fwd_decode_warp_keys);
    // The K and V of a GQA group are shared by its query heads.
    p.head_group =
        choose_head_group(hq, int64_t(p.sk) * (d + d_v) * q.element_size() / p.q_per_kv_head, p.mask != nullptr);
    at::Tensor o_partial, lse_partial;
    if (p.num_splits > 1) {
        o_partial = at::empty({p.num_splits, b, hq, sq, d_v}, q.options().dtype(at::kFloat));
        lse_partial = at::empty({p.num_splits, b, hq, sq}, q.options().dtype(at::kFloat));
        p.o_partial = o_partial.data_ptr<float>();
        p.lse_partial = lse_partial.data_ptr<float>();
    }
    sel.kernels->fwd(p, stream);
    if (p.num_splits > 1) {
        if (q.scalar_type() == at::kHalf)
            run_fwd_combine_fp16(p, stream);
        else
            run_fwd_combine_bf16(p, stream);
    }
    return {out, lse};
}

// Returns {dq, dk, dv} shaped like q, k, v, and the row term D = rowsum(dO * O) - dlse [B, Hq, Sq]
// float32; dout and out are [B, Sq, Hq, Dv]. dlse (optional, [B, Hq, Sq]) is the gradient reaching
// the returned LSE.
std::vector<at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
                            const std::optional<at::Tensor>& startend_row_indices, bool causal, double softmax_scale,
                            bool deterministic, int64_t arch, double softcap) {
    check_qkv(q, k, v);
    const std::vector<int64_t> o_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"dout", &dout}, {"out", &out}}) {
        TORCH_CHECK(t->sizes() == at::IntArrayRef(o_shape), "flashmask: ", name,
                    " must be [B, Sq, Hq, Dv] (the B, Sq, Hq of q and the Dv of v) = ", shape_str(o_shape), ", got ",
                    shape_str(t->sizes()));
    }
    TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                "flashmask: dout and out must have the dtype of q");
    TORCH_CHECK(dout.is_contiguous() && out.stride(-1) == 1,
                "flashmask: dout must be contiguous and out needs a contiguous last dimension");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(dout.data_ptr()) % 16 == 0, "flashmask: dout must be 16-byte aligned");
    const c10::cuda::CUDAGuard guard(q.device());
    const int b = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3), d_v = v.size(3);
    const int sk = k.size(1), hk = k.size(2);
    at::Tensor dq = at::empty_like(q);
    at::Tensor dk = at::empty_like(k);
    at::Tensor dv = at::empty_like(v);
    if (b == 0 || hq == 0 || sk == 0 || sq == 0) {  // no key: O = 0, so D = -dlse
        dq.zero_();
        dk.zero_();
        dv.zero_();
        at::Tensor dsum = at::zeros({b, hq, sq}, q.options().dtype(at::kFloat));
        if (dlse.has_value()) dsum.sub_(*dlse);
        return {dq, dk, dv, dsum};
    }
    const at::Tensor lse_c = lse.contiguous();
    TORCH_CHECK(lse_c.scalar_type() == at::kFloat && lse_c.dim() == 3 && lse_c.size(0) == b && lse_c.size(1) == hq &&
                    lse_c.size(2) == sq,
                "flashmask: lse must be float32 [B, Hq, Sq]");
    at::Tensor dlse_c;
    if (dlse.has_value()) {
        dlse_c = dlse->to(at::kFloat).contiguous();
        TORCH_CHECK(dlse_c.sizes() == lse_c.sizes(), "flashmask: dlse must be shaped like lse");
    }
    const Selection sel = select_kernels(d, d_v, dtype_of(q), device_cc(q), int(arch),
                                         deterministic ? Slot::bwd_deterministic : Slot::bwd);
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    BwdParams p{};
    MaskMeta meta;
    // The SM90 backward takes its key blocks in the order of a job list (heaviest first, few heads
    // in flight); its deterministic mode in the launch order, which its dQ turns follow, and from
    // kTurnListKeys keys with a mask in a list of that order whose head grouping suits the mask.
    const bool sm90 = sel.kernels->arch == 90;
    const Jobs jobs = sm90 && !deterministic                                ? Jobs::key_blocks
                      : sm90 && sk >= kTurnListKeys && !head_group_forced() ? Jobs::key_blocks_in_turn
                                                                            : Jobs::none;
    fill_common(p, q, k, v, startend_row_indices, causal, softmax_scale, softcap,
                jobs != Jobs::none ? sel.tiles.bwd_block_m : 0, sel.tiles.bwd_block_n, jobs, /*keys_seen=*/false, meta,
                stream);
    p.o = out.data_ptr();
    set_strides(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
    p.lse = lse_c.data_ptr<float>();
    p.dout = dout.data_ptr();
    set_strides(dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);

    // The SM90 kernel loads a query block's LSE and D by bulk copies: rows padded to whole blocks.
    const bool padded_stats = sel.kernels->arch == 90;
    const int block_m = sel.tiles.bwd_block_m;
    p.stats_stride = padded_stats ? (sq + block_m - 1) / block_m * block_m : sq;
    at::Tensor dsum = at::empty({b, hq, p.stats_stride}, q.options().dtype(at::kFloat));
    p.dsum = dsum.data_ptr<float>();
    at::Tensor lse_log2;
    if (padded_stats) {
        lse_log2 = at::empty_like(dsum);
        p.lse_log2 = lse_log2.data_ptr<float>();
    }

    // GQA: each query head writes its own dK, dV slice and the group is summed below.
    const bool expand = hq != hk;
    at::Tensor dk_h = expand ? at::empty({b, sk, hq, d}, k.options()) : dk;
    at::Tensor dv_h = expand ? at::empty({b, sk, hq, d_v}, v.options()) : dv;
    p.dk = dk_h.data_ptr();
    p.dv = dv_h.data_ptr();
    set_strides(dk_h, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
    set_strides(dv_h, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
    p.dq = dq.data_ptr();
    set_strides(dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
    // dQ: fp32 atomics into dq_accum, or (deterministic) a dQ kernel of its own (SM80), or the SM90
    // kernel's additions taken in key block order through one semaphore per query block.
    const bool dq_kernel = deterministic && sel.kernels->arch != 90;
    at::Tensor dq_accum, dq_semaphore;
    if (!dq_kernel) {
        const int m_blocks = (sq + block_m - 1) / block_m;
        // With padded rows the D kernel zeroes the accumulator (row i of a (batch, head) owns its
        // head-dim floats at i * head dim), in the pass that reads dO and O anyway.
        const auto shape = std::vector<int64_t>{b, hq, m_blocks, block_m * sel.kernels->head_dim};
        dq_accum = padded_stats ? at::empty(shape, q.options().dtype(at::kFloat))
                                : at::zeros(shape, q.options().dtype(at::kFloat));
        p.dq_accum = dq_accum.data_ptr<float>();
        if (padded_stats) p.dq_accum_row = sel.kernels->head_dim;
        if (deterministic) {
            dq_semaphore = at::zeros({b, hq, m_blocks}, q.options().dtype(at::kInt));
            p.dq_semaphore = dq_semaphore.data_ptr<int>();
        }
    }
    // The SM90 backward's persistent CTAs draw jobs from this counter, which the D kernel zeroes
    // (one launch fewer than a fill).
    at::Tensor job_counter;
    if (sel.kernels->arch == 90) {
        job_counter = at::empty({1}, q.options().dtype(at::kInt));
        p.job_counter = job_counter.data_ptr<int>();
    }
    const float* dlse_ptr = dlse.has_value() ? dlse_c.data_ptr<float>() : nullptr;
    if (q.scalar_type() == at::kHalf)
        run_bwd_dsum_fp16(p, dlse_ptr, stream);
    else
        run_bwd_dsum_bf16(p, dlse_ptr, stream);
    p.head_group = choose_head_group(hq, int64_t(sq) * (d + d_v) * q.element_size(), p.mask != nullptr);
    sel.kernels->bwd_kv(p, stream);
    if (dq_kernel) sel.kernels->bwd_dq(p, stream);
    if (expand) {
        // One pass: the reduction accumulates the half-precision slices in fp32 and rounds once.
        at::sum_out(dk, dk_h.view({b, sk, hk, hq / hk, d}), 3);
        at::sum_out(dv, dv_h.view({b, sk, hk, hq / hk, d_v}), 3);
    }
    // D, which the sinks' gradient reads (flashmask/_cuda.py sink_grad), without the padding.
    return {dq, dk, dv, dsum.narrow(2, 0, sq)};
}

// Pins choices the library otherwise makes itself (api/overrides.h), for the tests; returns the
// previous (head_group, decode_warp, mask_cache).
std::tuple<int64_t, int64_t, int64_t> set_overrides(int64_t head_group, int64_t decode_warp, int64_t mask_cache) {
    TORCH_CHECK(head_group >= 0 && head_group <= (int64_t(1) << 30),
                "flashmask: head_group must be 0 (the library's choice) or a positive head count, got ",
                num_str(head_group));
    TORCH_CHECK(decode_warp >= -1 && decode_warp <= 1,
                "flashmask: decode_warp must be -1 (the library's choice), 0 or 1, got ", num_str(decode_warp));
    TORCH_CHECK(mask_cache >= -1 && mask_cache <= 1,
                "flashmask: mask_cache must be -1 (the library's choice), 0 or 1, got ", num_str(mask_cache));
    Overrides& o = overrides();
    const std::tuple<int64_t, int64_t, int64_t> previous{o.head_group, o.decode_warp, o.mask_cache};
    o.head_group = int(head_group);
    o.decode_warp = int(decode_warp);
    o.mask_cache = int(mask_cache);
    return previous;
}

}  // namespace flashmask

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "flashmask CUDA kernels";
    m.def("fwd", &flashmask::fwd, "FlashMask attention forward", py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("startend_row_indices"), py::arg("causal"), py::arg("softmax_scale"), py::arg("num_splits") = 0,
          py::arg("arch") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
    m.def("bwd", &flashmask::bwd, "FlashMask attention backward", py::arg("dout"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dlse"), py::arg("startend_row_indices"),
          py::arg("causal"), py::arg("softmax_scale"), py::arg("deterministic"), py::arg("arch") = 0,
          py::arg("softcap") = 0.0);
    m.def("mask_cache_stats", &flashmask::mask_cache_stats,
          "(hits, misses) of the mask metadata cache since its last clear");
    m.def("mask_cache_clear", &flashmask::mask_cache_clear, "empty the mask metadata cache and zero its counts");
    m.def("_set_overrides", &flashmask::set_overrides,
          "tests only: pin the head group, the SM90 forward's decode warp and the mask cache (0 / -1: the "
          "library's choice); returns the previous values",
          py::arg("head_group") = 0, py::arg("decode_warp") = -1, py::arg("mask_cache") = -1);
    m.def("head_dims", &flashmask::compiled_head_dims, "the equal head dims compiled (sorted)");
    m.def("head_dim_pairs", &flashmask::compiled_head_dim_pairs,
          "every (head dim, value head dim) pair compiled, equal ones included (sorted)");
    m.def("dtypes", &flashmask::compiled_dtypes);
    m.def("cuda_targets", &flashmask::cuda_targets, "the build's device code targets, e.g. sm_80, sm_90a");
    m.def("has_code_for", &flashmask::has_code_for,
          "whether the build carries device code for compute capability cc (major * 10 + minor)", py::arg("cc"));
    m.def("archs", &flashmask::compiled_archs,
          "architecture families compiled for (head dim, dtype name, value head dim; 0: equal to the head dim)",
          py::arg("head_dim"), py::arg("dtype"), py::arg("head_dim_v") = 0);
    m.def("device_archs", &flashmask::device_archs,
          "those of archs() whose kernels run on a device of compute capability cc (major * 10 + minor)",
          py::arg("head_dim"), py::arg("dtype"), py::arg("cc"), py::arg("head_dim_v") = 0);
    m.def(
        "selected_arch",
        [](int64_t d, const std::string& dtype, int64_t cc, int64_t arch, const std::string& slot, int64_t d_v) {
            const flashmask::DType t = dtype == "float16" ? flashmask::DType::fp16 : flashmask::DType::bf16;
            const flashmask::Slot s = slot == "fwd"   ? flashmask::Slot::fwd
                                      : slot == "bwd" ? flashmask::Slot::bwd
                                                      : flashmask::Slot::bwd_deterministic;
            return int64_t(
                flashmask::select_kernels(int(d), int(d_v == 0 ? d : d_v), t, int(cc), int(arch), s).kernels->arch);
        },
        "the architecture family a call would run on (slot: fwd, bwd or bwd_deterministic; head_dim_v 0: equal to "
        "the head dim)",
        py::arg("head_dim"), py::arg("dtype"), py::arg("cc"), py::arg("arch"), py::arg("slot"),
        py::arg("head_dim_v") = 0);
}
