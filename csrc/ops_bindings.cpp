// pybind11 bindings of the data-plane kernels: register_ops(m). Tensors arrive as integer
// addresses (tensor.data_ptr()) and the stream as an integer handle; every function returns
// after enqueueing its work (no synchronization) and releases the GIL while it launches.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse_ops.h"
#include "resolve_probe.h"

namespace py = pybind11;

namespace hisparse {
namespace {

template <typename T>
T* as_ptr(uint64_t addr) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(addr));
}

cudaStream_t as_stream(uint64_t handle) {
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(handle));
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("vllm_hisparse._C.") + what + ": " +
                             cudaGetErrorString(err));
  }
}

// resolve's inputs by name (Python: _C.ResolveParams(topk=..., ...)); addresses as ints.
template <typename T>
void def_address(py::class_<ResolveParams>& c, const char* name, T* ResolveParams::*field) {
  c.def_property(
      name, [field](const ResolveParams& p) { return reinterpret_cast<uintptr_t>(p.*field); },
      [field](ResolveParams& p, uint64_t addr) { p.*field = as_ptr<T>(addr); });
}

ResolveParams make_resolve_params(uint64_t topk, uint64_t token_rows, uint64_t residency,
                                  uint64_t host_blocks, uint64_t hot_blocks, uint64_t slot_pos,
                                  uint64_t lru, uint64_t out_rows, uint64_t miss_src,
                                  uint64_t miss_dst, uint64_t miss_count, uint64_t stats,
                                  uint64_t error, uint64_t error_host, int num_tokens, int k,
                                  int num_rows, int num_pages, int num_slots, int block_size) {
  ResolveParams p{};
  p.topk = as_ptr<const int32_t>(topk);
  p.token_rows = as_ptr<const int32_t>(token_rows);
  p.residency = as_ptr<const int32_t>(residency);
  p.host_blocks = as_ptr<const int32_t>(host_blocks);
  p.hot_blocks = as_ptr<const int32_t>(hot_blocks);
  p.slot_pos = as_ptr<int32_t>(slot_pos);
  p.lru = as_ptr<int16_t>(lru);
  p.out_rows = as_ptr<int32_t>(out_rows);
  p.miss_src = as_ptr<int32_t>(miss_src);
  p.miss_dst = as_ptr<int32_t>(miss_dst);
  p.miss_count = as_ptr<int32_t>(miss_count);
  p.stats = as_ptr<long long>(stats);
  p.error = as_ptr<int32_t>(error);
  p.error_host = as_ptr<int32_t>(error_host);
  p.num_tokens = num_tokens;
  p.k = k;
  p.num_rows = num_rows;
  p.num_pages = num_pages;
  p.num_slots = num_slots;
  p.block_size = block_size;
  return p;
}

ResolveConfig make_config(int threads, int max_tokens_per_request) {
  ResolveConfig c;
  c.threads = threads;
  c.max_tokens_per_request = max_tokens_per_request;
  return c;
}

void resolve_py(const ResolveParams& p, int threads, int max_tokens_per_request,
                uint64_t stream) {
  const ResolveConfig config = make_config(threads, max_tokens_per_request);
  cudaError_t err;
  {
    py::gil_scoped_release release;
    err = launch_resolve(p, config, as_stream(stream));
  }
  check(err, "resolve");
}

void resolve_probe_py(const ResolveParams& p, int threads, int max_tokens_per_request,
                      uint64_t stream, uint64_t times, int stop, bool general_only) {
  if (stop < 0 || stop > 5) throw std::invalid_argument("resolve_probe: stop must be in 0..5");
  if ((times != 0 || stop != 0) && !has_probe_kernels()) {
    throw std::runtime_error(
        "resolve_probe: phase stamps and stop points need the probe kernels; rebuild with "
        "-DHISPARSE_PROBE_KERNELS=ON (SKBUILD_CMAKE_DEFINE=\"HISPARSE_PROBE_KERNELS=ON\")");
  }
  ResolveProbe probe;
  probe.times = as_ptr<unsigned long long>(times);
  probe.stop = stop;
  probe.general_only = general_only;
  const ResolveConfig config = make_config(threads, max_tokens_per_request);
  cudaError_t err;
  {
    py::gil_scoped_release release;
    err = launch_resolve_probe(p, config, probe, as_stream(stream));
  }
  check(err, "resolve_probe");
}

py::dict resolve_info_py(int num_tokens, int k, int num_slots, int block_size, int num_pages,
                         int threads, int max_tokens_per_request) {
  const ResolveLaunchInfo info =
      resolve_launch_info(num_tokens, k, num_slots, block_size, num_pages,
                          make_config(threads, max_tokens_per_request));
  py::dict d;
  d["threads"] = info.threads;
  d["slots_per_thread"] = info.slots_per_thread;
  d["smem_bytes"] = info.smem_bytes;
  d["hash_capacity"] = info.hash_capacity;
  d["union_capacity"] = info.union_capacity;
  d["victim_capacity"] = info.victim_capacity;
  d["hot_blocks_in_smem"] = info.hot_blocks_in_smem;
  d["stage_pages"] = info.stage_pages;
  d["general_smem_bytes"] = info.general_smem_bytes;
  d["fast_path"] = static_cast<bool>(info.fast_path);
  d["fast_stage_pages"] = info.fast_stage_pages;
  return d;
}

void copy_rows_py(int mode, const std::vector<uint64_t>& src, const std::vector<uint64_t>& dst,
                  int row_bytes, long long src_rows, long long dst_rows, uint64_t a, uint64_t b,
                  uint64_t count, int n_outer, int n_inner, int rows_per_warp, int ctas_per_sm,
                  uint64_t stream, long long src_stride, long long dst_stride, int pair_major,
                  int max_ctas) {
  if (src.size() != dst.size()) throw std::invalid_argument("copy_rows: layer lists differ");
  if (row_bytes <= 0 || row_bytes % 16 != 0)
    throw std::invalid_argument("copy_rows: row_bytes must be a positive multiple of 16");
  for (long long stride : {src_stride, dst_stride}) {
    if (stride != 0 && (stride < row_bytes || stride % 16 != 0))
      throw std::invalid_argument(
          "copy_rows: a row stride must be 0 (dense) or a multiple of 16 that is >= row_bytes");
  }
  CopyTuning tuning;
  tuning.rows_per_warp = rows_per_warp;
  tuning.ctas_per_sm = ctas_per_sm;
  if (max_ctas < 0) throw std::invalid_argument("copy_rows: max_ctas must be >= 0");
  tuning.max_ctas = max_ctas;
  cudaError_t err = cudaSuccess;
  {
    py::gil_scoped_release release;
    for (size_t l0 = 0; l0 < src.size() && err == cudaSuccess; l0 += kMaxCopyLayers) {
      CopyParams p{};
      const size_t n = std::min(src.size() - l0, static_cast<size_t>(kMaxCopyLayers));
      for (size_t i = 0; i < n; ++i) {
        p.src[i] = src[l0 + i];
        p.dst[i] = dst[l0 + i];
      }
      p.num_layers = static_cast<int>(n);
      p.row_bytes = row_bytes;
      p.mode = mode;
      p.a = as_ptr<const int32_t>(a);
      p.b = as_ptr<const int32_t>(b);
      p.count = as_ptr<const int32_t>(count);
      p.n_outer = n_outer;
      p.n_inner = n_inner;
      p.src_rows = src_rows;
      p.dst_rows = dst_rows;
      p.src_stride = src_stride;
      p.dst_stride = dst_stride;
      p.pair_major = pair_major;
      err = launch_copy_rows(p, tuning, as_stream(stream));
    }
  }
  check(err, "copy_rows");
}

void score_threshold_py(uint64_t logits, uint64_t topk, uint64_t threshold, uint64_t width,
                        long long logits_stride, long long topk_stride, double width_units,
                        int rows, int cols, int k, int dtype, uint64_t stream) {
  ScoreThresholdParams p{};
  p.logits = as_ptr<const void>(logits);
  p.topk = as_ptr<const int32_t>(topk);
  p.threshold = as_ptr<float>(threshold);
  p.width = as_ptr<float>(width);
  p.logits_stride = logits_stride;
  p.topk_stride = topk_stride;
  p.width_units = width_units;
  p.rows = rows;
  p.cols = cols;
  p.k = k;
  p.dtype = dtype;
  cudaError_t err;
  {
    py::gil_scoped_release release;
    err = launch_score_threshold(p, as_stream(stream));
  }
  check(err, "score_threshold");
}

void slot_classes_py(uint64_t logits, uint64_t threshold, uint64_t width,
                     uint64_t batch_state_rows, uint64_t slot_pos, uint64_t slot_class,
                     long long logits_stride, int requests, int next_n, int cols, int num_rows,
                     int num_slots, int dtype, uint64_t stream) {
  SlotClassesParams p{};
  p.logits = as_ptr<const void>(logits);
  p.threshold = as_ptr<const float>(threshold);
  p.width = as_ptr<const float>(width);
  p.batch_state_rows = as_ptr<const int32_t>(batch_state_rows);
  p.slot_pos = as_ptr<const int32_t>(slot_pos);
  p.slot_class = as_ptr<uint8_t>(slot_class);
  p.logits_stride = logits_stride;
  p.requests = requests;
  p.next_n = next_n;
  p.cols = cols;
  p.num_rows = num_rows;
  p.num_slots = num_slots;
  p.dtype = dtype;
  cudaError_t err;
  {
    py::gil_scoped_release release;
    err = launch_slot_classes(p, as_stream(stream));
  }
  check(err, "slot_classes");
}

py::dict host_alloc_py(size_t bytes, int mode) {
  HostAllocation a;
  {
    py::gil_scoped_release release;
    a = host_alloc_registered(bytes, mode);
  }
  py::dict d;
  d["ptr"] = reinterpret_cast<uintptr_t>(a.ptr);
  d["bytes"] = a.bytes;
  d["mode"] = a.mode;
  d["huge_requested_ok"] = a.huge_requested_ok;
  d["cuda_error"] = a.cuda_error;
  d["message"] = std::string(a.message);
  return d;
}

void spin_py(uint64_t nanoseconds, int ctas, bool busy, uint64_t stream) {
  check(launch_spin(nanoseconds, ctas, busy, as_stream(stream)), "spin");
}

void token_state_rows_py(uint64_t batch_rows, bool batch_rows_64, uint64_t step_table,
                         uint64_t out, int num_tokens, int num_batch_rows, int limit,
                         uint64_t stream) {
  check(launch_token_state_rows(as_ptr<const void>(batch_rows), batch_rows_64,
                                as_ptr<const int32_t>(step_table), as_ptr<int32_t>(out),
                                num_tokens, num_batch_rows, limit, as_stream(stream)),
        "token_state_rows");
}

// The fields merge_rows and merge_table_rows share.
MergeRowsParams merge_params(uint64_t ours, uint64_t token_rows, uint64_t out, uint64_t counts,
                             int num_tokens, int k, int from_stride_rows, int to_stride_rows) {
  MergeRowsParams p{};
  p.ours = as_ptr<const int32_t>(ours);
  p.token_rows = as_ptr<const int32_t>(token_rows);
  p.out = as_ptr<int32_t>(out);
  p.counts = as_ptr<int32_t>(counts);
  p.num_tokens = num_tokens;
  p.k = k;
  p.from_stride_rows = from_stride_rows;
  p.to_stride_rows = to_stride_rows;
  return p;
}

void merge_rows_py(uint64_t ours, uint64_t token_rows, uint64_t theirs, uint64_t out,
                   uint64_t counts, int num_tokens, int k, int from_stride_rows,
                   int to_stride_rows, uint64_t stream) {
  MergeRowsParams p = merge_params(ours, token_rows, out, counts, num_tokens, k,
                                   from_stride_rows, to_stride_rows);
  p.theirs = as_ptr<const int32_t>(theirs);
  check(launch_merge_rows(p, as_stream(stream)), "merge_rows");
}

void merge_table_rows_py(uint64_t ours, uint64_t token_rows, uint64_t topk, uint64_t batch_rows,
                         uint64_t block_table, int table_rows, int table_cols,
                         long long table_stride, int block_size, uint64_t out, uint64_t counts,
                         int num_tokens, int k, int from_stride_rows, int to_stride_rows,
                         uint64_t stream) {
  MergeRowsParams p = merge_params(ours, token_rows, out, counts, num_tokens, k,
                                   from_stride_rows, to_stride_rows);
  p.topk = as_ptr<const int32_t>(topk);
  p.batch_rows = as_ptr<const int32_t>(batch_rows);
  p.block_table = as_ptr<const int32_t>(block_table);
  p.table_rows = table_rows;
  p.table_cols = table_cols;
  p.table_stride = table_stride;
  p.block_size = block_size;
  check(launch_merge_rows(p, as_stream(stream)), "merge_table_rows");
}

int host_free_py(uint64_t ptr, size_t bytes) {
  py::gil_scoped_release release;
  return host_free_registered(as_ptr<void>(ptr), bytes);
}

}  // namespace
}  // namespace hisparse

void register_ops(py::module_& m) {
  using namespace hisparse;
  m.attr("has_data_plane") = true;
  m.attr("has_probe_kernels") = has_probe_kernels();
  m.attr("COPY_PLAN") = static_cast<int>(kCopyPlan);
  m.attr("COPY_PAIRS") = static_cast<int>(kCopyPairs);
  m.attr("COPY_BLOCKS") = static_cast<int>(kCopyBlocks);
  m.attr("MAX_COPY_LAYERS") = kMaxCopyLayers;
  py::class_<ResolveParams> params(m, "ResolveParams",
                                   "resolve's tensors (addresses as ints) and sizes, by name");
  params.def(py::init(&make_resolve_params), py::kw_only(), py::arg("topk"),
             py::arg("token_rows"), py::arg("residency"), py::arg("host_blocks"),
             py::arg("hot_blocks"), py::arg("slot_pos"), py::arg("lru"), py::arg("out_rows"),
             py::arg("miss_src"), py::arg("miss_dst"), py::arg("miss_count"), py::arg("stats"),
             py::arg("error"), py::arg("error_host"), py::arg("num_tokens"), py::arg("k"),
             py::arg("num_rows"), py::arg("num_pages"), py::arg("num_slots"),
             py::arg("block_size"));
  def_address(params, "topk", &ResolveParams::topk);
  def_address(params, "token_rows", &ResolveParams::token_rows);
  def_address(params, "residency", &ResolveParams::residency);
  def_address(params, "host_blocks", &ResolveParams::host_blocks);
  def_address(params, "hot_blocks", &ResolveParams::hot_blocks);
  def_address(params, "slot_pos", &ResolveParams::slot_pos);
  def_address(params, "lru", &ResolveParams::lru);
  def_address(params, "out_rows", &ResolveParams::out_rows);
  def_address(params, "miss_src", &ResolveParams::miss_src);
  def_address(params, "miss_dst", &ResolveParams::miss_dst);
  def_address(params, "miss_count", &ResolveParams::miss_count);
  def_address(params, "stats", &ResolveParams::stats);
  def_address(params, "slot_class", &ResolveParams::slot_class);
  def_address(params, "error", &ResolveParams::error);
  def_address(params, "error_host", &ResolveParams::error_host);
  params.def_readwrite("num_tokens", &ResolveParams::num_tokens)
      .def_readwrite("k", &ResolveParams::k)
      .def_readwrite("num_rows", &ResolveParams::num_rows)
      .def_readwrite("num_pages", &ResolveParams::num_pages)
      .def_readwrite("num_slots", &ResolveParams::num_slots)
      .def_readwrite("block_size", &ResolveParams::block_size);
  m.def("resolve", &resolve_py, "Launch resolve (docs/design.md, \"resolve\") on `stream`.",
        py::arg("params"), py::kw_only(), py::arg("threads"), py::arg("max_tokens_per_request"),
        py::arg("stream"));
  m.def("resolve_probe", &resolve_probe_py,
        "Benchmarks and tests only: resolve with phase stamps into `times` (int64 [10] "
        "address or 0), every CTA stopping at `stop` (0 = none) and/or the general kernel "
        "for every request.",
        py::arg("params"), py::kw_only(), py::arg("threads"), py::arg("max_tokens_per_request"),
        py::arg("stream"), py::arg("times") = 0, py::arg("stop") = 0,
        py::arg("general_only") = false);
  m.def("resolve_launch_info", &resolve_info_py, py::arg("num_tokens"), py::arg("k"),
        py::arg("num_slots"), py::arg("block_size"), py::arg("num_pages"), py::kw_only(),
        py::arg("threads"), py::arg("max_tokens_per_request"));
  m.def("copy_rows", &copy_rows_py, "Launch a multi-layer row copy (plan, pairs or blocks).",
        py::arg("mode"), py::arg("src"), py::arg("dst"), py::arg("row_bytes"),
        py::arg("src_rows"), py::arg("dst_rows"), py::arg("a"), py::arg("b"), py::arg("count"),
        py::arg("n_outer"), py::arg("n_inner"), py::arg("rows_per_warp") = 0,
        py::arg("ctas_per_sm") = 0, py::arg("stream") = 0, py::arg("src_stride") = 0,
        py::arg("dst_stride") = 0, py::arg("pair_major") = 1, py::arg("max_ctas") = 0);
  m.def("token_state_rows", &token_state_rows_py,
        "Launch the token -> state row lookup of a step (int32 out [T]).", py::arg("batch_rows"),
        py::arg("batch_rows_64"), py::arg("step_table"), py::arg("out"), py::arg("num_tokens"),
        py::arg("num_batch_rows"), py::arg("limit"), py::arg("stream"));
  m.def("merge_rows", &merge_rows_py,
        "Launch merge + translate (+ compaction when `counts` != 0) of a top-k conversion.",
        py::arg("ours"), py::arg("token_rows"), py::arg("theirs"), py::arg("out"),
        py::arg("counts"), py::arg("num_tokens"), py::arg("k"), py::arg("from_stride_rows"),
        py::arg("to_stride_rows"), py::arg("stream"));
  m.def("merge_table_rows", &merge_table_rows_py,
        "Launch merge_rows with vLLM's rows computed from its block table (table mode).",
        py::arg("ours"), py::arg("token_rows"), py::arg("topk"), py::arg("batch_rows"),
        py::arg("block_table"), py::arg("table_rows"), py::arg("table_cols"),
        py::arg("table_stride"), py::arg("block_size"), py::arg("out"), py::arg("counts"),
        py::arg("num_tokens"), py::arg("k"), py::arg("from_stride_rows"),
        py::arg("to_stride_rows"), py::arg("stream"));
  m.attr("SCORE_SUM_LANES") = kScoreSumLanes;
  m.attr("NUM_SCORE_CLASSES") = kNumScoreClasses;
  m.attr("SCORE_FLOAT32") = static_cast<int>(kScoreFloat32);
  m.attr("SCORE_BFLOAT16") = static_cast<int>(kScoreBFloat16);
  m.def("score_threshold", &score_threshold_py,
        "Launch score_threshold (ops/reference_scores.py) on `stream`.", py::arg("logits"),
        py::arg("topk"), py::arg("threshold"), py::arg("width"), py::arg("logits_stride"),
        py::arg("topk_stride"), py::arg("width_units"), py::arg("rows"), py::arg("cols"),
        py::arg("k"), py::arg("dtype"), py::arg("stream"));
  m.def("slot_classes", &slot_classes_py,
        "Launch slot_classes (ops/reference_scores.py) on `stream`.", py::arg("logits"),
        py::arg("threshold"), py::arg("width"), py::arg("batch_state_rows"),
        py::arg("slot_pos"), py::arg("slot_class"), py::arg("logits_stride"),
        py::arg("requests"), py::arg("next_n"), py::arg("cols"), py::arg("num_rows"),
        py::arg("num_slots"), py::arg("dtype"), py::arg("stream"));
  m.def("host_alloc_registered", &host_alloc_py,
        "mmap + (THP | MAP_HUGETLB | 4 KiB) + cudaHostRegister; mode 0/1/2.", py::arg("bytes"),
        py::arg("mode"));
  m.def("host_free_registered", &host_free_py, py::arg("ptr"), py::arg("bytes"));
  m.def("spin", &spin_py, "Benchmarks only: `ctas` 1-thread CTAs that wait `nanoseconds` of "
        "the GPU's global timer on `stream` (`busy`: without sleeping).",
        py::arg("nanoseconds"), py::arg("ctas"), py::arg("busy"), py::arg("stream"));
}
