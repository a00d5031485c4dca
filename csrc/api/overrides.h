// Choices the library makes itself that the tests pin, through the private binding entry
// _set_overrides (flashmask/_cuda.py: _overrides); 0 or -1 leave a choice to the library.
#pragma once

namespace flashmask {

struct Overrides {
    int head_group = 0;    // > 0: heads interleaved per launch (the largest divisor of Hq up to it)
    int decode_warp = -1;  // 0 / 1: the SM90 forward without / with its decode warp, where built
    int mask_cache = -1;   // 0 / 1: the mask metadata cache off / on, whatever FLASHMASK_MASK_CACHE says
};

// One set per process.
inline Overrides& overrides() {
    static Overrides o;
    return o;
}

}  // namespace flashmask
