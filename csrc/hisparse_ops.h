// Host-side interface of the data-plane kernels (docs/design.md, "Op contracts"). No torch headers: every
// tensor crosses as a raw pointer, every launch goes on the stream it is given, nothing
// allocates and nothing synchronizes, so each launch can be captured in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace hisparse {

// ---------------------------------------------------------------------------------------
// resolve (docs/design.md, "resolve")
// ---------------------------------------------------------------------------------------

// Error codes written into the 4-word device error record (code, state_row, a, b).
// 1..7 match vllm_hisparse.ops.errors.ResolveErrorCode; 8..9 are limits of the kernel.
enum ResolveErrorCode : int32_t {
  kErrOk = 0,
  kErrPositionOutOfRange = 1,  // [position, P * bs]
  kErrNoHostBlock = 2,         // [position, page]
  kErrHotOverflow = 3,         // [num_host_backed, leased slots]
  kErrNotContiguous = 4,       // [token, first token of the earlier run]
  kErrHotBlockMissing = 5,     // [slot, position]: a hit on a slot whose hot block is -1
  kErrDuplicateSlot = 6,       // [position, lowest slot holding it]
  kErrStateRowOutOfRange = 7,  // [state_row, R]
  kErrUnionCapacity = 8,       // [distinct positions seen, hash capacity]
  kErrCorruptLru = 9,          // [lru value, D]
};

struct ResolveParams {
  const int32_t* topk;         // [T, K]
  const int32_t* token_rows;   // [T]
  const int32_t* residency;    // [R, P]
  const int32_t* host_blocks;  // [R, P]
  const int32_t* hot_blocks;   // [R, D / bs]
  int32_t* slot_pos;           // [R, D]   IN/OUT
  int16_t* lru;                // [R, D]   IN/OUT
  int32_t* out_rows;           // [T, K]
  int32_t* miss_src;           // [T, K]
  int32_t* miss_dst;           // [T, K]
  int32_t* miss_count;         // [T]
  long long* stats;            // [3] or nullptr
  const uint8_t* slot_class;   // [R, D] eviction class per slot (0 first, > 3 = 3) or nullptr
  int32_t* error;              // [4] device error record, sticky until cleared
  int32_t* error_host;         // [4] pinned host mirror written by the kernel (or nullptr)
  int num_tokens;              // T
  int k;                       // K
  int num_rows;                // R
  int num_pages;               // P
  int num_slots;               // D
  int block_size;              // bs
  int hash_capacity;           // entries of the shared-memory hash table (physical size)
  int union_capacity;          // distinct positions one request may insert (the
                               // kErrUnionCapacity bound, <= hash_capacity)
  int victim_capacity;         // entries of the shared-memory victim list
  int hot_blocks_in_smem;      // D / bs when the hot_blocks row is staged in shared memory
  int stage_pages;             // P when the request's residency and host_blocks rows are
                               // staged in shared memory, else 0; set by launch_resolve
  int fast_stage_pages;        // the fast path's staged page rows (P or 0), set by launch_resolve
};

// Launch choices of resolve: the tuning carried by the ops backend object
// (vllm_hisparse.ops.select(...)); the defaults are the measured best (docs/kernels.md).
struct ResolveConfig {
  int threads = 0;                 // 0 = default (1024); 512 = 512 threads per CTA when D <= 8192
  int max_tokens_per_request = 4;  // bounds the union one CTA's hash holds (kErrUnionCapacity)
};

struct ResolveLaunchInfo {
  int threads;           // threads per CTA
  int slots_per_thread;  // D handled per thread in the LRU pass
  size_t smem_bytes;     // dynamic shared memory per CTA
  int hash_capacity;     // physical hash entries (up to 4 per selection of the bound)
  int union_capacity;    // kErrUnionCapacity bound: 1.5 entries per selection of the bound
  int victim_capacity;
  int hot_blocks_in_smem;
  int stage_pages;       // P when residency / host_blocks rows are staged (num_pages given)
  size_t general_smem_bytes;  // dynamic shared memory of the general kernel alone
  int fast_path;         // 1: the fast-path kernel is launched (when the rows are aligned)
  int fast_kpt;          // its selections per thread
  int fast_spt;          // its slots per thread
  int fast_stage_pages;  // P when the fast path stages the residency / host_blocks rows
};

// Shared-memory plan for a launch of T = num_tokens tokens. num_pages: P, to decide whether
// the request's page rows are staged (0 = unknown: not staged).
ResolveLaunchInfo resolve_launch_info(int num_tokens, int k, int num_slots, int block_size,
                                      int num_pages, const ResolveConfig& config);

// Launches one CTA per token (non-leading tokens of a request exit at once): the fast-path
// kernel when the shape allows it (it hands what it cannot take to the general path), else
// the general kernel. Returns a CUDA error code (cudaSuccess on success); never synchronizes.
// The probe entry point for benchmarks is launch_resolve_probe (resolve_probe.h).
cudaError_t launch_resolve(const ResolveParams& p, const ResolveConfig& config,
                           cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// score classes (score-aware eviction; contract: vllm_hisparse/ops/reference_scores.py)
// ---------------------------------------------------------------------------------------

constexpr int kScoreSumLanes = 256;   // core.trace.SCORE_SUM_LANES: the float64 sum's order
constexpr int kNumScoreClasses = 4;   // core.trace.NUM_SCORE_CLASSES: edges thr - c w, c 1..3

enum ScoreDtype : int32_t {
  kScoreFloat32 = 0,
  kScoreBFloat16 = 1,
};

struct ScoreThresholdParams {
  const void* logits;         // [rows, cols] float32 or bf16, row stride logits_stride
  const int32_t* topk;        // [rows, k], row stride topk_stride; outside [0, cols) = padding
  float* threshold;           // [rows] OUT lowest finite selected score (+inf: none)
  float* width;               // [rows] OUT class width (>= FLT_MIN)
  long long logits_stride;    // elements between rows
  long long topk_stride;
  double width_units;         // core.trace.SCORE_CLASS_WIDTH
  int rows;
  int cols;                   // W
  int k;                      // K
  int dtype;                  // ScoreDtype
};

struct SlotClassesParams {
  const void* logits;             // [requests * next_n, cols], row stride logits_stride
  const float* threshold;         // [requests * next_n]
  const float* width;             // [requests * next_n]
  const int32_t* batch_state_rows;  // [>= requests]; outside [0, num_rows): skipped
  const int32_t* slot_pos;        // [num_rows, num_slots]; outside [0, cols): class 0
  uint8_t* slot_class;            // [num_rows, num_slots] OUT (the requests' rows only)
  long long logits_stride;
  int requests;
  int next_n;
  int cols;
  int num_rows;                   // R
  int num_slots;                  // D
  int dtype;                      // ScoreDtype
};

// One launch of kScoreSumLanes threads per row (rows == 0: nothing launched). Returns
// cudaErrorInvalidValue for an inconsistent shape; never synchronizes.
cudaError_t launch_score_threshold(const ScoreThresholdParams& p, cudaStream_t stream);
// One launch, a CTA per (request, chunk of 1024 slots) (no request or no slot: nothing).
cudaError_t launch_slot_classes(const SlotClassesParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// row copies (docs/design.md, "Copies"): gather (miss plan), mirror (row pairs), page copies (blocks)
// ---------------------------------------------------------------------------------------

constexpr int kMaxCopyLayers = 64;  // per launch; the wrapper splits longer lists

enum CopyMode : int32_t {
  kCopyPlan = 0,    // a = miss_src [T,K], b = miss_dst [T,K], count = miss_count [T]
  kCopyPairs = 1,   // a = src_rows [N],   b = dst_rows [N]      (-1 in either: skip)
  kCopyBlocks = 2,  // a = src_blocks [N], b = dst_blocks [N], n_inner = block_size
};

struct CopyParams {
  uint64_t src[kMaxCopyLayers];  // base address of each source layer (UVA)
  uint64_t dst[kMaxCopyLayers];  // base address of each destination layer
  int num_layers;
  int row_bytes;                 // a multiple of 16
  int mode;                      // CopyMode
  const int32_t* a;
  const int32_t* b;
  const int32_t* count;
  int n_outer;                   // plan: T; pairs/blocks: N
  int n_inner;                   // plan: K; pairs: 1; blocks: block_size
  long long src_rows;            // rows of each source layer (ids outside are skipped)
  long long dst_rows;            // rows of each destination layer
  long long src_stride;          // bytes between consecutive rows of a source layer: 0 or
                                 // row_bytes for a dense layer, else a multiple of 16 that is
                                 // >= row_bytes (row-strided views, e.g. a position-major pool)
  long long dst_stride;          // same for the destination layers
  int pair_major;                // 1: item = pair * L + layer (all layers of a row together,
                                 //    the default); 0: item = layer * pairs + pair
};

struct CopyTuning {
  int rows_per_warp = 0;  // 1, 2, 4, 8 or 16 rows in flight per warp; 0 = default for the size
  int threads = 256;      // threads per CTA
  int ctas_per_sm = 0;    // grid cap = SMs * ctas_per_sm; 0 = default
  int max_ctas = 0;       // a further cap on the whole grid, 0 = none: a copy that runs beside
                          // compute (side stream) keeps to a few SMs, so its long-latency host
                          // loads do not hold the memory pipeline of every SM
};

cudaError_t launch_copy_rows(const CopyParams& p, const CopyTuning& tuning,
                             cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// finishing a top-k conversion (docs/kernels.md "Finishing a conversion")
// ---------------------------------------------------------------------------------------

// out[t] = step_table[1 + batch_rows[t]] when 0 <= batch_rows[t] < num_batch_rows,
// t < step_table[0] and t < limit; else -1. batch_rows is int32 [T] (int64 when
// batch_rows_64), step_table int32 [1 + num_batch_rows], out int32 [T].
cudaError_t launch_token_state_rows(const void* batch_rows, bool batch_rows_64,
                                    const int32_t* step_table, int32_t* out, int num_tokens,
                                    int num_batch_rows, int limit, cudaStream_t stream);

struct MergeRowsParams {
  const int32_t* ours;        // [T, K] flat rows in the from_stride_rows space (-1 = none)
  const int32_t* token_rows;  // [T] >= 0: the token takes `ours`, else `theirs`
  const int32_t* theirs;      // [T, K] rows already in the target space
  int32_t* out;               // [T, K] must not overlap the inputs
  int32_t* counts;            // [T] or nullptr: with counts, valid (>= 0) entries are moved
                              // to the front in their order, -1 after, counts[t] = how many
  int num_tokens;             // T
  int k;                      // K
  int from_stride_rows;       // rows between device blocks in `ours`
  int to_stride_rows;         // rows between device blocks in the target space
  // Table mode (theirs == nullptr): an untracked token's rows are vLLM's decode conversion
  // computed here, block_table[batch_rows[t], pos / block_size] * to_stride_rows
  // + pos % block_size, -1 for pos < 0, a page at or past table_cols or a batch row outside
  // [0, table_rows).
  const int32_t* topk;        // [T, K] request-relative positions (-1 = none)
  const int32_t* batch_rows;  // [T] batch row of each token
  const int32_t* block_table; // [table_rows, table_cols], rows table_stride entries apart
  int table_rows;
  int table_cols;
  long long table_stride;
  int block_size;
};

// One CTA per token: merge, translate (block * to + offset) and optionally compact.
cudaError_t launch_merge_rows(const MergeRowsParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// host memory helper (huge-page experiment of the benchmarks and the worker's host pool)
// ---------------------------------------------------------------------------------------

struct HostAllocation {
  void* ptr = nullptr;
  size_t bytes = 0;
  int mode = 0;           // requested: 0 = 4 KiB pages, 1 = THP (madvise), 2 = MAP_HUGETLB
  bool huge_requested_ok = false;  // madvise / mmap flag accepted
  int cuda_error = 0;     // cudaHostRegister result
  char message[256] = {0};
};

HostAllocation host_alloc_registered(size_t bytes, int mode);
int host_free_registered(void* ptr, size_t bytes);

// ---------------------------------------------------------------------------------------
// wall-clock spin (benchmarks: a stand-in for work of a known duration, e.g. expert-parallel
// communication, that holds one SM and does not stretch when the SM clock drops)
// ---------------------------------------------------------------------------------------

// `ctas` CTAs of one thread each that return once `nanoseconds` of the GPU's global timer
// have passed since they started; `busy` polls without sleeping (keeps the SMs issuing, so
// the GPU's clocks stay up). Capturable; no allocation.
cudaError_t launch_spin(uint64_t nanoseconds, int ctas, bool busy, cudaStream_t stream);

}  // namespace hisparse
