// resolve's probe entry point (benchmarks and tests only): the PhaseProbe instantiation of
// resolve_dispatch.cuh, which stamps phase ends, counts the fast path's hand-offs and stops
// CTAs at a stop point (resolve_probe.cuh). The production launch (launch_resolve) does not
// contain this code. Built only with HISPARSE_PROBE_KERNELS (CMake option of that name);
// without it a launch that asks for stamps or a stop returns cudaErrorNotSupported.
#include <cuda_runtime.h>

#include "hisparse_ops.h"
#include "resolve_probe.h"
#ifndef HISPARSE_PROBE_KERNELS
#define HISPARSE_PROBE_KERNELS 0
#endif
#if HISPARSE_PROBE_KERNELS
#include "resolve_dispatch.cuh"
#include "resolve_probe.cuh"
#endif

namespace hisparse {

cudaError_t launch_resolve_probe(const ResolveParams& params, const ResolveConfig& config,
                                 const ResolveProbe& probe, cudaStream_t stream) {
  if (probe.stop < 0 || probe.stop > 5) return cudaErrorInvalidValue;
  if (probe.times == nullptr && probe.stop == 0) {  // nothing to observe: production kernels
    return probe.general_only ? launch_resolve_general(params, config, stream)
                              : launch_resolve(params, config, stream);
  }
#if HISPARSE_PROBE_KERNELS
  if (params.num_tokens == 0) return cudaSuccess;
  const ResolveLaunchInfo info =
      resolve_launch_info(params.num_tokens, params.k, params.num_slots, params.block_size,
                          params.num_pages, config);
  return resolve_detail::launch_planned(resolve_detail::planned_params(params, info), info,
                                        probe.general_only, resolve_detail::PhaseProbe(probe),
                                        stream);
#else
  return cudaErrorNotSupported;
#endif
}

bool has_probe_kernels() { return HISPARSE_PROBE_KERNELS != 0; }

}  // namespace hisparse
