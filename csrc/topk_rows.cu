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
// its scan total is the row total; a longer row takes a first counting pass for it. Each
// thread reads its entries' both candidates before it knows the token's kind, so the loads
// of a merge form a chain of two (candidates, token and batch row; then the block table).
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

// Both candidates of this thread's kPerThread entries `first + e * kStride` (resolve's row
// and vLLM's row, or in table mode its position), -1 past the row. They are read before the
// token's kind is known, together with its state row and batch row: a merge then waits on
// two dependent loads (these, then the block table in table mode), not four.
template <int kStride>
__device__ __forceinline__ void load_candidates(const MergeRowsParams& p, long long base, int first,
                                                int32_t (&ours)[kPerThread],
                                                int32_t (&other)[kPerThread]) {
  const int32_t* second = p.theirs != nullptr ? p.theirs : p.topk;
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) {
    const int j = first + e * kStride;
    ours[e] = j < p.k ? p.ours[base + j] : -1;
    other[e] = j < p.k ? second[base + j] : -1;
  }
}

// One entry: resolve's row translated to the target space for a tracked token, else vLLM's
// row (given, or from the token's block-table row `table_row` in table mode: nullptr when
// the batch row is outside the table).
__device__ __forceinline__ int32_t merged_value(const MergeRowsParams& p, bool tracked,
                                                const int32_t* table_row, int32_t ours,
                                                int32_t other) {
  if (!tracked) {
    if (p.theirs != nullptr) return other;
    const int32_t pos = other;
    if (pos < 0 || table_row == nullptr) return -1;
    // A power-of-two block size (vLLM's: 64) divides by a shift, as vLLM's constexpr does.
    const int32_t bs = p.block_size;
    const int32_t page = (bs & (bs - 1)) == 0 ? pos >> (__ffs(bs) - 1) : pos / bs;
    if (page >= p.table_cols) return -1;
    // 32-bit wrap-around, as vLLM's int32 Triton arithmetic.
    return static_cast<int32_t>(static_cast<uint32_t>(table_row[page]) *
                                    static_cast<uint32_t>(p.to_stride_rows) +
                                static_cast<uint32_t>(pos - page * bs));
  }
  if (ours < 0 || p.from_stride_rows == p.to_stride_rows) return ours;
  const int32_t block = ours / p.from_stride_rows;
  return block * p.to_stride_rows + (ours - block * p.from_stride_rows);
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
  const long long base = static_cast<long long>(t) * p.k;
  const bool compact = p.counts != nullptr;
  // Issued together: the token's state row and batch row, and its first tile's candidates
  // (without counts entry j stays at j, so a tile is strided over the threads: coalesced).
  const int32_t token_row = p.token_rows[t];
  const int32_t batch_row = p.theirs == nullptr ? p.batch_rows[t] : -1;
  int32_t ours[kPerThread], other[kPerThread];
  if (compact) {
    load_candidates<1>(p, base, threadIdx.x * kPerThread, ours, other);
  } else {
    load_candidates<kThreads>(p, base, threadIdx.x, ours, other);
  }
  const bool tracked = token_row >= 0;
  const int32_t* table_row = nullptr;
  if (!tracked && p.theirs == nullptr && batch_row >= 0 && batch_row < p.table_rows)
    table_row = p.block_table + static_cast<long long>(batch_row) * p.table_stride;

  if (!compact) {
    for (int tile = 0; tile < p.k; tile += kTile) {
      if (tile > 0) load_candidates<kThreads>(p, base, tile + threadIdx.x, ours, other);
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        const int j = tile + threadIdx.x + e * kThreads;
        if (j < p.k) p.out[base + j] = merged_value(p, tracked, table_row, ours[e], other[e]);
      }
    }
    return;
  }

  // A row of one tile (K <= kTile, the models' top-k) is read once: its tile's scan total is
  // the row total. A longer row takes a counting pass for it first.
  const bool one_tile = p.k <= kTile;
  int row_total = 0;
  if (!one_tile) {
    int mine = 0;
    for (int tile = 0; tile < p.k; tile += kTile) {
      const int first = tile + threadIdx.x * kPerThread;
      int32_t o[kPerThread], x[kPerThread];
      load_candidates<1>(p, base, first, o, x);
#pragma unroll
      for (int e = 0; e < kPerThread; ++e)
        mine += first + e < p.k && merged_value(p, tracked, table_row, o[e], x[e]) >= 0;
    }
    block_exclusive_scan(mine, warp_sums, row_total);
  }

  int valid_before_tile = 0;
  for (int tile = 0; tile < p.k; tile += kTile) {
    const int first = tile + threadIdx.x * kPerThread;
    if (tile > 0) load_candidates<1>(p, base, first, ours, other);
    int32_t v[kPerThread];
    int n_valid = 0;
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      const int j = first + e;
      v[e] = j < p.k ? merged_value(p, tracked, table_row, ours[e], other[e]) : -1;
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
