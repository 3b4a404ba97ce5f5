// Shared memory of the general path (docs/kernels.md, "The general path"), one request per
// CTA: the static control block, the layout of the dynamic part (the launch's sizing on the
// host and the kernel's pointers side by side), and the view of the request's rows that reads
// them from there where the launch staged them.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_ops.h"
#include "resolve_common.cuh"

namespace hisparse::resolve_detail {

constexpr int kRefsInRegs = 8;  // selections per thread kept in registers (one "chunk")

// Control block of the general path. Per-warp partials instead of counters that need an
// initialising barrier; the scan buffers are double-buffered across chunk rounds.
struct GeneralCtl {
  int run[3][kMaxWarps];  // per warp: run end, first earlier token, last later token
  int n_host;
  int n_res;
  int n_hit_slots;
  int n_hit_pos;
  int n_unleased;  // hot blocks of -1
  int cap_flag;
  int corrupt_flag;
  unsigned long long classify_err;  // position, host block
  unsigned long long hit_err;       // hit errors (duplicate slot, hot block)
  int hits[kMaxWarps];                          // per warp: unleased << 16 | hits (LRU order)
  unsigned evict[2][kMaxWarps];                 // per warp: evictables of classes 0|1, 2|3

  int misses[2][kRefsInRegs][kMaxWarps];        // first-reference misses per (u, warp)
};

// The dynamic shared memory, in order: [hash: hash_entries x u64][slot_of: hash_entries x
// i32][victims: victim_entries x u16] (16-byte aligned) [hit bitmask: a bit per slot]
// [hot_blocks row][residency row][host_blocks row], each int32 array padded to 4 words; the
// rows only where staged (hot_blocks_in_smem, stage_pages; 0 = read from global memory).
// bytes() sizes it for the launch (host); the constructor carves it in the kernel.
struct GeneralSmem {
  unsigned long long* const tab;
  int* const slot_of;
  uint16_t* const victims;
  uint32_t* const hitmask;
  int* const hotb;
  int* const sres;
  int* const shb;

  __host__ __device__ static constexpr long long words4(long long n) { return (n + 3) & ~3LL; }
  __host__ __device__ static constexpr long long bytes(long long hash_entries,
                                                       long long victim_entries, int num_slots,
                                                       int hot_blocks_in_smem, int stage_pages) {
    return ((hash_entries * 12 + victim_entries * 2 + 15) & ~15LL) +
           words4((num_slots + 31) / 32) * 4 + words4(hot_blocks_in_smem) * 4 +
           words4(stage_pages) * 8;
  }
  __device__ __forceinline__ GeneralSmem(unsigned char* smem, int hash_entries,
                                         int victim_entries, int num_slots,
                                         int hot_blocks_in_smem, int stage_pages)
      : tab(reinterpret_cast<unsigned long long*>(smem)),
        slot_of(reinterpret_cast<int*>(tab + hash_entries)),
        victims(reinterpret_cast<uint16_t*>(slot_of + hash_entries)),
        hitmask(reinterpret_cast<uint32_t*>(
            smem + ((static_cast<size_t>(hash_entries) * 12 +
                     static_cast<size_t>(victim_entries) * 2 + 15) & ~static_cast<size_t>(15)))),
        hotb(reinterpret_cast<int*>(hitmask + ((((num_slots + 31) >> 5) + 3) & ~3))),
        sres(hotb + ((hot_blocks_in_smem + 3) & ~3)),
        shb(sres + ((stage_pages + 3) & ~3)) {}
};

// One request's page rows (residency, host_blocks: num_pages entries) and hot-block row
// (num_slots / block_size entries) as the general path reads them: from shared memory where
// staged, else from global memory. Positions and slots map to pages and blocks by a shift when
// the block size is a power of two (bs_shift >= 0).
struct RequestRows {
  const ResolveParams& p;
  const long long row_p;   // the request's first entry in residency / host_blocks
  const long long row_hb;  // its first entry in hot_blocks
  const int bs, bs_shift;
  const int n_hotb, n_stage;  // entries staged (0: global memory)
  int* const hotb;
  int* const sres;
  int* const shb;

  __device__ __forceinline__ RequestRows(const ResolveParams& p, int row, int bs, int bs_shift,
                                         int* hotb, int* sres, int* shb)
      : p(p),
        row_p(static_cast<long long>(row) * p.num_pages),
        row_hb(bs > 0 ? static_cast<long long>(row) * (p.num_slots / bs) : 0),
        bs(bs),
        bs_shift(bs_shift),
        n_hotb(p.hot_blocks_in_smem),
        n_stage(p.stage_pages),
        hotb(hotb),
        sres(sres),
        shb(shb) {}

  // Rows staged by cp.async (no registers; the caller waits before its barrier), the page
  // rows prefetched to L2 where not staged.
  __device__ __forceinline__ void stage() const {
    if (n_hotb) stage_row(hotb, p.hot_blocks + row_hb, n_hotb);
    if (n_stage) {
      stage_row(sres, p.residency + row_p, n_stage);
      stage_row(shb, p.host_blocks + row_p, n_stage);
    } else {
      prefetch_l2(p.residency + row_p, static_cast<long long>(p.num_pages) * 4);
      prefetch_l2(p.host_blocks + row_p, static_cast<long long>(p.num_pages) * 4);
    }
  }
  __device__ __forceinline__ bool pages_staged() const { return n_stage != 0; }
  __device__ __forceinline__ int page_of(int q) const {
    return bs_shift >= 0 ? (q >> bs_shift) : q / bs;
  }
  __device__ __forceinline__ int residency(int page) const {
    return n_stage ? sres[page] : __ldg(&p.residency[row_p + page]);
  }
  __device__ __forceinline__ int host_block(int page) const {
    return n_stage ? shb[page] : __ldg(&p.host_blocks[row_p + page]);
  }
  __device__ __forceinline__ int hot_block_at(int b) const {
    return n_hotb ? hotb[b] : __ldg(&p.hot_blocks[row_hb + b]);
  }
  __device__ __forceinline__ int hot_block(int slot) const {
    return hot_block_at(bs_shift >= 0 ? (slot >> bs_shift) : slot / bs);
  }
  // The device row of a hot slot: its block's row times the block size plus its offset.
  __device__ __forceinline__ int slot_row(int slot) const {
    const int off = bs_shift >= 0 ? (slot & (bs - 1)) : slot % bs;
    return static_cast<int>(static_cast<unsigned>(hot_block(slot)) * bs +
                            static_cast<unsigned>(off));
  }
};

}  // namespace hisparse::resolve_detail
