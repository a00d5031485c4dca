// CUTLASS numbers the named barriers of user code from past the hardware ids it reserves; the
// hardware has 16 (0-15), and an id past them is undefined behaviour that no tool reports.
#pragma once
#include <cutlass/arch/barrier.h>

namespace flashmask::sm90 {

constexpr bool user_barrier_fits(int id) {
    return id >= 0 && id + int(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount) <
                          int(cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers);
}

}  // namespace flashmask::sm90
