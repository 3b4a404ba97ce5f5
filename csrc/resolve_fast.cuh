// resolve's fast path (docs/design.md, "resolve"): the common request in four barriers and a few hundred
// instructions per thread; see docs/kernels.md. resolve_fast_kernel is the default launch
// (resolve_launch.cu) and hands every request it does not take to resolve_general.
//
// The fast path takes a request of one token whose K selections and D slots fit the CTA
// (KPT selections and SPT slots per thread). Its table maps the hot slots' positions to their
// slots in buckets of 4 entries: a slot claims an entry with one atomic add on its bucket's
// fill count, and a selection reads its bucket with one 16-byte load, so neither side runs a
// probe loop (per-lane probe loops split warps into groups that then ran the rest of the
// phase separately: 3-4x the instructions, measured with ncu). Only misses go into a second,
// CAS-built table that detects repeats. With stats, resident positions are counted without
// atomics in the common case: before B1 every resident selection writes its index into its
// position's cell of two direct-mapped tables (relaxed 16-bit stores, the last one wins);
// after B1 a position is counted by the selection its cell A names or, when cell A went to
// another position, by the one its cell B names; only a selection whose position lost both
// cells goes to the CAS table. Everything it cannot decide alone (a multi-token run, a
// repeated miss, any error, a hot block of -1 in a request with host-backed positions, an lru
// value outside [0, D)) is handed to resolve_general before the first global write, so the
// general path sees untouched state and reports exactly what the reference twin reports.
//
//   entry  round trip 1: this token's selections, token_rows (t - 1, t + 1 and a contiguity
//          scan); round trip 2: slot_pos and lru of the request into registers, the page rows
//          of each selection, the hot_blocks row; the tables cleared meanwhile
//   B0     slot positions inserted (position -> slot); with stats, representative cells of
//          resident selections stored
//   B1     selections classified: resident row, hit (bucket read; hit bit set), or miss
//          (repeat check in the miss table)
//   B2     (barrier-or: any host-backed?) hand-off check; fully resident exit; rows of
//          residents and hits written; one packed scan (misses in selection order, hits in
//          LRU order)
//   B3     new LRU order (into shared memory), victims = first M evictables
//   B4     the new LRU order stored by vectors;
//          misses take their victims: rows, slot_pos, miss plan; counts, stats
//
// KPT selections and SPT slots per thread, THREADS per CTA; GSPT: the general path's slots per
// thread for the same D; Probe: NoProbe in production (resolve_probe.cuh).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_ops.h"
#include "resolve_common.cuh"
#include "resolve_general.cuh"
#include "resolve_probe.cuh"

namespace hisparse::resolve_detail {

// Why the fast path hands a request over (bits of FastCtl::flags).
enum FastHandOff : int {
  kHandRun = 1,        // the state row also occurs at another token (error path)
  kHandCheck = 2,      // a selection fails a check (position range, host block)
  kHandRepeat = 4,     // a missed position is selected twice (first reference decides)
  kHandSlots = 8,      // a selected host-backed position is held by two hot slots (an error)
  kHandHotBlock = 16,  // a hot block is -1 (fatal only with host-backed positions)
  kHandLru = 32,       // an lru value is outside [0, D) (fatal only with host-backed ones)
};
constexpr int kHandAlways = kHandRun | kHandCheck | kHandRepeat | kHandSlots;

struct FastCtl {
  int flags;
  int n_res;
  int part[kMaxWarps];
};

// Shared-memory plan of the fast path (byte offsets; the hot_blocks row comes last).
template <int KPT, int SPT, int THREADS>
struct FastPlan {
  static constexpr int kMaxD = SPT * THREADS;
  static constexpr int kMaxK = KPT * THREADS;
  // position -> slot table: buckets of 4 entries, filled by an atomic count (no probe loop:
  // a key goes to the first bucket of its chain with room), <= 1 key per bucket on average
  // up to 4096 slots, 2 past it
  static constexpr int kBuckets = kMaxD < 4096 ? kMaxD : 4096;
  static constexpr int kMissCap = 2 * kMaxK;  // misses / resident positions, load <= 1/2
  static constexpr size_t kKeys = 0;
  static constexpr size_t kSlots = kKeys + 16ull * kBuckets;
  static constexpr size_t kCount = kSlots + 8ull * kBuckets;
  static constexpr size_t kMiss = kCount + 4ull * kBuckets;
  static constexpr size_t kHitmask = kMiss + 4ull * kMissCap;
  static_assert(4 * kMissCap >= 2 * kMaxD, "the miss table's space holds the new LRU order");
  static constexpr size_t kVictims = kHitmask + 4ull * (kMaxD / 32);
  // two tables of representative cells (uint16 selection index; stats only), load <= 1/2
  static constexpr int kRepCells = 2 * kMaxK;
  static constexpr size_t kRepA = kVictims + ((2ull * kMaxK + 15) & ~15ull);
  static constexpr size_t kRepB = kRepA + 2ull * kRepCells;
  static constexpr size_t kHotb = kRepB + 2ull * kRepCells;
  // then the staged residency and host_blocks rows (16-byte aligned), when staged
  __host__ __device__ static constexpr size_t stage_offset(int hot_blocks) {
    return kHotb + ((4ull * hot_blocks + 15) & ~15ull);
  }
  __host__ __device__ static constexpr size_t bytes(int hot_blocks, int stage_pages) {
    return stage_offset(hot_blocks) + 2 * ((4ull * stage_pages + 15) & ~15ull);
  }
};

template <int N>
__device__ __forceinline__ void load_vec(int (&v)[N], const int32_t* src) {
  static_assert(N % 2 == 0, "vector of 2, 4, 8 or 16 ints");
  if constexpr (N == 2) {
    const int2 a = *reinterpret_cast<const int2*>(src);
    v[0] = a.x;
    v[1] = a.y;
  } else {
#pragma unroll
    for (int q = 0; q < N / 4; ++q) {
      const int4 a = *reinterpret_cast<const int4*>(src + 4 * q);
      v[4 * q] = a.x;
      v[4 * q + 1] = a.y;
      v[4 * q + 2] = a.z;
      v[4 * q + 3] = a.w;
    }
  }
}

// A store that races with other threads' stores to the same cell on purpose (the last one
// wins): relaxed at CTA scope, so no data race under the PTX memory model.
__device__ __forceinline__ void store_relaxed(uint16_t* cell, int value) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(cell));
  const unsigned short v = static_cast<unsigned short>(value);
  asm volatile("st.relaxed.cta.shared.u16 [%0], %1;" ::"r"(s), "h"(v) : "memory");
}

// The second representative cell of a position: a multiplier independent of hash_index's.
__device__ __forceinline__ int rep_index_b(int key, int cap) {
  return static_cast<int>(__umulhi(static_cast<unsigned>(key) * 0x85EBCA77u,
                                   static_cast<unsigned>(cap)));
}

// Returns true when the request must go to resolve_general (nothing written yet; the answer
// is the same on every thread of the CTA).
template <int KPT, int SPT, int THREADS, class Probe>
__device__ __forceinline__ bool resolve_fast(const ResolveParams& p, const Probe& probe) {
  using Plan = FastPlan<KPT, SPT, THREADS>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ FastCtl c;
  constexpr int nwarps = THREADS >> 5;
  constexpr int kBuckets = Plan::kBuckets;
  constexpr int kMissCap = Plan::kMissCap;
  int* keys = reinterpret_cast<int*>(smem_raw + Plan::kKeys);
  uint16_t* slot_of = reinterpret_cast<uint16_t*>(smem_raw + Plan::kSlots);
  int* fill = reinterpret_cast<int*>(smem_raw + Plan::kCount);
  int* miss_keys = reinterpret_cast<int*>(smem_raw + Plan::kMiss);
  uint32_t* hitmask = reinterpret_cast<uint32_t*>(smem_raw + Plan::kHitmask);
  uint16_t* victims = reinterpret_cast<uint16_t*>(smem_raw + Plan::kVictims);
  int* hotb = reinterpret_cast<int*>(smem_raw + Plan::kHotb);
  uint16_t* rep_a = reinterpret_cast<uint16_t*>(smem_raw + Plan::kRepA);
  uint16_t* rep_b = reinterpret_cast<uint16_t*>(smem_raw + Plan::kRepB);
  constexpr int kRepCells = Plan::kRepCells;

  const int t = blockIdx.x;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int K = p.k;
  const int T = p.num_tokens;
  const int D = p.num_slots;
  const int bs = p.block_size;  // a power of two (launch_resolve checks)
  const int bs_shift = __ffs(bs) - 1;
  const int n_hotb = D >> bs_shift;  // <= THREADS (launch_resolve checks)
  const long long base = static_cast<long long>(t) * K;
  const int i0 = tid * KPT;  // this thread's selections: i0 .. i0 + KPT - 1
  const int j0 = tid * SPT;  // this thread's slots and LRU entries: j0 .. j0 + SPT - 1
  if (probe.stops_at(1)) return false;

  // ---- round trip 1 -------------------------------------------------------------------------
  int q[KPT];
  if (i0 < K) {
    load_vec(q, p.topk + base + i0);
  } else {
#pragma unroll
    for (int u = 0; u < KPT; ++u) q[u] = -1;
  }
  const int row = __ldg(&p.token_rows[t]);
  const int prev = t > 0 ? __ldg(&p.token_rows[t - 1]) : INT_MIN;
  const int next = t + 1 < T ? __ldg(&p.token_rows[t + 1]) : INT_MIN;
  const int scan_v = tid < T ? __ldg(&p.token_rows[tid]) : 0;
  if (row == -1) {  // padding token
#pragma unroll
    for (int u = 0; u < KPT; ++u)
      if (i0 + u < K) p.out_rows[base + i0 + u] = -1;
    if (tid == 0) p.miss_count[t] = 0;
    return false;
  }
  if (t > 0 && prev == row) return false;  // a later token of a run: its first CTA decides
  // A run of several tokens, or a state row out of range (an error): the general path.
  if (next == row || row < 0 || row >= p.num_rows) return true;
  probe.mark(0);

  // ---- round trip 2 -------------------------------------------------------------------------
  const long long row_p = static_cast<long long>(row) * p.num_pages;
  const long long row_d = static_cast<long long>(row) * D;
  const int npos = p.num_pages << bs_shift;  // < 2^31 (launch_resolve checks)
  int sp[SPT];
  uint32_t lw[SPT / 2];
  if (j0 < D) {
    load_vec(sp, p.slot_pos + row_d + j0);
    int raw[SPT / 2];
    load_vec(raw, reinterpret_cast<const int32_t*>(p.lru + row_d + j0));
#pragma unroll
    for (int k = 0; k < SPT / 2; ++k) lw[k] = static_cast<uint32_t>(raw[k]);
  }
  // Page rows: staged whole by cp.async (a few 16-byte pieces per thread) when they fit;
  // gathered per selection otherwise (one sector request per selection and row: several
  // times slower at P = 2048, measured).
  const int n_stage = p.fast_stage_pages;
  int* sres = reinterpret_cast<int*>(smem_raw + Plan::stage_offset(n_hotb));
  int* shb = sres + ((n_stage + 3) & ~3);
  auto lru_slot = [&](int k) { return static_cast<int>((lw[k >> 1] >> ((k & 1) * 16)) & 0xFFFFu); };
  int rb[KPT], hk[KPT];
  if (n_stage) {
    stage_row(sres, p.residency + row_p, n_stage);
    stage_row(shb, p.host_blocks + row_p, n_stage);
  } else {
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      rb[u] = -1;
      hk[u] = -1;
      if (q[u] >= 0 && q[u] < npos) {
        rb[u] = __ldg(&p.residency[row_p + (q[u] >> bs_shift)]);
        hk[u] = __ldg(&p.host_blocks[row_p + (q[u] >> bs_shift)]);
      }
    }
  }
  const int hbv = tid < n_hotb ? __ldg(&p.hot_blocks[static_cast<long long>(row) * n_hotb + tid]) : 0;
  bool other = false;  // contiguity: this row at another token is an error (general path)
  for (int j = tid; j < T; j += THREADS) {
    const int v = j == tid ? scan_v : __ldg(&p.token_rows[j]);
    if (j != t && v == row) other = true;
  }
  // Tables cleared while the loads are in flight.
  {
    int4* f4 = reinterpret_cast<int4*>(fill);  // entries past a bucket's fill are never read
#pragma unroll
    for (int i = tid; i < kBuckets / 4; i += THREADS) f4[i] = make_int4(0, 0, 0, 0);
    int4* m4 = reinterpret_cast<int4*>(miss_keys);
#pragma unroll
    for (int i = tid; i < kMissCap / 4; i += THREADS) m4[i] = make_int4(-1, -1, -1, -1);
    for (int i = tid; i < Plan::kMaxD / 32; i += THREADS) hitmask[i] = 0u;
    if (tid == 0) {
      c.flags = 0;
      c.n_res = 0;
    }
    if (tid < n_hotb) hotb[tid] = hbv;
  }
  if (n_stage) cp_async_wait_all();
  probe.mark(1);
  __syncthreads();  // ---- B0: tables clear, control block, hot blocks ---------------------
  if (probe.stops_at(2)) return false;

  if (n_stage) {
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      const bool in = q[u] >= 0 && q[u] < npos;
      rb[u] = in ? sres[q[u] >> bs_shift] : -1;
      hk[u] = in ? shb[q[u] >> bs_shift] : -1;
    }
  }
  const bool with_stats = p.stats != nullptr;
  if (with_stats) {  // representative cells of resident selections (read after B1)
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      if (i0 + u < K && q[u] >= 0 && q[u] < npos && rb[u] >= 0) {
        store_relaxed(&rep_a[hash_index(q[u], kRepCells)], i0 + u);
        store_relaxed(&rep_b[rep_index_b(q[u], kRepCells)], i0 + u);
      }
    }
  }
  {
    int fl = other ? kHandRun : 0;
    if (tid < n_hotb && hbv < 0) fl |= kHandHotBlock;
    // Bucket fill counts can pass 4: a bucket whose count passed 4 sent keys on to the next.
    int b[SPT], idx[SPT];
#pragma unroll
    for (int k = 0; k < SPT; ++k) {
      if (j0 < D && lru_slot(k) >= D) fl |= kHandLru;
      b[k] = hash_index(sp[k], kBuckets);
      idx[k] = j0 < D && sp[k] != -1 ? atomicAdd(&fill[b[k]], 1) : -1;  // -1: an empty slot
    }
#pragma unroll
    for (int k = 0; k < SPT; ++k) {
      while (idx[k] >= 4) {  // rare at <= 1 key per bucket
        b[k] = (b[k] + 1) & (kBuckets - 1);
        idx[k] = atomicAdd(&fill[b[k]], 1);
      }
      if (idx[k] >= 0) {
        keys[b[k] * 4 + idx[k]] = sp[k];
        slot_of[b[k] * 4 + idx[k]] = static_cast<uint16_t>(j0 + k);
      }
    }
    if (fl) atomicOr(&c.flags, fl);
  }
  probe.mark(2);
  __syncthreads();  // ---- B1: position -> slot table ---------------------------------------
  if (probe.stops_at(3)) return false;

  // ---- classify -------------------------------------------------------------------------------
  int res[KPT];  // out row (resident, hit, -1 for padding); a miss's page host row
  unsigned miss_bits = 0;
  bool any_host = false;
  {
    int fl = 0, my_res = 0;
    bool look[KPT], to_miss[KPT];
    int mkey[KPT];
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      const int qq = q[u];
      res[u] = -1;
      look[u] = false;
      to_miss[u] = false;
      mkey[u] = qq;
      if (i0 + u >= K || qq == -1) continue;
      if (qq < -1 || qq >= npos) {
        fl |= kHandCheck;
        continue;
      }
      if (rb[u] >= 0) {  // resident: its row; with stats, counted once
        res[u] = static_cast<int>(static_cast<unsigned>(rb[u]) * bs + (qq & (bs - 1)));
        if (with_stats) {
          // Cell A names this selection: it counts the position. Cell A names another
          // selection of the same position: that one counts. Otherwise cell A went to another
          // position, and cell B decides the same way; a selection that lost both cells to
          // other positions is counted through the CAS table (tagged, so never a miss key).
          const int me = i0 + u;
          const int a = rep_a[hash_index(qq, kRepCells)];
          if (a == me) {
            ++my_res;
          } else if (__ldg(&p.topk[base + a]) != qq) {
            const int b = rep_b[rep_index_b(qq, kRepCells)];
            if (b == me) {
              ++my_res;
            } else if (__ldg(&p.topk[base + b]) != qq) {
              to_miss[u] = true;
              mkey[u] = static_cast<int>(static_cast<unsigned>(qq) | 0x80000000u);
            }
          }
        }
        continue;
      }
      if (hk[u] < 0) {
        fl |= kHandCheck;
        continue;
      }
      look[u] = true;
      any_host = true;
    }
    // Lookup: one 16-byte load per bucket; the whole chain is read (usually one bucket) so
    // that a position held by two slots is seen (an error: the general path reports it).
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      if (!look[u]) continue;
      int bk = hash_index(q[u], kBuckets), at = -1, n_found = 0, n;
      do {
        const int4 kv = reinterpret_cast<const int4*>(keys)[bk];
        n = fill[bk];
        const bool m0 = n > 0 && kv.x == q[u], m1 = n > 1 && kv.y == q[u];
        const bool m2 = n > 2 && kv.z == q[u], m3 = n > 3 && kv.w == q[u];
        n_found += m0 + m1 + m2 + m3;
        if (at < 0 && (m0 | m1 | m2 | m3)) at = bk * 4 + (m0 ? 0 : m1 ? 1 : m2 ? 2 : 3);
        bk = (bk + 1) & (kBuckets - 1);
      } while (n > 4);
      if (n_found > 1) fl |= kHandSlots;
      if (at >= 0) {  // hit
        const int slot = slot_of[at];
        atomicOr(&hitmask[slot >> 5], 1u << (slot & 31));
        res[u] = static_cast<int>(static_cast<unsigned>(hotb[slot >> bs_shift]) * bs +
                                  (slot & (bs - 1)));
      } else {  // miss: res = the page's host row for now
        miss_bits |= 1u << u;
        to_miss[u] = true;
        res[u] = static_cast<int>(static_cast<unsigned>(hk[u]) * bs + (q[u] & (bs - 1)));
      }
    }
    // Repeats: a repeated miss is handed over (its first reference decides its rank); a
    // resident position that lost its representative cells is counted once.
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      if (!to_miss[u]) continue;
      int h = hash_index(mkey[u], kMissCap);
      int old;
      while ((old = atomicCAS(&miss_keys[h], -1, mkey[u])) != -1 && old != mkey[u])
        h = (h + 1) & (kMissCap - 1);
      const bool fresh = old == -1;
      if ((miss_bits >> u) & 1u) {
        if (!fresh) fl |= kHandRepeat;
      } else {
        my_res += fresh;
      }
    }
    if (fl) atomicOr(&c.flags, fl);
    if (with_stats) {
      my_res = __reduce_add_sync(0xffffffffu, my_res);
      if (lane == 0 && my_res) atomicAdd(&c.n_res, my_res);
    }
  }
  probe.mark(3);
  const bool host = __syncthreads_or(any_host);  // ---- B2: hits marked, flags -------------
  {
    const int flags = c.flags;
    if ((flags & kHandAlways) || (host && flags)) return true;
  }
  if (probe.stops_at(4)) return false;
  if (!host) {  // fully resident (or padding only): the hot state is never touched
#pragma unroll
    for (int u = 0; u < KPT; ++u)
      if (i0 + u < K) p.out_rows[base + i0 + u] = res[u];
    if (tid == 0) {
      p.miss_count[t] = 0;
      if (with_stats && c.n_res)
        atomicAdd(reinterpret_cast<unsigned long long*>(p.stats),
                  static_cast<unsigned long long>(c.n_res));
    }
    return false;
  }

  // Rows of residents, hits and padding; misses are written after B4.
#pragma unroll
  for (int u = 0; u < KPT; ++u)
    if (i0 + u < K && !((miss_bits >> u) & 1u)) p.out_rows[base + i0 + u] = res[u];
  auto is_hit = [&](int slot) { return (hitmask[slot >> 5] >> (slot & 31)) & 1u; };
  // One scan for two counts: misses (selection order) in the high half, hits in LRU order in
  // the low half (each < 2^16: K and D are at most 16384 here).
  int my_hits = 0;
  if (j0 < D) {
#pragma unroll
    for (int k = 0; k < SPT; ++k) my_hits += is_hit(lru_slot(k));
  }
  const int mine = (__popc(miss_bits) << 16) | my_hits;
  int incl = warp_inclusive_sum(mine, lane);
  if (lane == 31) c.part[warp] = incl;
  probe.mark(4);
  __syncthreads();  // ---- B3: scan partials --------------------------------------------------
  if (probe.stops_at(5)) return false;
  int total;
  {
    const int wt = lane < nwarps ? c.part[lane] : 0;
    const int wincl = warp_inclusive_sum(wt, lane);
    total = __shfl_sync(0xffffffffu, wincl, 31);
    incl += __shfl_sync(0xffffffffu, wincl - wt, warp);
  }
  const int excl = incl - mine;
  const int M = total >> 16;
  const int H = total & 0xFFFF;
  const int E = D - H;
  // [evictable not taken] + [taken, miss order] + [hits, old order]; victims = first M
  // evictables.
  if (j0 < D) {
    int hh = excl & 0xFFFF;
    int e = j0 - hh;
    // The new order goes to shared memory first (the miss table, dead since B2) and out
    // after B4 in one vector store per thread: 4 scattered 2-byte stores per thread held
    // the store queue (ncu: lg throttle).
    uint16_t* lrow = reinterpret_cast<uint16_t*>(smem_raw + Plan::kMiss);
#pragma unroll
    for (int k = 0; k < SPT; ++k) {
      const int slot = lru_slot(k);
      int newpos;
      if (is_hit(slot)) {
        newpos = E + hh++;
      } else {
        if (e < M) victims[e] = static_cast<uint16_t>(slot);
        newpos = e < M ? E - M + e : e - M;
        ++e;
      }
      lrow[newpos] = static_cast<uint16_t>(slot);
    }
  }
  probe.mark(5);
  __syncthreads();  // ---- B4: victims, new LRU order -----------------------------------------
  if (j0 < D) {
    int v[SPT / 2];
    load_vec(v, reinterpret_cast<const int32_t*>(smem_raw + Plan::kMiss) + j0 / 2);
    int32_t* dst = reinterpret_cast<int32_t*>(p.lru + row_d + j0);
    if constexpr (SPT == 4) {
      *reinterpret_cast<int2*>(dst) = make_int2(v[0], v[1]);
    } else {
#pragma unroll
      for (int q4 = 0; q4 < SPT / 8; ++q4)
        reinterpret_cast<int4*>(dst)[q4] =
            make_int4(v[4 * q4], v[4 * q4 + 1], v[4 * q4 + 2], v[4 * q4 + 3]);
    }
  }
  if (miss_bits) {
    int m = excl >> 16;
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      if (!((miss_bits >> u) & 1u)) continue;
      const int slot = victims[m];
      const int r = static_cast<int>(static_cast<unsigned>(hotb[slot >> bs_shift]) * bs +
                                     (slot & (bs - 1)));
      p.out_rows[base + i0 + u] = r;
      p.slot_pos[row_d + slot] = q[u];
      p.miss_src[base + m] = res[u];
      p.miss_dst[base + m] = r;
      ++m;
    }
  }
  if (tid == 0) {
    p.miss_count[t] = M;
    if (with_stats) {
      auto* st = reinterpret_cast<unsigned long long*>(p.stats);
      if (c.n_res) atomicAdd(st + 0, static_cast<unsigned long long>(c.n_res));
      if (H) atomicAdd(st + 1, static_cast<unsigned long long>(H));
      if (M) atomicAdd(st + 2, static_cast<unsigned long long>(M));
    }
  }
  probe.mark(6);
  return false;
}

template <int KPT, int SPT, int THREADS, int GSPT, class Probe>
__global__ void __launch_bounds__(THREADS, 1) resolve_fast_kernel(const ResolveParams p,
                                                                  const Probe probe) {
  if (resolve_fast<KPT, SPT, THREADS>(p, probe)) {
    probe.count_hand_off();
    resolve_general<GSPT, THREADS, false>(p, probe);  // never launched with slot_class
  }
}

}  // namespace hisparse::resolve_detail
