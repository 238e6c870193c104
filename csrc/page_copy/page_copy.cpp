// CPU page copy between two page-major pools, and the op registration for
// torch.ops.pdserve.copy_pages (CPU here, CUDA too when built with
// PDSERVE_WITH_CUDA; the CUDA kernel is in page_copy.cu).
//
// The copy: validate (plan_page_copy) -> merge runs of consecutive src and dst
// page ids into one memcpy each -> cut the concatenated runs into equal byte
// shares, one per thread, so one large page also spreads over the threads.
#include "page_copy.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "compile with -fopenmp: without it at::parallel_for runs on one thread"
#endif

namespace pdserve {
namespace {

// Each thread gets at least this many bytes; smaller copies stay on the
// calling thread, where waking a worker would cost about as much as the copy.
constexpr int64_t kMinBytesPerThread = 128 * 1024;
constexpr int64_t kShareAlign = 4096;  // thread shares start on 4 KiB boundaries

struct Pool {
  char* base;
  int64_t num_pages;
  int64_t page_bytes;
  int64_t stride;  // bytes between consecutive pages
  int64_t elem;    // element size in bytes
};

Pool describe_pool(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), name, " is an undefined tensor");
  TORCH_CHECK(t.dim() >= 1, name, " needs a page dim (dim 0); got a 0-d tensor");
  const int64_t elem = static_cast<int64_t>(t.element_size());
  int64_t page_numel = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(
        t.size(d) == 1 || t.stride(d) == page_numel,
        name, " pages are not contiguous: dim ", d, " has stride ", t.stride(d),
        " where a contiguous page needs ", page_numel, " (sizes ", t.sizes(),
        ", strides ", t.strides(), "); a view that keeps a strided part of each "
        "page, like pool[:, :, layer] of a [pages, 2, layers, ...] pool, is not page-contiguous");
    page_numel *= t.size(d);
  }
  Pool p{static_cast<char*>(t.data_ptr()), t.size(0), page_numel * elem,
         t.stride(0) * elem, elem};
  TORCH_CHECK(
      p.num_pages <= 1 || p.page_bytes == 0 || p.stride >= p.page_bytes,
      name, " pages overlap: dim 0 stride is ", p.stride, " bytes but a page is ",
      p.page_bytes, " bytes");
  return p;
}

at::Tensor checked_index(const at::Tensor& idx, const char* name, int64_t num_pages) {
  TORCH_CHECK(idx.defined(), name, " is an undefined tensor");
  TORCH_CHECK(idx.device().is_cpu(), name, " must be a CPU tensor; got one on ", idx.device());
  TORCH_CHECK(idx.scalar_type() == at::kLong, name, " must be int64; got ", idx.scalar_type());
  TORCH_CHECK(idx.dim() == 1, name, " must be 1-D; got shape ", idx.sizes());
  at::Tensor c = idx.contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < c.numel(); ++i) {
    TORCH_CHECK(
        p[i] >= 0 && p[i] < num_pages,
        name, "[", i, "] = ", p[i], " is out of range for a pool of ", num_pages, " pages");
  }
  return c;
}

std::vector<int64_t> sorted_copy(const at::Tensor& idx) {
  const int64_t* p = idx.const_data_ptr<int64_t>();
  std::vector<int64_t> v(p, p + idx.numel());
  if (!std::is_sorted(v.begin(), v.end())) {
    std::sort(v.begin(), v.end());
  }
  return v;
}

// Each dst page is written once, and no dst page shares bytes with a src page:
// otherwise the result would depend on the order the threads copy in.
void check_disjoint(const Pool& s, const Pool& d, const PageCopyPlan& plan) {
  const std::vector<int64_t> dst_ids = sorted_copy(plan.dst_idx);
  const auto dup = std::adjacent_find(dst_ids.begin(), dst_ids.end());
  TORCH_CHECK(
      dup == dst_ids.end(),
      "dst_idx repeats page ", *dup, "; each dst page may be written once per call");

  const auto lo = [](const Pool& p) { return reinterpret_cast<uintptr_t>(p.base); };
  const auto hi = [&](const Pool& p) {
    return lo(p) + static_cast<uintptr_t>((p.num_pages - 1) * p.stride + p.page_bytes);
  };
  if (hi(s) <= lo(d) || hi(d) <= lo(s)) {
    return;  // the pools do not share memory
  }
  // Page addresses grow with the id (stride >= page_bytes > 0), so sorted ids
  // give sorted addresses; a dst page at b overlaps a src page at a iff
  // |a - b| < page_bytes.
  std::vector<uintptr_t> src_addr;
  for (int64_t id : sorted_copy(plan.src_idx)) {
    src_addr.push_back(lo(s) + static_cast<uintptr_t>(id * s.stride));
  }
  const auto pb = static_cast<uintptr_t>(s.page_bytes);
  for (int64_t id : dst_ids) {
    const uintptr_t b = lo(d) + static_cast<uintptr_t>(id * d.stride);
    const auto it = std::lower_bound(src_addr.begin(), src_addr.end(), b + 1 > pb ? b + 1 - pb : 0);
    TORCH_CHECK(
        it == src_addr.end() || *it >= b + pb,
        "dst page ", id, " overlaps a src page in memory (src and dst share storage); "
        "copy between disjoint pages");
  }
}

struct Run {
  int64_t src_off;  // bytes from plan.src
  int64_t dst_off;
  int64_t bytes;
};

// Consecutive ids in both lists become one run when both pools are dense
// (page i + 1 starts where page i ends).
std::vector<Run> merge_runs(const PageCopyPlan& plan) {
  const bool dense = plan.src_stride == plan.page_bytes && plan.dst_stride == plan.page_bytes;
  const int64_t* si = plan.src_idx.const_data_ptr<int64_t>();
  const int64_t* di = plan.dst_idx.const_data_ptr<int64_t>();
  std::vector<Run> runs;
  for (int64_t i = 0; i < plan.n; ++i) {
    if (dense && i > 0 && si[i] == si[i - 1] + 1 && di[i] == di[i - 1] + 1) {
      runs.back().bytes += plan.page_bytes;
    } else {
      runs.push_back({si[i] * plan.src_stride, di[i] * plan.dst_stride, plan.page_bytes});
    }
  }
  return runs;
}

// Copies bytes [begin, end) of the runs laid end to end; starts[r] is the
// position of run r in that concatenation.
void copy_share(
    const PageCopyPlan& plan,
    const std::vector<Run>& runs,
    const std::vector<int64_t>& starts,
    int64_t begin,
    int64_t end) {
  if (begin >= end) {
    return;
  }
  size_t r = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  while (begin < end) {
    const Run& run = runs[r];
    const int64_t within = begin - starts[r];
    const int64_t bytes = std::min(run.bytes - within, end - begin);
    std::memcpy(plan.dst + run.dst_off + within, plan.src + run.src_off + within, bytes);
    begin += bytes;
    ++r;
  }
}

}  // namespace

PageCopyPlan plan_page_copy(
    const at::Tensor& src,
    const at::Tensor& dst,
    const at::Tensor& src_idx,
    const at::Tensor& dst_idx) {
  const Pool s = describe_pool(src, "src");
  const Pool d = describe_pool(dst, "dst");
  TORCH_CHECK(
      s.elem == d.elem, "src and dst element sizes differ: ", src.scalar_type(), " (", s.elem,
      " bytes) vs ", dst.scalar_type(), " (", d.elem, " bytes)");
  TORCH_CHECK(
      s.page_bytes == d.page_bytes, "src and dst pages differ in size: ", s.page_bytes,
      " bytes (src shape ", src.sizes(), ") vs ", d.page_bytes, " bytes (dst shape ",
      dst.sizes(), ")");
  PageCopyPlan plan;
  plan.src_idx = checked_index(src_idx, "src_idx", s.num_pages);
  plan.dst_idx = checked_index(dst_idx, "dst_idx", d.num_pages);
  TORCH_CHECK(
      plan.src_idx.numel() == plan.dst_idx.numel(), "src_idx and dst_idx differ in length: ",
      plan.src_idx.numel(), " vs ", plan.dst_idx.numel());
  plan.src = s.base;
  plan.dst = d.base;
  plan.page_bytes = s.page_bytes;
  plan.src_stride = s.stride;
  plan.dst_stride = d.stride;
  plan.n = plan.src_idx.numel();
  if (plan.n > 0 && plan.page_bytes > 0) {
    check_disjoint(s, d, plan);
  }
  return plan;
}

void copy_pages_cpu(
    const at::Tensor& src,
    const at::Tensor& dst,
    const at::Tensor& src_idx,
    const at::Tensor& dst_idx,
    int64_t num_threads) {
  TORCH_CHECK(
      src.device().is_cpu() && dst.device().is_cpu(),
      "copy_pages: the CPU kernel needs src and dst on the CPU; got src on ", src.device(),
      " and dst on ", dst.device());
  TORCH_CHECK(num_threads >= 1, "copy_pages: num_threads must be >= 1; got ", num_threads);
  const PageCopyPlan plan = plan_page_copy(src, dst, src_idx, dst_idx);
  if (plan.n == 0 || plan.page_bytes == 0) {
    return;
  }
  const std::vector<Run> runs = merge_runs(plan);
  std::vector<int64_t> starts(runs.size());
  int64_t total = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    starts[r] = total;
    total += runs[r].bytes;
  }

  // NOTE: the threads are torch's intra-op pool (OpenMP in this build), as for
  // any torch CPU op: its workers spin briefly between regions, so a copy
  // after other torch work starts without waking sleeping threads (starting a
  // std::thread per call cost more than copying 1 MiB). A call from a second
  // Python thread while the first runs torch ops gets a second team of
  // workers: pass a small num_threads there to leave cores to the first.
  const int64_t nt = std::max<int64_t>(
      1, std::min({num_threads, static_cast<int64_t>(at::get_num_threads()), total / kMinBytesPerThread}));
  const auto share_begin = [&](int64_t t) {
    return t >= nt ? total : (total * t / nt) / kShareAlign * kShareAlign;
  };
  at::parallel_for(0, nt, 1, [&](int64_t first, int64_t last) {
    copy_share(plan, runs, starts, share_begin(first), share_begin(last));
  });
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "copy_pages(Tensor src, Tensor(a!) dst, Tensor src_idx, Tensor dst_idx, "
      "int num_threads) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("copy_pages", &pdserve::copy_pages_cpu);
}

#ifdef PDSERVE_WITH_CUDA
TORCH_LIBRARY_IMPL(pdserve, CUDA, m) {
  m.impl("copy_pages", &pdserve::copy_pages_cuda);
}
#endif
