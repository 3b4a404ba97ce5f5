// launch_spin (hisparse_ops.h): a kernel that waits on the GPU's global nanosecond timer.
#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_ops.h"

namespace hisparse {
namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(uint64_t nanoseconds, bool busy) {
  const uint64_t start = global_ns();
  while (global_ns() - start < nanoseconds) {
    if (!busy) __nanosleep(1000);  // the timer ticks coarsely (~1 us): no need to poll faster
  }
}

}  // namespace

cudaError_t launch_spin(uint64_t nanoseconds, int ctas, bool busy, cudaStream_t stream) {
  if (ctas < 1) return cudaErrorInvalidValue;
  spin_kernel<<<ctas, 1, 0, stream>>>(nanoseconds, busy);
  return cudaGetLastError();
}

}  // namespace hisparse
