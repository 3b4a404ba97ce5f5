// resolve (docs/design.md, "resolve"): one CTA per request maps its logical top-k positions to device
// rows, updates the hot-slot LRU and writes the miss plan. See docs/kernels.md.
//
// resolve_general_kernel of the leading CTA of a request (the CTA of its first token; the
// CTAs of its other tokens exit at once, the CTA of a padding token writes -1 / 0 and exits):
//   entry  two dependent global round trips: (1) selections (8 per thread in registers),
//          token_rows around t; (2) slot_pos and the lru chunk into registers, the hot_blocks,
//          residency and host_blocks rows into shared memory by cp.async; hash part cleared
//   B1     classify every selection and insert host-backed positions (64-bit entries:
//          position | first reference); the hash index stays in a register
//   B2     errors / fully resident exit; hit marking in slot order (ballots -> hit bitmask)
//   B3     hits get their rows; hits, unleased slots (hot block -1) and, with eviction
//          classes, evictables per class per LRU chunk, and first-reference misses: one
//          barrier for the scans
//   B4     victims = first M evictables in (class, LRU) order; miss ranks stored in the hash
//   B5     misses' rows, slot_pos, miss plan; LRU rewrite from registers; counts, stats
// Every check is done before the first write of hot state. A request that fails a check
// writes out_rows = -1 and miss_count = 0 for its tokens and leaves slot_pos, lru and stats
// untouched; the first error of the launch is recorded.
//
// SPT: LRU entries (slots) per thread; THREADS: CTA size; Probe: NoProbe in production
// (resolve_probe.cuh).
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "hisparse_ops.h"
#include "resolve_common.cuh"
#include "resolve_errors.cuh"
#include "resolve_general_smem.cuh"
#include "resolve_hash.cuh"
#include "resolve_probe.cuh"

namespace hisparse::resolve_detail {

constexpr int kHashSpread = 4;  // a request's hash part: up to 4 entries per reference (<= C)
constexpr int kLookahead = 4;    // tokens after t read at entry to size the run without a scan

// This thread's LRU chunk (entries [j0, j0 + SPT) of the row) into registers, two 16-bit
// slots per word; one vector load where the row and the chunk allow it, zeros past D.
template <int SPT>
__device__ __forceinline__ void load_lru_chunk(uint32_t (&lru_w)[(SPT + 1) / 2],
                                               const int16_t* lru, long long row_d, int j0,
                                               int D) {
  const int16_t* lrow = lru + row_d;
  bool vec = (D % SPT) == 0;
  if constexpr (SPT >= 8) vec = vec && (reinterpret_cast<uintptr_t>(lru) & 15) == 0;
  else if constexpr (SPT == 4) vec = vec && (reinterpret_cast<uintptr_t>(lru) & 7) == 0;
  else if constexpr (SPT == 2) vec = vec && (reinterpret_cast<uintptr_t>(lru) & 3) == 0;
  if (vec && SPT >= 2) {
    if constexpr (SPT >= 8) {
#pragma unroll
      for (int q = 0; q < SPT / 8; ++q) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (j0 + q * 8 < D) v = *reinterpret_cast<const uint4*>(lrow + j0 + q * 8);
        lru_w[q * 4 + 0] = v.x;
        lru_w[q * 4 + 1] = v.y;
        lru_w[q * 4 + 2] = v.z;
        lru_w[q * 4 + 3] = v.w;
      }
    } else if constexpr (SPT == 4) {
      uint2 v = make_uint2(0, 0);
      if (j0 < D) v = *reinterpret_cast<const uint2*>(lrow + j0);
      lru_w[0] = v.x;
      lru_w[1] = v.y;
    } else if constexpr (SPT == 2) {
      lru_w[0] = j0 < D ? *reinterpret_cast<const uint32_t*>(lrow + j0) : 0u;
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

// The general path: any run length, any K and D, every error. resolve_general_kernel runs it
// for a whole launch; resolve_fast_kernel hands it the requests that its fast path does not
// take. kClasses: the instantiation that orders victims by p.slot_class (a launch with classes
// runs only it); without, the class code is not compiled in, so the fast kernel that inlines
// this path keeps its register budget.
template <int SPT, int THREADS, bool kClasses, class Probe>
__device__ __forceinline__ void resolve_general(const ResolveParams& p, const Probe& probe) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ GeneralCtl s;
  constexpr int nwarps = THREADS >> 5;
  constexpr int CH = kRefsInRegs * THREADS;  // selections per chunk
  // slot_pos values for hit marking are loaded at entry when they fit in registers
  constexpr bool kEarlySlots = SPT <= 8;
  constexpr int kSlotRegs = kEarlySlots ? SPT : 1;
  const int t = blockIdx.x;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int K = p.k;
  const int T = p.num_tokens;
  const int D = p.num_slots;
  const int bs = p.block_size;
  const int bs_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
  const long long base = static_cast<long long>(t) * K;
  if (probe.stops_at(1)) return;

  // ---- round trip 1: everything that does not depend on the state row -------------------
  // This token's selections (chunk 0, registers), the state row, the previous token's row,
  // the next kLookahead rows (run length without a scan) and the first slice of token_rows
  // for the contiguity scan.
  int ref[kRefsInRegs];  // selection, then (after classify) its hash index or -1
  const int k_first = K < CH ? K : CH;
#pragma unroll
  for (int u = 0; u < kRefsInRegs; ++u) {
    const int i = u * THREADS + tid;
    ref[u] = i < k_first ? __ldg(&p.topk[base + i]) : -1;
  }
  const int row = __ldg(&p.token_rows[t]);
  const int prev = t > 0 ? __ldg(&p.token_rows[t - 1]) : 0;
  int ahead[kLookahead];
#pragma unroll
  for (int j = 0; j < kLookahead; ++j)
    ahead[j] = t + 1 + j < T ? __ldg(&p.token_rows[t + 1 + j]) : INT_MIN;
  int scan_v = tid < T ? __ldg(&p.token_rows[tid]) : 0;

  if (row == -1) {  // padding token
    for (int i = tid; i < K; i += THREADS) p.out_rows[base + i] = -1;
    if (tid == 0) p.miss_count[t] = 0;
    return;
  }
  if (t > 0 && prev == row) return;  // not the first token of its run

  // ---- round trip 2: the request's rows -----------------------------------------------------
  probe.mark(0);
  const bool row_ok = row >= 0 && row < p.num_rows;
  const long long row_d = static_cast<long long>(row) * D;
  int ntok_ahead = 1;  // run length, exact when <= kLookahead
#pragma unroll
  for (int j = 0; j < kLookahead; ++j)
    if (ntok_ahead == j + 1 && t + 1 + j < T && ahead[j] == row) ntok_ahead = j + 2;
  const bool big = ntok_ahead > kLookahead;  // 5+ tokens: the scan gives the length
  const long long n_ahead_l = static_cast<long long>(ntok_ahead) * K;
  const int n_pre = static_cast<int>(n_ahead_l < CH ? n_ahead_l : CH);  // chunk-0 refs known

  const int cap_phys = p.hash_capacity;
  const GeneralSmem sm(smem_raw, cap_phys, p.victim_capacity, D, p.hot_blocks_in_smem,
                       p.stage_pages);
  unsigned long long* const tab = sm.tab;
  int* const slot_of = sm.slot_of;
  uint16_t* const victims = sm.victims;
  uint32_t* const hitmask = sm.hitmask;
  const RequestRows rows(p, row, bs, bs_shift, sm.hotb, sm.sres, sm.shb);

  uint32_t lru_w[(SPT + 1) / 2];
  int qv[kSlotRegs];
  const int j0 = tid * SPT;
  if (row_ok) {
    if constexpr (kEarlySlots) {
#pragma unroll
      for (int k = 0; k < SPT; ++k) {
        const int slot = (k * nwarps + warp) * 32 + lane;
        qv[k] = slot < D ? p.slot_pos[row_d + slot] : -1;
      }
    }
    load_lru_chunk<SPT>(lru_w, p.lru, row_d, j0, D);
    // Selections of the run's next tokens that fall into chunk 0.
#pragma unroll
    for (int u = 0; u < kRefsInRegs; ++u) {
      const int i = u * THREADS + tid;
      if (i >= k_first && i < n_pre) ref[u] = __ldg(&p.topk[base + i]);
    }
    // Rows staged in shared memory by cp.async (no registers, one wait before the barrier).
    rows.stage();
  }
  // Hash part of this request (while the loads are in flight): up to kHashSpread entries per
  // selection, never more than the table. A 5+-token request takes the whole table.
  int cap;
  {
    long long c = big ? static_cast<long long>(cap_phys) : kHashSpread * n_ahead_l;
    if (c > cap_phys) c = cap_phys;
    cap = static_cast<int>((c + 31) & ~31LL);
    if (cap < 32) cap = 32;
    if (cap > cap_phys) cap = cap_phys;
  }
  for (int i = tid * 2; i < cap; i += THREADS * 2)
    *reinterpret_cast<ulonglong2*>(tab + i) = make_ulonglong2(kEmptyEntry, kEmptyEntry);
  for (int i = tid * 4; i < cap; i += THREADS * 4)
    *reinterpret_cast<int4*>(slot_of + i) = make_int4(-1, -1, -1, -1);
  if (tid == 0) {
    s.n_host = 0;
    s.n_res = 0;
    s.n_hit_slots = 0;
    s.n_hit_pos = 0;
    s.n_unleased = 0;
    s.cap_flag = 0;
    s.corrupt_flag = 0;
    s.classify_err = kNoError;
    s.hit_err = kNoError;
  }
  // Contiguity scan of token_rows (per-warp partials; reduced after the barrier).
  {
    int run_end = INT_MAX, first_other = INT_MAX, last_same = -1;
    for (int i = tid; i < T; i += THREADS) {
      const int v = i == tid ? scan_v : __ldg(&p.token_rows[i]);
      if (i > t && v != row) run_end = min(run_end, i);
      if (v == row && i < t) first_other = min(first_other, i);
      if (v == row && i > t) last_same = max(last_same, i);
    }
    run_end = __reduce_min_sync(0xffffffffu, run_end);
    first_other = __reduce_min_sync(0xffffffffu, first_other);
    last_same = __reduce_max_sync(0xffffffffu, last_same);
    if (lane == 0) {
      s.run[0][warp] = run_end;
      s.run[1][warp] = first_other;
      s.run[2][warp] = last_same;
    }
  }
  cp_async_wait_all();
  probe.mark(1);
  __syncthreads();  // ---- B1: staged rows, hash part, control block, run partials ---------

  int run_end, first_other, last_same;
  {
    const bool w = lane < nwarps;
    run_end = __reduce_min_sync(0xffffffffu, w ? s.run[0][lane] : INT_MAX);
    first_other = __reduce_min_sync(0xffffffffu, w ? s.run[1][lane] : INT_MAX);
    last_same = __reduce_max_sync(0xffffffffu, w ? s.run[2][lane] : -1);
    if (run_end == INT_MAX) run_end = T;
  }
  const int ntok = run_end - t;
  const int N = ntok * K;
  if (!row_ok) {
    fail_request(p, base, N, t, ntok);
    if (tid == 0) record_error(p, kErrStateRowOutOfRange, -1, row, p.num_rows);
    return;
  }
  if (first_other != INT_MAX || last_same >= run_end) {
    fail_request(p, base, N, t, ntok);
    if (tid == 0 && first_other != INT_MAX)
      record_error(p, kErrNotContiguous, row, t, first_other);
    return;
  }
  const int n0 = N < CH ? N : CH;  // selections of chunk 0
  const int nchunks = (N + CH - 1) / CH;
  if (n0 > n_pre) {  // only a 5+-token request with small K: the rest of chunk 0
#pragma unroll
    for (int u = 0; u < kRefsInRegs; ++u) {
      const int i = u * THREADS + tid;
      if (i >= n_pre && i < n0) ref[u] = __ldg(&p.topk[base + i]);
    }
  }
  if (probe.stops_at(2)) return;

  // ---- classify and insert ------------------------------------------------------------------
  const long long npos = static_cast<long long>(p.num_pages) * bs;
  const bool with_stats = p.stats != nullptr;
  int my_host = 0, my_res = 0;
  // Page rows of a selection (host block read even for resident pages, so that without
  // staging both gathers are in flight together).
  auto lookup = [&](int q, int& rb, int& hb) {
    rb = -1;
    hb = -1;
    if (q >= 0 && q < npos) {
      const int page = rows.page_of(q);
      rb = rows.residency(page);
      hb = rows.host_block(page);
    }
  };
  // Classify selection i (value q, page rows rb / hb): writes padding / resident rows,
  // inserts host-backed positions; returns the hash index of a host-backed selection, else -1.
  auto classify = [&](int i, int q, int rb, int hb) -> int {
    if (q == -1) {
      p.out_rows[base + i] = -1;
      return -1;
    }
    if (q < -1 || q >= npos) {
      submit_err(&s.classify_err, kPrioPosition, i, q);
      return -1;
    }
    const int page = rows.page_of(q);
    const int off = q - page * bs;
    if (rb >= 0) {
      p.out_rows[base + i] = static_cast<int>(static_cast<unsigned>(rb) * bs + off);
      if (with_stats) {
        bool ins;
        const int h = tab_insert(tab, cap, static_cast<unsigned>(q),
                                 static_cast<unsigned>(i) | kResidentRef, ins);
        if (h < 0) atomicExch(&s.cap_flag, 1);
        my_res += ins;
      }
      return -1;
    }
    if (hb < 0) {
      submit_err(&s.classify_err, kPrioNoHost, i, q);
      return -1;
    }
    bool ins;
    const int h = tab_insert(tab, cap, static_cast<unsigned>(q), static_cast<unsigned>(i), ins);
    if (h < 0) atomicExch(&s.cap_flag, 1);
    my_host += ins;
    return h;
  };
  const int nu0 = (n0 + THREADS - 1) / THREADS;  // register slots in use (uniform)
  if (rows.pages_staged()) {
#pragma unroll
    for (int u = 0; u < kRefsInRegs; ++u) {
      if (u >= nu0) break;  // uniform: jump past the unused copies of the code
      const int i = u * THREADS + tid;
      int rb, hb;
      lookup(ref[u], rb, hb);
      ref[u] = i < n0 ? classify(i, ref[u], rb, hb) : -1;
    }
  } else {  // global gathers: a group's loads in flight before its first insert
    constexpr int G = kRefsInRegs / 2;
#pragma unroll
    for (int g = 0; g < kRefsInRegs; g += G) {
      int rb[G], hb[G];
#pragma unroll
      for (int u = 0; u < G; ++u)
        lookup((g + u) * THREADS + tid < n0 ? ref[g + u] : -1, rb[u], hb[u]);
#pragma unroll
      for (int u = 0; u < G; ++u) {
        const int i = (g + u) * THREADS + tid;
        ref[g + u] = i < n0 ? classify(i, ref[g + u], rb[u], hb[u]) : -1;
      }
    }
  }
  for (int c = 1; c < nchunks; ++c) {  // selections past chunk 0 (5+ tokens): not kept
    constexpr int G = kRefsInRegs / 2;
#pragma unroll 1
    for (int g = 0; g < kRefsInRegs; g += G) {
      const int cb = c * CH + g * THREADS;
      int qc[G], rb[G], hb[G];
#pragma unroll
      for (int u = 0; u < G; ++u) {
        const int i = cb + u * THREADS + tid;
        qc[u] = i < N ? __ldg(&p.topk[base + i]) : -1;
      }
#pragma unroll
      for (int u = 0; u < G; ++u) lookup(qc[u], rb[u], hb[u]);
#pragma unroll
      for (int u = 0; u < G; ++u) {
        const int i = cb + u * THREADS + tid;
        if (i < N) classify(i, qc[u], rb[u], hb[u]);
      }
    }
  }
  // Hot blocks of -1: their slots are never taken (a region of fewer blocks than D / bs).
  int my_unleased = 0;
  {
    const int n_hb = D / bs;
    for (int b = tid; b < n_hb; b += THREADS)
      my_unleased += rows.hot_block_at(b) < 0;
  }
  my_host = __reduce_add_sync(0xffffffffu, my_host);
  my_res = __reduce_add_sync(0xffffffffu, my_res);
  my_unleased = __reduce_add_sync(0xffffffffu, my_unleased);
  if (lane == 0) {
    if (my_host) atomicAdd(&s.n_host, my_host);
    if (my_res) atomicAdd(&s.n_res, my_res);
    if (my_unleased) atomicAdd(&s.n_unleased, my_unleased);
  }
  probe.mark(2);
  __syncthreads();  // ---- B2: the hash is complete --------------------------------------------

  {
    const int n_host = s.n_host;
    if (s.cap_flag || n_host + s.n_res > p.union_capacity) {
      fail_request(p, base, N, t, ntok);
      if (tid == 0) record_error(p, kErrUnionCapacity, row, N, p.union_capacity);
      return;
    }
    if (s.classify_err != kNoError) {
      fail_request(p, base, N, t, ntok);
      report_err(p, s.classify_err, row, base);
      return;
    }
    const int leased = D - s.n_unleased * bs;
    if (n_host > leased) {
      fail_request(p, base, N, t, ntok);
      if (tid == 0) record_error(p, kErrHotOverflow, row, n_host, leased);
      return;
    }
    if (n_host == 0) {  // fully resident (or empty): the hot state is never touched
      for (int j = tid; j < ntok; j += THREADS) p.miss_count[t + j] = 0;
      if (tid == 0 && with_stats && s.n_res > 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(p.stats),
                  static_cast<unsigned long long>(s.n_res));
      return;
    }
  }
  if (probe.stops_at(3)) return;

  // ---- hit marking in slot order -----------------------------------------------------------
  {
    int warp_hit_slots = 0, warp_hit_pos = 0;
    auto mark = [&](int sb, int q) {
      const int slot = sb + lane;
      bool hit = false, first = false;
      if (q >= 0) {
        unsigned long long e;
        const int h = tab_find(tab, cap, static_cast<unsigned>(q), e);
        if (h >= 0 && !(static_cast<unsigned>(e) & kResidentRef)) {
          const int v = static_cast<int>(static_cast<unsigned>(e));
          hit = true;
          const int old = atomicCAS(&slot_of[h], -1, slot);
          if (old == -1) {
            first = true;
          } else {
            submit_err(&s.hit_err, kPrioDuplicate, v, old);
            submit_err(&s.hit_err, kPrioDuplicate, v, slot);
          }
          if (rows.hot_block(slot) < 0) submit_err(&s.hit_err, kPrioHotBlock, v, slot);
        }
      }
      const unsigned bits = __ballot_sync(0xffffffffu, hit);
      const unsigned firsts = __ballot_sync(0xffffffffu, first);
      if (lane == 0) hitmask[sb >> 5] = bits;
      warp_hit_slots += __popc(bits);
      warp_hit_pos += __popc(firsts);
    };
    if constexpr (kEarlySlots) {
#pragma unroll
      for (int k = 0; k < SPT; ++k) {
        const int sb = (k * nwarps + warp) * 32;
        if (sb < D) mark(sb, qv[k]);  // uniform per warp
      }
    } else {
      constexpr int kBatch = 4;
#pragma unroll
      for (int k0 = 0; k0 < SPT; k0 += kBatch) {
        int qb[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int slot = ((k0 + u) * nwarps + warp) * 32 + lane;
          qb[u] = slot < D ? p.slot_pos[row_d + slot] : -1;
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int sb = ((k0 + u) * nwarps + warp) * 32;
          if (sb < D) mark(sb, qb[u]);
        }
      }
    }
    if (lane == 0) {
      if (warp_hit_slots) atomicAdd(&s.n_hit_slots, warp_hit_slots);
      if (warp_hit_pos) atomicAdd(&s.n_hit_pos, warp_hit_pos);
    }
  }
  probe.mark(3);
  __syncthreads();  // ---- B3: hitmask, slot_of of hits, counts --------------------------------
  if (s.hit_err != kNoError && static_cast<unsigned>(s.hit_err >> 60) == kPrioDuplicate) {
    fail_request(p, base, N, t, ntok);
    report_err(p, s.hit_err, row, base);
    return;
  }
  if (probe.stops_at(4)) return;

  const int H = s.n_hit_slots;
  const int U = s.n_unleased * bs;  // unleased slots
  const int E = D - H - U;          // evictable slots
  const int M = s.n_host - s.n_hit_pos;  // <= E: n_host <= D - U and no slot is duplicated
  auto is_hit_slot = [&](int slot) { return (hitmask[slot >> 5] >> (slot & 31)) & 1u; };
  auto lru_slot = [&](int k) {
    return static_cast<int>((lru_w[k / 2] >> ((k & 1) * 16)) & 0xFFFFu);
  };
  const uint8_t* const classes =
      kClasses && p.slot_class != nullptr ? p.slot_class + row_d : nullptr;
  auto class_of = [&](int slot) -> int {
    if (classes == nullptr) return 0;
    const int c = classes[slot];
    return c < 3 ? c : 3;
  };

  // With eviction classes: this thread's evictables (not hit, leased) per class, two 16-bit
  // counts per word (classes 0|1, 2|3). Counted again where needed rather than kept live
  // across barriers, so the LRU path keeps its register budget.
  auto count_classes = [&](unsigned& ev01, unsigned& ev23) {
    ev01 = ev23 = 0;
#pragma unroll
    for (int k = 0; k < SPT; ++k) {
      if (j0 + k < D) {
        const int slot = lru_slot(k);
        if (slot < D && !is_hit_slot(slot) && rows.hot_block(slot) >= 0) {
          const int c = class_of(slot);
          const unsigned one = 1u << ((c & 1) * 16);
          if (c < 2) ev01 += one;
          else ev23 += one;
        }
      }
    }
  };
  // LRU order, per thread (its SPT consecutive LRU entries): hits and unleased slots packed
  // (unleased << 16 | hits: both <= D, and U < D here, so the sum stays below 2^31).
  int my_pack = 0;
  {
    bool corrupt = false;
#pragma unroll
    for (int k = 0; k < SPT; ++k) {
      if (j0 + k < D) {
        const int slot = lru_slot(k);
        if (slot >= D) {
          corrupt = true;
        } else if (is_hit_slot(slot)) {
          my_pack += 1;
        } else if (rows.hot_block(slot) < 0) {
          my_pack += 1 << 16;
        }
      }
    }
    if (corrupt) atomicExch(&s.corrupt_flag, 1);
  }
  // Selections: hits get their row now; first references of misses are flagged for the scan.
  const unsigned lt_mask = (1u << lane) - 1u;
  auto hit_or_flag = [&](int i, int h) -> bool {
    const int so = slot_of[h];
    if (so >= 0) {
      p.out_rows[base + i] = rows.slot_row(so);
      return false;
    }
    return static_cast<int>(static_cast<unsigned>(tab[h])) == i;
  };
  unsigned flags = 0;
#pragma unroll
  for (int u = 0; u < kRefsInRegs; ++u) {
    if (u >= nu0) break;
    const int i = u * THREADS + tid;
    if (ref[u] >= 0 && hit_or_flag(i, ref[u])) flags |= 1u << u;
  }
  // One barrier for the scans: hit, unleased and per-class ranks in LRU order, miss ranks in
  // first-reference order.
  const int incl_h = warp_inclusive_sum(my_pack, lane);
  if (lane == 31) s.hits[warp] = incl_h;
  if (classes != nullptr) {  // (a corrupt lru value is skipped here and fails after B4)
    unsigned ev01, ev23;
    count_classes(ev01, ev23);
    ev01 = warp_inclusive_sum(ev01, lane);
    ev23 = warp_inclusive_sum(ev23, lane);
    if (lane == 31) {
      s.evict[0][warp] = ev01;
      s.evict[1][warp] = ev23;
    }
  }
#pragma unroll
  for (int u = 0; u < kRefsInRegs; ++u) {
    if (u >= nu0) break;
    const unsigned bal = __ballot_sync(0xffffffffu, (flags >> u) & 1u);
    if (lane == 0) s.misses[0][u][warp] = __popc(bal);
  }
  probe.mark(4);
  __syncthreads();  // ---- B4: scan partials, corrupt flag ----------------------------------------
  if (s.corrupt_flag) {
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
      record_error(p, kErrCorruptLru, row, bad, D);
    }
    return;
  }
  if (s.hit_err != kNoError) {  // a hit on a slot whose hot block is -1 (after CORRUPT_LRU)
    fail_request(p, base, N, t, ntok);
    report_err(p, s.hit_err, row, base);
    return;
  }
  // Warp-level second step of a scan over `nwarps` partials: (exclusive prefix of this
  // thread's warp, total).
  auto warp_prefix = [&](const int* parts, int& total) -> int {
    const int wt = lane < nwarps ? parts[lane] : 0;
    const int incl = warp_inclusive_sum(wt, lane);
    total = __shfl_sync(0xffffffffu, incl, 31);
    return __shfl_sync(0xffffffffu, incl - wt, warp);
  };
  int total_pack;
  const int pack_base = warp_prefix(s.hits, total_pack) + incl_h - my_pack;
  const int first_j = j0 < D ? j0 : D;
  // With eviction classes: the evictables of classes 0|1 and 2|3 before this thread's chunk
  // (pre) and in all (tot), 16-bit halves; all threads call it (warp shuffles).
  auto class_prefix = [&](unsigned& pre01, unsigned& pre23, unsigned& tot01, unsigned& tot23) {
    auto prefix_u = [&](const unsigned* parts, unsigned mine, unsigned& total) -> unsigned {
      const unsigned wt = lane < nwarps ? parts[lane] : 0u;
      const unsigned incl = warp_inclusive_sum(wt, lane);
      total = __shfl_sync(0xffffffffu, incl, 31);
      return __shfl_sync(0xffffffffu, incl - wt, warp) + warp_inclusive_sum(mine, lane) - mine;
    };
    unsigned ev01, ev23;
    count_classes(ev01, ev23);
    pre01 = prefix_u(s.evict[0], ev01, tot01);
    pre23 = prefix_u(s.evict[1], ev23, tot23);
  };
  // This thread's LRU entries in order: f(slot, new LRU position, victim index or -1). New
  // order: [unleased] + [evictable not taken] + [taken, victim order] + [hits], each in old
  // LRU order; victim i takes miss i. Victims: the first M evictables in LRU order (one class),
  // or in (class, LRU) order. Per class c: the rank of the thread's next evictable (r), the
  // class's first victim index (base) and how many it gives (quota); indexed by constants
  // only (a runtime index would put the arrays in local memory).
  auto walk_impl = [&](auto with_classes, auto&& f) {
    constexpr int C = decltype(with_classes)::value ? 4 : 1;
    int hh = pack_base & 0xFFFF, uu = pack_base >> 16;
    int r[C], base[C], quota[C];
    if constexpr (C == 1) {
      r[0] = first_j - hh - uu;  // evictables before this chunk
      base[0] = 0;
      quota[0] = M;
    } else {
      unsigned pre01, pre23, tot01, tot23;
      class_prefix(pre01, pre23, tot01, tot23);
      const int count[4] = {static_cast<int>(tot01 & 0xFFFFu), static_cast<int>(tot01 >> 16),
                            static_cast<int>(tot23 & 0xFFFFu), static_cast<int>(tot23 >> 16)};
      r[0] = static_cast<int>(pre01 & 0xFFFFu);
      r[1] = static_cast<int>(pre01 >> 16);
      r[2] = static_cast<int>(pre23 & 0xFFFFu);
      r[3] = static_cast<int>(pre23 >> 16);
#pragma unroll
      for (int c = 0, b = 0; c < 4; ++c) {
        base[c] = b;
        const int left = M - b;
        quota[c] = left <= 0 ? 0 : (left < count[c] ? left : count[c]);
        b += count[c];
      }
    }
    int ev_before = 0, taken_before = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      ev_before += r[c];
      taken_before += r[c] < quota[c] ? r[c] : quota[c];
    }
#pragma unroll
    for (int k = 0; k < SPT; ++k) {
      if (j0 + k < D) {
        const int slot = lru_slot(k);
        if (is_hit_slot(slot)) {
          f(slot, U + E + hh++, -1);
        } else if (rows.hot_block(slot) < 0) {
          f(slot, uu++, -1);
        } else {
          const int c = C == 1 ? 0 : class_of(slot);
          int rank = 0, first = 0, q = 0;
#pragma unroll
          for (int x = 0; x < C; ++x) {
            if (x == c) {
              rank = r[x]++;
              first = base[x];
              q = quota[x];
            }
          }
          if (rank < q) {
            f(slot, U + E - M + first + rank, first + rank);
            ++taken_before;
          } else {
            f(slot, U + ev_before - taken_before, -1);
          }
          ++ev_before;
        }
      }
    }
  };
  auto walk = [&](auto&& f) {
    if constexpr (kClasses) {
      if (classes != nullptr) return walk_impl(std::true_type{}, f);
    }
    walk_impl(std::false_type{}, f);
  };
  walk([&](int slot, int, int v) {
    if (v >= 0) victims[v] = static_cast<uint16_t>(slot);
  });
  // Miss ranks of chunk 0; slot_of of a missed position becomes -2 - rank.
  int carry = 0;
  auto rank_flags = [&](unsigned fl, int nu, int buf, auto&& on_rank) {
#pragma unroll
    for (int u = 0; u < kRefsInRegs; ++u) {
      if (u >= nu) break;
      int tot;
      const int wex = warp_prefix(s.misses[buf][u], tot);
      const unsigned bal = __ballot_sync(0xffffffffu, (fl >> u) & 1u);
      if ((fl >> u) & 1u) on_rank(u, carry + wex + __popc(bal & lt_mask));
      carry += tot;
    }
  };
  rank_flags(flags, nu0, 0, [&](int u, int m) { slot_of[ref[u]] = -2 - m; });
  // Chunks past 0 (5+ tokens): reload, look up, flag and rank with one barrier each.
  for (int c = 1; c < nchunks; ++c) {
    // The previous chunk's miss ranks (slot_of stores) before this chunk reads slot_of.
    __syncthreads();
    const int cb = c * CH;
    const int nc = N - cb < CH ? N - cb : CH;
    const int nu = (nc + THREADS - 1) / THREADS;
    int hc[kRefsInRegs];
    unsigned fl = 0;
#pragma unroll
    for (int u = 0; u < kRefsInRegs; ++u) {
      const int i = cb + u * THREADS + tid;
      hc[u] = -1;
      if (i < N) {
        const int q = __ldg(&p.topk[base + i]);
        unsigned long long e;
        const int h = q >= 0 ? tab_find(tab, cap, static_cast<unsigned>(q), e) : -1;
        if (h >= 0 && !(static_cast<unsigned>(e) & kResidentRef)) {
          hc[u] = h;
          if (hit_or_flag(i, h)) fl |= 1u << u;
        }
      }
    }
    const int buf = c & 1;
#pragma unroll
    for (int u = 0; u < kRefsInRegs; ++u) {
      if (u < nu) {
        const unsigned bal = __ballot_sync(0xffffffffu, (fl >> u) & 1u);
        if (lane == 0) s.misses[buf][u][warp] = __popc(bal);
      }
    }
    __syncthreads();
    rank_flags(fl, nu, buf, [&](int u, int m) { slot_of[hc[u]] = -2 - m; });
  }
  probe.mark(5);
  __syncthreads();  // ---- B5: victims, miss ranks -----------------------------------------------
  if (probe.stops_at(5)) return;

  // Walk the host-backed selections that missed: (selection, hash index) -> f(i, h, m).
  auto for_misses = [&](auto&& f) {
#pragma unroll
    for (int u = 0; u < kRefsInRegs; ++u) {
      if (u >= nu0) break;
      const int h = ref[u];
      if (h >= 0) {
        const int so = slot_of[h];
        if (so <= -2) f(u * THREADS + tid, h, -2 - so);
      }
    }
    for (int c = 1; c < nchunks; ++c) {
      const int cb = c * CH;
#pragma unroll
      for (int u = 0; u < kRefsInRegs; ++u) {
        const int i = cb + u * THREADS + tid;
        if (i < N) {
          const int q = __ldg(&p.topk[base + i]);
          unsigned long long e;
          const int h = q >= 0 ? tab_find(tab, cap, static_cast<unsigned>(q), e) : -1;
          if (h >= 0 && !(static_cast<unsigned>(e) & kResidentRef)) {
            const int so = slot_of[h];
            if (so <= -2) f(i, h, -2 - so);
          }
        }
      }
    }
  };
  // ---- writes: misses (rows, slot_pos, plan), LRU, counts, stats ----------------------------
  for_misses([&](int i, int h, int m) {
    const int slot = victims[m];
    const int r = rows.slot_row(slot);
    p.out_rows[base + i] = r;
    const unsigned long long e = tab[h];
    if (static_cast<int>(static_cast<unsigned>(e)) == i) {
      const int q = static_cast<int>(e >> 32);
      const int page = rows.page_of(q);
      const int off = q - page * bs;
      p.slot_pos[row_d + slot] = q;
      p.miss_src[base + m] =
          static_cast<int>(static_cast<unsigned>(rows.host_block(page)) * bs + off);
      p.miss_dst[base + m] = r;
    }
  });
  {  // [unleased] + [evictable not taken] + [taken, miss order] + [hits, old order]
    int16_t* lrow = p.lru + row_d;
    walk([&](int slot, int newpos, int) { lrow[newpos] = static_cast<int16_t>(slot); });
  }
  for (int j = tid; j < ntok; j += THREADS) {
    const long long c = static_cast<long long>(M) - static_cast<long long>(j) * K;
    p.miss_count[t + j] = static_cast<int>(c < 0 ? 0 : (c > K ? K : c));
  }
  if (tid == 0 && with_stats) {
    auto* st = reinterpret_cast<unsigned long long*>(p.stats);
    if (s.n_res) atomicAdd(st + 0, static_cast<unsigned long long>(s.n_res));
    if (s.n_hit_pos) atomicAdd(st + 1, static_cast<unsigned long long>(s.n_hit_pos));
    if (M) atomicAdd(st + 2, static_cast<unsigned long long>(M));
  }
  probe.mark(6);
}

template <int SPT, int THREADS, bool kClasses, class Probe>
__global__ void __launch_bounds__(THREADS, 1) resolve_general_kernel(const ResolveParams p,
                                                                     const Probe probe) {
  resolve_general<SPT, THREADS, kClasses>(p, probe);
}

}  // namespace hisparse::resolve_detail
