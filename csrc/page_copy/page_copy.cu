// CUDA page copy between a device pool and a host pool (or two device pools).
//
// The host pool is read or written in place through its device-mapped address
// (pinned with cudaHostAlloc, as torch's pin_memory() does, or registered with
// cudaHostRegister(..., cudaHostRegisterMapped)): one kernel moves every page,
// with no staging buffer and no per-page cudaMemcpyAsync. Work is split into
// chunks of at most kChunkBytes of one page; a block copies one chunk at a
// time (grid-stride), so a page of up to 64 KiB is one block, and a few large
// pages still spread over every SM. Validation is plan_page_copy (page_copy.cpp).
#include "page_copy.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

namespace pdserve {
namespace {

constexpr int kThreads = 512;
constexpr int kBlocksPerSm = 4;          // 4 x 512 threads fill an SM
constexpr int64_t kChunkBytes = 64 * 1024;
constexpr int kUnroll = 4;               // 16-byte loads in flight per thread

// Copies `bytes` bytes with the whole block; s, d and bytes are 16-byte aligned.
__device__ __forceinline__ void copy_chunk_vec16(const char* s, char* d, int64_t bytes) {
  const uint4* s4 = reinterpret_cast<const uint4*>(s);
  uint4* d4 = reinterpret_cast<uint4*>(d);
  const int64_t n4 = bytes / 16;
  const int64_t step = blockDim.x;
  int64_t j = threadIdx.x;
  // Issue kUnroll loads before the stores: over PCIe (mapped host memory) the
  // latency is microseconds and throughput needs many requests outstanding.
  for (; j + (kUnroll - 1) * step < n4; j += kUnroll * step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = s4[j + u * step];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      d4[j + u * step] = v[u];
    }
  }
  for (; j < n4; j += step) {
    d4[j] = s4[j];
  }
}

// idx: [2, n] int64 on the device, row 0 src page ids, row 1 dst page ids.
__global__ void __launch_bounds__(kThreads) copy_pages_kernel(
    const char* __restrict__ src,
    char* __restrict__ dst,
    const int64_t* __restrict__ idx,
    int64_t n,
    int64_t page_bytes,
    int64_t src_stride,
    int64_t dst_stride,
    int64_t chunks_per_page) {
  const int64_t work = n * chunks_per_page;
  for (int64_t w = blockIdx.x; w < work; w += gridDim.x) {
    const int64_t i = w / chunks_per_page;
    const int64_t begin = (w - i * chunks_per_page) * kChunkBytes;
    const int64_t left = page_bytes - begin;
    const int64_t bytes = left < kChunkBytes ? left : kChunkBytes;
    const char* s = src + idx[i] * src_stride + begin;
    char* d = dst + idx[n + i] * dst_stride + begin;
    const uint64_t align = reinterpret_cast<uint64_t>(s) | reinterpret_cast<uint64_t>(d) |
        static_cast<uint64_t>(bytes);
    if ((align & 15) == 0) {
      copy_chunk_vec16(s, d, bytes);
    } else {
      for (int64_t b = threadIdx.x; b < bytes; b += blockDim.x) {
        d[b] = s[b];
      }
    }
  }
}

// The address the device uses for `host_ptr` inside the CPU tensor `t`.
char* mapped_pointer(const at::Tensor& t, char* host_ptr, const char* name) {
  if (t.is_cuda()) {
    return host_ptr;
  }
  TORCH_CHECK(
      t.device().is_cpu(), "copy_pages: ", name, " must be on a CUDA device or the CPU; got ",
      t.device());
  void* dev = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&dev, host_ptr, 0);
  if (err != cudaSuccess) {
    // NOTE: clear the (non-sticky) error so a later launch check in torch does
    // not report it as its own.
    (void)cudaGetLastError();
    TORCH_CHECK(
        false, "copy_pages: ", name, " is a host tensor the device cannot address (",
        cudaGetErrorString(err), "); pin it with pin_memory() or register it with "
        "cudaHostRegister(ptr, bytes, cudaHostRegisterMapped)");
  }
  return static_cast<char*>(dev);
}

}  // namespace

void copy_pages_cuda(
    const at::Tensor& src,
    const at::Tensor& dst,
    const at::Tensor& src_idx,
    const at::Tensor& dst_idx,
    int64_t /*num_threads*/) {
  TORCH_CHECK(
      src.is_cuda() || dst.is_cuda(),
      "copy_pages: the CUDA kernel needs src or dst on a CUDA device");
  TORCH_CHECK(
      !(src.is_cuda() && dst.is_cuda()) || src.device() == dst.device(),
      "copy_pages: src and dst are on different devices (", src.device(), " and ",
      dst.device(), ")");
  const at::Tensor& device_pool = src.is_cuda() ? src : dst;
  const c10::cuda::CUDAGuard guard(device_pool.device());

  const PageCopyPlan plan = plan_page_copy(src, dst, src_idx, dst_idx);
  if (plan.n == 0 || plan.page_bytes == 0) {
    return;
  }
  const char* s = mapped_pointer(src, plan.src, "src");
  char* d = mapped_pointer(dst, plan.dst, "dst");

  // Page ids travel in one pinned [2, n] buffer copied on the current stream;
  // the host allocator keeps the buffer until that copy has run.
  at::Tensor idx_host =
      at::empty({2, plan.n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = idx_host.mutable_data_ptr<int64_t>();
  std::memcpy(h, plan.src_idx.const_data_ptr<int64_t>(), plan.n * sizeof(int64_t));
  std::memcpy(h + plan.n, plan.dst_idx.const_data_ptr<int64_t>(), plan.n * sizeof(int64_t));
  const at::Tensor idx = idx_host.to(device_pool.device(), at::kLong, /*non_blocking=*/true);

  const int64_t chunks_per_page = (plan.page_bytes + kChunkBytes - 1) / kChunkBytes;
  const int64_t work = plan.n * chunks_per_page;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_pool.get_device()));
  const int64_t grid = std::min<int64_t>(work, static_cast<int64_t>(sms) * kBlocksPerSm);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  copy_pages_kernel<<<static_cast<unsigned int>(grid), kThreads, 0, stream>>>(
      s, d, idx.const_data_ptr<int64_t>(), plan.n, plan.page_bytes, plan.src_stride,
      plan.dst_stride, chunks_per_page);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pdserve
