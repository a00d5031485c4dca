#include "api/registry.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>

#include "sm80/tile_config.h"
#include "sm90/tile_config.h"

namespace flashmask {

#include "kernel_registry.inc"  // generated: declarations and kKernelSets

namespace {

const char* dtype_name(DType t) { return t == DType::fp16 ? "float16" : "bfloat16"; }

// sm_90a code (wgmma, setmaxnreg) runs on compute capability 9.0 only; the mma.sync kernels on
// anything from 8.0 (the build carries sm_80 and sm_90 code).
bool runs_on(int arch, int cc) { return arch == 90 ? cc == 90 : arch <= cc; }

TileSizes tiles_of(const KernelSet& k) {
    if (k.arch == 90) {
        const sm90::FwdTile f = sm90::fwd_tile(k.head_dim);
        const sm90::BwdTile b = sm90::bwd_tile(k.head_dim);
        return {f.block_m, f.block_n, b.block_m, b.block_n, f.decode_warp_keys};
    }
    const sm80::FwdTile f = sm80::fwd_tile(k.head_dim);
    const sm80::BwdTile b = sm80::bwd_tile(k.head_dim);
    return {f.block_m, f.block_n, b.block_m, b.block_n};
}

// The deterministic backward: the SM80 kernels recompute dQ in a kernel of its own (bwd_dq); the
// SM90 backward orders its dQ additions itself (BwdParams::dq_semaphore).
bool deterministic_in_bwd_kv(const KernelSet& k) { return k.arch == 90; }

bool has(const KernelSet& k, Slot slot) {
    switch (slot) {
        case Slot::fwd:
            return k.fwd != nullptr;
        case Slot::bwd:
            return k.bwd_kv != nullptr;
        default:
            return k.bwd_kv != nullptr && (k.bwd_dq != nullptr || deterministic_in_bwd_kv(k));
    }
}

// Numbers in error messages go through std::to_string, never through c10::str's ostream: built by
// a g++ newer than the libstdc++ it runs with, the extension carries its own copy of ostream's
// integer insertion, and streaming an int there crashes the process inside TORCH_CHECK.
std::string join(const std::vector<int64_t>& xs) {
    std::string s;
    for (int64_t x : xs) s += (s.empty() ? "" : ", ") + std::to_string(x);
    return s;
}

// The head dims some family compiled a forward for (sorted, unique): the table is fixed at build
// time, so it is gathered once (thread-safe static initialisation) rather than on every call.
const std::vector<int64_t>& head_dims() {
    static const std::vector<int64_t> dims = [] {
        std::vector<int64_t> v;
        for (const KernelSet& k : kKernelSets) {
            if (k.fwd != nullptr && std::find(v.begin(), v.end(), k.head_dim) == v.end()) v.push_back(k.head_dim);
        }
        std::sort(v.begin(), v.end());
        return v;
    }();
    return dims;
}

// FLASHMASK_ARCH as std::atoi reads it (0 when unset or not a number), read once: at the first
// selection of the process, so it must be set before the first attention call.
int env_arch() {
    static const int arch = [] {
        const char* env = std::getenv("FLASHMASK_ARCH");
        return env != nullptr ? std::atoi(env) : 0;
    }();
    return arch;
}

}  // namespace

std::vector<int64_t> compiled_head_dims() { return head_dims(); }

std::vector<std::string> compiled_dtypes() {
    std::vector<std::string> names;
    for (DType t : {DType::fp16, DType::bf16}) {
        for (const KernelSet& k : kKernelSets) {
            if (k.fwd != nullptr && k.dtype == t) {
                names.push_back(dtype_name(t));
                break;
            }
        }
    }
    return names;
}

std::vector<int64_t> compiled_archs(int64_t head_dim, const std::string& dtype) {
    std::vector<int64_t> archs;
    for (const KernelSet& k : kKernelSets) {
        if (k.fwd != nullptr && k.head_dim == head_dim && dtype == dtype_name(k.dtype)) archs.push_back(k.arch);
    }
    return archs;
}

Selection select_kernels(int d, DType dtype, int cc, int arch, Slot slot) {
    if (arch == 0) arch = env_arch();
    TORCH_CHECK(arch == 0 || arch == 80 || arch == 90, "flashmask: unknown kernel architecture ", std::to_string(arch),
                " (FLASHMASK_ARCH / backend): choose 80 or 90");
    TORCH_CHECK(arch == 0 || runs_on(arch, cc), "flashmask: the sm", std::to_string(arch),
                " kernels cannot run on a device of compute capability ", std::to_string(cc));
    const std::vector<int64_t>& dims = head_dims();
    const auto it = std::find_if(dims.begin(), dims.end(), [d](int64_t k) { return d <= k; });
    TORCH_CHECK(it != dims.end(), "flashmask: head dim ", std::to_string(d),
                " is larger than every head dim this build compiled (", join(dims),
                "); rebuild with FLASHMASK_HEAD_DIMS including a larger one");
    const int head_dim = int(*it);
    // A family without a backward yet leaves the backward of a forced family to the newest that has one.
    if (slot != Slot::fwd && arch != 0) {
        bool any = false;
        for (const KernelSet& k : kKernelSets) any |= k.arch == arch && has(k, slot) && k.head_dim == head_dim;
        if (!any) arch = 0;
    }
    const KernelSet* best = nullptr;
    for (const KernelSet& k : kKernelSets) {
        if (!has(k, slot) || k.head_dim != head_dim || k.dtype != dtype || !runs_on(k.arch, cc)) continue;
        if (arch != 0 && k.arch != arch) continue;
        if (best == nullptr || k.arch > best->arch) best = &k;
    }
    TORCH_CHECK(best != nullptr, "flashmask: no ", arch ? "sm" + std::to_string(arch) + " " : std::string(),
                "kernel compiled for head dim ", std::to_string(head_dim), " and dtype ", dtype_name(dtype),
                " (this build: head dims ", join(dims), "; FLASHMASK_HEAD_DIMS / FLASHMASK_DTYPES / FLASHMASK_ARCHS)");
    return {best, tiles_of(*best)};
}

}  // namespace flashmask
