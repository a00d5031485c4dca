#include "api/registry.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "sm80/tile_config.h"
#include "sm90/tile_config.h"

namespace flashmask {

#include "kernel_registry.inc"  // generated: declarations and kKernelSets

namespace {

const char* dtype_name(DType t) { return t == DType::fp16 ? "float16" : "bfloat16"; }

// sm_90a code (wgmma, setmaxnreg) runs on compute capability 9.0 only; the mma.sync kernels on
// anything from 8.0. Whether the build carries code for the device at all (has_code_for) is asked
// once, where a choice starts.
bool runs_on(int arch, int cc) { return arch == 90 ? cc == 90 : arch <= cc; }

TileSizes tiles_of(const KernelSet& k) {
    if (k.arch == 90) {
        const sm90::FwdTile f = sm90::fwd_tile(k.head_dim, k.head_dim_v);
        const sm90::BwdTile b = sm90::bwd_tile(k.head_dim, k.head_dim_v);
        return {f.block_m, f.block_n, b.block_m, b.block_n, f.decode_warp_keys};
    }
    const sm80::FwdTile f = sm80::fwd_tile(k.head_dim, k.head_dim_v);
    const sm80::BwdTile b = sm80::bwd_tile(k.head_dim, k.head_dim_v);
    return {f.block_m, f.block_n, b.block_m, b.block_n};
}

// The deterministic backward: the SM80 kernels recompute dQ in a kernel of its own (bwd_dq); the
// SM90 backward orders its dQ additions itself (BwdParams::dq_semaphore).
bool deterministic_in_bwd_kv(const KernelSet& k) { return k.arch == 90; }

bool has(const KernelSet& k, Slot slot, int cc) {
    if (k.skips_sm90 && cc / 10 == 9) return false;
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

std::string join(const std::vector<std::string>& xs) {
    std::string s;
    for (const std::string& x : xs) s += (s.empty() ? "" : ", ") + x;
    return s;
}

std::string join(const std::vector<std::pair<int64_t, int64_t>>& pairs) {
    std::string s;
    for (const auto& [d, dv] : pairs)
        s += (s.empty() ? "(" : ", (") + std::to_string(d) + ", " + std::to_string(dv) + ")";
    return s;
}

// How a call's head dims read in messages: "head dim 128", or "head dims (q/k 192, v 128)".
std::string dims_str(int64_t d, int64_t dv) {
    if (d == dv) return "head dim " + std::to_string(d);
    return "head dims (q/k " + std::to_string(d) + ", v " + std::to_string(dv) + ")";
}

// The (head dim, value head dim) pairs some family compiled a forward for (sorted, unique): the
// table is fixed at build time, so it is gathered once (thread-safe static initialisation) rather
// than on every call.
const std::vector<std::pair<int64_t, int64_t>>& head_dim_pairs() {
    static const std::vector<std::pair<int64_t, int64_t>> pairs = [] {
        std::vector<std::pair<int64_t, int64_t>> v;
        for (const KernelSet& k : kKernelSets) {
            const std::pair<int64_t, int64_t> pair{k.head_dim, k.head_dim_v};
            if (k.fwd != nullptr && std::find(v.begin(), v.end(), pair) == v.end()) v.push_back(pair);
        }
        std::sort(v.begin(), v.end());
        return v;
    }();
    return pairs;
}

// The equal head dims among them.
const std::vector<int64_t>& head_dims() {
    static const std::vector<int64_t> dims = [] {
        std::vector<int64_t> v;
        for (const auto& [d, dv] : head_dim_pairs()) {
            if (d == dv) v.push_back(d);
        }
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

bool has_code_for(int cc) {
    if (kCudaTargets[0].cc == 0) return true;
    for (const CudaTarget& t : kCudaTargets) {
        if (t.cc != 0 && (t.arch_specific ? t.cc == cc : t.cc / 10 == cc / 10 && t.cc <= cc)) return true;
    }
    return false;
}

std::vector<std::string> cuda_targets() {
    std::vector<std::string> names;
    for (const CudaTarget& t : kCudaTargets) {
        if (t.cc != 0) names.push_back("sm_" + std::to_string(t.cc) + (t.arch_specific ? "a" : ""));
    }
    return names;
}

std::vector<int64_t> compiled_head_dims() { return head_dims(); }

std::vector<std::pair<int64_t, int64_t>> compiled_head_dim_pairs() { return head_dim_pairs(); }

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

std::vector<int64_t> compiled_archs(int64_t head_dim, const std::string& dtype, int64_t head_dim_v) {
    if (head_dim_v == 0) head_dim_v = head_dim;
    std::vector<int64_t> archs;
    for (const KernelSet& k : kKernelSets) {
        if (k.fwd != nullptr && k.head_dim == head_dim && k.head_dim_v == head_dim_v && dtype == dtype_name(k.dtype))
            archs.push_back(k.arch);
    }
    return archs;
}

std::vector<int64_t> device_archs(int64_t head_dim, const std::string& dtype, int64_t cc, int64_t head_dim_v) {
    if (head_dim_v == 0) head_dim_v = head_dim;
    std::vector<int64_t> archs;
    if (!has_code_for(int(cc))) return archs;
    for (const KernelSet& k : kKernelSets) {
        if (k.head_dim == head_dim && k.head_dim_v == head_dim_v && dtype == dtype_name(k.dtype) &&
            runs_on(k.arch, int(cc)) && has(k, Slot::fwd, int(cc)) && has(k, Slot::bwd, int(cc)) &&
            has(k, Slot::bwd_deterministic, int(cc)))
            archs.push_back(k.arch);
    }
    return archs;
}

Selection select_kernels(int d, int dv, DType dtype, int cc, int arch, Slot slot) {
    if (arch == 0) arch = env_arch();
    TORCH_CHECK(arch == 0 || arch == 80 || arch == 90, "flashmask: unknown kernel architecture ", std::to_string(arch),
                " (FLASHMASK_ARCH / backend): choose 80 or 90");
    TORCH_CHECK(has_code_for(cc), "flashmask: this build has no device code for compute capability ",
                std::to_string(cc / 10), ".", std::to_string(cc % 10), " (it carries ", join(cuda_targets()), ")");
    TORCH_CHECK(arch == 0 || runs_on(arch, cc), "flashmask: the sm", std::to_string(arch),
                " kernels cannot run on a device of compute capability ", std::to_string(cc));
    const std::vector<std::pair<int64_t, int64_t>>& pairs = head_dim_pairs();
    const auto it = std::find_if(pairs.begin(), pairs.end(), [d, dv](const std::pair<int64_t, int64_t>& k) {
        return d <= k.first && dv <= k.second;
    });
    if (d == dv) {
        TORCH_CHECK(it != pairs.end(), "flashmask: head dim ", std::to_string(d),
                    " is larger than every head dim this build compiled (", join(head_dims()),
                    "); rebuild with FLASHMASK_HEAD_DIMS including a larger one");
    } else {
        TORCH_CHECK(it != pairs.end(), "flashmask: ", dims_str(d, dv),
                    " fit no (head dim, value head dim) pair this build compiled (", join(pairs),
                    "); rebuild with FLASHMASK_HEAD_DIMS including a larger one");
    }
    // The newest family that runs here and has the slot for a pair holding (d, dv), and within it the
    // smallest such pair: on Hopper a head dim rounds up to the next SM90 one (zero padding) rather
    // than run on the SM80 kernels at its own, which was measured slower (docs/dev/head_dims.md).
    // A forced family takes its smallest pair holding (d, dv), or nothing if that pair lacks the slot
    // here, rather than a larger pair of its own.
    auto pick = [&](int family) {
        const KernelSet* best = nullptr;
        for (const KernelSet& k : kKernelSets) {
            if (d > k.head_dim || dv > k.head_dim_v || k.dtype != dtype || !runs_on(k.arch, cc)) continue;
            if (family != 0 ? k.arch != family : !has(k, slot, cc)) continue;
            if (best == nullptr || k.arch > best->arch ||
                (k.arch == best->arch &&
                 std::make_pair(k.head_dim, k.head_dim_v) < std::make_pair(best->head_dim, best->head_dim_v)))
                best = &k;
        }
        return best != nullptr && has(*best, slot, cc) ? best : nullptr;
    };
    const KernelSet* best = pick(arch);
    // A forced family without the slot here (the SM80 kernels a build for sm_80 and sm_90 leaves out
    // of sm_90) leaves it to the newest family that has it.
    if (best == nullptr && arch != 0) best = pick(0);
    TORCH_CHECK(best != nullptr, "flashmask: no ", arch ? "sm" + std::to_string(arch) + " " : std::string(),
                "kernel compiled for ", dims_str(d, dv), " and dtype ", dtype_name(dtype),
                " (this build: head dim pairs ", join(pairs),
                "; FLASHMASK_HEAD_DIMS / FLASHMASK_DTYPES / FLASHMASK_ARCHS)");
    return {best, tiles_of(*best)};
}

}  // namespace flashmask
