#include "api/mask_cache.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <list>
#include <mutex>
#include <tuple>
#include <vector>

#include "api/launch_policy.h"
#include "api/overrides.h"
#include "mask/bounds.h"

namespace flashmask {
namespace {

// Entries kept, most recently used first. Each holds O(B * Hm * Sk) memory at most (a contiguous
// copy of a strided mask) and O(B * Hm * Sq) (the per-row key counts), the rest is O(Sk / block_n)
// and O(Sq / block_m) per tile shape.
constexpr size_t kCapacity = 16;

// Why each field is in the key:
// - impl: the tensor itself. A version number means something only against its own counter: views
//   of one base share it, but aliases such as `x.data` or a tensor built on the same storage do
//   not, so a key on the storage alone could match an alias whose counter never saw the write.
//   The entry's weak reference keeps this address from being reused by another TensorImpl.
// - data, sizes, strides, offset: `x.data = y` and other metadata swaps keep the TensorImpl and
//   its counter but change what is read; sizes also hold B, Hm, Sk and C.
// - version: every in-place write through any view bumps the counter the views share.
// - device, stream: the metadata was computed on that stream; read from another one it would race
//   with its computation, and its memory (freed on eviction) belongs to that stream's pool. The
//   handle of the legacy default stream is the same on every device, hence the device.
// - causal, sq: the bounds read each column through read_column(causal, sq), which clamps to Sq.
// The tile sizes key the bounds (block_n) and the tile orders and floors (block_m, block_n) inside
// an entry.
struct Key {
    const c10::TensorImpl* impl;
    const void* data;
    std::vector<int64_t> sizes, strides;
    int64_t offset;
    uint32_t version;
    int device;
    cudaStream_t stream;
    bool causal;
    int sq;

    bool operator==(const Key& o) const {
        return std::tie(impl, data, sizes, strides, offset, version, device, stream, causal, sq) ==
               std::tie(o.impl, o.data, o.sizes, o.strides, o.offset, o.version, o.device, o.stream, o.causal, o.sq);
    }
};

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Entry {
    Key key;
    // Weak: the entry must not keep a mask the user dropped (and its memory) alive, only keep its
    // TensorImpl's address from being reused; an expired entry is dropped at the next lookup.
    WeakImpl owner;
    at::Tensor copy;  // the contiguous copy of a strided mask; undefined when the mask was contiguous
    std::vector<std::pair<int, at::Tensor>> bounds;  // by block_n
    // (order, floor) by (block_m, block_n)
    std::vector<std::pair<std::pair<int, int>, std::pair<at::Tensor, at::Tensor>>> tiles;
    std::vector<std::pair<std::tuple<int, int, int, Jobs>, at::Tensor>> jobs;  // by (block_m, block_n, hq, jobs)
    at::Tensor keys_seen;
};

struct Cache {
    std::mutex mu;
    std::list<Entry> lru;
    int64_t hits = 0, misses = 0;
};

// Never destroyed: a static destructor would free CUDA memory after the allocator is gone at exit.
Cache& cache() {
    static Cache* c = new Cache();
    return *c;
}

template <class K, class V>
V find(const std::vector<std::pair<K, V>>& xs, const K& k) {
    for (const auto& x : xs) {
        if (x.first == k) return x.second;
    }
    return {};
}

// Capture: the metadata must be computed inside the graph (its kernels replay with it), and memory
// allocated during capture belongs to the graph's private pool.
bool capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    return status != cudaStreamCaptureStatusNone;
}

// FLASHMASK_MASK_CACHE is read once, at the first call with a mask: 0, false, no or off turn the
// cache off. Overrides::mask_cache pins it (tests).
bool cache_enabled() {
    static const bool by_env = [] {
        const char* e = std::getenv("FLASHMASK_MASK_CACHE");
        if (e == nullptr) return true;
        for (const char* off : {"0", "false", "no", "off", "False", "FALSE", "OFF", "No", "NO"}) {
            if (std::strcmp(e, off) == 0) return false;
        }
        return true;
    }();
    const int pinned = overrides().mask_cache;
    return pinned >= 0 ? pinned != 0 : by_env;
}

at::Tensor compute_bounds(const at::Tensor& mask, bool causal, int sq, int block_n, cudaStream_t stream) {
    const int sk = mask.size(2);
    at::Tensor bounds =
        at::empty({mask.size(0), mask.size(1), (sk + block_n - 1) / block_n, kNumBounds}, mask.options());
    launch_mask_bounds(mask.data_ptr<int>(), bounds.data_ptr<int>(), mask.size(0) * mask.size(1), sk, mask.size(3),
                       causal, sq, block_n, stream);
    return bounds;
}

// MaskMeta::keys_seen: the steps of each column's visible rows, summed over the rows.
at::Tensor compute_keys_seen(const at::Tensor& mask, bool causal, int sq, cudaStream_t stream) {
    const int64_t batch_heads = mask.size(0) * mask.size(1);
    at::Tensor steps = at::zeros({batch_heads, sq + 1}, mask.options());
    launch_key_count_steps(mask.data_ptr<int>(), steps.data_ptr<int>(), batch_heads, mask.size(2), mask.size(3), causal,
                           sq, stream);
    return steps.narrow(1, 0, sq).cumsum(1, at::kInt).view({mask.size(0), mask.size(1), sq});
}

// Per query tile of block_m rows, the key blocks it visits and the lowest of them (the forward:
// MaskMeta::floor); or with key_blocks, per key block, the query blocks of block_m rows that see
// it (the backward; floor left undefined).
std::pair<at::Tensor, at::Tensor> compute_work(const at::Tensor& bounds, bool causal, int sq, int sk, int block_m,
                                               int block_n, bool key_blocks, cudaStream_t stream) {
    const int batch_heads = bounds.size(0) * bounds.size(1);
    const int n_blocks = bounds.size(2), m_tiles = (sq + block_m - 1) / block_m;
    at::Tensor work = at::empty({batch_heads, key_blocks ? n_blocks : m_tiles}, bounds.options());
    at::Tensor floor = key_blocks ? at::Tensor() : at::empty_like(work);
    launch_work(bounds.data_ptr<int>(), work.data_ptr<int>(), key_blocks ? nullptr : floor.data_ptr<int>(), batch_heads,
                n_blocks, m_tiles, block_m, block_n, sq, sk, causal, key_blocks, stream);
    return {work, floor};
}

// Longest tiles first: a few tiles may see far more keys than the rest (global tokens, a prefix),
// and started last they would finish alone.
at::Tensor compute_order(const at::Tensor& work) {
    return work.argsort(/*stable=*/true, /*dim=*/1, /*descending=*/true).to(at::kInt);
}

// MaskMeta::jobs. Buckets rather than a strict order: full attention has one bucket, taken head
// by head, where interleaving all heads would stream every head's K and V (or Q and dO) through L2
// at once (16 heads at 32K: 256 MiB); the heavy tiles of every head (global tokens) still start
// first.
at::Tensor compute_jobs(const at::Tensor& work, int batch, int hq) {
    const int hm = work.size(0) / batch, m_tiles = work.size(1);
    const at::Tensor per_head =
        work.view({batch, hm, 1, m_tiles}).expand({batch, hm, hq / hm, m_tiles}).reshape({batch * hq, m_tiles});
    const auto [sorted, tile] = per_head.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true);
    const at::Tensor jobs = tile + at::arange(int64_t(batch) * hq, tile.options()).unsqueeze(1) * m_tiles;
    const at::Tensor bucket = at::where(sorted > 0, at::floor(at::log2(sorted.to(at::kFloat)) * 2), -1.f).reshape({-1});
    return jobs.reshape({-1})
        .index_select(0, bucket.argsort(/*stable=*/true, /*dim=*/0, /*descending=*/true))
        .to(at::kInt);
}

// MaskMeta::jobs for the deterministic SM90 backward: a key block adds its dQ to a query block
// after the key block below it that sees it, so each head's key blocks must start in ascending
// order; heads are interleaved `group` at a time (job_and_head's launch order). The group is
// chosen on the device, with no host sync, from the mean share of query rows that see a key block.
// Long walks take kTurnFewHeads, so that the heads in flight keep their Q, dO and dQ in L2; short
// ones take every head: a band walked upwards (global + sliding window) makes each key block wait
// two blocks behind the one below it, a chain as long as the head's key blocks in flight, and only
// many heads fill the GPU around such chains.
at::Tensor compute_turn_jobs(const at::Tensor& work, int batch, int hq, int sq, int block_m) {
    const int n = work.size(1);
    const auto launch_order = [&](int group) {
        const auto opts = work.options();
        const at::Tensor b = at::arange(batch, opts).view({batch, 1, 1, 1});
        const at::Tensor first_head = at::arange(hq / group, opts).view({1, hq / group, 1, 1}) * group;
        const at::Tensor key_block = at::arange(n, opts).view({1, 1, n, 1});
        const at::Tensor head_in_group = at::arange(group, opts).view({1, 1, 1, group});
        return ((b * hq + first_head + head_in_group) * n + key_block).reshape({-1});
    };
    int few = std::min(hq, kTurnFewHeads);
    while (hq % few) --few;
    const at::Tensor long_walks = work.sum() * (int64_t(block_m) * kTurnDenseShare) >= int64_t(sq) * work.numel();
    return at::where(long_walks, launch_order(few), launch_order(hq));
}

// Whether a launch's jobs are the backward's key blocks, which take no forward tile order.
bool key_block_jobs(Jobs jobs) { return jobs == Jobs::key_blocks || jobs == Jobs::key_blocks_in_turn; }

// Fills what `m` lacks; returns whether anything was computed.
bool complete(MaskMeta& m, const at::Tensor& user_mask, bool causal, int sq, int block_m, int block_n, int hq,
              Jobs jobs, bool keys_seen, cudaStream_t stream) {
    bool computed = false;
    if (!m.mask.defined()) m.mask = user_mask.contiguous();
    if (!m.bounds.defined()) {
        m.bounds = compute_bounds(m.mask, causal, sq, block_n, stream);
        computed = true;
    }
    if (keys_seen && !m.keys_seen.defined()) {
        m.keys_seen = compute_keys_seen(m.mask, causal, sq, stream);
        computed = true;
    }
    const bool want_jobs = block_m > 0 && jobs != Jobs::none && !m.jobs.defined();
    const bool want_order = block_m > 0 && !key_block_jobs(jobs) && !m.order.defined();
    if (want_order || want_jobs) {
        const auto [work, floor] =
            compute_work(m.bounds, causal, sq, m.mask.size(2), block_m, block_n, key_block_jobs(jobs), stream);
        if (want_order) {
            m.order = compute_order(work);
            m.floor = floor;
        }
        if (want_jobs) {
            m.jobs = jobs == Jobs::key_blocks_in_turn ? compute_turn_jobs(work, m.mask.size(0), hq, sq, block_m)
                                                      : compute_jobs(work, m.mask.size(0), hq);
        }
        computed = true;
    }
    return computed;
}

}  // namespace

MaskMeta mask_metadata(const at::Tensor& user_mask, bool causal, int sq, int block_m, int block_n, int hq, Jobs jobs,
                       bool keys_seen, cudaStream_t stream) {
    const auto jobs_key = std::make_tuple(block_m, block_n, hq, jobs);
    const bool want_order = block_m > 0 && !key_block_jobs(jobs);
    MaskMeta m;
    c10::TensorImpl* impl = user_mask.unsafeGetTensorImpl();
    // Inference tensors have no version counter: an in-place change to them could not be seen.
    if (!cache_enabled() || !impl->version_counter().enabled() || capturing(stream)) {
        complete(m, user_mask, causal, sq, block_m, block_n, hq, jobs, keys_seen, stream);
        return m;
    }
    Key key{impl,
            user_mask.const_data_ptr(),
            user_mask.sizes().vec(),
            user_mask.strides().vec(),
            user_mask.storage_offset(),
            impl->version_counter().current_version(),
            user_mask.get_device(),
            stream,
            causal,
            sq};
    Cache& c = cache();
    // Entries leave the cache into `dropped`, which frees their tensors after the lock is released.
    std::list<Entry> dropped;
    {
        std::lock_guard<std::mutex> lock(c.mu);
        for (auto it = c.lru.begin(); it != c.lru.end();) {
            auto next = std::next(it);
            if (it->owner.expired()) {
                dropped.splice(dropped.end(), c.lru, it);
            } else if (it->key == key) {
                c.lru.splice(c.lru.begin(), c.lru, it);
                m.mask = it->copy.defined() ? it->copy : user_mask;
                m.bounds = find(it->bounds, block_n);
                if (want_order) std::tie(m.order, m.floor) = find(it->tiles, std::make_pair(block_m, block_n));
                if (block_m > 0 && jobs != Jobs::none) m.jobs = find(it->jobs, jobs_key);
                if (keys_seen) m.keys_seen = it->keys_seen;
            }
            it = next;
        }
    }
    // Computed outside the lock: ATen may call back into Python (dispatch modes, memory-history
    // hooks), which needs the GIL that a caller waiting on this lock could hold.
    const bool computed = complete(m, user_mask, causal, sq, block_m, block_n, hq, jobs, keys_seen, stream);
    std::lock_guard<std::mutex> lock(c.mu);
    if (!computed) {
        ++c.hits;
        return m;
    }
    ++c.misses;
    auto it = std::find_if(c.lru.begin(), c.lru.end(), [&](const Entry& e) { return e.key == key; });
    if (it == c.lru.end()) {
        // Versions only grow: an entry of this tensor at another version can never match again.
        for (auto old = c.lru.begin(); old != c.lru.end();) {
            auto next = std::next(old);
            if (old->key.impl == impl && old->key.version != key.version) dropped.splice(dropped.end(), c.lru, old);
            old = next;
        }
        c.lru.push_front(Entry{key, WeakImpl(user_mask.getIntrusivePtr()), {}, {}, {}, {}, {}});
        it = c.lru.begin();
        if (m.mask.unsafeGetTensorImpl() != impl) it->copy = m.mask;
        while (c.lru.size() > kCapacity) dropped.splice(dropped.end(), c.lru, std::prev(c.lru.end()));
    }
    if (!find(it->bounds, block_n).defined()) it->bounds.emplace_back(block_n, m.bounds);
    if (want_order && !find(it->tiles, std::make_pair(block_m, block_n)).first.defined()) {
        it->tiles.emplace_back(std::make_pair(block_m, block_n), std::make_pair(m.order, m.floor));
    }
    if (block_m > 0 && jobs != Jobs::none && !find(it->jobs, jobs_key).defined())
        it->jobs.emplace_back(jobs_key, m.jobs);
    if (keys_seen && !it->keys_seen.defined()) it->keys_seen = m.keys_seen;
    return m;
}

std::pair<int64_t, int64_t> mask_cache_stats() {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    return {c.hits, c.misses};
}

void mask_cache_clear() {
    Cache& c = cache();
    std::list<Entry> dropped;
    {
        std::lock_guard<std::mutex> lock(c.mu);
        dropped.swap(c.lru);
        c.hits = c.misses = 0;
    }
    // `dropped` frees its tensors here, outside the lock.
}

}  // namespace flashmask
