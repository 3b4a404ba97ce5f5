// Compile-time probes of the resolve kernels (benchmarks and tests only, docs/kernels.md).
//
// Both kernels take a Probe type. NoProbe, the production instantiation (launch_resolve),
// compiles every probe point to nothing. PhaseProbe, instantiated only by the probe entry
// point (resolve_probe.cu, launch_resolve_probe), stamps phase ends and can stop every CTA at
// a stop point:
//   mark(phase)      thread 0 of CTA 0 writes %globaltimer (ns) to times[phase], phases
//                    0..6, and clock64 at phases 0 and 6 to times[7] and times[8]
//   stops_at(s)      true at stop point s when the launch asked for it (1 = at entry, the
//                    launch floor; 2.. after each barrier; outputs are then incomplete)
//   count_hand_off() times[9] += 1 for every request the fast path hands to the general path
#pragma once

#include <cuda_runtime.h>

#include "resolve_probe.h"

namespace hisparse::resolve_detail {

struct NoProbe {
  __device__ __forceinline__ constexpr bool stops_at(int) const { return false; }
  __device__ __forceinline__ void mark(int) const {}
  __device__ __forceinline__ void count_hand_off() const {}
};

struct PhaseProbe {
  unsigned long long* times;  // [10] or nullptr
  int stop;                   // 0: run to the end

  explicit PhaseProbe(const ResolveProbe& probe) : times(probe.times), stop(probe.stop) {}

  __device__ __forceinline__ bool stops_at(int s) const { return stop == s; }

  __device__ __forceinline__ void mark(int phase) const {
    if (times != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      times[phase] = t;
      if (phase == 0) times[7] = clock64();
      if (phase == 6) times[8] = clock64();
    }
  }

  __device__ __forceinline__ void count_hand_off() const {
    if (times != nullptr && threadIdx.x == 0) atomicAdd(&times[9], 1ull);
  }
};

}  // namespace hisparse::resolve_detail
