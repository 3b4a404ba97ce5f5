// Host-side dispatch of one planned resolve launch onto the kernel instantiations, for one
// Probe type: launch_resolve (resolve_launch.cu) instantiates it with NoProbe,
// launch_resolve_probe (resolve_probe.cu) with PhaseProbe, so each kernel instantiation lives
// in exactly one translation unit.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_ops.h"
#include "resolve_fast.cuh"
#include "resolve_general.cuh"

namespace hisparse::resolve_detail {

constexpr int kMaxDevices = 64;

// The caller's parameters with the plan's table sizes filled in.
inline ResolveParams planned_params(const ResolveParams& params, const ResolveLaunchInfo& info) {
  ResolveParams p = params;
  p.hash_capacity = info.hash_capacity;
  p.union_capacity = info.union_capacity;
  p.victim_capacity = info.victim_capacity;
  p.hot_blocks_in_smem = info.hot_blocks_in_smem;
  p.stage_pages = info.stage_pages;
  p.fast_stage_pages = info.fast_stage_pages;
  return p;
}

// Vector loads of the fast path: topk rows by kpt ints, slot_pos by 16 B, lru by 2 * spt B.
inline bool fast_aligned(const ResolveParams& p, int kpt, int spt) {
  auto aligned = [](const void* ptr, size_t a) {
    return (reinterpret_cast<uintptr_t>(ptr) & (a - 1)) == 0;
  };
  return aligned(p.topk, 4 * kpt) && aligned(p.slot_pos, 16) && aligned(p.lru, spt >= 8 ? 16 : 8);
}

// One launch of `kernel` (one CTA per token). The shared-memory opt-in is per device and per
// function; `configured` (one array per kernel) raises it once to the largest size seen, so
// that steady-state (and graph-captured) launches make no extra runtime call.
template <class Probe>
cudaError_t launch_one(void (*kernel)(const ResolveParams, const Probe), int* configured,
                       int threads, const ResolveParams& p, const Probe& probe,
                       size_t smem_bytes, cudaStream_t stream) {
  if (smem_bytes > 48 * 1024) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const int bytes = static_cast<int>(smem_bytes);
    if (device >= kMaxDevices || configured[device] < bytes) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      if (err != cudaSuccess) return err;
      if (device < kMaxDevices) configured[device] = bytes;
    }
  }
  kernel<<<p.num_tokens, threads, smem_bytes, stream>>>(p, probe);
  return cudaGetLastError();
}

template <int SPT, int THREADS, class Probe>
cudaError_t launch_general_spt(const ResolveParams& p, const Probe& probe, size_t smem_bytes,
                               cudaStream_t stream) {
  if (p.slot_class != nullptr) {  // eviction classes: the instantiation that orders by class
    static int configured[kMaxDevices] = {0};
    return launch_one(resolve_general_kernel<SPT, THREADS, true, Probe>, configured, THREADS, p,
                      probe, smem_bytes, stream);
  }
  static int configured[kMaxDevices] = {0};
  return launch_one(resolve_general_kernel<SPT, THREADS, false, Probe>, configured, THREADS, p,
                    probe, smem_bytes, stream);
}

template <int KPT, int SPT, int THREADS, int GSPT, class Probe>
cudaError_t launch_fast(const ResolveParams& p, const Probe& probe, size_t smem_bytes,
                        cudaStream_t stream) {
  static int configured[kMaxDevices] = {0};
  return launch_one(resolve_fast_kernel<KPT, SPT, THREADS, GSPT, Probe>, configured, THREADS, p,
                    probe, smem_bytes, stream);
}

template <class Probe>
cudaError_t launch_general(const ResolveParams& p, const Probe& probe, int threads, int spt,
                           size_t smem_bytes, cudaStream_t stream) {
  if (threads == 1024) {
    switch (spt) {
      case 1: return launch_general_spt<1, 1024>(p, probe, smem_bytes, stream);
      case 2: return launch_general_spt<2, 1024>(p, probe, smem_bytes, stream);
      case 4: return launch_general_spt<4, 1024>(p, probe, smem_bytes, stream);
      case 8: return launch_general_spt<8, 1024>(p, probe, smem_bytes, stream);
      case 16: return launch_general_spt<16, 1024>(p, probe, smem_bytes, stream);
      case 32: return launch_general_spt<32, 1024>(p, probe, smem_bytes, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (spt) {
    case 1: return launch_general_spt<1, 512>(p, probe, smem_bytes, stream);
    case 2: return launch_general_spt<2, 512>(p, probe, smem_bytes, stream);
    case 4: return launch_general_spt<4, 512>(p, probe, smem_bytes, stream);
    case 8: return launch_general_spt<8, 512>(p, probe, smem_bytes, stream);
    case 16: return launch_general_spt<16, 512>(p, probe, smem_bytes, stream);
    default: return cudaErrorInvalidValue;
  }
}

// One launch of planned parameters (planned_params): the fast-path kernel when the plan takes
// the shape and the rows are aligned (unless general_only or with eviction classes), else the
// general kernel.
template <class Probe>
cudaError_t launch_planned(const ResolveParams& p, const ResolveLaunchInfo& info,
                           bool general_only, const Probe& probe, cudaStream_t stream) {
  if (!general_only && p.slot_class == nullptr && info.fast_path &&
      fast_aligned(p, info.fast_kpt, info.fast_spt)) {
    const int g = info.slots_per_thread;  // the general path's instantiation for this D
    const size_t bytes = info.smem_bytes;  // the larger of the two plans
    if (info.threads == 1024 && info.fast_spt == 4) {
      if (g == 4) return launch_fast<2, 4, 1024, 4>(p, probe, bytes, stream);
      if (g == 2) return launch_fast<2, 4, 1024, 2>(p, probe, bytes, stream);
      return launch_fast<2, 4, 1024, 1>(p, probe, bytes, stream);
    }
    if (info.threads == 1024) return launch_fast<2, 8, 1024, 8>(p, probe, bytes, stream);
    if (info.fast_spt == 8) return launch_fast<4, 8, 512, 8>(p, probe, bytes, stream);
    return launch_fast<4, 16, 512, 16>(p, probe, bytes, stream);
  }
  return launch_general(p, probe, info.threads, info.slots_per_thread, info.general_smem_bytes,
                        stream);
}

}  // namespace hisparse::resolve_detail
