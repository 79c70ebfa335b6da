// What this CPU can do at best, measured (decoding/bench/roofline.py): the forward suite prices each
// forward against these, so "a verify cannot cost less than this here" is a measurement, not a
// datasheet figure. Every probe runs on each of torch's threads at once and returns the sum.
// - fp32 FMAs: 12 independent 512-bit chains per thread (enough for two FMA ports' latency);
// - bf16 products: AMX tile dot products into 4 independent C tiles where the CPU has AMX, else
//   AVX512-BF16 pair dot products, 12 chains;
// - reading memory: one pass over a buffer far larger than the caches, prefetched 16 KiB ahead
//   as the linear kernels read their weights.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "vec.h"  // decoding/forward/csrc, on the include path

namespace {

using clk = std::chrono::steady_clock;

double seconds_since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

// runs body(iterations) on every thread at once and returns the work units per second summed
template <class F>
double on_every_thread(int64_t iters, double units_per_iter, F body) {
  const int n = at::get_num_threads();
  std::vector<double> secs(n, 0.0);
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto t = clk::now();
      body(iters, i);
      secs[i] = seconds_since(t);
    }
  });
  double rate = 0;
  for (double s : secs) rate += units_per_iter * iters / s;
  return rate;
}

volatile float sink;

double fp32_fma_gflops(int64_t iters) {
  return on_every_thread(iters, 12.0 * 32 / 1e9, [](int64_t it, int64_t) {
    __m512 a[12];
    for (int j = 0; j < 12; ++j) a[j] = _mm512_set1_ps(0.001f * j);
    const __m512 m = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
    for (int64_t i = 0; i < it; ++i)
      for (int j = 0; j < 12; ++j) a[j] = _mm512_fmadd_ps(a[j], m, c);
    float s = 0;
    for (int j = 0; j < 12; ++j) s += _mm512_reduce_add_ps(a[j]);
    sink = s;
  });
}

struct TileCfg {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

double bf16_gflops(int64_t iters) {
  if (specstop_vec::amx_ready())  // 4 C tiles of 16 x 16, A 16 x 32, B 32 x 16: 16K flops a tile op
    return on_every_thread(iters, 4.0 * 16 * 16 * 32 * 2 / 1e9, [](int64_t it, int64_t) {
      TileCfg cfg{};
      cfg.palette = 1;
      for (int t = 0; t < 6; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
      _tile_loadconfig(&cfg);
      alignas(64) static thread_local uint16_t buf[16 * 32] = {};
      _tile_loadd(4, buf, 64);
      _tile_loadd(5, buf, 64);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t i = 0; i < it; ++i) {
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 5);
      }
      alignas(64) float out[16 * 16];
      _tile_stored(0, out, 64);
      sink = out[0];
      _tile_release();
    });
  return on_every_thread(iters, 12.0 * 64 / 1e9, [](int64_t it, int64_t) {  // 16 lanes x 2 pairs x 2
    __m512 a[12];
    for (int j = 0; j < 12; ++j) a[j] = _mm512_setzero_ps();
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x0001);
    for (int64_t i = 0; i < it; ++i)
      for (int j = 0; j < 12; ++j) a[j] = _mm512_dpbf16_ps(a[j], x, y);
    float s = 0;
    for (int j = 0; j < 12; ++j) s += _mm512_reduce_add_ps(a[j]);
    sink = s;
  });
}

double read_gbps(int64_t mib) {
  const int n = at::get_num_threads();
  const size_t bytes = (size_t)mib << 20;
  std::vector<float*> bufs(n);
  for (auto& b : bufs) {
    b = (float*)std::aligned_alloc(64, bytes);
    std::memset(b, 1, bytes);  // touch every page before timing
  }
  const double rate = on_every_thread(1, bytes / 1e9, [&](int64_t, int64_t t) {
    const float* p = bufs[t];
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (size_t i = 0; i < bytes / 4; i += 32) {
      _mm_prefetch((const char*)(p + i) + 16384, _MM_HINT_T0);
      _mm_prefetch((const char*)(p + i) + 16384 + 64, _MM_HINT_T0);
      a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
      a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    }
    sink = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  });
  for (auto b : bufs) std::free(b);
  return rate;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop, m) {  // no tensor arguments: registered as plain functions
  m.def("fp32_fma_gflops(int iters) -> float", &fp32_fma_gflops);
  m.def("bf16_gflops(int iters) -> float", &bf16_gflops);
  m.def("read_gbps(int mib) -> float", &read_gbps);
}
