// resolve's probe entry point (benchmarks and tests only): the PhaseProbe instantiation of
// resolve_dispatch.cuh, which stamps phase ends, counts the fast path's hand-offs and stops
// CTAs at a stop point (resolve_probe.cuh). The production launch (launch_resolve) does not
// contain this code.
#include <cuda_runtime.h>

#include "hisparse_ops.h"
#include "resolve_dispatch.cuh"
#include "resolve_probe.cuh"
#include "resolve_probe.h"

namespace hisparse {

cudaError_t launch_resolve_probe(const ResolveParams& params, const ResolveConfig& config,
                                 const ResolveProbe& probe, cudaStream_t stream) {
  if (probe.stop < 0 || probe.stop > 5) return cudaErrorInvalidValue;
  if (probe.times == nullptr && probe.stop == 0) {  // nothing to observe: production kernels
    return probe.general_only ? launch_resolve_general(params, config, stream)
                              : launch_resolve(params, config, stream);
  }
  if (params.num_tokens == 0) return cudaSuccess;
  const ResolveLaunchInfo info =
      resolve_launch_info(params.num_tokens, params.k, params.num_slots, params.block_size,
                          params.num_pages, config);
  return resolve_detail::launch_planned(resolve_detail::planned_params(params, info), info,
                                        probe.general_only, resolve_detail::PhaseProbe(probe),
                                        stream);
}

}  // namespace hisparse
