// The kernels this build compiled, as a table generated from csrc/instantiations.py, and the
// choice among them for a device, a (head dim, value head dim) pair and a dtype.
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "common/params.h"

namespace flashmask {

enum class DType { fp16, bf16 };

using FwdFn = void (*)(const AttnParams&, cudaStream_t);
using BwdFn = void (*)(const BwdParams&, cudaStream_t);

// The kernels of one (architecture family, head dim, value head dim, dtype); a family leaves the
// slots it lacks null.
struct KernelSet {
    int arch;        // 80: mma.sync kernels (sm_80 and later), 90: wgmma/TMA kernels (sm_90a)
    int head_dim;    // of q and k
    int head_dim_v;  // of v and the output
    DType dtype;
    FwdFn fwd;
    BwdFn bwd_kv;  // dK, dV (and dQ by atomics when BwdParams::dq_accum is set)
    BwdFn bwd_dq;  // deterministic dQ
    // The set has no sm_90 code, its slots absent on compute capability 9.x: a build for sm_90 and an
    // older arch leaves those head dims to the SM90 kernels there (csrc/instantiations.py skips_sm90).
    bool skips_sm90;
};

// A device code target of the build (-gencode ...,code=sm_XY[a]): sm_XY code runs on compute
// capability X.Y and the later minors of major X; arch-specific sm_XYa code on X.Y alone.
struct CudaTarget {
    int cc;  // 10 * X + Y; 0 ends the list
    bool arch_specific;
};

// Tile sizes a kernel set walks with: the binding sizes the mask bounds, the tile work and the dQ
// accumulator with them.
struct TileSizes {
    int fwd_block_m, fwd_block_n, bwd_block_m, bwd_block_n;
    int fwd_decode_warp_keys = 0;  // the SM90 forward's decode warp from this Sk (0: not built)
};

struct Selection {
    const KernelSet* kernels;
    TileSizes tiles;
};

// The equal head dims, the (head dim, value head dim) pairs (equal ones included) and the dtypes
// some architecture family compiled (sorted, unique).
std::vector<int64_t> compiled_head_dims();
std::vector<std::pair<int64_t, int64_t>> compiled_head_dim_pairs();
std::vector<std::string> compiled_dtypes();
// The architecture families compiled for (head dim, value head dim, dtype), e.g. {80, 90};
// head_dim_v 0 means equal to head_dim.
std::vector<int64_t> compiled_archs(int64_t head_dim, const std::string& dtype, int64_t head_dim_v = 0);
// Those of them whose kernels (forward, atomic and deterministic backward) run on a device of
// compute capability `cc`: a family may have them for older devices only (KernelSet::skips_sm90).
std::vector<int64_t> device_archs(int64_t head_dim, const std::string& dtype, int64_t cc, int64_t head_dim_v = 0);

// Whether the build carries device code a GPU of compute capability `cc` runs (a table that lists
// no targets restricts nothing), and the targets as "sm_80", "sm_90a", ...
bool has_code_for(int cc);
std::vector<std::string> cuda_targets();

// The kernels for head dims (d, dv) of q/k and v and dtype on a device of compute capability `cc`
// (major * 10 + minor): of the newest family the device runs that has a pair holding both, the
// smallest such pair (by head dim, then value head dim), whose kernels predicate the columns past d
// and dv; on Hopper head dim 32 thus runs on the SM90 head dim 64. `arch` 0 takes the newest family the
// device runs, unless the environment variable FLASHMASK_ARCH names one (read once, at the first
// call of the process); 80 or 90 asks for that family and raises if it is not compiled or the
// device cannot run it.
// `slot` says which kernels the call needs: the forward, the backward with atomic dQ, or the
// deterministic backward. A forced family whose smallest pair holding (d, dv) lacks them on this
// device leaves the call to the newest family that has them.
enum class Slot { fwd, bwd, bwd_deterministic };
Selection select_kernels(int d, int dv, DType dtype, int cc, int arch, Slot slot);

}  // namespace flashmask
