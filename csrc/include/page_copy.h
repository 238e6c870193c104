// Copy whole KV pages between two page-major pools: dst[dst_idx[i]] = src[src_idx[i]].
//
// A pool is a tensor kv[num_pages, ...]: dim 0 indexes pages, each page is one
// contiguous run of page_bytes bytes, and consecutive pages sit stride(0) *
// element_size bytes apart (>= page_bytes; == page_bytes when the pool is dense,
// which lets runs of consecutive page ids become one memcpy).
//
// plan_page_copy() validates both pools and the index lists on the host and is
// shared by the CPU kernel (page_copy.cpp) and the CUDA kernel (page_copy.cu).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pdserve {

struct PageCopyPlan {
  char* src = nullptr;  // page 0 of src (host address; the CUDA path maps it)
  char* dst = nullptr;  // page 0 of dst
  int64_t page_bytes = 0;
  int64_t src_stride = 0;  // bytes from one src page to the next
  int64_t dst_stride = 0;
  int64_t n = 0;            // pages to copy
  at::Tensor src_idx;       // [n] int64, CPU, contiguous, in range
  at::Tensor dst_idx;       // [n] int64, CPU, contiguous, in range, no duplicates
};

// Raises c10::Error (RuntimeError in Python) when: a pool has no page dim or its
// pages are not contiguous or overlap; the pools differ in page bytes or element
// size; an index list is not a 1-D CPU int64 tensor, the lists differ in length,
// or an id is out of range; dst_idx repeats a page; or a dst page overlaps a src
// page in memory (same pool, or views of one storage). Devices are not checked
// here: each kernel checks the devices it accepts.
PageCopyPlan plan_page_copy(
    const at::Tensor& src,
    const at::Tensor& dst,
    const at::Tensor& src_idx,
    const at::Tensor& dst_idx);

// Both pools on the CPU. Copies on up to num_threads (>= 1) of torch's
// intra-op threads, at least 128 KiB each; small copies run on the caller.
void copy_pages_cpu(
    const at::Tensor& src,
    const at::Tensor& dst,
    const at::Tensor& src_idx,
    const at::Tensor& dst_idx,
    int64_t num_threads);

#ifdef PDSERVE_WITH_CUDA
// At least one pool on a CUDA device (both on the same one if both are); a host
// pool must be pinned or cudaHostRegister'ed with cudaHostRegisterMapped.
// Enqueued on the current CUDA stream of the device pool; num_threads is unused.
void copy_pages_cuda(
    const at::Tensor& src,
    const at::Tensor& dst,
    const at::Tensor& src_idx,
    const at::Tensor& dst_idx,
    int64_t num_threads);
#endif

}  // namespace pdserve
