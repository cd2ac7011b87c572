// qjax decode-shape matmul kernels for XLA:CPU (jax.ffi): y = x @ W for a few rows of x with
// an int8 / packed int4 / bf16 weight, f32 accumulation, weight codes read once and never
// widened into a float copy of the weight.
//
// Why a kernel: XLA:CPU does not fuse an int->float convert into a dot, so a weight-only
// quantized matmul materialises a float weight each call (see qjax/core/qdot.py). Here each
// small slice of codes is widened in registers / L1 and consumed at once.
//
// Two weight layouts (the two qeinsum needs):
//   kn: W is (K, N), contracted K first, N contiguous; scales (G, N), groups of K/G rows.
//       int4 packs N: byte (k, i) holds column 2i in its low and 2i+1 in its high nibble.
//   nk: W is (N, K) (the tied head 'BTD,VD->BTV'), K contiguous; scales (N, G).
//       int4 packs K: byte (n, i) holds k = 2i (low nibble) and 2i+1 (high nibble).
// Work is split in column (kn) or row (nk) chunks over XLA's intra-op thread pool; small
// weights run on the calling thread (waking the pool cost more than it saved).
// Three families of forms:
//   f32 activations x int8 / int4 codes, widened to f32 in registers (weight-only numerics);
//   int8 activations ("_a8": quantized here per row and weight group, qeinsum's 'int8'
//     numerics) x int8 / int4 codes on integer dots: W8A8 / W4A8;
//   bf16 weights (f32 activations).
// Two instruction sets, chosen at compile time (-mavx512* / -mavx2 flags): AVX-512 F/BW/VL/VNNI
// (gemv_avx512.inc: vpdpbusd integer dots, and AVX-512 BF16 dots for kn bf16 where present),
// else AVX2 + FMA (gemv_avx2.inc: vpmaddubsw + vpmaddwd, bf16 widened to f32). This file
// holds what both share: threading, drivers, FFI handlers. Elsewhere the build fails and qjax
// uses its XLA paths. QjaxGemvIsa() names the forms built.
// Built on first use (or by python -m qjax.kernels.build) into a per-user cache, with the
// flags of the CPU's instruction-set level (qjax/kernels/_build.py), headers from jax.ffi.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <memory>
#include <thread>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The ISA files' tunings (kStrip, kRowBlock, A8Cols, ...) are theirs; these are shared.
// The timings behind these constants: docs/fast_decode.md ("the kernel's tunings").
// kn: weight rows per block. A block runs along whole rows (strip after strip), so memory is
// read in long sequential runs; a tall block (a column strip down the matrix) steps a page
// per row and defeats the prefetchers.
constexpr int64_t kKBlock = 32;
// nk: row ranges per worker (fewer and more both ran the int4 a8 head slower; many short
// chunks ran slower than one thread).
constexpr int64_t kNkChunksPerWorker = 4;
// int8-activation weights smaller than this run on the calling thread: waking the pool costs
// more; every Gemma 270M int4 projection (<= 655 KB) is below it.
constexpr int64_t kSerialBytes = 1 << 20;
// The same for bf16 'kn' weights: two threads on XLA's pool ran slower below it.
constexpr int64_t kSerialBytesBf16 = 4 << 20;

// Threads that can run chunks: the pool's plus the caller.
inline int64_t Workers(ffi::ThreadPool& pool) {
  return std::max<int64_t>(1, pool.num_threads() + 1);
}

// Runs fn(chunk) for chunk in [0, n) on the caller plus the pool's threads. Chunks are taken
// from a shared counter, and the caller waits only for chunks already claimed, so a helper
// task that starts late finds nothing to do and touches only the shared state.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, F fn) {
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  // Helpers hold `fn` by pointer: they call it only on a claimed chunk, and every claimed
  // chunk finishes before this function returns.
  auto work = [state, n, fnp = &fn]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      (*fnp)(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#include "gemv_avx512.inc"
#elif defined(__AVX2__) && defined(__FMA__)
#include "gemv_avx2.inc"
#else
#error "qjax gemv needs AVX2 + FMA or AVX-512 F/BW/VL/VNNI (qjax/kernels/_build.py passes the -m flags)"
#endif

// Calls f(std::integral_constant<int, mb>()) for 1 <= mb <= kMax: register tiles take their
// row count as a template argument.
template <int kMax, typename F>
inline void WithRows(int64_t mb, F&& f) {
  if constexpr (kMax > 1) {
    if (mb < kMax) return WithRows<kMax - 1>(mb, f);
  }
  f(std::integral_constant<int, kMax>());
}

// ---- kn: W (K, N), row stride `ld` bytes -------------------------------------------------
// y (M, N) = x (M, K) @ W; G group rows of scales (G = 0: none). Threads own column ranges.
template <typename L>
void KnDriver(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
              const uint8_t* w, int64_t ld, int64_t G, const float* scale, float* y) {
  std::memset(y, 0, sizeof(float) * M * N);
  const int64_t gs = G > 1 ? K / G : K;
  const int64_t kb = kKBlock;
  const int64_t strips = (N + kStrip - 1) / kStrip;
  const int64_t chunks = std::min(strips, 2 * Workers(pool));
  ParallelFor(pool, chunks, [&](int64_t c) {
    const int64_t s0 = strips * c / chunks, s1 = strips * (c + 1) / chunks;
    for (int64_t b0 = 0; b0 < K; b0 += kb) {
      const int64_t b1 = std::min(K, b0 + kb);
      for (int64_t st = s0; st < s1; ++st) {
        const int64_t c0 = st * kStrip, nc = std::min(kStrip, N - c0);
        for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
          for (int64_t k0 = b0; k0 < b1;) {  // split the block at group boundaries
            const int64_t k1 = std::min(b1, (k0 / gs + 1) * gs);
            const float* s = G > 1 ? scale + (k0 / gs) * N : nullptr;
            WithRows<kRowBlock>(M - m0, [&](auto mb) {
              KnTile<L, decltype(mb)::value>(x + m0 * K, K, w, ld, k0, k1, c0, nc, s,
                                             y + m0 * N, N);
            });
            k0 = k1;
          }
        }
      }
    }
    if (G == 1) {  // one scale row: applied once, after the whole contraction
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = kStrip * s0; n < std::min(N, kStrip * s1); ++n) y[m * N + n] *= scale[n];
    }
  });
}

// ---- nk: W (N, K), row stride `ld` bytes; scales (N, G) ----------------------------------
template <typename L>
void NkDriver(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
              const uint8_t* w, int64_t ld, int64_t G, const float* scale, float* y) {
  const int64_t chunks = std::min<int64_t>(N, kNkChunksPerWorker * Workers(pool));
  ParallelFor(pool, chunks, [&](int64_t c) {
    for (int64_t n = N * c / chunks; n < N * (c + 1) / chunks; ++n) {
      const float* s = G > 0 ? scale + n * G : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        WithRows<kRowBlock>(M - m0, [&](auto mb) {
          NkRow<L, decltype(mb)::value>(x + m0 * K, K, w + n * ld, G, s, y + m0 * N + n, N);
        });
      }
    }
  });
}

// ---- int8 activations (W8A8 / W4A8 at decode) ---------------------------------------------
// The numerics of qeinsum's 'int8' path (qjax/core/tiled_path.py): activations quantized per
// row and per weight group (per row when ungrouped), scale = amax / 127 (1 where amax = 0, NaN
// where the block holds a NaN), q = round-half-even(x / scale) clipped to +-127 (the ISA
// files' QuantizeRows); integer dots per group, exact in int32, rescaled by (activation scale
// x weight scale) in f32.

template <bool kI4>
void KnA8Driver(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                const uint8_t* w, int64_t ld, int64_t G, const float* scale, float* y) {
  const int64_t unit = K / G;  // G = 1: one block per row (per-token activation scales)
  const int64_t nb = G;
  std::unique_ptr<int8_t[]> q(new int8_t[M * K]);
  std::unique_ptr<float[]> sa(new float[M * nb]);
  std::unique_ptr<int32_t[]> sq(new int32_t[M * nb]);
  QuantizeRows(x, M, K, unit, q.get(), sa.get(), sq.get());
  std::memset(y, 0, sizeof(float) * M * N);
  constexpr int64_t cols = A8Cols(kI4);
  const int64_t strips = (N + cols - 1) / cols;
  const int64_t threads = K * ld < kSerialBytes ? 1 : Workers(pool);
  const int64_t chunks = std::min(strips, threads == 1 ? 1 : 4 * threads);
  // A block longer than kA8Part rows (per-channel int8: the whole K) is walked in parts, so
  // that memory is read in runs of whole rows, not a column strip down the matrix.
  constexpr int64_t kA8Part = 128;
  const int64_t part = unit % kA8Part == 0 ? kA8Part : unit;
  const int64_t rows = (M + kA8Rows - 1) / kA8Rows * kA8Rows;  // M rounded up to whole tiles
  auto body = [&](int64_t c) {
    const int64_t s0 = strips * c / chunks, s1 = strips * (c + 1) / chunks;
    // the parts' integer sums: cols int32 per (strip, row)
    std::unique_ptr<int32_t[]> carry(part < unit ? new int32_t[(s1 - s0) * rows * cols]
                                                 : nullptr);
    for (int64_t b = 0; b < nb; ++b) {
      const float* s = scale + b * N;
      for (int64_t p0 = b * unit; p0 < (b + 1) * unit; p0 += part) {
        const bool first = p0 == b * unit, last = p0 + part == (b + 1) * unit;
        for (int64_t st = s0; st < s1; ++st) {
          const int64_t c0 = st * cols, nc = std::min(cols, N - c0);
          for (int64_t m0 = 0; m0 < M; m0 += kA8Rows) {
            int32_t* cm = carry ? carry.get() + ((st - s0) * rows + m0) * cols : nullptr;
            WithRows<kA8Rows>(M - m0, [&](auto mb) {
              KnA8Tile<kI4, decltype(mb)::value>(q.get() + m0 * K, K, sa.get() + m0 * nb,
                                                 sq.get() + m0 * nb, nb, b, w, ld, p0, part,
                                                 c0, nc, s, y + m0 * N, N, cm, first, last);
            });
          }
        }
      }
    }
  };
  if (chunks == 1) body(0); else ParallelFor(pool, chunks, body);
}

// nk: W (N, K), K contiguous. int4 rows pack K (byte i: k = 2 i low, 2 i + 1 high) and the
// ISA's row step reads kNkI4Chunk values, low nibbles then high: the activations of each chunk
// are reordered once to its even values, then its odd ones.
void SplitEvenOdd(int8_t* q, int64_t M, int64_t K) {
  int8_t t[kNkI4Chunk];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += kNkI4Chunk) {
      int8_t* p = q + m * K + k;
      for (int64_t j = 0; j < kNkI4Chunk / 2; ++j) {
        t[j] = p[2 * j];
        t[kNkI4Chunk / 2 + j] = p[2 * j + 1];
      }
      std::memcpy(p, t, kNkI4Chunk);
    }
}

template <bool kI4>
void NkA8Driver(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                const uint8_t* w, int64_t ld, int64_t G, const float* scale, float* y) {
  const int64_t unit = K / G, nb = G;
  std::unique_ptr<int8_t[]> q(new int8_t[M * K]);
  std::unique_ptr<float[]> sa(new float[M * nb]);
  std::unique_ptr<int32_t[]> sq(new int32_t[M * nb]);
  QuantizeRows(x, M, K, unit, q.get(), sa.get(), sq.get());
  if (kI4) SplitEvenOdd(q.get(), M, K);
  // A few long ranges of rows (a thread streams each one), not many short ones, which ran the
  // Gemma head slower than one thread did (docs/fast_decode.md).
  const int64_t chunks =
      N * ld < kSerialBytes ? 1 : std::min<int64_t>(N, kNkChunksPerWorker * Workers(pool));
  constexpr int kRows = 4;
  auto body = [&](int64_t c) {
    const int64_t n0 = N * c / chunks, n1 = N * (c + 1) / chunks;
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        WithRows<kRows>(M - m0, [&](auto mb) {
          NkA8Row<kI4, decltype(mb)::value>(q.get() + m0 * K, K, sa.get() + m0 * nb,
                                            sq.get() + m0 * nb, nb, unit, w + n * ld,
                                            scale + n * G, y + m0 * N + n, N);
        });
      }
    }
  };
  if (chunks == 1) body(0); else ParallelFor(pool, chunks, body);
}

}  // namespace

// ---- handlers ------------------------------------------------------------------------------
// x (M, K) f32; y (M, N) f32. kn codes (K, N) int8 | (K, N/2) uint8 | (K, N) bf16 with scales
// (G, N) f32; nk codes (N, K) int8 | (N, K/2) uint8 | (N, K) bf16 with scales (N, G) f32.
template <typename L, bool kKn>
ffi::Error Run(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
               const float* scale, int64_t G, int codes_per_elem, int bytes_per_elem,
               ffi::Result<ffi::AnyBuffer>& y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("qjax gemv: operands must be 2-d");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  // A stored element holds codes_per_elem codes (2: packed int4) in bytes_per_elem bytes.
  const int64_t ld = wd[1] * bytes_per_elem;      // row stride in bytes
  const int64_t rowlen = wd[1] * codes_per_elem;  // weights per row
  if (yd[0] != M || (kKn ? (wd[0] != K || rowlen != N) : (wd[0] != N || rowlen != K)))
    return ffi::Error::InvalidArgument("qjax gemv: shapes do not match");
  if (G > 0 && K % G) return ffi::Error::InvalidArgument("qjax gemv: groups must divide K");
  const float* xp = reinterpret_cast<const float*>(x.untyped_data());
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.untyped_data());
  float* yp = reinterpret_cast<float*>(y->untyped_data());
#ifdef QJAX_GEMV_BF16_DOT
  if (kKn && std::is_same<L, LoadBf16>::value)
    KnBf16DpDriver(pool, xp, M, K, N, reinterpret_cast<const uint16_t*>(wp), yp);
  else
#endif
  if (kKn) KnDriver<L>(pool, xp, M, K, N, wp, ld, G, scale, yp);
  else NkDriver<L>(pool, xp, M, K, N, wp, ld, G, scale, yp);
  return ffi::Error::Success();
}

#define QJAX_Q(fn, L, kn, per2)                                                            \
  static ffi::Error fn(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,           \
                       ffi::Buffer<ffi::F32> s, ffi::Result<ffi::AnyBuffer> y) {           \
    const auto sd = s.dimensions();                                                        \
    return Run<L, kn>(pool, x, w, s.typed_data(), kn ? sd[0] : sd[1], per2, 1, y);           \
  }
#define QJAX_F(fn, kn)                                                                     \
  static ffi::Error fn(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,           \
                       ffi::Result<ffi::AnyBuffer> y) {                                     \
    return Run<LoadBf16, kn>(pool, x, w, nullptr, 0, 1, 2, y);                               \
  }
QJAX_Q(KnI8, LoadI8, true, 1)
QJAX_Q(KnI4, LoadI4, true, 2)
QJAX_F(KnBf16, true)
QJAX_Q(NkI8, LoadI8, false, 1)
QJAX_Q(NkI4, LoadI4, false, 2)
QJAX_F(NkBf16, false)


// int8-activation forms: x (M, K) f32, codes and scales as above. kn needs K / G a multiple
// of 4; nk needs K / G a multiple of 64 (int8) / 128 (int4).
template <bool kI4, bool kKn>
ffi::Error RunA8(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                 const ffi::Buffer<ffi::F32>& s, ffi::Result<ffi::AnyBuffer>& y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions(),
             sd = s.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("qjax gemv a8: operands must be 2-d");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const int64_t rowlen = wd[1] * (kI4 ? 2 : 1);
  const int64_t G = kKn ? sd[0] : sd[1];
  if (yd[0] != M || (kKn ? (wd[0] != K || rowlen != N) : (wd[0] != N || rowlen != K)))
    return ffi::Error::InvalidArgument("qjax gemv a8: shapes do not match");
  if (G <= 0 || K % G || (K / G) % (kKn ? 4 : (kI4 ? 128 : 64)))
    return ffi::Error::InvalidArgument("qjax gemv a8: group length does not fit the kernel");
  const float* xp = reinterpret_cast<const float*>(x.untyped_data());
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.untyped_data());
  float* yp = reinterpret_cast<float*>(y->untyped_data());
  if (kKn) KnA8Driver<kI4>(pool, xp, M, K, N, wp, wd[1], G, s.typed_data(), yp);
  else NkA8Driver<kI4>(pool, xp, M, K, N, wp, wd[1], G, s.typed_data(), yp);
  return ffi::Error::Success();
}
#define QJAX_A8(fn, i4, kn)                                                                \
  static ffi::Error fn(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,           \
                       ffi::Buffer<ffi::F32> s, ffi::Result<ffi::AnyBuffer> y) {           \
    return RunA8<i4, kn>(pool, x, w, s, y);                                                \
  }
QJAX_A8(KnI8A8, false, true)
QJAX_A8(KnI4A8, true, true)
QJAX_A8(NkI8A8, false, false)
QJAX_A8(NkI4A8, true, false)

#define QJAX_BIND_Q(name, fn)                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, fn,                                            \
                                ffi::Ffi::Bind()                                     \
                                    .Ctx<ffi::ThreadPool>()                          \
                                    .Arg<ffi::AnyBuffer>()                           \
                                    .Arg<ffi::AnyBuffer>()                           \
                                    .Arg<ffi::Buffer<ffi::F32>>()                    \
                                    .Ret<ffi::AnyBuffer>());
#define QJAX_BIND_F(name, fn)                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, fn,                                            \
                                ffi::Ffi::Bind()                                     \
                                    .Ctx<ffi::ThreadPool>()                          \
                                    .Arg<ffi::AnyBuffer>()                           \
                                    .Arg<ffi::AnyBuffer>()                           \
                                    .Ret<ffi::AnyBuffer>());

QJAX_BIND_Q(QjaxKnI8, KnI8)
QJAX_BIND_Q(QjaxKnI4, KnI4)
QJAX_BIND_F(QjaxKnBf16, KnBf16)
QJAX_BIND_Q(QjaxNkI8, NkI8)
QJAX_BIND_Q(QjaxNkI4, NkI4)
QJAX_BIND_F(QjaxNkBf16, NkBf16)
QJAX_BIND_Q(QjaxKnI8A8, KnI8A8)
QJAX_BIND_Q(QjaxKnI4A8, KnI4A8)
QJAX_BIND_Q(QjaxNkI8A8, NkI8A8)
QJAX_BIND_Q(QjaxNkI4A8, NkI4A8)

// The forms this library was built with: "avx512" or "avx2" (qjax.kernels.isa()).
extern "C" __attribute__((visibility("default"))) const char* QjaxGemvIsa() { return kIsa; }
