"""Feasibility prototype: resolve with one 2-CTA thread-block cluster per request (GPU, sm_90).

    python3 benchmarks/proto_resolve_cluster.py [--batches 1 64 128] [--misses 0.05 0.0]

NOT the production kernel (csrc/resolve.cu is untouched). It covers the common path only, to
measure how fast a cluster split of ``resolve`` can be:

* one token per request (T = batch), K = 2048, D = 4096, power-of-two bs, P any;
* every valid position resident or host-backed with a valid host block; hot blocks valid;
  at most ``TAB`` (4096) distinct positions per CTA; no error detection at all (an invalid
  input gives garbage or a hang, not an error code);
* supported and checked exactly: padding selections (-1), padding tokens (token_rows -1),
  duplicate positions within a token's top-k (first-reference order), resident positions, a
  request without any host-backed position (cluster-uniform early exit: lru/slot_pos untouched).

Design (per request, CTA rank c in {0, 1} of its cluster): the owner CTA of a position p is
the page parity ``(p / bs) & 1``. Both CTAs load the whole top-k row, all D ``slot_pos`` and
the D ``lru`` entries (registers); each inserts only its own positions into its own shared
64-bit hash (position | first reference), probes only its own ``slot_pos`` values and so finds
the hits of its own positions. Per-slot hit bitmask words (D / 32), per-warp miss-flag words
(first references of misses, one per warp and selection chunk, in top-k order) and per-warp
host-backed counts are exchanged through DSMEM at ONE cluster barrier. Then each CTA: global
miss ranks = prefix over the OR of both CTAs' flag words (one warp-level scan per warp) + popc
below the lane; the LRU-order evictable scan over all D slots (redundantly in both CTAs:
per-slot hit bit = own word | peer word); victims = the m-th evictable; writes of its own
misses/hits/residents; the LRU rewrite of its own half of the old LRU indices. Barriers:
3 block barriers before the exchange, the cluster barrier, 2 block barriers after it and a
split cluster barrier (arrive after the last DSMEM read, wait before exit). ``--stop-batches``
also times the kernel returning at each phase boundary (a runtime ``stop`` argument). The kernel is launched by ``cudaLaunchKernelEx`` with a cluster dimension of 2 through
a small shared library compiled here with nvcc (no torch headers: builds in seconds) and
called with ctypes on torch's current stream, so it can be captured in a CUDA graph.

The script checks every output exactly against ``vllm_hisparse.ops.reference.resolve`` on CPU
copies (out_rows, miss_src/miss_dst up to miss_count, miss_count, slot_pos, lru, stats) on the
benchmark cases and on an edge case (duplicates, padding, residents, an all-resident request,
a padding token), then times it next to the production kernel with the bench's CUDA-graph
harness (``graph_time_resolve``: restore slot_pos/lru, flush L2, launch; minus the same graph
without launches). Results: docs/kernels.md, "Cluster prototype (fourth session)".
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import subprocess
import sys

import torch

CUDA_SRC = r"""
#include <cuda_runtime.h>
#include <cooperative_groups.h>
#include <stdint.h>
namespace cg = cooperative_groups;

#define TAB_BITS 12
#define TAB (1 << TAB_BITS)
#define EMPTY_ENTRY (~0ull)
#define CLAIM_FREE (-1)
#define CLAIM_RESIDENT (-3)
#define CLAIM_MISS_BASE (-10)   // claim = -10 - miss rank

__device__ __forceinline__ unsigned home_of(int p) {
  return ((unsigned)p * 2654435761u) >> (32 - TAB_BITS);
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ int warp_incl_scan(int v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    int o = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += o;
  }
  return v;
}
__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

// NT threads per CTA, SEL = K / NT selections and SPT = D / NT slots per thread.
template <int NT, int SEL, int SPT, int MINB>
__global__ void __launch_bounds__(NT, MINB) proto_resolve_kernel(
    const int* __restrict__ topk, const int* __restrict__ token_rows,
    const int* __restrict__ residency, const int* __restrict__ host_blocks,
    const int* __restrict__ hot_blocks, int* __restrict__ slot_pos, short* __restrict__ lru,
    int P, int sh, int* __restrict__ out_rows, int* __restrict__ miss_src,
    int* __restrict__ miss_dst, int* __restrict__ miss_count,
    unsigned long long* __restrict__ stats, int stop) {
  constexpr int K = NT * SEL;
  constexpr int D = NT * SPT;
  constexpr int NW = NT / 32;
  constexpr int NMW = SEL * NW;            // miss-flag words, top-k order
  constexpr int NHW = SPT * NW;            // hit words (D / 32)
  constexpr int WPL = (NMW + 31) / 32;     // miss words per lane in the rank scan
  const int bs = 1 << sh;
  const int nhot = D >> sh;

  extern __shared__ __align__(16) unsigned char smem[];
  unsigned long long* tab = reinterpret_cast<unsigned long long*>(smem);  // [TAB]
  int* claim = reinterpret_cast<int*>(tab + TAB);                          // [TAB]
  short* victim = reinterpret_cast<short*>(claim + TAB);                   // [K]
  int* hot_s = reinterpret_cast<int*>(victim + K);                         // [D / bs]
  __shared__ unsigned hitw[NHW];
  __shared__ unsigned missw[NMW];
  __shared__ int hbw[NW], resw[NW], hitcw[NW], wsum[NW];

  cg::cluster_group cluster = cg::this_cluster();
  const int c = (int)cluster.block_rank();
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int t = blockIdx.x >> 1;
  const size_t tk = (size_t)t * K;
  if (stop == 1) return;  // timing only: the launch floor

  // ---- round trip 1: the token's row and its top-k (both CTAs read all of it)
  const int row = token_rows[t];
  int sel[SEL];
#pragma unroll
  for (int j = 0; j < SEL; ++j) sel[j] = topk[tk + j * NT + tid];
  if (row < 0) {  // padding token: same decision in both CTAs, no DSMEM traffic
    if (c == 0) {
#pragma unroll
      for (int j = 0; j < SEL; ++j) out_rows[tk + j * NT + tid] = -1;
      if (tid == 0) miss_count[t] = 0;
    }
    return;
  }
  // hash clear while round trip 2 is in flight
  {
    uint4* t4 = reinterpret_cast<uint4*>(tab);
    const uint4 e = make_uint4(~0u, ~0u, ~0u, ~0u);
    for (int i = tid; i < TAB / 2; i += NT) t4[i] = e;
    uint4* c4 = reinterpret_cast<uint4*>(claim);
    for (int i = tid; i < TAB / 4; i += NT) c4[i] = e;
  }
  // ---- round trip 2: slot_pos, lru, hot blocks, page rows of own selections
  const size_t rd = (size_t)row * D;
  int spv[SPT];
  short lv[SPT];
#pragma unroll
  for (int q = 0; q < SPT / 4; ++q) {
    int4 v = reinterpret_cast<const int4*>(slot_pos + rd + tid * SPT)[q];
    spv[4 * q] = v.x; spv[4 * q + 1] = v.y; spv[4 * q + 2] = v.z; spv[4 * q + 3] = v.w;
    uint2 l = reinterpret_cast<const uint2*>(lru + rd + tid * SPT)[q];
    lv[4 * q] = (short)(l.x & 0xffff); lv[4 * q + 1] = (short)(l.x >> 16);
    lv[4 * q + 2] = (short)(l.y & 0xffff); lv[4 * q + 3] = (short)(l.y >> 16);
  }
  for (int i = tid; i < nhot; i += NT) hot_s[i] = hot_blocks[(size_t)row * nhot + i];
  bool own[SEL];
  int resb[SEL], hostb[SEL];
#pragma unroll
  for (int j = 0; j < SEL; ++j) {
    const int p = sel[j];
    own[j] = p >= 0 && ((p >> sh) & 1) == c;
    resb[j] = -1;
    hostb[j] = -1;
    if (own[j]) {
      resb[j] = residency[(size_t)row * P + (p >> sh)];
      hostb[j] = host_blocks[(size_t)row * P + (p >> sh)];
    }
  }
  __syncthreads();  // B1: table cleared
  if (stop == 2) {  // timing only: round trips 1 and 2 complete
    int acc = row;
#pragma unroll
    for (int j = 0; j < SEL; ++j) acc ^= sel[j] ^ resb[j] ^ hostb[j];
#pragma unroll
    for (int i = 0; i < SPT; ++i) acc ^= spv[i] ^ lv[i];
    if (acc == 0x7fffffff) out_rows[tk] = acc;
    return;
  }

  // ---- classify + insert own positions: entry = position (high) | first reference (low)
  int ent[SEL];
#pragma unroll
  for (int j = 0; j < SEL; ++j) {
    const int p = sel[j];
    const int k = j * NT + tid;
    ent[j] = -1;
    if (own[j]) {
      const unsigned long long mine = ((unsigned long long)(unsigned)p << 32) | (unsigned)k;
      unsigned h = home_of(p);
      while (true) {
        const unsigned long long old = atomicCAS(&tab[h], EMPTY_ENTRY, mine);
        if (old == EMPTY_ENTRY) break;
        if ((int)(old >> 32) == p) {
          if ((unsigned)old > (unsigned)k) atomicMin(&tab[h], mine);
          break;
        }
        h = (h + 1) & (TAB - 1);
      }
      ent[j] = (int)h;
      if (resb[j] >= 0) {
        claim[h] = CLAIM_RESIDENT;
        out_rows[tk + k] = (resb[j] << sh) + (p & (bs - 1));
      }
    } else if (p < 0 && c == 0) {
      out_rows[tk + k] = -1;
    }
  }
  __syncthreads();  // B2: inserts done
  if (stop == 3) return;

  // ---- hit marking: probe own slot_pos values; claim the entry
#pragma unroll
  for (int i = 0; i < SPT; ++i) {
    const int v = spv[i];
    bool hit = false;
    if (v >= 0 && ((v >> sh) & 1) == c) {
      unsigned h = home_of(v);
      while (true) {
        const unsigned long long e = tab[h];
        if (e == EMPTY_ENTRY) break;
        if ((int)(e >> 32) == v) {
          if (claim[h] != CLAIM_RESIDENT) {
            claim[h] = tid * SPT + i;
            hit = true;
          }
          break;
        }
        h = (h + 1) & (TAB - 1);
      }
    }
    const unsigned b = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) hitw[w * SPT + i] = b;
  }
  __syncthreads();  // B3: claims done
  if (stop == 4) return;

  // ---- per selection: hit rows now; miss first references -> flag words
  int cl[SEL];
  bool flag[SEL];
  unsigned myflags[SEL];
  int n_hb = 0, n_res = 0, n_hit = 0;
#pragma unroll
  for (int j = 0; j < SEL; ++j) {
    const int k = j * NT + tid;
    cl[j] = CLAIM_RESIDENT;
    bool first = false;
    if (ent[j] >= 0) {
      first = (unsigned)tab[ent[j]] == (unsigned)k;
      cl[j] = claim[ent[j]];
      if (cl[j] >= 0) out_rows[tk + k] = (hot_s[cl[j] >> sh] << sh) + (cl[j] & (bs - 1));
    }
    flag[j] = ent[j] >= 0 && cl[j] == CLAIM_FREE && first;
    myflags[j] = __ballot_sync(0xffffffffu, flag[j]);
    if (lane == 0) missw[j * NW + w] = myflags[j];
    n_hb += __popc(__ballot_sync(0xffffffffu, ent[j] >= 0 && first && cl[j] != CLAIM_RESIDENT));
    n_res += __popc(__ballot_sync(0xffffffffu, ent[j] >= 0 && first && cl[j] == CLAIM_RESIDENT));
    n_hit += __popc(__ballot_sync(0xffffffffu, ent[j] >= 0 && first && cl[j] >= 0));
  }
  if (lane == 0) {
    hbw[w] = n_hb;
    resw[w] = n_res;
    hitcw[w] = n_hit;
  }
  cluster.sync();  // the one exchange barrier (also a block barrier)

  const unsigned* peer_missw = cluster.map_shared_rank(missw, c ^ 1);
  const unsigned* peer_hitw = cluster.map_shared_rank(hitw, c ^ 1);
  const int* peer_hbw = cluster.map_shared_rank(hbw, c ^ 1);
  const bool any_hb =
      __any_sync(0xffffffffu, lane < NW && (hbw[lane] != 0 || peer_hbw[lane] != 0));

  // global miss ranks: prefix over the OR of both CTAs' flag words (every warp does it)
  unsigned cw[WPL];
  int pre[WPL];
  int run = 0;
#pragma unroll
  for (int q = 0; q < WPL; ++q) {
    const int x = lane * WPL + q;
    cw[q] = x < NMW ? (missw[x] | peer_missw[x]) : 0u;
    pre[q] = run;
    run += __popc(cw[q]);
  }
  const int incl = warp_incl_scan(run, lane);
  const int M = __shfl_sync(0xffffffffu, incl, 31);
#pragma unroll
  for (int q = 0; q < WPL; ++q) pre[q] += incl - run;
  const unsigned lt_mask = (1u << lane) - 1u;
  int mrank[SEL];
#pragma unroll
  for (int j = 0; j < SEL; ++j) {
    const int x = j * NW + w;
    const int src = x / WPL, qq = x % WPL;
    int base = 0;
    unsigned word = 0;
#pragma unroll
    for (int q = 0; q < WPL; ++q) {
      const int b = __shfl_sync(0xffffffffu, pre[q], src);
      const unsigned wd = __shfl_sync(0xffffffffu, cw[q], src);
      if (q == qq) { base = b; word = wd; }
    }
    mrank[j] = base + __popc(word & lt_mask);
    if (flag[j]) claim[ent[j]] = CLAIM_MISS_BASE - mrank[j];  // for later references
  }

  if (stop == 5) {  // after the exchange and the miss ranks
    cluster_arrive();
    cluster_wait();
    if (M == -1) out_rows[tk] = mrank[0];
    return;
  }
  if (any_hb) {
    // ---- LRU-order evictable scan over all D slots (both CTAs)
    bool ev[SPT];
    int cnt = 0;
#pragma unroll
    for (int i = 0; i < SPT; ++i) {
      const int s = lv[i];
      const int st = s / SPT;
      const int word = (st >> 5) * SPT + (s % SPT);
      const unsigned hw = hitw[word] | peer_hitw[word];
      ev[i] = !((hw >> (st & 31)) & 1u);
      cnt += ev[i];
    }
    cluster_arrive();  // last DSMEM read done
    const int wincl = warp_incl_scan(cnt, lane);
    if (lane == 31) wsum[w] = wincl;
    __syncthreads();  // B5
    const int ws = lane < NW ? wsum[lane] : 0;
    const int wsi = warp_incl_scan(ws, lane);
    const int wbase = __shfl_sync(0xffffffffu, wsi - ws, w);
    const int E = __shfl_sync(0xffffffffu, wsi, 31);
    int q = wbase + wincl - cnt;  // evictables before this thread's first LRU index
    const int li0 = tid * SPT;
    const bool write_lru = (li0 >= c * (D / 2)) && (li0 < (c + 1) * (D / 2));
#pragma unroll
    for (int i = 0; i < SPT; ++i) {
      const int li = li0 + i;
      const int s = lv[i];
      int npos;
      if (ev[i]) {
        if (q < M) {
          victim[q] = (short)s;
          npos = E - M + q;
        } else {
          npos = q - M;
        }
        ++q;
      } else {
        npos = E + (li - q);
      }
      if (write_lru) lru[rd + npos] = (short)s;
    }
    __syncthreads();  // B6: victims
    if (stop == 6) {  // after the scan, the victims and the LRU rewrite
      cluster_wait();
      return;
    }
    // ---- misses: every reference gets its row; the first one writes slot_pos and the copy
#pragma unroll
    for (int j = 0; j < SEL; ++j) {
      if (ent[j] >= 0 && cl[j] == CLAIM_FREE) {
        const int m = flag[j] ? mrank[j] : CLAIM_MISS_BASE - claim[ent[j]];
        const int s = victim[m];
        const int r = (hot_s[s >> sh] << sh) + (s & (bs - 1));
        const int k = j * NT + tid;
        out_rows[tk + k] = r;
        if (flag[j]) {
          const int p = sel[j];
          slot_pos[rd + s] = p;
          miss_src[tk + m] = (hostb[j] << sh) + (p & (bs - 1));
          miss_dst[tk + m] = r;
        }
      }
    }
  } else {
    cluster_arrive();
  }
  if (c == 0 && tid == 0) miss_count[t] = M;
  if (stats != nullptr && w == 0) {
    const int r_ = warp_sum(lane < NW ? resw[lane] : 0);
    const int h_ = warp_sum(lane < NW ? hitcw[lane] : 0);
    if (lane == 0) {
      if (r_) atomicAdd(&stats[0], (unsigned long long)r_);
      if (h_) atomicAdd(&stats[1], (unsigned long long)h_);
      if (c == 0 && M) atomicAdd(&stats[2], (unsigned long long)M);
    }
  }
  cluster_wait();  // the peer may still read this CTA's words until it arrives
}

template <int NT, int SEL, int SPT, int MINB>
static int launch(int T, const int* topk, const int* token_rows, const int* residency,
                  const int* host_blocks, const int* hot_blocks, int* slot_pos, short* lru,
                  int P, int sh, int* out_rows, int* miss_src, int* miss_dst, int* miss_count,
                  unsigned long long* stats, int stop, cudaStream_t stream) {
  constexpr int K = NT * SEL, D = NT * SPT;
  const size_t smem = (size_t)TAB * 8 + (size_t)TAB * 4 + (size_t)K * 2 + (size_t)(D >> sh) * 4;
  auto kern = proto_resolve_kernel<NT, SEL, SPT, MINB>;
  static size_t smem_set = 0;  // opt in once per size (the first call is outside any capture)
  cudaError_t e;
  if (smem_set < smem) {
    e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
    smem_set = smem;
  }
  if (T == 0) return 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(2 * T, 1, 1);
  cfg.blockDim = dim3(NT, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, kern, topk, token_rows, residency, host_blocks, hot_blocks,
                         slot_pos, lru, P, sh, out_rows, miss_src, miss_dst, miss_count, stats,
                         stop);
  return (int)e;
}

extern "C" int proto_resolve(int threads, int stop, int T, int K, int D, int P, int sh,
                             const int* topk, const int* token_rows, const int* residency,
                             const int* host_blocks, const int* hot_blocks, int* slot_pos,
                             short* lru, int* out_rows, int* miss_src, int* miss_dst,
                             int* miss_count, unsigned long long* stats, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (K != 2048 || D != 4096) return -1;
  if (threads == 1024)
    return launch<1024, 2, 4, 1>(T, topk, token_rows, residency, host_blocks, hot_blocks,
                                 slot_pos, lru, P, sh, out_rows, miss_src, miss_dst,
                                 miss_count, stats, stop, s);
  if (threads == 512)
    return launch<512, 4, 8, 2>(T, topk, token_rows, residency, host_blocks, hot_blocks,
                                slot_pos, lru, P, sh, out_rows, miss_src, miss_dst,
                                miss_count, stats, stop, s);
  if (threads == 1025)  // 1024 threads capped at 32 registers: two CTAs per SM
    return launch<1024, 2, 4, 2>(T, topk, token_rows, residency, host_blocks, hot_blocks,
                                 slot_pos, lru, P, sh, out_rows, miss_src, miss_dst,
                                 miss_count, stats, stop, s);
  return -2;
}
"""


def build_library(out_dir: str) -> str:
    """Compile CUDA_SRC into a shared library (nvcc, sm_90a); cached by source hash."""
    digest = hashlib.sha1(CUDA_SRC.encode()).hexdigest()[:12]
    os.makedirs(out_dir, exist_ok=True)
    so = os.path.join(out_dir, f"proto_resolve_cluster_{digest}.so")
    if os.path.exists(so):
        return so
    cu = os.path.join(out_dir, f"proto_resolve_cluster_{digest}.cu")
    with open(cu, "w") as f:
        f.write(CUDA_SRC)
    cmd = ["nvcc", "-O3", "-arch=sm_90a", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
           "-Xptxas", "-v", "-o", so + ".tmp", cu]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    sys.stderr.write(res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({res.returncode})")
    os.replace(so + ".tmp", so)
    return so


class Proto:
    def __init__(self, so: str):
        self.lib = ctypes.CDLL(so)
        f = self.lib.proto_resolve
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_int] * 7 + [ctypes.c_void_p] * 13

    def resolve(self, threads, topk, token_rows, residency, host_blocks, hot_blocks, slot_pos,
                lru, block_size, out_rows, miss_src, miss_dst, miss_count, stats=None, stop=0):
        T, K = topk.shape
        D = slot_pos.shape[1]
        P = residency.shape[1]
        assert block_size & (block_size - 1) == 0
        sh = block_size.bit_length() - 1
        stream = torch.cuda.current_stream().cuda_stream
        rc = self.lib.proto_resolve(
            threads, stop, T, K, D, P, sh, topk.data_ptr(), token_rows.data_ptr(),
            residency.data_ptr(), host_blocks.data_ptr(), hot_blocks.data_ptr(),
            slot_pos.data_ptr(), lru.data_ptr(), out_rows.data_ptr(), miss_src.data_ptr(),
            miss_dst.data_ptr(), miss_count.data_ptr(),
            stats.data_ptr() if stats is not None else None, stream)
        if rc != 0:
            raise RuntimeError(f"proto_resolve launch failed: {rc}")


def reference_outputs(s):
    """The reference on CPU copies of set s, from its initial hot state."""
    from vllm_hisparse.ops import reference
    cpu = {k: v.cpu() for k, v in s.items()}
    T, K = cpu["topk"].shape
    sp = cpu["slot_pos0"].clone()
    lr = cpu["lru0"].clone()
    out = dict(out_rows=torch.full((T, K), -7, dtype=torch.int32),
               miss_src=torch.full((T, K), -7, dtype=torch.int32),
               miss_dst=torch.full((T, K), -7, dtype=torch.int32),
               miss_count=torch.full((T,), -7, dtype=torch.int32),
               stats=torch.zeros(3, dtype=torch.int64))
    reference.resolve(cpu["topk"], cpu["token_rows"], cpu["residency"], cpu["host_blocks"],
                      cpu["hot_blocks"], sp, lr, 64, out["out_rows"], out["miss_src"],
                      out["miss_dst"], out["miss_count"], out["stats"])
    out["slot_pos"] = sp
    out["lru"] = lr
    return out


def run_and_compare(s, fn, ref) -> list[str]:
    """Run fn (a resolve with the op's signature) once on set s from its initial state and
    return the names of outputs that differ from ref (outputs poisoned first)."""
    s["slot_pos"].copy_(s["slot_pos0"])
    s["lru"].copy_(s["lru0"])
    for name in ("out_rows", "miss_src", "miss_dst", "miss_count"):
        s[name].fill_(-7)
    stats = torch.zeros(3, dtype=torch.int64, device=s["topk"].device)
    fn(s["topk"], s["token_rows"], s["residency"], s["host_blocks"], s["hot_blocks"],
       s["slot_pos"], s["lru"], 64, s["out_rows"], s["miss_src"], s["miss_dst"],
       s["miss_count"], stats)
    torch.cuda.synchronize()
    bad = []
    for name in ("out_rows", "miss_count", "slot_pos", "lru"):
        if not torch.equal(s[name].cpu(), ref[name]):
            bad.append(name)
    if not torch.equal(stats.cpu(), ref["stats"]):
        bad.append("stats")
    counts = ref["miss_count"].tolist()
    got_src, got_dst = s["miss_src"].cpu(), s["miss_dst"].cpu()
    for t, n in enumerate(counts):
        if not (torch.equal(got_src[t, :n], ref["miss_src"][t, :n])
                and torch.equal(got_dst[t, :n], ref["miss_dst"][t, :n])):
            bad.append(f"miss_src/dst[{t}]")
            break
    return bad


def edge_set(make_resolve_sets):
    """Batch 8, 15 % misses, plus duplicates, padding selections, resident pages, a request
    with no host-backed position (row 5) and a padding token (token 6)."""
    s = make_resolve_sets(8, 2048, 4096, 0.15, sets=1)[0]
    topk = s["topk"]
    topk[:, 100:200] = topk[:, 0:100].clone()      # duplicates, first reference earlier
    topk[:, 1500:1560] = topk[:, 1800:1860].clone()  # ... and first reference later
    topk[:, 300:350] = -1
    res = s["residency"]
    bs = 64
    n_pages = res.shape[1]
    for r in range(8):
        pages = (topk[r, 400:450].long() // bs).unique()
        res[r, pages] = (torch.arange(pages.numel(), device=res.device, dtype=torch.int32)
                         + 1000 + 100 * r)
    res[5] = torch.arange(n_pages, dtype=torch.int32, device=res.device) + 5000
    s["token_rows"][6] = -1
    return s


def graph_time(sets, fn, flush: bool, iters: int) -> float:
    """graph_time_resolve of vllm_hisparse.cli.benchmarks.kernels with the launch as fn."""
    from vllm_hisparse.cli.benchmarks.kernels import graph_time_resolve

    return graph_time_resolve(sets, flush=flush, iters=iters, launch=fn)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128])
    ap.add_argument("--misses", type=float, nargs="+", default=[0.05, 0.0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1024, 512],
                    help="1024, 512, or 1025 = 1024 threads capped at 32 registers (2 CTAs/SM)")
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--so", default="", help="prebuilt library (else compiled with nvcc)")
    ap.add_argument("--build-dir", default="/tmp/proto_resolve_cluster")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--no-production", action="store_true")
    ap.add_argument("--stop-batches", type=int, nargs="*", default=[],
                    help="also time the stop points of the first --threads variant, 5 %% misses")
    a = ap.parse_args()
    so = a.so or build_library(a.build_dir)
    if a.build_only:
        print(so)
        return 0
    from vllm_hisparse.cli.benchmarks.kernels import graph_time_resolve, make_resolve_sets
    proto = Proto(so)
    cuda_ops = None
    if not a.no_production:
        from vllm_hisparse.ops import cuda as cuda_ops
    fns = {nt: (lambda *args, nt=nt: proto.resolve(nt, *args)) for nt in a.threads}

    ok_all = True
    es = edge_set(make_resolve_sets)
    ref = reference_outputs(es)
    for nt, fn in fns.items():
        bad = run_and_compare(es, fn, ref)
        ok_all &= not bad
        print(f"edge case (dups, padding, residents, all-resident request, padding token), "
              f"{nt} threads: {'exact' if not bad else 'DIFFERS: ' + ', '.join(bad)}", flush=True)
    if cuda_ops is not None:
        bad = run_and_compare(es, cuda_ops.resolve, ref)
        print(f"edge case, production kernel: {'exact' if not bad else 'DIFFERS: ' + ', '.join(bad)}",
              flush=True)
    del es

    rows = []
    for miss in a.misses:
        for B in a.batches:
            sets = make_resolve_sets(B, 2048, 4096, miss, sets=4)
            exact = {}
            refs = [reference_outputs(s) for s in sets]
            for nt, fn in fns.items():
                bads = []
                for s, ref in zip(sets, refs):
                    bads += run_and_compare(s, fn, ref)
                exact[nt] = not bads
                ok_all &= not bads
                if bads:
                    print(f"batch {B} miss {miss} {nt} threads differs: {sorted(set(bads))}",
                          flush=True)
            prod = graph_time_resolve(sets, flush=True, iters=a.iters) if cuda_ops else float("nan")
            times = {nt: graph_time(sets, fn, True, a.iters) for nt, fn in fns.items()}
            warm = graph_time(sets, fns[a.threads[0]], False, a.iters)
            rows.append((B, miss, prod, times, warm, exact))
            print(f"batch {B:4d} miss {miss:.0%}: production {prod:5.1f}  " +
                  "  ".join(f"proto{nt} {times[nt]:5.1f}" for nt in fns) +
                  f"  (proto{a.threads[0]} warm {warm:5.1f})  exact " +
                  "/".join("yes" if exact[nt] else "NO" for nt in fns), flush=True)
            del sets

    for B in a.stop_batches:
        sets = make_resolve_sets(B, 2048, 4096, 0.05, sets=4)
        nt = a.threads[0]
        cum = [graph_time(sets, lambda *args, st=st: proto.resolve(nt, *args, stop=st), True,
                          a.iters) for st in (1, 2, 3, 4, 5, 6, 0)]
        print(f"batch {B}, {nt} threads, cold, cumulative µs to stop point (launch floor, round "
              "trips, classify+insert, hit marking, exchange+ranks, scan+victims+LRU, full): " +
              ", ".join(f"{v:.1f}" for v in cum), flush=True)
        del sets

    print("\nresolve, K 2048, D 4096, bs 64, P 2048, cold L2, µs per launch (CUDA-graph replays)")
    print("| batch | misses | production | " + " | ".join(f"cluster {nt}" for nt in fns) +
          f" | cluster {a.threads[0]} warm | exact |")
    print("|---|---|---|" + "---|" * len(fns) + "---|---|")
    for B, miss, prod, times, warm, exact in rows:
        print(f"| {B} | {miss:.0%} | {prod:.1f} | " +
              " | ".join(f"{times[nt]:.1f}" for nt in fns) + f" | {warm:.1f} | " +
              "/".join("yes" if exact[nt] else "no" for nt in fns) + " |")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
