// resolve's launch plan and production launch (docs/design.md, "resolve", docs/kernels.md): the
// shared-memory plan of both paths (resolve_launch_info) and launch_resolve, the NoProbe
// instantiation of resolve_dispatch.cuh.
#include <climits>
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_ops.h"
#include "resolve_dispatch.cuh"
#include "resolve_fast.cuh"
#include "resolve_general.cuh"
#include "resolve_probe.cuh"
#include "resolve_probe.h"

namespace hisparse {
namespace {

using resolve_detail::FastPlan;
using resolve_detail::kHashSpread;

constexpr int kMaxHotBlocksSmem = 4096;  // hot_blocks row staged in shared memory up to this
// Dynamic shared memory per CTA: the Hopper opt-in (227 KiB) less room for the static control
// blocks (~2.5 KiB).
constexpr long long kSmemBudget = 227LL * 1024 - 3 * 1024;
constexpr int kMaxStagePages = 8192;  // residency + host_blocks rows staged up to this P

int pow2_at_least(int x) {
  int v = 1;
  while (v < x) v <<= 1;
  return v;
}

// The fast path's instantiation for a shape (selections and slots per thread), or false when
// only the general kernel can take it: bs a power of two dividing D, K <= D, at most one hot
// block per thread, an instantiated (kpt, spt, threads, general_spt) that holds K and D
// (resolve_dispatch.cuh).
bool fast_shape(int K, int D, int bs, int P, int threads, int general_spt, int& kpt, int& spt) {
  if (bs <= 0 || (bs & (bs - 1)) != 0 || D % bs != 0 || K < 1 || K > D) return false;
  if (D / bs > threads) return false;  // one hot block per thread is staged
  if (static_cast<long long>(P) * bs >= INT_MAX) return false;
  kpt = threads == 512 ? 4 : 2;
  if (K % kpt != 0 || K > kpt * threads) return false;
  if (threads == 1024) {
    spt = D <= 4096 ? 4 : (D <= 8192 ? 8 : 0);
    if (spt == 4 && general_spt > 4) return false;
    if (spt == 8 && general_spt != 8) return false;
  } else {
    spt = D <= 4096 ? 8 : (D <= 8192 ? 16 : 0);
    if (spt != general_spt) return false;
  }
  return spt != 0 && D % spt == 0;
}

size_t fast_smem_bytes(int kpt, int spt, int threads, int hot_blocks, int stage_pages) {
  if (threads == 1024 && spt == 4) return FastPlan<2, 4, 1024>::bytes(hot_blocks, stage_pages);
  if (threads == 1024 && spt == 8) return FastPlan<2, 8, 1024>::bytes(hot_blocks, stage_pages);
  if (threads == 512 && spt == 8) return FastPlan<4, 8, 512>::bytes(hot_blocks, stage_pages);
  if (threads == 512 && spt == 16) return FastPlan<4, 16, 512>::bytes(hot_blocks, stage_pages);
  return 0;
}

cudaError_t launch(const ResolveParams& params, const ResolveConfig& config, bool general_only,
                   cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  const ResolveLaunchInfo info =
      resolve_launch_info(params.num_tokens, params.k, params.num_slots, params.block_size,
                          params.num_pages, config);
  return resolve_detail::launch_planned(resolve_detail::planned_params(params, info), info,
                                        general_only, resolve_detail::NoProbe{}, stream);
}

}  // namespace

ResolveLaunchInfo resolve_launch_info(int num_tokens, int k, int num_slots, int block_size,
                                      int num_pages, const ResolveConfig& config) {
  const int threads = config.threads;
  const int max_tokens_per_request = config.max_tokens_per_request;
  ResolveLaunchInfo info{};
  // 1024 threads measured faster than 512 at every batch (docs/kernels.md); 512 is kept
  // selectable for D <= 8192.
  info.threads = (num_slots > 8192 || threads != 512) ? 1024 : 512;
  int spt = (num_slots + info.threads - 1) / info.threads;
  spt = pow2_at_least(spt < 1 ? 1 : spt);
  info.slots_per_thread = spt;
  int tok = max_tokens_per_request < 1 ? 1 : max_tokens_per_request;
  if (num_tokens > 0 && tok > num_tokens) tok = num_tokens;
  const long long n = static_cast<long long>(tok) * k;
  auto round32 = [](long long c) { return c < 32 ? 32LL : (c + 31) & ~31LL; };
  // The union bound: 1.5 entries per selection of max_tokens_per_request tokens.
  long long bound = round32((3 * n + 1) / 2);
  const int hot_blocks = block_size > 0 ? num_slots / block_size : 0;
  info.hot_blocks_in_smem = hot_blocks <= kMaxHotBlocksSmem ? hot_blocks : 0;
  auto bytes_for = [&](long long phys, long long bnd, long long stage) {
    const long long vc = bnd < num_slots ? bnd : num_slots;
    return resolve_detail::GeneralSmem::bytes(phys, vc, num_slots, info.hot_blocks_in_smem,
                                              static_cast<int>(stage));
  };
  const long long budget = kSmemBudget;
  // Priorities: the bound itself, then the staged page rows, then spare hash entries (up to
  // kHashSpread per selection) that keep the probe chains short.
  while (bound > 32 && bytes_for(bound, bound, 0) > budget) bound -= 32;
  long long stage = 0;
  if (num_pages > 0 && num_pages <= kMaxStagePages &&
      bytes_for(bound, bound, num_pages) <= budget)
    stage = num_pages;
  int fast_kpt = 0, fast_spt = 0;
  info.fast_path = fast_shape(k, num_slots, block_size, num_pages, info.threads,
                              info.slots_per_thread, fast_kpt, fast_spt) ? 1 : 0;
  size_t fast_bytes = 0;
  if (info.fast_path) {
    info.fast_kpt = fast_kpt;
    info.fast_spt = fast_spt;
    const int hot = num_slots / block_size;
    // staged page rows when they fit beside the tables
    if (num_pages > 0 && num_pages <= kMaxStagePages &&
        fast_smem_bytes(fast_kpt, fast_spt, info.threads, hot, num_pages) <= kSmemBudget)
      info.fast_stage_pages = num_pages;
    fast_bytes = fast_smem_bytes(fast_kpt, fast_spt, info.threads, hot, info.fast_stage_pages);
  }
  // Spare hash entries of the general path: with the fast path only in the room its plan
  // takes anyway. Every byte of shared memory past that comes out of the L1 cache, which
  // holds the fused kernel's spilled registers (measured: the same single-token launch
  // planned for 4 tokens, 224 KiB, ran 0.4 µs slower than planned for 1, 149 KiB, at batch
  // 64, D 4096, and 2.7 µs slower at D 8192).
  long long phys_budget = budget;
  if (info.fast_path) {
    phys_budget = static_cast<long long>(fast_bytes);
    if (phys_budget < bytes_for(bound, bound, stage)) phys_budget = bytes_for(bound, bound, stage);
  }
  long long phys = round32(kHashSpread * n);
  if (phys < bound) phys = bound;
  while (phys > bound && bytes_for(phys, bound, stage) > phys_budget) phys -= 32;
  info.hash_capacity = static_cast<int>(phys);
  info.union_capacity = static_cast<int>(bound);
  info.victim_capacity = static_cast<int>(bound < num_slots ? bound : num_slots);
  info.stage_pages = static_cast<int>(stage);
  info.general_smem_bytes = static_cast<size_t>(bytes_for(phys, bound, stage));
  info.smem_bytes = info.general_smem_bytes > fast_bytes ? info.general_smem_bytes : fast_bytes;
  return info;
}

cudaError_t launch_resolve(const ResolveParams& params, const ResolveConfig& config,
                           cudaStream_t stream) {
  return launch(params, config, /*general_only=*/false, stream);
}

cudaError_t launch_resolve_general(const ResolveParams& params, const ResolveConfig& config,
                                   cudaStream_t stream) {
  return launch(params, config, /*general_only=*/true, stream);
}

}  // namespace hisparse
