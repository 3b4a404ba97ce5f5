// Launchers of the score ops (hisparse_ops.h): shape checks, then one launch each on the
// given stream (no allocation, no synchronization: capturable).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "hisparse_ops.h"
#include "score_classes.cuh"

namespace hisparse {

cudaError_t launch_score_threshold(const ScoreThresholdParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0 || p.k < 0 || p.logits_stride < 0 || p.topk_stride < 0)
    return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (p.threshold == nullptr || p.width == nullptr || (p.k > 0 && p.topk == nullptr) ||
      (p.cols > 0 && p.logits == nullptr))
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (p.dtype == kScoreFloat32) {
    score_detail::score_threshold_kernel<float><<<grid, kScoreSumLanes, 0, stream>>>(p);
  } else if (p.dtype == kScoreBFloat16) {
    score_detail::score_threshold_kernel<__nv_bfloat16><<<grid, kScoreSumLanes, 0, stream>>>(p);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_slot_classes(const SlotClassesParams& p, cudaStream_t stream) {
  if (p.requests < 0 || p.next_n <= 0 || p.cols < 0 || p.num_rows < 0 || p.num_slots < 0 ||
      p.logits_stride < 0 || p.requests > 65535)
    return cudaErrorInvalidValue;
  if (p.requests == 0 || p.num_rows == 0 || p.num_slots == 0) return cudaSuccess;
  if (p.threshold == nullptr || p.width == nullptr || p.batch_state_rows == nullptr ||
      p.slot_pos == nullptr || p.slot_class == nullptr || (p.cols > 0 && p.logits == nullptr))
    return cudaErrorInvalidValue;
  const int chunks = (p.num_slots + score_detail::kSlotsPerCta - 1) / score_detail::kSlotsPerCta;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(p.requests));
  constexpr int threads = score_detail::kSlotThreads;
  if (p.dtype == kScoreFloat32) {
    score_detail::slot_classes_kernel<float><<<grid, threads, 0, stream>>>(p);
  } else if (p.dtype == kScoreBFloat16) {
    score_detail::slot_classes_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(p);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace hisparse
