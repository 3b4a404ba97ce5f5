// Device helpers that both resolve paths use (docs/design.md, "resolve", docs/kernels.md): hashing,
// warp scans, cp.async staging, L2 prefetch and the launch's first-error-wins record.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_ops.h"

namespace hisparse::resolve_detail {

constexpr int kMaxWarps = 32;  // warps of the largest CTA (1024 threads)

__device__ __forceinline__ int hash_index(int key, int cap) {
  return static_cast<int>(__umulhi(static_cast<unsigned>(key) * 0x9E3779B1u,
                                   static_cast<unsigned>(cap)));
}

// Inclusive sum of v over the lanes of a warp (all 32 lanes call); unsigned for packed 16-bit
// counts that may reach the sign bit.
template <class T>
__device__ __forceinline__ T warp_inclusive_sum(T v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T n = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += n;
  }
  return v;
}

// L2 prefetch of a row that is read by scattered gathers (not staged).
__device__ __forceinline__ void prefetch_l2(const void* base, long long bytes) {
  const char* p = static_cast<const char*>(base);
  const long long lines = bytes < (64 << 10) ? (bytes + 127) / 128 : (64 << 10) / 128;
  for (long long i = threadIdx.x; i < lines; i += blockDim.x) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i * 128));
  }
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Copy n int32 from global to shared without registers (16-byte pieces when both sides allow).
__device__ __forceinline__ void stage_row(int* dst, const int32_t* src, int n) {
  if ((n & 3) == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0 &&
      (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) cp_async16(dst + i, src + i);
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) cp_async4(dst + i, src + i);
  }
}

// First error of the launch wins the device word; the winner mirrors the record into the
// pinned host words (details first, code last) so the host can poll it without any copy.
__device__ __forceinline__ void record_error(const ResolveParams& p, int code, int row, int a,
                                             int b) {
  if (atomicCAS(p.error, 0, code) == 0) {
    p.error[1] = row;
    p.error[2] = a;
    p.error[3] = b;
    if (p.error_host != nullptr) {
      volatile int32_t* h = p.error_host;
      h[1] = row;
      h[2] = a;
      h[3] = b;
      __threadfence_system();
      h[0] = code;
      __threadfence_system();
    }
  }
}

}  // namespace hisparse::resolve_detail
