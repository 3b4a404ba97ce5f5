// The two small ops around resolve in a sparse-attention layer's top-k conversion
// (hisparse_ops.h: launch_token_state_rows, launch_merge_rows; docs/kernels.md "Finishing a
// conversion"). Each is one launch, so a step whose requests are all FULL pays two near-empty
// launches per layer instead of the ~15 elementwise kernels the torch version queued. In its
// table mode merge_rows also computes vLLM's own rows (its decode conversion), so that vLLM's
// conversion kernel need not run first.
//
// merge_rows: one CTA per token. The row is processed in tiles of kThreads * kPerThread
// entries, each thread holding kPerThread consecutive entries, so a block-wide exclusive scan
// of the valid counts gives every entry its destination: a valid entry goes to (valid entries
// before it), an invalid one to (row total) + (invalid entries before it). Every output entry
// is written exactly once. A row of one tile (K <= 2048, the models' top-k) is read once and
// its scan total is the row total; a longer row takes a first counting pass for it.
#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_ops.h"

namespace hisparse {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPerThread = 8;
constexpr int kTile = kThreads * kPerThread;

template <typename BatchRow>
__global__ void token_state_rows_kernel(const BatchRow* __restrict__ batch_rows,
                                        const int32_t* __restrict__ step_table, int32_t* out,
                                        int num_tokens, int num_batch_rows, int limit) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= num_tokens) return;
  const long long b = static_cast<long long>(batch_rows[t]);
  const int real = step_table[0];
  int32_t row = -1;
  if (b >= 0 && b < num_batch_rows && t < real && t < limit) row = step_table[1 + b];
  out[t] = row;
}

// `table_row`: the token's block-table row in table mode (nullptr: none, or not table mode).
__device__ __forceinline__ int32_t merged_value(const MergeRowsParams& p, bool tracked,
                                                const int32_t* table_row, long long idx) {
  if (!tracked) {
    if (p.theirs != nullptr) return p.theirs[idx];
    const int32_t pos = p.topk[idx];
    if (pos < 0 || table_row == nullptr) return -1;
    const int32_t page = pos / p.block_size;
    if (page >= p.table_cols) return -1;
    // 32-bit wrap-around, as vLLM's int32 Triton arithmetic.
    return static_cast<int32_t>(static_cast<uint32_t>(table_row[page]) *
                                    static_cast<uint32_t>(p.to_stride_rows) +
                                static_cast<uint32_t>(pos - page * p.block_size));
  }
  const int32_t r = p.ours[idx];
  if (r < 0 || p.from_stride_rows == p.to_stride_rows) return r;
  const int32_t block = r / p.from_stride_rows;
  return block * p.to_stride_rows + (r - block * p.from_stride_rows);
}

// Exclusive prefix of `v` over the CTA (thread order) and the CTA's total.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int& total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += n;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int s = warp_sums[w];
    if (w < warp) before += s;
    total += s;
  }
  __syncthreads();  // warp_sums is rewritten by the next call
  return before + incl - v;
}

__global__ void __launch_bounds__(kThreads) merge_rows_kernel(const __grid_constant__ MergeRowsParams p) {
  __shared__ int warp_sums[kWarps];
  const int t = blockIdx.x;
  const bool tracked = p.token_rows[t] >= 0;
  const long long base = static_cast<long long>(t) * p.k;
  const int32_t* table_row = nullptr;
  if (!tracked && p.theirs == nullptr) {
    const int32_t b = p.batch_rows[t];
    if (b >= 0 && b < p.table_rows) table_row = p.block_table + static_cast<long long>(b) * p.table_stride;
  }

  if (p.counts == nullptr) {
    for (int j = threadIdx.x; j < p.k; j += kThreads) p.out[base + j] = merged_value(p, tracked, table_row, base + j);
    return;
  }

  // A row of one tile (K <= kTile, the models' top-k) is read once: its tile's scan total is
  // the row total. A longer row takes a counting pass for it first.
  const bool one_tile = p.k <= kTile;
  int row_total = 0;
  if (!one_tile) {
    int mine = 0;
    for (int j = threadIdx.x; j < p.k; j += kThreads) mine += merged_value(p, tracked, table_row, base + j) >= 0;
    block_exclusive_scan(mine, warp_sums, row_total);
  }

  int valid_before_tile = 0;
  for (int tile = 0; tile < p.k; tile += kTile) {
    const int first = tile + threadIdx.x * kPerThread;
    int32_t v[kPerThread];
    int n_valid = 0;
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      const int j = first + e;
      v[e] = j < p.k ? merged_value(p, tracked, table_row, base + j) : -1;
      n_valid += (j < p.k && v[e] >= 0);
    }
    int tile_total = 0;
    int valid_before = valid_before_tile + block_exclusive_scan(n_valid, warp_sums, tile_total);
    if (one_tile) row_total = tile_total;
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      const int j = first + e;
      if (j >= p.k) break;
      if (v[e] >= 0) {
        p.out[base + valid_before] = v[e];
        ++valid_before;
      } else {
        p.out[base + row_total + (j - valid_before)] = -1;
      }
    }
    valid_before_tile += tile_total;
  }
  if (threadIdx.x == 0) p.counts[t] = row_total;
}

}  // namespace

cudaError_t launch_token_state_rows(const void* batch_rows, bool batch_rows_64,
                                    const int32_t* step_table, int32_t* out, int num_tokens,
                                    int num_batch_rows, int limit, cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  if (num_batch_rows < 0) return cudaErrorInvalidValue;
  const int threads = 256;
  const int blocks = (num_tokens + threads - 1) / threads;
  if (batch_rows_64) {
    token_state_rows_kernel<<<blocks, threads, 0, stream>>>(
        static_cast<const int64_t*>(batch_rows), step_table, out, num_tokens, num_batch_rows,
        limit);
  } else {
    token_state_rows_kernel<<<blocks, threads, 0, stream>>>(
        static_cast<const int32_t*>(batch_rows), step_table, out, num_tokens, num_batch_rows,
        limit);
  }
  return cudaGetLastError();
}

cudaError_t launch_merge_rows(const MergeRowsParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.k <= 0) return cudaSuccess;
  if (p.from_stride_rows <= 0 || p.to_stride_rows <= 0) return cudaErrorInvalidValue;
  // An empty block table may have no storage; the kernel never reads it then.
  if (p.theirs == nullptr &&
      (p.topk == nullptr || p.batch_rows == nullptr || p.block_size <= 0 || p.table_rows < 0 ||
       p.table_cols < 0 ||
       (p.block_table == nullptr && p.table_rows > 0 && p.table_cols > 0))) {
    return cudaErrorInvalidValue;
  }
  merge_rows_kernel<<<p.num_tokens, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace hisparse
