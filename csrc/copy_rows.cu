// Row copies of docs/design.md, "Copies" (gather of a miss plan, row mirrors, page copies) for every
// layer of a list in one launch. See docs/kernels.md.
//
// Work is a flat list of (layer, pair) items; a warp takes G consecutive items at a time,
// lanes 0..G-1 resolve the G (src, dst) row addresses into a per-warp shared slice, then
// the warp treats the G rows as one run of G * row_bytes / 16 chunks of 16 bytes: lane i
// owns chunks i, i + 32, ... and issues ALL its loads before its first store, so G rows
// (G * 656 B) are in flight per warp. Loads use the read-only path without L1 allocation
// (ld.global.nc.L1::no_allocate), which is also how pinned host memory is read over UVA.
// The grid is capped at ctas_per_sm CTAs per SM and strides over the items, so small and
// large batches alike spread over the whole GPU.
#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_ops.h"

namespace hisparse {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyWarps = kCopyThreads / 32;
constexpr int kMaxRowsPerWarp = 16;

__device__ __forceinline__ uint4 load_nc(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ void store16(void* ptr, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Exclusive prefix of the clamped per-row counts into excl[0..T]; returns the total.
__device__ long long plan_prefix(const CopyParams& p, int* excl, int* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int T = p.n_outer;
  const int K = p.n_inner;
  int carry = 0;
  for (int r0 = 0; r0 < T; r0 += kCopyThreads) {
    const int t = r0 + threadIdx.x;
    int c = t < T ? p.count[t] : 0;
    c = c < 0 ? 0 : (c > K ? K : c);
    int incl = c;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += n;
    }
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    int wprefix = 0;
    int rtotal = 0;
#pragma unroll
    for (int w = 0; w < kCopyWarps; ++w) {
      const int v = scratch[w];
      if (w < warp) wprefix += v;
      rtotal += v;
    }
    if (t < T) excl[t] = carry + wprefix + incl - c;
    carry += rtotal;
    __syncthreads();  // scratch is rewritten by the next round
  }
  if (threadIdx.x == 0) excl[T] = carry;
  __syncthreads();
  return carry;
}

// Source and destination address of item `item` (0 when the item is skipped). Items are
// pair-major (item = pair * L + layer: a warp's G consecutive items are the layers of one row,
// which a position-major host pool keeps adjacent) or layer-major (item = layer * pairs + pair).
__device__ __forceinline__ void item_addresses(const CopyParams& p, const int* excl,
                                               long long pairs, long long item,
                                               uint64_t& src, uint64_t& dst) {
  src = 0;
  dst = 0;
  int layer;
  long long q;
  if (p.pair_major) {
    q = item / p.num_layers;
    layer = static_cast<int>(item - q * p.num_layers);
  } else {
    layer = static_cast<int>(item / pairs);
    q = item - static_cast<long long>(layer) * pairs;
  }
  long long srow, drow;
  if (p.mode == kCopyPlan) {
    int lo = 0;
    int hi = p.n_outer;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (excl[mid] <= q) lo = mid; else hi = mid;
    }
    const long long idx = static_cast<long long>(lo) * p.n_inner + (q - excl[lo]);
    srow = p.a[idx];
    drow = p.b[idx];
  } else if (p.mode == kCopyPairs) {
    srow = p.a[q];
    drow = p.b[q];
  } else {
    const long long e = q / p.n_inner;
    const long long o = q - e * p.n_inner;
    const int sb = p.a[e];
    const int db = p.b[e];
    if (sb < 0 || db < 0) return;
    srow = static_cast<long long>(sb) * p.n_inner + o;
    drow = static_cast<long long>(db) * p.n_inner + o;
  }
  if (srow < 0 || drow < 0 || srow >= p.src_rows || drow >= p.dst_rows) return;
  src = p.src[layer] + static_cast<uint64_t>(srow) * static_cast<uint64_t>(p.src_stride);
  dst = p.dst[layer] + static_cast<uint64_t>(drow) * static_cast<uint64_t>(p.dst_stride);
}

template <int CPR, int G>
__global__ void __launch_bounds__(kCopyThreads) copy_rows_kernel(const __grid_constant__ CopyParams p) {
  extern __shared__ int excl[];  // plan mode: T + 1 prefix entries
  __shared__ int scratch[kCopyWarps];
  __shared__ uint64_t addr[kCopyWarps][2][kMaxRowsPerWarp];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  long long pairs;
  if (p.mode == kCopyPlan) {
    pairs = plan_prefix(p, excl, scratch);
  } else {
    pairs = static_cast<long long>(p.n_outer) * p.n_inner;
  }
  const long long items = pairs * p.num_layers;
  if (items == 0) return;
  const long long groups = (items + G - 1) / G;
  const long long gwarps = static_cast<long long>(gridDim.x) * kCopyWarps;
  const int cpr = CPR > 0 ? CPR : p.row_bytes / 16;

  for (long long g = static_cast<long long>(blockIdx.x) * kCopyWarps + warp; g < groups;
       g += gwarps) {
    if (lane < G) {
      const long long item = g * G + lane;
      uint64_t s = 0, d = 0;
      if (item < items) item_addresses(p, excl, pairs, item, s, d);
      addr[warp][0][lane] = s;
      addr[warp][1][lane] = d;
    }
    __syncwarp();
    if constexpr (CPR > 0) {
      constexpr int kChunks = G * CPR;
      constexpr int kIters = (kChunks + 31) / 32;
      uint4 v[kIters];
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int c = lane + 32 * k;
        const int r = c / CPR;
        const int off = c - r * CPR;
        if (c < kChunks) {
          const uint64_t s = addr[warp][0][r];
          if (s != 0 && addr[warp][1][r] != 0)
            v[k] = load_nc(reinterpret_cast<const void*>(s + 16u * off));
        }
      }
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int c = lane + 32 * k;
        const int r = c / CPR;
        const int off = c - r * CPR;
        if (c < kChunks) {
          const uint64_t s = addr[warp][0][r];
          const uint64_t d = addr[warp][1][r];
          if (s != 0 && d != 0) store16(reinterpret_cast<void*>(d + 16u * off), v[k]);
        }
      }
    } else {
      // Generic row size: rows one after another, four 16-byte loads in flight per lane.
      for (int r = 0; r < G; ++r) {
        const uint64_t s = addr[warp][0][r];
        const uint64_t d = addr[warp][1][r];
        if (s == 0 || d == 0) continue;
        for (int c0 = 0; c0 < cpr; c0 += 128) {
          uint4 v[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int c = c0 + lane + 32 * u;
            if (c < cpr) v[u] = load_nc(reinterpret_cast<const void*>(s + 16ull * c));
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int c = c0 + lane + 32 * u;
            if (c < cpr) store16(reinterpret_cast<void*>(d + 16ull * c), v[u]);
          }
        }
      }
    }
    __syncwarp();  // addr slice is rewritten by the next group
  }
}

using KernelFn = void (*)(CopyParams);

template <int CPR>
KernelFn pick_g(int g) {
  switch (g) {
    case 1: return copy_rows_kernel<CPR, 1>;
    case 2: return copy_rows_kernel<CPR, 2>;
    case 4: return copy_rows_kernel<CPR, 4>;
    case 8: return copy_rows_kernel<CPR, 8>;
    default: return copy_rows_kernel<CPR, 16>;
  }
}

int default_rows_per_warp(int row_bytes) {
  // Tuned on the H200 (docs/kernels.md): enough rows in flight per warp that the loads of a
  // group cover ~2-3 KiB.
  if (row_bytes <= 768) return 4;
  return 2;
}

}  // namespace

cudaError_t launch_copy_rows(const CopyParams& params, const CopyTuning& tuning,
                             cudaStream_t stream) {
  if (params.num_layers <= 0 || params.n_outer <= 0 || params.n_inner <= 0) return cudaSuccess;
  if (params.num_layers > kMaxCopyLayers || params.row_bytes <= 0 || params.row_bytes % 16 != 0)
    return cudaErrorInvalidValue;
  CopyParams p = params;
  if (p.src_stride == 0) p.src_stride = p.row_bytes;
  if (p.dst_stride == 0) p.dst_stride = p.row_bytes;
  if (p.src_stride < p.row_bytes || p.src_stride % 16 != 0 || p.dst_stride < p.row_bytes ||
      p.dst_stride % 16 != 0)
    return cudaErrorInvalidValue;
  int g = tuning.rows_per_warp > 0 ? tuning.rows_per_warp : default_rows_per_warp(p.row_bytes);
  if (g != 1 && g != 2 && g != 4 && g != 8 && g != 16) return cudaErrorInvalidValue;
  KernelFn fn;
  if (p.row_bytes == 656) {
    fn = pick_g<41>(g);
  } else if (p.row_bytes == 1152) {
    fn = pick_g<72>(g);
  } else {
    fn = pick_g<0>(g);
  }
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int per_sm = tuning.ctas_per_sm > 0 ? tuning.ctas_per_sm : 4;
  const long long max_items = static_cast<long long>(p.n_outer) * p.n_inner * p.num_layers;
  const long long groups = (max_items + g - 1) / g;
  long long ctas = (groups + kCopyWarps - 1) / kCopyWarps;
  const long long cap = static_cast<long long>(sms) * per_sm;
  if (ctas > cap) ctas = cap;
  if (tuning.max_ctas > 0 && ctas > tuning.max_ctas) ctas = tuning.max_ctas;
  if (ctas < 1) ctas = 1;
  size_t smem = p.mode == kCopyPlan ? (static_cast<size_t>(p.n_outer) + 1) * sizeof(int) : 0;
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  fn<<<static_cast<unsigned>(ctas), kCopyThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace hisparse
