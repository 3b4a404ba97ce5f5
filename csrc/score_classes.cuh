// Kernels of the score ops (score-aware eviction; vllm_hisparse/ops/reference_scores.py is
// the contract, docs/kernels.md "Score classes"): score_threshold_kernel (one CTA per logits
// row: threshold and width) and slot_classes_kernel (one CTA per decode request and slot
// chunk: the slot classes). Every float result is a fixed sequence of IEEE operations written
// with explicit rounding intrinsics (no FMA contraction), so the torch and numpy twins give
// the same bits.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "hisparse_ops.h"

namespace hisparse::score_detail {

template <class T>
__device__ __forceinline__ float load_score(const T* p);

template <>
__device__ __forceinline__ float load_score<float>(const float* p) {
  return __ldg(p);
}

template <>
__device__ __forceinline__ float load_score<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(__ldg(p));  // exact
}

// Entries of a lane loaded before they are added (loads in flight together; the adds stay
// in column order).
constexpr int kThresholdUnroll = 8;

// One CTA of kScoreSumLanes threads per logits row. Lane l adds the row's columns
// j = l, l + lanes, ... to +0.0 in increasing j (0.0 for padding and non-finite scores);
// the lanes are then halved pairwise, lane l += lane l + h for h = lanes / 2 ... 1
// (core.trace.lane_tree_sum). The minimum and the count are order-free.
template <class T>
__global__ void __launch_bounds__(kScoreSumLanes)
    score_threshold_kernel(ScoreThresholdParams p) {
  const int row = blockIdx.x;
  const int lane = threadIdx.x;
  const T* logits = static_cast<const T*>(p.logits) + static_cast<long long>(row) * p.logits_stride;
  const int32_t* topk = p.topk + static_cast<long long>(row) * p.topk_stride;

  double sum = 0.0;
  float lowest = __int_as_float(0x7f800000);  // +inf
  int count = 0;
  for (int j0 = lane; j0 < p.k; j0 += kScoreSumLanes * kThresholdUnroll) {
    float v[kThresholdUnroll];
    bool ok[kThresholdUnroll];
#pragma unroll
    for (int u = 0; u < kThresholdUnroll; ++u) {
      const int j = j0 + u * kScoreSumLanes;
      const int col = j < p.k ? __ldg(topk + j) : -1;
      ok[u] = col >= 0 && col < p.cols;
      v[u] = ok[u] ? load_score<T>(logits + col) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kThresholdUnroll; ++u) {
      if (j0 + u * kScoreSumLanes >= p.k) break;  // past K: no entry (the twin adds none)
      const bool valid = ok[u] && isfinite(v[u]);
      sum = __dadd_rn(sum, valid ? static_cast<double>(v[u]) : 0.0);
      if (valid) {
        lowest = fminf(lowest, v[u]);
        ++count;
      }
    }
  }

  __shared__ double sums[kScoreSumLanes];
  __shared__ float lows[kScoreSumLanes / 32];
  __shared__ int counts[kScoreSumLanes / 32];
  sums[lane] = sum;
  __syncthreads();
#pragma unroll
  for (int h = kScoreSumLanes / 2; h >= 32; h >>= 1) {
    if (lane < h) sums[lane] = __dadd_rn(sums[lane], sums[lane + h]);
    __syncthreads();
  }
#pragma unroll
  for (int h = 16; h >= 1; h >>= 1) {
    lowest = fminf(lowest, __shfl_xor_sync(0xffffffffu, lowest, h));
    count += __shfl_xor_sync(0xffffffffu, count, h);
  }
  if ((lane & 31) == 0) {
    lows[lane >> 5] = lowest;
    counts[lane >> 5] = count;
  }
  __syncthreads();
  if (lane >= 32) return;
  double s = sums[lane];
#pragma unroll
  for (int h = 16; h >= 1; h >>= 1) {
    const double other = __shfl_down_sync(0xffffffffu, s, h);  // lane l reads lane l + h
    s = __dadd_rn(s, other);
  }
  if (lane != 0) return;
  float thr = lows[0];
  int n = counts[0];
#pragma unroll
  for (int w = 1; w < kScoreSumLanes / 32; ++w) {
    thr = fminf(thr, lows[w]);
    n += counts[w];
  }
  const double mean = __ddiv_rn(s, static_cast<double>(n > 0 ? n : 1));
  const double spread = __dmul_rn(__dsub_rn(mean, static_cast<double>(thr)), p.width_units);
  float w = __double2float_rn(spread);
  const float tiny = 1.17549435e-38f;  // FLT_MIN, the smallest normal float
  if (!(isfinite(w) && w > tiny)) w = tiny;
  p.threshold[row] = thr;
  p.width[row] = w;
}

// Slots of one thread (strided by the CTA, so the slot_pos loads and class stores coalesce).
constexpr int kSlotsPerThread = 4;
constexpr int kSlotThreads = 256;
constexpr int kSlotsPerCta = kSlotsPerThread * kSlotThreads;

// grid (ceil(D / kSlotsPerCta), requests): one request's slot chunk, every logits row of the
// request (next_n) folded by max.
template <class T>
__global__ void __launch_bounds__(kSlotThreads) slot_classes_kernel(SlotClassesParams p) {
  const int request = blockIdx.y;
  const int state_row = __ldg(p.batch_state_rows + request);
  if (state_row < 0 || state_row >= p.num_rows) return;  // no state row: nothing to write
  const long long row_base = static_cast<long long>(state_row) * p.num_slots;
  const int first = blockIdx.x * kSlotsPerCta + threadIdx.x;

  int pos[kSlotsPerThread];
  unsigned cls[kSlotsPerThread];
#pragma unroll
  for (int u = 0; u < kSlotsPerThread; ++u) {
    const int slot = first + u * kSlotThreads;
    pos[u] = slot < p.num_slots ? __ldg(p.slot_pos + row_base + slot) : -1;
    cls[u] = 0;
  }
  for (int q = 0; q < p.next_n; ++q) {
    const int row = request * p.next_n + q;
    const float thr = __ldg(p.threshold + row);
    const float w = __ldg(p.width + row);
    if (!isfinite(thr)) continue;  // no finite selection: class 0
    const float e1 = __fsub_rn(thr, __fmul_rn(1.0f, w));
    const float e2 = __fsub_rn(thr, __fmul_rn(2.0f, w));
    const float e3 = __fsub_rn(thr, __fmul_rn(3.0f, w));
    const T* logits = static_cast<const T*>(p.logits) + static_cast<long long>(row) * p.logits_stride;
    float s[kSlotsPerThread];
#pragma unroll
    for (int u = 0; u < kSlotsPerThread; ++u) {
      const bool inside = pos[u] >= 0 && pos[u] < p.cols;
      s[u] = inside ? load_score<T>(logits + pos[u]) : __int_as_float(0x7fc00000);  // NaN: 0
    }
#pragma unroll
    for (int u = 0; u < kSlotsPerThread; ++u) {
      const unsigned c = static_cast<unsigned>(s[u] >= e1) + static_cast<unsigned>(s[u] >= e2) +
                         static_cast<unsigned>(s[u] >= e3);
      cls[u] = c > cls[u] ? c : cls[u];
    }
  }
#pragma unroll
  for (int u = 0; u < kSlotsPerThread; ++u) {
    const int slot = first + u * kSlotThreads;
    if (slot < p.num_slots) p.slot_class[row_base + slot] = static_cast<uint8_t>(cls[u]);
  }
}

}  // namespace hisparse::score_detail
