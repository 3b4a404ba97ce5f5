// The general path's hash of one request's host-backed positions, in shared memory
// (docs/kernels.md, "The general path"): open addressing over `cap` 64-bit entries, filled in
// one phase (atomics only), read after its barrier.
#pragma once

#include <cuda_runtime.h>

#include "resolve_common.cuh"

namespace hisparse::resolve_detail {

constexpr unsigned long long kEmptyEntry = ~0ull;
constexpr unsigned kResidentRef = 0x80000000u;  // in an entry's ref word (stats mode only)

// Hash entry: position (high word) | first reference (low word, atomicMin). Inserting is one
// CAS for a new key; a later reference of a present key lowers the first reference only when
// it is earlier (64-bit min; a CAS loop in hardware, taken only by duplicates).
__device__ __forceinline__ int tab_insert(unsigned long long* tab, int cap, unsigned key,
                                          unsigned ref, bool& inserted) {
  const unsigned long long mine = (static_cast<unsigned long long>(key) << 32) | ref;
  int h = hash_index(static_cast<int>(key), cap);
  for (int probes = 0; probes < cap; ++probes) {
    // Every access of a table being filled is atomic (no plain read racing another
    // thread's CAS): the CAS either claims the empty entry or returns its occupant.
    const unsigned long long cur = atomicCAS(&tab[h], kEmptyEntry, mine);
    if (cur == kEmptyEntry) {
      inserted = true;
      return h;
    }
    if (static_cast<unsigned>(cur >> 32) == key) {
      inserted = false;
      // The ref word only decreases, so a stale read is never lower than the current one.
      if (static_cast<unsigned>(cur) > ref) atomicMin(&tab[h], mine);
      return h;
    }
    if (++h == cap) h = 0;
  }
  inserted = false;
  return -1;
}

// Index of `key` (its entry in `entry`), or -1. Only after the inserting phase's barrier.
__device__ __forceinline__ int tab_find(const unsigned long long* tab, int cap, unsigned key,
                                        unsigned long long& entry) {
  int h = hash_index(static_cast<int>(key), cap);
  for (int probes = 0; probes < cap; ++probes) {
    const unsigned long long e = tab[h];
    if (static_cast<unsigned>(e >> 32) == key) {
      entry = e;
      return h;
    }
    if (e == kEmptyEntry) return -1;
    if (++h == cap) h = 0;
  }
  return -1;
}

}  // namespace hisparse::resolve_detail
