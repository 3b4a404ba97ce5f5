// The general path's error handling (docs/kernels.md, "Errors"): each CTA collects error
// candidates in one 64-bit word per phase, the smallest wins, and a failed request writes
// out_rows = -1 and miss_count = 0 for its tokens before any write of hot state.
#pragma once

#include <cuda_runtime.h>

#include "hisparse_ops.h"
#include "resolve_common.cuh"

namespace hisparse::resolve_detail {

constexpr unsigned long long kNoError = ~0ull;

// Error candidates of one CTA: atomicMin over (priority, key, detail) picks the error the
// reference twin would raise first (its check order, then first-reference order).
enum Priority : unsigned {
  kPrioCapacity = 0,
  kPrioPosition = 1,
  kPrioNoHost = 2,
  kPrioDuplicate = 3,
  kPrioHotBlock = 4,
};

__device__ __forceinline__ void submit_err(unsigned long long* err, unsigned prio, int key,
                                           int detail) {
  const unsigned long long v = (static_cast<unsigned long long>(prio) << 60) |
                               (static_cast<unsigned long long>(key & 0x0FFFFFFF) << 32) |
                               static_cast<unsigned>(detail);
  atomicMin(err, v);
}

// Fill -1 / 0 for refs [base, base+n) and tokens [t0, t0+ntok).
__device__ __forceinline__ void fail_request(const ResolveParams& p, long long base, int n,
                                             int t0, int ntok) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) p.out_rows[base + i] = -1;
  for (int j = threadIdx.x; j < ntok; j += blockDim.x) p.miss_count[t0 + j] = 0;
}

// Thread 0: turn the CTA's best error candidate into the launch's error record.
__device__ __forceinline__ void report_err(const ResolveParams& p, unsigned long long v,
                                           int row, long long base) {
  if (threadIdx.x != 0) return;
  const unsigned prio = static_cast<unsigned>(v >> 60);
  const int key = static_cast<int>((v >> 32) & 0x0FFFFFFF);
  const int detail = static_cast<int>(static_cast<unsigned>(v));
  const int bs = p.block_size;
  switch (prio) {
    case kPrioPosition:
      record_error(p, kErrPositionOutOfRange, row, detail, p.num_pages * bs);
      break;
    case kPrioNoHost:
      record_error(p, kErrNoHostBlock, row, detail, detail / bs);
      break;
    case kPrioDuplicate:
      record_error(p, kErrDuplicateSlot, row, __ldg(&p.topk[base + key]), detail);
      break;
    case kPrioHotBlock:
      record_error(p, kErrHotBlockMissing, row, detail, __ldg(&p.topk[base + key]));
      break;
    default:
      break;
  }
}

}  // namespace hisparse::resolve_detail
