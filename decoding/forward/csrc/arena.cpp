// Packed weights in 2 MiB pages.
//
// A decode step streams every weight once, 4 KiB page after page: 270 MB of bf16 weights are
// ~66,000 pages, each a TLB miss and a page walk that the kernels' software prefetches wait on.
// On a 2-core AMX Xeon (1 thread) a layer's linears streamed at ~12 GB/s from 4 KiB pages and at
// ~14.3 GB/s (the core's streaming rate) from 2 MiB ones. Linux backs an aligned region with huge
// pages when asked (madvise; transparent_hugepage "madvise" or "always"); where it will not, the
// memory is ordinary pages and nothing else changes.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <cstdlib>

namespace {

constexpr size_t HUGE_PAGE = size_t(2) << 20;

at::Tensor huge_empty(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "huge_empty: numel >= 0");
  const size_t bytes = std::max<size_t>(HUGE_PAGE, (numel * c10::elementSize(dtype) + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
  void* p = std::aligned_alloc(HUGE_PAGE, bytes);
  TORCH_CHECK(p != nullptr, "huge_empty: out of memory (", bytes, " bytes)");
  madvise(p, bytes, MADV_HUGEPAGE);  // advice: ordinary pages where the kernel declines
  // fault the pages in now, one after the other: two threads faulting huge pages at once contend
  // (270 MB: 0.13-0.36 s on 2 threads of a 2-core VM, 0.035 s on one)
  for (size_t i = 0; i < bytes; i += HUGE_PAGE) ((volatile char*)p)[i] = 0;
  return at::from_blob(p, {numel}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(dtype));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop, m) { m.def("huge_empty(int numel, ScalarType dtype) -> Tensor", &huge_empty); }
