// resolve (DESIGN.md §4.1): one CTA per request maps its logical top-k positions to device
// rows, updates the hot-slot LRU and writes the miss plan. See docs/kernels.md.
//
// Phases of the leading CTA of a request (the CTA of its first token; the CTAs of its other
// tokens exit at once, the CTA of a padding token writes -1 / 0 and exits):
//   0  run length + contiguity scan of token_rows; lru chunk -> registers; L2 prefetch of
//      the request's table rows
//   1  init the shared-memory hash (only the part this request needs)
//   2  classify every reference: padding, resident (row written now), host-backed (insert
//      position into the hash, first reference via atomicMin); errors become candidates
//   -  no host-backed position: write counts and return (the LRU is never touched)
//   3a hit marking in slot order: slot_pos -> hash lookup; warp ballots build a hit bitmask
//   3b LRU order: count hits per thread, one CTA scan, victims = first M evictables;
//      every check is done before the first write of hot state
//   4  misses in first-reference order (CTA scan per round): take victims, write slot_pos
//      and the compact miss plan
//   5  out_rows of every host-backed reference, miss_count, stats
// A request that fails a check writes out_rows = -1 and miss_count = 0 for its tokens and
// leaves slot_pos, lru and stats untouched; the first error of the launch is recorded.
#include <climits>
#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_ops.h"

namespace hisparse {
namespace {

constexpr int kEmptyKey = -1;
constexpr int32_t kResidentTag = 1 << 30;  // vals of resident keys (stats mode only)
constexpr int kMaxWarps = 32;
constexpr int kRefsPerThread = 4;  // blocked refs per thread per miss-pass round
constexpr int kUnroll = 4;         // independent loads in flight in the striped passes
constexpr unsigned long long kNoError = ~0ull;
constexpr int kMaxDevices = 64;
constexpr int kMaxHotBlocksSmem = 4096;  // hot_blocks row staged in shared memory up to this
constexpr long long kMaxBitmapPositions = 1 << 18;
constexpr long long kSmemBudget = 227LL * 1024 - 1024;  // dynamic smem per CTA (Hopper opt-in)  // position bitmap (32 KiB) up to this
constexpr int kHashSpread = 4;  // a request's hash part: up to 4 entries per reference (<= C)

// Error candidates of one CTA: atomicMin over (priority, key, detail) picks the error the
// reference twin would raise first (its check order, then first-reference order).
enum Priority : unsigned {
  kPrioCapacity = 0,
  kPrioPosition = 1,
  kPrioNoHost = 2,
  kPrioDuplicate = 3,
  kPrioHotBlock = 4,
};

struct Ctl {
  int run_end;       // first token after the run
  int first_other;   // first token of the same row before the run (INT_MAX: none)
  int last_same;     // last token of the same row after the run start
  int n_host;        // distinct host-backed positions
  int n_res;         // distinct resident positions (stats mode)
  int n_hit_slots;   // slots whose position is selected
  int n_hit_pos;     // distinct positions that hit
  int cap_flag;      // the hash overflowed (phase 2)
  int corrupt_flag;  // lru holds a value outside [0, D) (phase 3b)
  int victim_flag;   // a victim's hot block is -1 (phase 3b)
  unsigned long long err;
  int scan[2][kMaxWarps];
};


__device__ __forceinline__ int hash_index(int key, int cap) {
  return static_cast<int>(__umulhi(static_cast<unsigned>(key) * 0x9E3779B1u,
                                   static_cast<unsigned>(cap)));
}

// Inserts `key`; returns its index, or -1 when the table is full. Atomics only, so the
// concurrent inserts of one phase are race-free.
__device__ __forceinline__ int hash_insert(int* keys, int cap, int key, bool& inserted) {
  int h = hash_index(key, cap);
  for (int probes = 0; probes < cap; ++probes) {
    const int old = atomicCAS(&keys[h], kEmptyKey, key);
    if (old == kEmptyKey) {
      inserted = true;
      return h;
    }
    if (old == key) {
      inserted = false;
      return h;
    }
    if (++h == cap) h = 0;
  }
  inserted = false;
  return -1;
}

__device__ __forceinline__ int hash_find(const int* keys, int cap, int key) {
  int h = hash_index(key, cap);
  for (int probes = 0; probes < cap; ++probes) {
    const int k = keys[h];
    if (k == key) return h;
    if (k == kEmptyKey) return -1;
    if (++h == cap) h = 0;
  }
  return -1;
}

__device__ __forceinline__ void submit_error(Ctl& s, unsigned prio, int key, int detail) {
  const unsigned long long v = (static_cast<unsigned long long>(prio) << 60) |
                               (static_cast<unsigned long long>(key & 0x0FFFFFFF) << 32) |
                               static_cast<unsigned>(detail);
  atomicMin(&s.err, v);
}

// Exclusive scan of v over the CTA with one barrier; `buf` must not be reused before the
// next barrier.
__device__ __forceinline__ int cta_exclusive_scan(int v, int* buf, int& total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  int incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += n;
  }
  if (lane == 31) buf[warp] = incl;
  __syncthreads();
  const int wt = lane < nwarps ? buf[lane] : 0;
  int wincl = wt;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, wincl, d);
    if (lane >= d) wincl += n;
  }
  total = __shfl_sync(0xffffffffu, wincl, 31);
  const int warp_excl = __shfl_sync(0xffffffffu, wincl - wt, warp);
  return warp_excl + incl - v;
}

__device__ __forceinline__ void prefetch_l2(const void* base, long long bytes) {
  const char* p = static_cast<const char*>(base);
  const long long lines = bytes < (64 << 10) ? (bytes + 127) / 128 : (64 << 10) / 128;
  for (long long i = threadIdx.x; i < lines; i += blockDim.x) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i * 128));
  }
}

// First error of the launch wins the device word; the winner mirrors the record into
// pinned host memory (details first, code last) so the host can poll it without any copy.
__device__ __forceinline__ void record_error_impl(int32_t* error, int32_t* error_host, int code,
                                                  int row, int a, int b) {
  if (atomicCAS(error, 0, code) == 0) {
    error[1] = row;
    error[2] = a;
    error[3] = b;
    if (error_host != nullptr) {
      volatile int32_t* h = error_host;
      h[1] = row;
      h[2] = a;
      h[3] = b;
      __threadfence_system();
      h[0] = code;
      __threadfence_system();
    }
  }
}
#define record_error(err, ...) record_error_impl(err, p.error_host, __VA_ARGS__)

// Debug timing (benchmarks only): thread 0 of CTA 0 stamps %globaltimer at phase ends.
__device__ __forceinline__ void mark_time(const ResolveParams& p, int phase) {
  if (p.debug_times != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    p.debug_times[phase] = t;
  }
}

// Fill -1 / 0 for refs [base, base+n) and tokens [t0, t0+ntok).
__device__ __forceinline__ void fail_request(const ResolveParams& p, long long base, int n, int t0, int ntok) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) p.out_rows[base + i] = -1;
  for (int j = threadIdx.x; j < ntok; j += blockDim.x) p.miss_count[t0 + j] = 0;
}

// Thread 0: turn the CTA's best candidate into the launch's error record.
__device__ __forceinline__ void report_candidate(const ResolveParams& p, const Ctl& s, int row,
                                 long long base) {
  if (threadIdx.x != 0) return;
  const unsigned long long v = s.err;
  const unsigned prio = static_cast<unsigned>(v >> 60);
  const int key = static_cast<int>((v >> 32) & 0x0FFFFFFF);
  const int detail = static_cast<int>(static_cast<unsigned>(v));
  const int bs = p.block_size;
  switch (prio) {
    case kPrioPosition:
      record_error(p.error, kErrPositionOutOfRange, row, detail, p.num_pages * bs);
      break;
    case kPrioNoHost:
      record_error(p.error, kErrNoHostBlock, row, detail, detail / bs);
      break;
    case kPrioDuplicate:
      record_error(p.error, kErrDuplicateSlot, row, __ldg(&p.topk[base + key]), detail);
      break;
    case kPrioHotBlock:
      record_error(p.error, kErrHotBlockMissing, row, detail, __ldg(&p.topk[base + key]));
      break;
    default:
      break;
  }
}

template <int SPT, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) resolve_kernel(const ResolveParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ Ctl s;

  const int t = blockIdx.x;
  const int tid = threadIdx.x;
  constexpr int nthreads = THREADS;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  constexpr int nwarps = THREADS >> 5;
  const int K = p.k;
  const int T = p.num_tokens;
  const int D = p.num_slots;
  const int bs = p.block_size;

  prefetch_l2(p.topk + static_cast<long long>(t) * p.k, static_cast<long long>(p.k) * 4);
  const int row = __ldg(&p.token_rows[t]);
  if (row == -1) {  // padding token
    for (int i = tid; i < K; i += nthreads) p.out_rows[static_cast<long long>(t) * K + i] = -1;
    if (tid == 0) p.miss_count[t] = 0;
    return;
  }
  if (t > 0 && __ldg(&p.token_rows[t - 1]) == row) return;  // not the first token of its run

  const bool row_ok = row >= 0 && row < p.num_rows;
  const long long row_p = static_cast<long long>(row) * p.num_pages;
  const long long row_d = static_cast<long long>(row) * D;
  const long long row_hb = static_cast<long long>(row) * (D / bs);

  // ---- phase 0: prefetch, lru chunk into registers, run scan --------------------------
  mark_time(p, 0);
  uint32_t lru_w[(SPT + 1) / 2];
  const int j0 = tid * SPT;
  if (row_ok) {
    prefetch_l2(p.slot_pos + row_d, static_cast<long long>(D) * 4);
    prefetch_l2(p.residency + row_p, static_cast<long long>(p.num_pages) * 4);
    prefetch_l2(p.host_blocks + row_p, static_cast<long long>(p.num_pages) * 4);
    const int16_t* lrow = p.lru + row_d;
    if constexpr (SPT % 8 == 0) {
      if ((D & 7) == 0 && (reinterpret_cast<uintptr_t>(p.lru) & 15) == 0) {
#pragma unroll
        for (int q = 0; q < SPT / 8; ++q) {
          uint4 v = make_uint4(0, 0, 0, 0);
          if (j0 + q * 8 < D) v = *reinterpret_cast<const uint4*>(lrow + j0 + q * 8);
          lru_w[q * 4 + 0] = v.x;
          lru_w[q * 4 + 1] = v.y;
          lru_w[q * 4 + 2] = v.z;
          lru_w[q * 4 + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int k = 0; k < SPT; k += 2) {
          const uint32_t lo = j0 + k < D ? static_cast<uint16_t>(lrow[j0 + k]) : 0u;
          const uint32_t hi = j0 + k + 1 < D ? static_cast<uint16_t>(lrow[j0 + k + 1]) : 0u;
          lru_w[k / 2] = lo | (hi << 16);
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < SPT; k += 2) {
        const uint32_t lo = j0 + k < D ? static_cast<uint16_t>(lrow[j0 + k]) : 0u;
        const uint32_t hi =
            (k + 1 < SPT && j0 + k + 1 < D) ? static_cast<uint16_t>(lrow[j0 + k + 1]) : 0u;
        lru_w[k / 2] = lo | (hi << 16);
      }
    }
  }
  if (tid == 0) {
    s.run_end = T;
    s.first_other = INT_MAX;
    s.last_same = -1;
    s.n_host = 0;
    s.n_res = 0;
    s.n_hit_slots = 0;
    s.n_hit_pos = 0;
    s.cap_flag = 0;
    s.corrupt_flag = 0;
    s.victim_flag = 0;
    s.err = kNoError;
  }
  __syncthreads();
  {
    int run_end = INT_MAX, first_other = INT_MAX, last_same = -1;
    for (int i = tid; i < T; i += nthreads) {
      const int v = __ldg(&p.token_rows[i]);
      if (i > t && v != row) run_end = min(run_end, i);
      if (v == row && i < t) first_other = min(first_other, i);
      if (v == row && i > t) last_same = max(last_same, i);
    }
    run_end = __reduce_min_sync(0xffffffffu, run_end);
    first_other = __reduce_min_sync(0xffffffffu, first_other);
    last_same = __reduce_max_sync(0xffffffffu, last_same);
    if (lane == 0) {
      if (run_end != INT_MAX) atomicMin(&s.run_end, run_end);
      if (first_other != INT_MAX) atomicMin(&s.first_other, first_other);
      if (last_same >= 0) atomicMax(&s.last_same, last_same);
    }
  }
  mark_time(p, 1);
  __syncthreads();
  const int ntok = s.run_end - t;
  const long long base = static_cast<long long>(t) * K;
  const int N = ntok * K;

  if (!row_ok) {
    fail_request(p, base, N, t, ntok);
    if (tid == 0) record_error(p.error, kErrStateRowOutOfRange, -1, row, p.num_rows);
    return;
  }
  if (s.first_other != INT_MAX || s.last_same >= s.run_end) {
    fail_request(p, base, N, t, ntok);
    // The later run reports (its first token, the first token of the earlier run).
    if (tid == 0 && s.first_other != INT_MAX)
      record_error(p.error, kErrNotContiguous, row, t, s.first_other);
    return;
  }

  // ---- phase 1: hash init ---------------------------------------------------------------
  mark_time(p, 2);
  int* keys = reinterpret_cast<int*>(smem_raw);
  int* vals = keys + p.hash_capacity;
  int* slot_of = vals + p.hash_capacity;
  uint16_t* victims = reinterpret_cast<uint16_t*>(slot_of + p.hash_capacity);
  uint32_t* hitmask = reinterpret_cast<uint32_t*>(
      smem_raw + ((static_cast<size_t>(p.hash_capacity) * 12 +
                   static_cast<size_t>(p.victim_capacity) * 2 + 15) & ~static_cast<size_t>(15)));

  int* hotb = reinterpret_cast<int*>(hitmask + ((D + 31) >> 5));
  const int n_hotb = p.hot_blocks_in_smem;  // D / bs when staged, else 0
  for (int i = tid; i < n_hotb; i += nthreads) hotb[i] = __ldg(&p.hot_blocks[row_hb + i]);
  // Bitmap of the request's host-backed positions (when P * bs is small enough): hit marking
  // tests a slot's position with one load and probes the hash only for selected positions.
  uint32_t* posbits = reinterpret_cast<uint32_t*>(hotb + n_hotb);
  const int n_posbits = p.position_bitmap_words;  // 0 = no bitmap
  for (int i = tid; i < n_posbits; i += nthreads) posbits[i] = 0u;
  auto hot_block = [&](int slot) -> int {
    return n_hotb ? hotb[slot / bs] : __ldg(&p.hot_blocks[row_hb + slot / bs]);
  };

  // The request's part of the hash: up to kHashSpread entries per reference (load factor
  // <= 1/kHashSpread, short probe chains), never more than the table (which is sized for
  // 1.5 entries per reference of max_tokens_per_request tokens: the UNION_CAPACITY bound).
  long long capl = static_cast<long long>(kHashSpread) * N;
  if (capl > p.hash_capacity) capl = p.hash_capacity;
  int cap = static_cast<int>(capl);
  cap = (cap + 31) & ~31;
  if (cap < 32) cap = 32;
  if (cap > p.hash_capacity) cap = p.hash_capacity;
  for (int i = tid * 4; i < cap; i += nthreads * 4) {
    *reinterpret_cast<int4*>(keys + i) = make_int4(kEmptyKey, kEmptyKey, kEmptyKey, kEmptyKey);
    *reinterpret_cast<int4*>(vals + i) = make_int4(INT_MAX, INT_MAX, INT_MAX, INT_MAX);
    *reinterpret_cast<int4*>(slot_of + i) = make_int4(-1, -1, -1, -1);
  }
  __syncthreads();

  // ---- phase 2: classify and insert -------------------------------------------------------
  const long long npos = static_cast<long long>(p.num_pages) * bs;
  const bool with_stats = p.stats != nullptr;
  int my_host = 0, my_res = 0;
  for (int i0 = 0; i0 < N; i0 += nthreads * kUnroll) {
    int pos[kUnroll];
    int rb[kUnroll];
    int hb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * nthreads + tid;
      pos[u] = i < N ? __ldg(&p.topk[base + i]) : -1;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      rb[u] = -1;
      if (pos[u] >= 0 && pos[u] < npos) rb[u] = __ldg(&p.residency[row_p + pos[u] / bs]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      hb[u] = 0;
      if (pos[u] >= 0 && pos[u] < npos && rb[u] < 0) hb[u] = __ldg(&p.host_blocks[row_p + pos[u] / bs]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * nthreads + tid;
      if (i >= N) continue;
      const int q = pos[u];
      if (q == -1) {
        p.out_rows[base + i] = -1;
        continue;
      }
      if (q < -1 || q >= npos) {
        submit_error(s, kPrioPosition, i, q);
        continue;
      }
      const int page = q / bs;
      const int off = q - page * bs;
      if (rb[u] >= 0) {
        p.out_rows[base + i] = static_cast<int>(static_cast<unsigned>(rb[u]) * bs + off);
        if (with_stats) {
          bool ins;
          const int h = hash_insert(keys, cap, q, ins);
          if (h < 0) {
            atomicExch(&s.cap_flag, 1);
          } else {
            my_res += ins;
            atomicMin(&vals[h], i | kResidentTag);
          }
        }
        continue;
      }
      if (hb[u] < 0) {
        submit_error(s, kPrioNoHost, i, q);
        continue;
      }
      bool ins;
      const int h = hash_insert(keys, cap, q, ins);
      if (h < 0) {
        atomicExch(&s.cap_flag, 1);
      } else {
        my_host += ins;
        atomicMin(&vals[h], i);
        if (ins && n_posbits) atomicOr(&posbits[q >> 5], 1u << (q & 31));
      }
    }
  }
  my_host = __reduce_add_sync(0xffffffffu, my_host);
  my_res = __reduce_add_sync(0xffffffffu, my_res);
  if (lane == 0) {
    if (my_host) atomicAdd(&s.n_host, my_host);
    if (my_res) atomicAdd(&s.n_res, my_res);
  }
  mark_time(p, 3);
  __syncthreads();

  if (s.cap_flag || s.err != kNoError) {
    fail_request(p, base, N, t, ntok);
    if (s.cap_flag) {
      if (tid == 0) record_error(p.error, kErrUnionCapacity, row, N, cap);
    } else {
      report_candidate(p, s, row, base);
    }
    return;
  }
  const int n_host = s.n_host;
  if (n_host > D) {
    fail_request(p, base, N, t, ntok);
    if (tid == 0) record_error(p.error, kErrHotOverflow, row, n_host, D);
    return;
  }
  if (n_host == 0) {  // fully resident (or empty): the hot state is never touched
    for (int j = tid; j < ntok; j += nthreads) p.miss_count[t + j] = 0;
    if (tid == 0 && with_stats && s.n_res > 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(p.stats), static_cast<unsigned long long>(s.n_res));
    return;
  }

  // ---- phase 3a: hit marking in slot order ---------------------------------------------------
  mark_time(p, 4);
  // Slots (k * nwarps + warp) * 32 + lane, k < SPT, cover D; loads go in batches of up to
  // 8 per lane so they overlap instead of one round trip per 32-slot chunk.
  constexpr int kBatch = SPT >= 32 ? 4 : (SPT < 8 ? SPT : 8);
  int warp_hit_slots = 0, warp_hit_pos = 0;  // uniform over the warp
#pragma unroll
  for (int k0 = 0; k0 < SPT; k0 += kBatch) {
    int qv[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int slot = ((k0 + u) * nwarps + warp) * 32 + lane;
      qv[u] = slot < D ? p.slot_pos[row_d + slot] : -1;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int sb = ((k0 + u) * nwarps + warp) * 32;
      if (sb >= D) break;  // uniform per warp
      const int slot = sb + lane;
      const int q = qv[u];
      bool hit = false;
      bool first = false;
      bool maybe = q >= 0;
      if (maybe && n_posbits) {
        maybe = (q >> 5) < n_posbits && ((posbits[q >> 5] >> (q & 31)) & 1u);
      }
      if (maybe) {
        const int h = hash_find(keys, cap, q);
        if (h >= 0) {
          const int v = vals[h];
          if (!(v & kResidentTag)) {
            hit = true;
            const int old = atomicCAS(&slot_of[h], -1, slot);
            if (old == -1) {
              first = true;
            } else {
              submit_error(s, kPrioDuplicate, v, old);
              submit_error(s, kPrioDuplicate, v, slot);
            }
            if (hot_block(slot) < 0) submit_error(s, kPrioHotBlock, v, slot);
          }
        }
      }
      const unsigned bits = __ballot_sync(0xffffffffu, hit);
      const unsigned firsts = __ballot_sync(0xffffffffu, first);
      if (lane == 0) hitmask[sb >> 5] = bits;
      warp_hit_slots += __popc(bits);
      warp_hit_pos += __popc(firsts);
    }
  }
  if (lane == 0) {
    if (warp_hit_slots) atomicAdd(&s.n_hit_slots, warp_hit_slots);
    if (warp_hit_pos) atomicAdd(&s.n_hit_pos, warp_hit_pos);
  }
  __syncthreads();
  if (s.err != kNoError && static_cast<unsigned>(s.err >> 60) == kPrioDuplicate) {
    fail_request(p, base, N, t, ntok);
    report_candidate(p, s, row, base);
    return;
  }

  // ---- phase 3b: LRU order, victims ----------------------------------------------------------
  mark_time(p, 5);
  const int H = s.n_hit_slots;
  const int E = D - H;
  const int M = n_host - s.n_hit_pos;  // <= E because n_host <= D and no slot is duplicated
  int my_hits = 0;
  bool corrupt = false;
#pragma unroll
  for (int k = 0; k < SPT; ++k) {
    if (j0 + k < D) {
      const int slot = static_cast<int>((lru_w[k / 2] >> ((k & 1) * 16)) & 0xFFFFu);
      if (slot >= D) {
        corrupt = true;
      } else {
        my_hits += (hitmask[slot >> 5] >> (slot & 31)) & 1u;
      }
    }
  }
  if (corrupt) atomicExch(&s.corrupt_flag, 1);
  int total_hits;
  const int hit_base = cta_exclusive_scan(my_hits, s.scan[0], total_hits);
  const int first_j = j0 < D ? j0 : D;
  const int ev_base = first_j - hit_base;
  const bool corrupt_any = s.corrupt_flag != 0;  // written before the scan's barrier
  if (!corrupt_any) {
    int e = ev_base;
#pragma unroll
    for (int k = 0; k < SPT; ++k) {
      if (j0 + k < D) {
        const int slot = static_cast<int>((lru_w[k / 2] >> ((k & 1) * 16)) & 0xFFFFu);
        if (!((hitmask[slot >> 5] >> (slot & 31)) & 1u)) {
          if (e < M) {
            victims[e] = static_cast<uint16_t>(slot);
            if (hot_block(slot) < 0) atomicExch(&s.victim_flag, 1);
          }
          ++e;
        }
      }
    }
  }
  __syncthreads();
  if (corrupt_any) {
    fail_request(p, base, N, t, ntok);
    if (tid == 0) {
      int bad = 0;
      for (int j = 0; j < D; ++j) {
        const int v = static_cast<uint16_t>(p.lru[row_d + j]);
        if (v >= D) {
          bad = static_cast<int16_t>(v);
          break;
        }
      }
      record_error(p.error, kErrCorruptLru, row, bad, D);
    }
    return;
  }
  const bool dry = s.victim_flag != 0 || s.err != kNoError;

  // ---- phase 4: misses in first-reference order --------------------------------------------
  mark_time(p, 6);
  // Rounds of nthreads * kRefsPerThread refs, each thread a contiguous chunk; dry = only
  // look for hot-block errors of the victims (nothing written).
  int carry = 0;
  int round = 0;
  for (int r0 = 0; r0 < N; r0 += nthreads * kRefsPerThread, ++round) {
    int hq[kRefsPerThread];
    int pq[kRefsPerThread];
    int cnt = 0;
    const int ib = r0 + tid * kRefsPerThread;
#pragma unroll
    for (int u = 0; u < kRefsPerThread; ++u) {
      hq[u] = -1;
      pq[u] = ib + u < N ? __ldg(&p.topk[base + ib + u]) : -1;
    }
#pragma unroll
    for (int u = 0; u < kRefsPerThread; ++u) {
      if (pq[u] >= 0) {
        const int h = hash_find(keys, cap, pq[u]);
        if (h >= 0 && vals[h] == ib + u && slot_of[h] == -1) {
          hq[u] = h;
          ++cnt;
        }
      }
    }
    int round_total;
    int m = carry + cta_exclusive_scan(cnt, s.scan[round & 1], round_total);
    carry += round_total;
#pragma unroll
    for (int u = 0; u < kRefsPerThread; ++u) {
      if (hq[u] < 0) continue;
      const int slot = victims[m];
      const int blk = hot_block(slot);
      if (dry) {
        if (blk < 0) submit_error(s, kPrioHotBlock, ib + u, slot);
      } else {
        const int q = pq[u];
        const int page = q / bs;
        const int off = q - page * bs;
        slot_of[hq[u]] = slot;
        p.slot_pos[row_d + slot] = q;
        const int hbk = __ldg(&p.host_blocks[row_p + page]);
        p.miss_src[base + m] = static_cast<int>(static_cast<unsigned>(hbk) * bs + off);
        p.miss_dst[base + m] =
            static_cast<int>(static_cast<unsigned>(blk) * bs + static_cast<unsigned>(slot % bs));
      }
      ++m;
    }
    __syncthreads();
  }
  if (dry) {
    fail_request(p, base, N, t, ntok);
    report_candidate(p, s, row, base);
    return;
  }

  // ---- LRU rewrite: [evictable not taken] + [taken, miss order] + [hits, old order] -------
  {
    int h = hit_base;
    int e = ev_base;
    int16_t* lrow = p.lru + row_d;
#pragma unroll
    for (int k = 0; k < SPT; ++k) {
      if (j0 + k < D) {
        const int slot = static_cast<int>((lru_w[k / 2] >> ((k & 1) * 16)) & 0xFFFFu);
        int newpos;
        if ((hitmask[slot >> 5] >> (slot & 31)) & 1u) {
          newpos = E + h++;
        } else {
          newpos = e < M ? E - M + e : e - M;
          ++e;
        }
        lrow[newpos] = static_cast<int16_t>(slot);
      }
    }
  }

  // ---- phase 5: out_rows of host-backed refs, counts, stats ------------------------------
  mark_time(p, 7);
  for (int i0 = 0; i0 < N; i0 += nthreads * kUnroll) {
    int pos[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * nthreads + tid;
      pos[u] = i < N ? __ldg(&p.topk[base + i]) : -1;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (pos[u] < 0) continue;
      const int h = hash_find(keys, cap, pos[u]);
      if (h < 0 || (vals[h] & kResidentTag)) continue;
      const int slot = slot_of[h];
      const int blk = hot_block(slot);
      p.out_rows[base + i0 + u * nthreads + tid] =
          static_cast<int>(static_cast<unsigned>(blk) * bs + static_cast<unsigned>(slot % bs));
    }
  }
  for (int j = tid; j < ntok; j += nthreads) {
    const long long c = static_cast<long long>(M) - static_cast<long long>(j) * K;
    p.miss_count[t + j] = static_cast<int>(c < 0 ? 0 : (c > K ? K : c));
  }
  if (tid == 0 && with_stats) {
    auto* st = reinterpret_cast<unsigned long long*>(p.stats);
    if (s.n_res) atomicAdd(st + 0, static_cast<unsigned long long>(s.n_res));
    if (s.n_hit_pos) atomicAdd(st + 1, static_cast<unsigned long long>(s.n_hit_pos));
    if (M) atomicAdd(st + 2, static_cast<unsigned long long>(M));
  }
  mark_time(p, 8);
}

int pow2_at_least(int x) {
  int v = 1;
  while (v < x) v <<= 1;
  return v;
}

template <int SPT, int THREADS>
cudaError_t launch_spt(const ResolveParams& p, const ResolveLaunchInfo& info,
                       cudaStream_t stream) {
  if (info.threads != THREADS) return cudaErrorInvalidConfiguration;
  if (info.smem_bytes > 48 * 1024) {
    // The opt-in is per device and per function; raise it once to the largest size seen so
    // that steady-state (and graph-captured) launches make no extra runtime call.
    static int configured[kMaxDevices] = {0};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const int bytes = static_cast<int>(info.smem_bytes);
    if (device >= kMaxDevices || configured[device] < bytes) {
      err = cudaFuncSetAttribute(resolve_kernel<SPT, THREADS>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      if (err != cudaSuccess) return err;
      if (device < kMaxDevices) configured[device] = bytes;
    }
  }
  resolve_kernel<SPT, THREADS><<<p.num_tokens, THREADS, info.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

ResolveLaunchInfo resolve_launch_info(int num_tokens, int k, int num_slots, int block_size,
                                      int max_tokens_per_request, int threads) {
  ResolveLaunchInfo info{};
  // 1024 threads measured 18-20 % faster than 512 at every batch (docs/kernels.md); 512 is
  // kept selectable for D <= 8192.
  info.threads = (num_slots > 8192 || threads != 512) ? 1024 : 512;
  int spt = (num_slots + info.threads - 1) / info.threads;
  spt = pow2_at_least(spt < 1 ? 1 : spt);
  info.slots_per_thread = spt;
  int tok = max_tokens_per_request < 1 ? 1 : max_tokens_per_request;
  if (num_tokens > 0 && tok > num_tokens) tok = num_tokens;
  long long n = static_cast<long long>(tok) * k;
  long long cap = (3 * n + 1) / 2;
  cap = (cap + 31) & ~31LL;
  if (cap < 32) cap = 32;
  // Keep within the opt-in shared memory of Hopper (227 KiB) with the other arrays.
  const int hot_blocks = block_size > 0 ? num_slots / block_size : 0;
  info.hot_blocks_in_smem = hot_blocks <= kMaxHotBlocksSmem ? hot_blocks : 0;
  const long long hitmask_bytes =
      ((num_slots + 31) / 32) * 4LL + static_cast<long long>(info.hot_blocks_in_smem) * 4;
  const long long budget = kSmemBudget;
  auto bytes_for = [&](long long c) {
    const long long vc = c < num_slots ? c : num_slots;
    return ((c * 12 + vc * 2 + 15) & ~15LL) + hitmask_bytes;
  };
  while (cap > 32 && bytes_for(cap) > budget) cap -= 32;
  info.hash_capacity = static_cast<int>(cap);
  info.victim_capacity = static_cast<int>(cap < num_slots ? cap : num_slots);
  info.smem_bytes = static_cast<size_t>(bytes_for(cap));
  return info;
}

cudaError_t launch_resolve(const ResolveParams& params, int max_tokens_per_request,
                           int threads, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  ResolveLaunchInfo info = resolve_launch_info(params.num_tokens, params.k, params.num_slots,
                                               params.block_size, max_tokens_per_request,
                                               threads);
  ResolveParams p = params;
  p.hash_capacity = info.hash_capacity;
  p.victim_capacity = info.victim_capacity;
  p.hot_blocks_in_smem = info.hot_blocks_in_smem;
  // Position bitmap (after the staged hot_blocks row) when P * bs is small enough and fits.
  p.position_bitmap_words = 0;
  const long long npos = static_cast<long long>(p.num_pages) * p.block_size;
  if (npos > 0 && npos <= kMaxBitmapPositions) {
    const long long words = (npos + 31) / 32;
    if (static_cast<long long>(info.smem_bytes) + words * 4 <= kSmemBudget) {
      p.position_bitmap_words = static_cast<int>(words);
      info.smem_bytes += static_cast<size_t>(words) * 4;
    }
  }
  if (info.threads == 1024) {
    switch (info.slots_per_thread) {
      case 1: return launch_spt<1, 1024>(p, info, stream);
      case 2: return launch_spt<2, 1024>(p, info, stream);
      case 4: return launch_spt<4, 1024>(p, info, stream);
      case 8: return launch_spt<8, 1024>(p, info, stream);
      case 16: return launch_spt<16, 1024>(p, info, stream);
      case 32: return launch_spt<32, 1024>(p, info, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (info.slots_per_thread) {
    case 1: return launch_spt<1, 512>(p, info, stream);
    case 2: return launch_spt<2, 512>(p, info, stream);
    case 4: return launch_spt<4, 512>(p, info, stream);
    case 8: return launch_spt<8, 512>(p, info, stream);
    case 16: return launch_spt<16, 512>(p, info, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace hisparse
