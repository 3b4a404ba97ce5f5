// Page-locked host memory with a chosen page size: mmap (+ madvise(MADV_HUGEPAGE) or
// MAP_HUGETLB), touch every page, then cudaHostRegister(Mapped | Portable) so GPU threads can
// read it over UVA. Used by the huge-page benchmark and available to the worker's host pool.
#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

#include "hisparse_ops.h"

namespace hisparse {

namespace {
constexpr size_t kHuge = 2u << 20;
}

HostAllocation host_alloc_registered(size_t bytes, int mode) {
  HostAllocation a;
  a.mode = mode;
  a.bytes = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = MAP_FAILED;
  if (mode == 2) {
#ifdef MAP_HUGETLB
    p = mmap(nullptr, a.bytes, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p == MAP_FAILED) {
      std::snprintf(a.message, sizeof(a.message), "mmap(MAP_HUGETLB) failed: %s",
                    std::strerror(errno));
      return a;
    }
    a.huge_requested_ok = true;
#else
    std::snprintf(a.message, sizeof(a.message), "MAP_HUGETLB is not defined here");
    return a;
#endif
  } else {
    // Over-allocate by 2 MiB so the region can start on a 2 MiB boundary (THP needs it).
    const size_t span = a.bytes + kHuge;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      std::snprintf(a.message, sizeof(a.message), "mmap failed: %s", std::strerror(errno));
      return a;
    }
    const uintptr_t start = (reinterpret_cast<uintptr_t>(raw) + kHuge - 1) & ~(kHuge - 1);
    const size_t head = start - reinterpret_cast<uintptr_t>(raw);
    if (head) munmap(raw, head);
    const size_t tail = span - head - a.bytes;
    if (tail) munmap(reinterpret_cast<char*>(start) + a.bytes, tail);
    p = reinterpret_cast<void*>(start);
#ifdef MADV_HUGEPAGE
    if (mode == 1) {
      a.huge_requested_ok = madvise(p, a.bytes, MADV_HUGEPAGE) == 0;
      if (!a.huge_requested_ok)
        std::snprintf(a.message, sizeof(a.message), "madvise(MADV_HUGEPAGE) failed: %s",
                      std::strerror(errno));
    } else {
#ifdef MADV_NOHUGEPAGE
      madvise(p, a.bytes, MADV_NOHUGEPAGE);
#endif
    }
#endif
  }
  // Fault every page in now (the registration pins what is there).
  std::memset(p, 0, a.bytes);
  const cudaError_t err =
      cudaHostRegister(p, a.bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  a.cuda_error = static_cast<int>(err);
  if (err != cudaSuccess) {
    std::snprintf(a.message, sizeof(a.message), "cudaHostRegister failed: %s",
                  cudaGetErrorString(err));
    munmap(p, a.bytes);
    return a;
  }
  a.ptr = p;
  return a;
}

int host_free_registered(void* ptr, size_t bytes) {
  if (ptr == nullptr) return 0;
  const cudaError_t err = cudaHostUnregister(ptr);
  munmap(ptr, bytes);
  return static_cast<int>(err);
}

}  // namespace hisparse
