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
//     numerics) x int8 / int4 codes on AVX-512 VNNI integer dots (vpdpbusd): W8A8 / W4A8;
//   bf16 weights: kn on AVX-512 BF16 dots (vdpbf16ps, activations split into bf16 hi + lo),
//     nk widened to f32.
// Needs AVX-512 F/BW/VNNI/BF16 (-march=native on such a machine); elsewhere the build fails
// and qjax uses its XLA paths.
// Build: python -m qjax.kernels.build (g++ -O3 -march=native, headers from jax.ffi).

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

constexpr int64_t kStrip = 64;   // columns per register tile (one cache line of int8 codes)
constexpr int64_t kRowBlock = 4; // rows of x per register tile (4 x 4 accumulators)
// kn: weight rows per block. A block runs along whole rows (strip after strip), so memory is
// read in long sequential runs; a tall block (a column strip down the matrix) steps a page
// per row and defeats the prefetchers (measured ~3x slower at 4096 x 4096).
constexpr int64_t kKBlock = 32;
// nk: row ranges per worker (1 / 2 / 4 / 16 measured 3.3 / 2.8 / 2.1 / 3.8 ms on the int4 a8
// head; 4096 chunks of 64 rows had run slower than one thread).
constexpr int64_t kNkChunksPerWorker = 4;
// int8-activation weights smaller than this run on the calling thread: waking the pool costs
// more (a Gemma W4A8 decode step: 13.3 ms at 1 MiB against 14.3 at 128 KiB or with every call
// threaded); every Gemma 270M int4 projection (<= 655 KB) is below it.
constexpr int64_t kSerialBytes = 1 << 20;
// The same for bf16 'kn' weights: two threads on XLA's pool measured slower below it
// (640 x 2048: 119 us against 75).
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
  static constexpr int kNum = 1, kDen = 1;  // bytes per element: kNum / kDen
  static inline void Load(const uint8_t* row, int64_t e, int64_t n, __m512 w[4]) {
    Int8ToF32(_mm512_maskz_loadu_epi8(Mask64(n), row + e), w);
  }
};
struct LoadI4 {  // e even; the 16-bit word (hi << 8 | lo) puts the two codes in column order
  static constexpr int kNum = 1, kDen = 2;
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
  static constexpr int kNum = 2, kDen = 1;
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
  // The next strip's bytes of this row, read one strip pass from now (as KnA8Tile).
  const int64_t pf = c0 + nc < N ? (c0 + nc) * L::kNum / L::kDen : -1;
  for (int64_t k = k0; k < k1; ++k) {
    L::Load(w + k * ld, c0, nc, wv);
    if (pf >= 0)
      for (int64_t b = 0; b < kStrip * L::kNum / L::kDen; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + k * ld + pf + b), _MM_HINT_T0);
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
  const int64_t chunks = std::min(strips, 2 * Workers(pool));
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
  const int64_t chunks = std::min<int64_t>(N, kNkChunksPerWorker * Workers(pool));
  ParallelFor(pool, chunks, [&](int64_t c) {
    for (int64_t n = N * c / chunks; n < N * (c + 1) / chunks; ++n) {
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


// ---- int8 activations (W8A8 / W4A8 at decode): AVX-512 VNNI integer dots ------------------
// The numerics of qeinsum's 'int8' path (qjax/core/tiled_path.py): activations quantized per
// row and per weight group (per row when ungrouped), scale = amax / 127 (1 where amax = 0, NaN
// where the block holds a NaN), q = round-half-even(x / scale) clipped to +-127; integer dots
// per group, rescaled by (activation scale x weight scale) in f32. vpdpbusd multiplies
// unsigned by signed bytes: weights are read as u = code + 128 (int8: xor 0x80) or
// u = code + 8 (int4: nibble xor 8), and off * sum(q) of the block is subtracted in int32.

// x (M, K) f32 -> q (M, K) int8, sa (M, nb) f32, sq (M, nb) int32; blocks of `unit` values.
void QuantizeRows(const float* x, int64_t M, int64_t K, int64_t unit, int8_t* q, float* sa,
                  int32_t* sq) {
  const int64_t nb = K / unit;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * unit;
      __m512 amax = _mm512_setzero_ps();
      __mmask16 nan = 0;
      for (int64_t i = 0; i < unit; i += 16) {
        const __mmask16 mk = Mask16(unit - i);
        const __m512 v = _mm512_maskz_loadu_ps(mk, xb + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      }
      float am = _mm512_reduce_max_ps(amax);
      const float scale = nan ? std::numeric_limits<float>::quiet_NaN()
                              : (am == 0.f ? 1.f : am / 127.f);
      const __m512 sv = _mm512_set1_ps(scale);
      const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      __m512i sum = _mm512_setzero_si512();
      int8_t* qb = q + m * K + b * unit;
      for (int64_t i = 0; i < unit; i += 16) {
        const __mmask16 mk = Mask16(unit - i);
        const __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(mk, xb + i), sv);
        const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
        sum = _mm512_add_epi32(sum, _mm512_maskz_mov_epi32(mk, c));
        _mm_mask_storeu_epi8(qb + i, mk, _mm512_cvtsepi32_epi8(c));
      }
      sa[m * nb + b] = scale;
      sq[m * nb + b] = _mm512_reduce_add_epi32(sum);
    }
  }
}

// 4 rows of 64 bytes -> 4 registers of 16 dwords, dword j of w[i] holding the 4 rows' bytes of
// column 16 * lane + 4 * i + (j % 4) (a 4 x 4 byte transpose within each 128-bit lane).
inline void Transpose4(const __m512i r[4], __m512i w[4]) {
  const __m512i t0 = _mm512_unpacklo_epi8(r[0], r[1]), t1 = _mm512_unpackhi_epi8(r[0], r[1]);
  const __m512i t2 = _mm512_unpacklo_epi8(r[2], r[3]), t3 = _mm512_unpackhi_epi8(r[2], r[3]);
  w[0] = _mm512_unpacklo_epi16(t0, t2);
  w[1] = _mm512_unpackhi_epi16(t0, t2);
  w[2] = _mm512_unpacklo_epi16(t1, t3);
  w[3] = _mm512_unpackhi_epi16(t1, t3);
}

// The inverse lane order: o[L] = columns 16 L .. 16 L + 15 of accumulators in Transpose4's order.
inline void Unpermute4(const __m512i a[4], __m512i o[4]) {
  const __m512i u0 = _mm512_shuffle_i32x4(a[0], a[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i u1 = _mm512_shuffle_i32x4(a[2], a[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i u2 = _mm512_shuffle_i32x4(a[0], a[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i u3 = _mm512_shuffle_i32x4(a[2], a[3], _MM_SHUFFLE(3, 2, 3, 2));
  o[0] = _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0));
  o[1] = _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1));
  o[2] = _mm512_shuffle_i32x4(u2, u3, _MM_SHUFFLE(2, 0, 2, 0));
  o[3] = _mm512_shuffle_i32x4(u2, u3, _MM_SHUFFLE(3, 1, 3, 1));
}

// kn, one strip of 64 weight bytes per row (int8: 64 columns; int4: 128), one block of `unit`
// rows [k0, k0 + unit), MB activation rows: y[m, c0 + j] += dot * sa[m, b] * s[c0 + j].
template <bool kI4, int MB>
inline void KnA8Tile(const int8_t* q, int64_t K, const float* sa, const int32_t* sq,
                     int64_t nb, int64_t b, const uint8_t* w, int64_t ld, int64_t k0,
                     int64_t unit, int64_t c0, int64_t nc, const float* s, float* y,
                     int64_t N, __m512i* carry, bool first, bool last) {
  // Rows [k0, k0 + unit) are a part of block b; `carry` holds the block's integer sums
  // between its parts (MB x R vectors): loaded unless `first`, stored unless `last`, and
  // only the last part rescales into y.
  constexpr int R = kI4 ? 8 : 4;
  __m512i acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < R; ++i)
      acc[m][i] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(carry + m * R + i);
  const int64_t bytes = kI4 ? nc / 2 : nc;
  const __mmask64 mk = Mask64(bytes);
  const uint8_t* wb = w + (kI4 ? c0 / 2 : c0);
  const __m512i flip = _mm512_set1_epi8(kI4 ? 0x88 : 0x80), low4 = _mm512_set1_epi8(0x0F);
  // The next strip's bytes of these rows: read by the next call, one strip pass from now.
  const bool pf = c0 + nc < N;
  const int64_t pfo = kI4 ? nc / 2 : nc;
  for (int64_t k = k0; k < k0 + unit; k += 4) {
    __m512i r[4], wv[R];
    for (int i = 0; i < 4; ++i)
      r[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, wb + (k + i) * ld), flip);
    if (pf)
      for (int i = 0; i < 4; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(wb + (k + i) * ld + pfo), _MM_HINT_T0);
    if (kI4) {
      __m512i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        lo[i] = _mm512_and_si512(r[i], low4);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(r[i], 4), low4);
      }
      Transpose4(lo, wv);
      Transpose4(hi, wv + 4);
    } else {
      Transpose4(r, wv);
    }
    for (int m = 0; m < MB; ++m) {
      int32_t a4;
      std::memcpy(&a4, q + m * K + k, 4);
      const __m512i av = _mm512_set1_epi32(a4);
      for (int i = 0; i < R; ++i) acc[m][i] = _mm512_dpbusd_epi32(acc[m][i], wv[i], av);
    }
  }
  if (!last) {
    for (int m = 0; m < MB; ++m)
      for (int i = 0; i < R; ++i) _mm512_storeu_si512(carry + m * R + i, acc[m][i]);
    return;
  }
  const int32_t off = kI4 ? 8 : 128;
  // int4: lo accumulators hold the even columns (packed byte i -> column 2 i), hi the odd.
  const __m512i ia = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i ib = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                      24, 8);
  for (int m = 0; m < MB; ++m) {
    const __m512i corr = _mm512_set1_epi32(off * sq[m * nb + b]);
    const __m512 as = _mm512_set1_ps(sa[m * nb + b]);
    __m512 f[R];
    if (kI4) {
      __m512i ol[4], oh[4];
      Unpermute4(acc[m], ol);
      Unpermute4(acc[m] + 4, oh);
      for (int L = 0; L < 4; ++L) {
        const __m512i a = _mm512_sub_epi32(ol[L], corr), h = _mm512_sub_epi32(oh[L], corr);
        f[2 * L] = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a, ia, h));
        f[2 * L + 1] = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a, ib, h));
      }
    } else {
      __m512i o[4];
      Unpermute4(acc[m], o);
      for (int L = 0; L < 4; ++L) f[L] = _mm512_cvtepi32_ps(_mm512_sub_epi32(o[L], corr));
    }
    float* ym = y + m * N + c0;
    for (int v = 0; v < R; ++v) {
      const __mmask16 mv = Mask16(nc - 16 * v);
      if (!mv) break;
      const __m512 sc = _mm512_mul_ps(as, _mm512_maskz_loadu_ps(mv, s + c0 + 16 * v));
      _mm512_mask_storeu_ps(ym + 16 * v, mv,
                            _mm512_fmadd_ps(f[v], sc, _mm512_maskz_loadu_ps(mv, ym + 16 * v)));
    }
  }
}

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
  constexpr int64_t cols = kI4 ? 128 : 64;
  constexpr int MBMAX = 2;
  const int64_t strips = (N + cols - 1) / cols;
  const int64_t threads = K * ld < kSerialBytes ? 1 : Workers(pool);
  const int64_t chunks = std::min(strips, threads == 1 ? 1 : 4 * threads);
  // A block longer than kA8Part rows (per-channel int8: the whole K) is walked in parts, so
  // that memory is read in runs of whole rows, not a column strip down the matrix.
  constexpr int64_t kA8Part = 128;
  constexpr int R = kI4 ? 8 : 4;
  const int64_t part = unit % kA8Part == 0 ? kA8Part : unit;
  auto body = [&](int64_t c) {
    const int64_t s0 = strips * c / chunks, s1 = strips * (c + 1) / chunks;
    std::unique_ptr<__m512i[]> carry(
        part < unit ? new __m512i[(s1 - s0) * ((M + MBMAX - 1) / MBMAX) * MBMAX * R] : nullptr);
    for (int64_t b = 0; b < nb; ++b) {
      const float* s = scale + b * N;
      for (int64_t p0 = b * unit; p0 < (b + 1) * unit; p0 += part) {
        const bool first = p0 == b * unit, last = p0 + part == (b + 1) * unit;
        for (int64_t st = s0; st < s1; ++st) {
          const int64_t c0 = st * cols, nc = std::min(cols, N - c0);
          for (int64_t m0 = 0; m0 < M; m0 += MBMAX) {
            const int64_t mb = std::min<int64_t>(MBMAX, M - m0);
            const int8_t* qm = q.get() + m0 * K;
            const float* sam = sa.get() + m0 * nb;
            const int32_t* sqm = sq.get() + m0 * nb;
            float* ym = y + m0 * N;
            __m512i* cm = carry ? carry.get() + ((st - s0) * ((M + MBMAX - 1) / MBMAX) +
                                                 m0 / MBMAX) * MBMAX * R : nullptr;
#define QJAX_KN(MBV) KnA8Tile<kI4, MBV>(qm, K, sam, sqm, nb, b, w, ld, p0, part, c0, nc, s, ym, N, cm, first, last)
            if (mb == 1) QJAX_KN(1); else QJAX_KN(2);
#undef QJAX_KN
          }
        }
      }
    }
  };
  if (chunks == 1) body(0); else ParallelFor(pool, chunks, body);
}

// nk: W (N, K), K contiguous. int4 rows pack K (byte i: k = 2 i low, 2 i + 1 high), so the
// activations of each 128-value chunk are split into its 64 even and 64 odd values once.
void SplitEvenOdd(int8_t* q, int64_t M, int64_t K) {
  static const __m512i ev = [] {
    alignas(64) int8_t idx[64];
    for (int i = 0; i < 64; ++i) idx[i] = static_cast<int8_t>(2 * i);
    return _mm512_load_si512(idx);
  }();
  const __m512i od = _mm512_add_epi8(ev, _mm512_set1_epi8(1));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 128) {
      int8_t* p = q + m * K + k;
      const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
      _mm512_storeu_si512(p, _mm512_permutex2var_epi8(a, ev, b));
      _mm512_storeu_si512(p + 64, _mm512_permutex2var_epi8(a, od, b));
    }
}

template <bool kI4, int MB>
inline void NkA8Row(const int8_t* q, int64_t K, const float* sa, const int32_t* sq, int64_t nb,
                    int64_t unit, const uint8_t* row, const float* s, float* y, int64_t N) {
  const __m512i flip = _mm512_set1_epi8(kI4 ? 0x88 : 0x80), low4 = _mm512_set1_epi8(0x0F);
  const int32_t off = kI4 ? 8 : 128;
  __m512 tot[MB];
  for (int m = 0; m < MB; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_si512();
    const int64_t k0 = b * unit;
    for (int64_t k = k0; k < k0 + unit; k += kI4 ? 128 : 64) {
      const __m512i r = _mm512_xor_si512(_mm512_loadu_si512(row + (kI4 ? k / 2 : k)), flip);
      if (kI4) {
        const __m512i lo = _mm512_and_si512(r, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(r, 4), low4);
        for (int m = 0; m < MB; ++m) {
          const int8_t* qm = q + m * K + k;
          acc[m] = _mm512_dpbusd_epi32(acc[m], lo, _mm512_loadu_si512(qm));
          acc[m] = _mm512_dpbusd_epi32(acc[m], hi, _mm512_loadu_si512(qm + 64));
        }
      } else {
        for (int m = 0; m < MB; ++m)
          acc[m] = _mm512_dpbusd_epi32(acc[m], r, _mm512_loadu_si512(q + m * K + k));
      }
    }
    const float sw = s[b];
    for (int m = 0; m < MB; ++m) {
      // The block's offset correction, in int32 on one lane: the lanes then sum exactly.
      const __m512i a = _mm512_mask_sub_epi32(acc[m], 1, acc[m],
                                              _mm512_set1_epi32(off * sq[m * nb + b]));
      tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(sa[m * nb + b] * sw),
                               tot[m]);
    }
  }
  for (int m = 0; m < MB; ++m) y[m * N] = _mm512_reduce_add_ps(tot[m]);
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
  // A few long ranges of rows (a thread streams each one), not many short ones: 4096 chunks of
  // 64 rows ran the Gemma head 1.6x slower than one thread did.
  const int64_t chunks =
      N * ld < kSerialBytes ? 1 : std::min<int64_t>(N, kNkChunksPerWorker * Workers(pool));
  constexpr int MBMAX = 4;
  auto body = [&](int64_t c) {
    const int64_t n0 = N * c / chunks, n1 = N * (c + 1) / chunks;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * ld;
      const float* s = scale + n * G;
      for (int64_t m0 = 0; m0 < M; m0 += MBMAX) {
        const int64_t mb = std::min<int64_t>(MBMAX, M - m0);
        const int8_t* qm = q.get() + m0 * K;
        const float* sam = sa.get() + m0 * nb;
        const int32_t* sqm = sq.get() + m0 * nb;
        float* ym = y + m0 * N + n;
        switch (mb) {
          case 1: NkA8Row<kI4, 1>(qm, K, sam, sqm, nb, unit, row, s, ym, N); break;
          case 2: NkA8Row<kI4, 2>(qm, K, sam, sqm, nb, unit, row, s, ym, N); break;
          case 3: NkA8Row<kI4, 3>(qm, K, sam, sqm, nb, unit, row, s, ym, N); break;
          default: NkA8Row<kI4, 4>(qm, K, sam, sqm, nb, unit, row, s, ym, N); break;
        }
      }
    }
  };
  if (chunks == 1) body(0); else ParallelFor(pool, chunks, body);
}


// ---- bf16 weights, kn, on AVX-512 BF16 dot products (vdpbf16ps) -------------------------
// Each f32 activation is split into bf16 hi + lo (x - hi rounded again), so the products keep
// ~16 of f32's 24 mantissa bits against exact bf16 weights: two bf16 dots per pair of rows
// instead of widening every weight to f32 (the widening form read Gemma's 640 x 2048 bf16
// projection at ~10 GB/s).
// x (M, K) -> xp (M, K/2 rounded up) dwords of (x[2j], x[2j+1]) as bf16 pairs, hi and lo.
void SplitBf16Pairs(const float* x, int64_t M, int64_t K, uint32_t* hi, uint32_t* lo) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < K2; ++j) {
      float a = x[m * K + 2 * j], b = 2 * j + 1 < K ? x[m * K + 2 * j + 1] : 0.f;
      const __m128 v = _mm_set_ps(0.f, 0.f, b, a);
      const __m128bh h = _mm_cvtneps_pbh(v);
      const __m128 hf = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32((__m128i)h), 16));
      const __m128bh l = _mm_cvtneps_pbh(_mm_sub_ps(v, hf));
      hi[m * K2 + j] = static_cast<uint32_t>(_mm_cvtsi128_si32((__m128i)h));
      lo[m * K2 + j] = static_cast<uint32_t>(_mm_cvtsi128_si32((__m128i)l));
    }
  }
}

template <int MB>
inline void KnBf16DpTile(const uint32_t* xh, const uint32_t* xl, int64_t K2, const uint16_t* w,
                         int64_t N, int64_t K, int64_t k0, int64_t k1, int64_t c0, int64_t nc,
                         float* y) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
  const __mmask32 m0 = static_cast<__mmask32>(Mask64(std::min<int64_t>(nc, 32)));
  const __mmask32 m1 = static_cast<__mmask32>(Mask64(std::max<int64_t>(nc - 32, 0)));
  const bool pf = c0 + nc < N;
  for (int64_t k = k0; k < k1; k += 2) {
    const uint16_t* r0 = w + k * N + c0;
    const bool two = k + 1 < K;
    const uint16_t* r1 = r0 + N;
    const __m512i a0 = _mm512_maskz_loadu_epi16(m0, r0), a1 = _mm512_maskz_loadu_epi16(m1, r0 + 32);
    const __m512i b0 = two ? _mm512_maskz_loadu_epi16(m0, r1) : _mm512_setzero_si512();
    const __m512i b1 = two ? _mm512_maskz_loadu_epi16(m1, r1 + 32) : _mm512_setzero_si512();
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(r0 + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r0 + 96), _MM_HINT_T0);
      if (two) {
        _mm_prefetch(reinterpret_cast<const char*>(r1 + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(r1 + 96), _MM_HINT_T0);
      }
    }
    // dword lanes of (row k, row k + 1) per column, in unpack order (undone at the store)
    const __m512bh p[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                           (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
    for (int m = 0; m < MB; ++m) {
      const __m512bh h = (__m512bh)_mm512_set1_epi32(static_cast<int>(xh[m * K2 + k / 2]));
      const __m512bh l = (__m512bh)_mm512_set1_epi32(static_cast<int>(xl[m * K2 + k / 2]));
      for (int i = 0; i < 4; ++i)
        acc[m][i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[m][i], p[i], h), p[i], l);
    }
  }
  for (int m = 0; m < MB; ++m) {
    // unpacklo holds columns 8 L + 0..3 of lane L, unpackhi 8 L + 4..7 (per 32 columns)
    __m512 o[4];
    for (int h2 = 0; h2 < 2; ++h2) {
      const __m512 lo = acc[m][2 * h2], hi = acc[m][2 * h2 + 1];
      const __m512 t0 = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
      const __m512 t1 = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
      o[2 * h2] = _mm512_shuffle_f32x4(t0, t0, _MM_SHUFFLE(3, 1, 2, 0));
      o[2 * h2 + 1] = _mm512_shuffle_f32x4(t1, t1, _MM_SHUFFLE(3, 1, 2, 0));
    }
    float* ym = y + m * N + c0;
    for (int v = 0; v < 4; ++v) {
      const __mmask16 mv = Mask16(nc - 16 * v);
      if (!mv) break;
      _mm512_mask_storeu_ps(ym + 16 * v, mv,
                            _mm512_add_ps(o[v], _mm512_maskz_loadu_ps(mv, ym + 16 * v)));
    }
  }
}

void KnBf16DpDriver(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                    const uint16_t* w, float* y) {
  const int64_t K2 = (K + 1) / 2;
  std::unique_ptr<uint32_t[]> xh(new uint32_t[M * K2]), xl(new uint32_t[M * K2]);
  SplitBf16Pairs(x, M, K, xh.get(), xl.get());
  std::memset(y, 0, sizeof(float) * M * N);
  constexpr int64_t cols = 64, kb = 128;
  const int64_t strips = (N + cols - 1) / cols;
  const int64_t threads = 2 * K * N < kSerialBytesBf16 ? 1 : Workers(pool);
  const int64_t chunks = std::min(strips, threads == 1 ? 1 : 4 * threads);
  auto body = [&](int64_t c) {
    const int64_t s0 = strips * c / chunks, s1 = strips * (c + 1) / chunks;
    for (int64_t b0 = 0; b0 < K; b0 += kb) {
      const int64_t b1 = std::min(K, b0 + kb);
      for (int64_t st = s0; st < s1; ++st) {
        const int64_t c0 = st * cols, nc = std::min(cols, N - c0);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int64_t mb = std::min<int64_t>(4, M - m0);
          const uint32_t* h = xh.get() + m0 * K2;
          const uint32_t* l = xl.get() + m0 * K2;
          float* ym = y + m0 * N;
          switch (mb) {
            case 1: KnBf16DpTile<1>(h, l, K2, w, N, K, b0, b1, c0, nc, ym); break;
            case 2: KnBf16DpTile<2>(h, l, K2, w, N, K, b0, b1, c0, nc, ym); break;
            case 3: KnBf16DpTile<3>(h, l, K2, w, N, K, b0, b1, c0, nc, ym); break;
            default: KnBf16DpTile<4>(h, l, K2, w, N, K, b0, b1, c0, nc, ym); break;
          }
        }
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
  if (kKn && std::is_same<L, LoadBf16>::value)
    KnBf16DpDriver(pool, xp, M, K, N, reinterpret_cast<const uint16_t*>(wp), yp);
  else if (kKn) KnDriver<L>(pool, xp, M, K, N, wp, ld, G, scale, yp);
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
