// Host interface of resolve's probe entry point (benchmarks and tests only; the production
// launch is launch_resolve in hisparse_ops.h). No torch headers.
#pragma once

#include <cuda_runtime_api.h>

#include "hisparse_ops.h"

namespace hisparse {

struct ResolveProbe {
  unsigned long long* times = nullptr;  // [10]: phase stamps of CTA 0 and (at [9]) the fast
                                        // path's hand-offs, or nullptr (resolve_probe.cuh)
  int stop = 0;                         // 0 = run; 1..5 = every CTA returns at that stop
  bool general_only = false;            // the general kernel for every request
};

// The general kernel for every request (what the fast path hands over), with the production
// kernels (NoProbe; resolve_launch.cu): benchmarks compare the two paths in one session.
cudaError_t launch_resolve_general(const ResolveParams& p, const ResolveConfig& config,
                                   cudaStream_t stream);

// One resolve launch with the probe's kernels (PhaseProbe instantiations), or with the
// production kernels when the probe asks for no stamps and no stop (general_only alone).
cudaError_t launch_resolve_probe(const ResolveParams& p, const ResolveConfig& config,
                                 const ResolveProbe& probe, cudaStream_t stream);

// Whether the phase-probe kernels were compiled (CMake option HISPARSE_PROBE_KERNELS);
// without them launch_resolve_probe refuses stamps and stops (cudaErrorNotSupported).
bool has_probe_kernels();

}  // namespace hisparse
