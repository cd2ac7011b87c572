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
// Work is split in column (kn) or row (nk) chunks over XLA's intra-op thread pool.
// Needs AVX-512 (F, BW; -march=native on an AVX-512 machine); elsewhere the build fails and
// qjax uses its XLA paths.
// Build: python -m qjax.kernels.build (g++ -O3 -march=native, headers from jax.ffi).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kStrip = 64;   // columns per register tile (one cache line of int8 codes)
constexpr int64_t kRowBlock = 4; // rows of x per register tile (4 x 4 accumulators)
// kn: weight rows per block. A block runs along whole rows (strip after strip), so memory is
// read in long sequential runs; a tall block (a column strip down the matrix) steps a page
// per row and defeats the prefetchers (measured ~3x slower at 4096 x 4096).
constexpr int64_t kKBlock = 32;
constexpr int64_t kNkRows = 64;  // nk: weight rows per parallel chunk

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

inline __mmask64 Mask64(int64_t n) { return n >= 64 ? ~0ULL : ((1ULL << n) - 1); }
inline __mmask16 Mask16(int64_t n) {
  return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

inline void Int8ToF32(__m512i v, __m512 w[4]) {
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 0)));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 1)));
  w[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 2)));
  w[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 3)));
}

// Widen `n` (<= 64) consecutive weights starting at element `e` of a row into 4 x 16 floats
// (zeros past n). Rows are raw bytes: element e sits at byte e (int8), e / 2 (int4), 2e (bf16).
struct LoadI8 {
  static inline void Load(const uint8_t* row, int64_t e, int64_t n, __m512 w[4]) {
    Int8ToF32(_mm512_maskz_loadu_epi8(Mask64(n), row + e), w);
  }
};
struct LoadI4 {  // e even; the 16-bit word (hi << 8 | lo) puts the two codes in column order
  static inline void Load(const uint8_t* row, int64_t e, int64_t n, __m512 w[4]) {
    const __m256i b = _mm256_maskz_loadu_epi8(static_cast<__mmask32>(Mask64((n + 1) / 2)),
                                              row + e / 2);
    const __m512i u = _mm512_cvtepu8_epi16(b);
    const __m512i t = _mm512_or_si512(
        _mm512_and_si512(u, _mm512_set1_epi16(0x000F)),
        _mm512_slli_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x00F0)), 4));
    const __m512i eight = _mm512_set1_epi8(8);  // nibble n -> (n ^ 8) - 8 sign-extends it
    __m512i c = _mm512_sub_epi8(_mm512_xor_si512(t, eight), eight);
    c = _mm512_maskz_mov_epi8(Mask64(n), c);
    Int8ToF32(c, w);
  }
};
struct LoadBf16 {
  static inline void Load(const uint8_t* row, int64_t e, int64_t n, __m512 w[4]) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + e;
    for (int i = 0; i < 4; ++i) {
      const __m256i h = _mm256_maskz_loadu_epi16(Mask16(n - 16 * i), p + 16 * i);
      w[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
};

// ---- kn: W (K, N), row stride `ld` bytes -------------------------------------------------
// y[m, c0 + j] += sum_k x[m, k] * W[k, c0 + j] * s[c0 + j] for k in [k0, k1) (one group:
// s is that group's scale row, or null), m < MB, j < nc.
template <typename L, int MB>
inline void KnTile(const float* x, int64_t K, const uint8_t* w, int64_t ld, int64_t k0,
                   int64_t k1, int64_t c0, int64_t nc, const float* s, float* y, int64_t N) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
  __m512 wv[4];
  for (int64_t k = k0; k < k1; ++k) {
    L::Load(w + k * ld, c0, nc, wv);
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
      for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_fmadd_ps(xb, wv[i], acc[m][i]);
    }
  }
  // The group's scale is constant over [k0, k1): applied to the partial sum, once.
  for (int i = 0; i < 4; ++i) {
    const __mmask16 mk = Mask16(nc - 16 * i);
    if (!mk) break;
    const __m512 sv = s ? _mm512_maskz_loadu_ps(mk, s + c0 + 16 * i) : _mm512_set1_ps(1.f);
    for (int m = 0; m < MB; ++m) {
      float* yp = y + m * N + c0 + 16 * i;
      _mm512_mask_storeu_ps(yp, mk, _mm512_fmadd_ps(acc[m][i], sv,
                                                    _mm512_maskz_loadu_ps(mk, yp)));
    }
  }
}

template <typename L>
void KnRows(const float* x, int64_t mb, int64_t K, const uint8_t* w, int64_t ld, int64_t k0,
            int64_t k1, int64_t c0, int64_t nc, const float* s, float* y, int64_t N) {
  switch (mb) {
    case 1: return KnTile<L, 1>(x, K, w, ld, k0, k1, c0, nc, s, y, N);
    case 2: return KnTile<L, 2>(x, K, w, ld, k0, k1, c0, nc, s, y, N);
    case 3: return KnTile<L, 3>(x, K, w, ld, k0, k1, c0, nc, s, y, N);
    default: return KnTile<L, 4>(x, K, w, ld, k0, k1, c0, nc, s, y, N);
  }
}

// y (M, N) = x (M, K) @ W; G group rows of scales (G = 0: none). Threads own column ranges.
template <typename L>
void KnDriver(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
              const uint8_t* w, int64_t ld, int64_t G, const float* scale, float* y) {
  std::memset(y, 0, sizeof(float) * M * N);
  const int64_t gs = G > 1 ? K / G : K;
  const int64_t kb = kKBlock;
  const int64_t strips = (N + kStrip - 1) / kStrip;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads() + 1);
  const int64_t chunks = std::min(strips, 2 * threads);
  ParallelFor(pool, chunks, [&](int64_t c) {
    const int64_t s0 = strips * c / chunks, s1 = strips * (c + 1) / chunks;
    for (int64_t b0 = 0; b0 < K; b0 += kb) {
      const int64_t b1 = std::min(K, b0 + kb);
      for (int64_t st = s0; st < s1; ++st) {
        const int64_t c0 = st * kStrip, nc = std::min(kStrip, N - c0);
        for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
          const int64_t mb = std::min(kRowBlock, M - m0);
          for (int64_t k0 = b0; k0 < b1;) {  // split the block at group boundaries
            const int64_t k1 = std::min(b1, (k0 / gs + 1) * gs);
            const float* s = G > 1 ? scale + (k0 / gs) * N : nullptr;
            KnRows<L>(x + m0 * K, mb, K, w, ld, k0, k1, c0, nc, s, y + m0 * N, N);
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
template <typename L, int MB>
inline void NkRow(const float* x, int64_t K, const uint8_t* row, int64_t G, const float* s,
                  float* y, int64_t N) {
  const int64_t gs = G > 0 ? K / G : K;
  __m512 total[MB];
  for (int m = 0; m < MB; ++m) total[m] = _mm512_setzero_ps();
  __m512 wv[4];
  for (int64_t g0 = 0; g0 < K; g0 += gs) {
    __m512 acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t e = g0; e < g0 + gs; e += kStrip) {
      const int64_t ne = std::min(kStrip, g0 + gs - e);
      L::Load(row, e, ne, wv);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * K + e;
        for (int i = 0; i < 4; ++i) {
          const __m512 xv = _mm512_maskz_loadu_ps(Mask16(ne - 16 * i), xm + 16 * i);
          acc[m][i & 1] = _mm512_fmadd_ps(xv, wv[i], acc[m][i & 1]);
        }
      }
    }
    const __m512 sv = _mm512_set1_ps(G > 0 ? s[g0 / gs] : 1.f);
    for (int m = 0; m < MB; ++m)
      total[m] = _mm512_fmadd_ps(_mm512_add_ps(acc[m][0], acc[m][1]), sv, total[m]);
  }
  for (int m = 0; m < MB; ++m) y[m * N] = _mm512_reduce_add_ps(total[m]);
}

template <typename L>
void NkDriver(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
              const uint8_t* w, int64_t ld, int64_t G, const float* scale, float* y) {
  const int64_t chunks = (N + kNkRows - 1) / kNkRows;
  ParallelFor(pool, chunks, [&](int64_t c) {
    for (int64_t n = c * kNkRows; n < std::min(N, (c + 1) * kNkRows); ++n) {
      const float* s = G > 0 ? scale + n * G : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t mb = std::min(kRowBlock, M - m0);
        const float* xm = x + m0 * K;
        float* ym = y + m0 * N + n;
        const uint8_t* row = w + n * ld;
        switch (mb) {
          case 1: NkRow<L, 1>(xm, K, row, G, s, ym, N); break;
          case 2: NkRow<L, 2>(xm, K, row, G, s, ym, N); break;
          case 3: NkRow<L, 3>(xm, K, row, G, s, ym, N); break;
          default: NkRow<L, 4>(xm, K, row, G, s, ym, N); break;
        }
      }
    }
  });
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
