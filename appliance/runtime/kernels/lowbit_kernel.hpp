// The low-bit matmul kernel, written once and compiled once per ISA (kernel_avx2.cpp, kernel_avxvnni.cpp,
// kernel_avx512vnni.cpp include it with their own -m flags and LOWBIT_DOT2 / LOWBIT_DOT1). Everything here sits in
// an anonymous namespace: each translation unit keeps its own copy, so the linker never merges an AVX-512 instance
// into the AVX2 path (the one-definition-rule trap of per-ISA builds).
//
// y[m, n] = sum_g s[n,g] * sum_{k in g} (q[n,k] - z[n,g]) * x[m,k]
//         ~ sum_g s[n,g] * (sum_{o in g} dx[m,o] * <q[n,o], xq[m,o]>  -  z[n,g] * sum_{o in g} dx[m,o] * sum xq[m,o])
// x is quantized to int8 per octet o of 8 values (dx = max|x| / 127: quantize_block), stored in blocks of 32. The
// zero-point term sums the quantized x, not the exact x: then the two terms are exactly the dot of (q - z) with the
// quantized x, and the rounding error scales with |q - z| (<= 15 - z) instead of q (<= 15). With the exact sum, Q4_1
// grids (z ~ 7.5) measured a 1.2-2.2% error of the largest output on the default model's layers, against 0.4-0.9%
// this way (both with one scale per block of 32).
//
// Weights keep OpenVINO's u4 byte order within a row: byte j of a 32-block holds elements 2j (low nibble) and 2j+1
// (high nibble); rewrite.py interleaves rows by groups of rg at load (lowbit_kernel.h, rows_of below). One 32-byte load is two blocks; AND and shift+AND give their even and their odd elements. The
// activations are stored to match, per pair of blocks (b, b+1): [b even 16, b+1 even 16, b odd 16, b+1 odd 16]
// (a last unpaired block: [even 16, odd 16]). Against one block per 256-bit register (unpacked through 128-bit
// halves), measured standalone on 1 thread at 1536 x 1536, g128, AVX2 path, best of 200 interleaved on a loaded
// box: 2.2-2.3 -> 1.5 ns per block and weight row at M = 1, 1.21 -> 0.88 at M = 4.
//
// A pass takes MT rows of x and NR weight rows (tile): MT x NR independent accumulator chains, each activation load
// shared by NR rows and each unpacked weight by MT. With one weight row per pass at M = 1 the op was latency-bound
// on its single FMA chain and ran at OpenVINO's speed (0.93-0.96 of its AMX bf16 time at the Qwen2.5-1.5B MLP
// shapes); with 8 rows per pass 0.67 (bench.kernels, 40 layers: docs/performance-log.md).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lowbit_kernel.h"
#include "vec_avx2.hpp"
#include "vec_exp.hpp"

// The dot of u8 (bits = 8) weights: the ISA's own unless it defines one (AVX2: s8 weights, kernel_avx2.cpp).
#ifndef LOWBIT_DOT2_W8
#define LOWBIT_DOT2_W8 LOWBIT_DOT2
#endif

namespace {

// The dot of a pair of blocks (even halves, odd halves) as 8 i32 lanes, for u4 or u8 weights.
template <bool W8>
inline __m256i dot2(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    return W8 ? LOWBIT_DOT2_W8(lo, xlo, hi, xhi) : LOWBIT_DOT2(lo, xlo, hi, xhi);
}

constexpr int BLOCK = 32;
// Accumulator chains per pass (rows of x times weight rows): 4 fill AVX2's 16 ymm registers (with the group
// accumulators, x and the unpacked weights); AVX-512VL's 32 take 8 (kernel_avx512vnni.cpp): at M = 1 eight weight
// rows per pass took 0.88-0.95 of four's time (standalone, 1 thread, 8960x1536 / 1536x8960 / g32, loaded box).
#ifndef LOWBIT_CHAINS
#define LOWBIT_CHAINS 4
#endif
constexpr int CHAINS = LOWBIT_CHAINS;
constexpr int MTILE = 4;  // rows of x per pass over a weight row: the row stays in L1, read from memory once

// The sum of the 8 lanes of v.
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ps(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One block of 32 floats to int8 as [its 16 even elements, its 16 odd ones], each octet (elements 8i .. 8i + 7)
// on its own scale d[i] = max|octet| / 127, q = round(v / d[i]) (division, rounded to nearest even as nearbyint);
// returns the block's sum of d[i] * q. An octet is what one i32 lane of every path's dot sums (maddubs + madd,
// vpdpbusd: the layout above), so per-octet scales cost the dot nothing (the scale vectors were 8 lanes already)
// and bound each value's rounding by its octet's largest instead of its block's: on a Zen 1 box our kernels' TVD
// from OpenVINO's next-token distribution at Qwen2.5-1.5B went 0.0180 -> 0.0137 (docs/performance-log.md).
// Vectorized: the scalar loop was ~12% of the op at M = 1 (41 us at K = 8960 against ~300 us of rows on 2 threads).
// `span` (1, 2 or 4 octets): one scale for each run of that many octets, their largest (the lanes tile's rows of x:
// lanes_tile). `natural`: out in element order instead of evens and odds. `second` (natural only): each value's
// rounding error too, as an int8 digit in 1/128ths of its step (|x / d - q| <= 1/2: within +-64; lanes_tile's TWO),
// and the returned sum is of d (q + second / 128).
inline float quantize_block(const float* v, __m128& d, __m256i& out, int span = 1, bool natural = false,
                            __m256i* second = nullptr) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 f[4];
    __m128 t[4];
    for (int i = 0; i < 4; ++i) {
        f[i] = _mm256_loadu_ps(v + 8 * i);
        const __m256 a = _mm256_and_ps(f[i], abs_mask);
        t[i] = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    }
    // The four octets' maxima as one vector: [max t0, max t1, max t2, max t3].
    const __m128 u01 = _mm_max_ps(_mm_unpacklo_ps(t[0], t[1]), _mm_unpackhi_ps(t[0], t[1]));
    const __m128 u23 = _mm_max_ps(_mm_unpacklo_ps(t[2], t[3]), _mm_unpackhi_ps(t[2], t[3]));
    d = _mm_div_ps(_mm_max_ps(_mm_movelh_ps(u01, u23), _mm_movehl_ps(u23, u01)), _mm_set1_ps(127.f));
    if (span >= 2) d = _mm_max_ps(d, _mm_shuffle_ps(d, d, _MM_SHUFFLE(2, 3, 0, 1)));
    if (span >= 4) d = _mm_max_ps(d, _mm_shuffle_ps(d, d, _MM_SHUFFLE(1, 0, 3, 2)));
    // An octet of zeros (or denormals flushed, or a NaN): d = 0, q = 0.
    const __m128 live = _mm_cmpgt_ps(d, _mm_setzero_ps());
    d = _mm_and_ps(d, live);
    // Division, not a multiplication by 1/d: 1/d overflows when d is denormal.
    const __m256 div = _mm256_castps128_ps256(_mm_blendv_ps(_mm_set1_ps(1.f), d, live));
    const __m256 keep = _mm256_castps128_ps256(live);
    __m256i q[4], r[4];
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        const __m256i lane = _mm256_set1_epi32(i);
        const __m256 di = _mm256_permutevar8x32_ps(div, lane), live_i = _mm256_permutevar8x32_ps(keep, lane);
        const __m256 t = _mm256_div_ps(f[i], di);
        q[i] = _mm256_and_si256(_mm256_cvtps_epi32(t), _mm256_castps_si256(live_i));
        __m256 value = _mm256_cvtepi32_ps(q[i]);
        if (second) {  // |t - q| <= 1/2: the error's digit in 1/128ths of d is within +-64
            r[i] = _mm256_and_si256(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(t, value), _mm256_set1_ps(128.f))),
                                    _mm256_castps_si256(live_i));
            value = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r[i]), _mm256_set1_ps(1.f / 128), value);
        }
        sum = _mm256_fmadd_ps(value, di, sum);
    }
    // packs (|q| <= 127: no saturation) leave dwords of 4 bytes as [0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, ...]:
    // back to natural order, then per 128-bit lane its evens and its odds, then the lanes' evens together.
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    b = _mm256_permutevar8x32_epi32(b, order);
    if (natural) {
        out = b;
        if (second)
            *second = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])), order);
        return hsum(sum);
    }
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    out = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, split), 0xd8);
    return hsum(sum);
}

// Quantizes blocks [b0, b1) of rows of x [M, K] to xq [M, Kp] (paired layout above), dxv [M, pairs, 8] (lanes 0-3:
// the pair's first block's four octets' dx, 4-7: its second's, 0 for an unpaired last block) and per-group sums
// xs [M, G] of dx * xq. b0 and b1 (unless b1 is the last block) start a pair and a group: ranges run in parallel.
// `wide` (tile_zmm's u4, whose K is a multiple of 128): each two pairs' halves as one 512-bit register reads them,
// [even halves of both pairs, odd halves of both], b0 a multiple of 4 blocks. `natural` (lanes_tile): each block in
// element order, its octets' dx in order too (dxv's layout is then octet by octet), `span` octets to a scale; `xq2`
// (natural only): the second digits (quantize_block's `second`) as xq, and xs sums both digits.
enum class XOrder { paired, wide, natural };

inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int64_t gs, int64_t G, int8_t* xq,
                          float* dxv, float* xs, int64_t b0, int64_t b1, XOrder order = XOrder::paired,
                          int span = 1, int8_t* xq2 = nullptr) {
    const bool wide = order == XOrder::wide;
    const int64_t blocks = Kp / BLOCK, pairs = (blocks + 1) / 2;
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K;
        int8_t* qr = xq + m * Kp;
        float* dr = dxv + m * pairs * 8;
        float* sr = xs + m * G;
        for (int64_t g = b0 * BLOCK / gs; g < (b1 * BLOCK + gs - 1) / gs && g < G; ++g) sr[g] = 0.f;
        for (int64_t i = b0 / 2 * 8; i < (b1 + 1) / 2 * 8; ++i) dr[i] = 0.f;
        for (int64_t b = b0; b < b1; ++b) {
            const float* v = xr + b * BLOCK;
            float tail[BLOCK];
            if ((b + 1) * BLOCK > K) {  // the last block past K: zeros
                for (int i = 0; i < BLOCK; ++i) tail[i] = b * BLOCK + i < K ? v[i] : 0.f;
                v = tail;
            }
            __m128 d;
            __m256i q, q2;
            const float sum = quantize_block(v, d, q, span, order == XOrder::natural, xq2 ? &q2 : nullptr);
            const int64_t pair = b / 2, second = b % 2;
            _mm_storeu_ps(dr + pair * 8 + second * 4, d);
            sr[(b * BLOCK) / gs] += sum;
            if (order == XOrder::natural) {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + b * BLOCK), q);
                if (xq2) _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq2 + m * Kp + b * BLOCK), q2);
                continue;
            }
            int8_t* base = wide ? qr + pair / 2 * 4 * BLOCK + pair % 2 * BLOCK : qr + pair * 2 * BLOCK;
            const int64_t odd = wide ? 2 * BLOCK : BLOCK;  // where the odd halves start
            if (pair * 2 + 1 < blocks) {  // [first even 16, second even 16, first odd 16, second odd 16]
                _mm_storeu_si128(reinterpret_cast<__m128i*>(base + second * 16), _mm256_castsi256_si128(q));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(base + odd + second * 16), _mm256_extracti128_si256(q, 1));
            } else {  // an unpaired last block: [even 16, odd 16]
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(base), q);
            }
        }
    }
}

// Pair p of blocks of a weight row (32 bytes of u4, or 64 of u8 in the paired layout) as its even and odd halves;
// `stride`: bytes from one pair of the row to the next (rg rows' pairs sit between: lowbit_kernel.h).
template <bool W8>
inline void load_pair(const uint8_t* w, int64_t p, int64_t stride, __m256i& lo, __m256i& hi) {
    if (W8) {
        lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * stride));
        hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * stride + BLOCK));
    } else {
        const __m256i mask = _mm256_set1_epi8(0x0f);
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * stride));
        lo = _mm256_and_si256(raw, mask);
        hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    }
}

// Pair p of rows [0, MT) of the quantized x (xrow) as its even and odd halves, and their blocks' scales (drow).
template <int MT>
inline void load_x(const int8_t* xrow, const float* drow, int64_t Kp, int64_t pairs, int64_t p, __m256i* xl,
                   __m256i* xh, __m256* dv) {
    for (int m = 0; m < MT; ++m) {
        xl[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xrow + m * Kp + p * 2 * BLOCK));
        xh[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xrow + m * Kp + p * 2 * BLOCK + BLOCK));
        dv[m] = _mm256_loadu_ps(drow + (m * pairs + p) * 8);
    }
}

// Software prefetch PREFETCH bytes ahead in a weight row, once per 64-byte line: with NR rows per pass the hardware
// prefetcher follows NR streams. At M = 1, weights from memory (48 layers), 1 thread, loaded box: 1024 bytes ahead
// took 0.76-1.0 of the time without (8960x1536 / 1536x8960 g128, AVX2 and AVX512-VNNI), 512 ahead 0.81-0.95.
// With grouped rows (one contiguous run per pass) on the AVX2 EPYC (standalone, 1 thread, load 11): 256, 1024, 2048
// and 4096 ahead within noise of each other (medians 1.1-1.8 ms a layer), none ahead 1.4-1.8 ms.
constexpr int64_t PREFETCH = 1024;

// `off`: the row's first pair's offset in its group of rows (the lines are the group's).
inline void prefetch(const uint8_t* w, int64_t p, int64_t stride, int64_t off) {
    if ((p * stride + off) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + p * stride + PREFETCH), _MM_HINT_T0);
}

// Eight f16 values h[g .. g + 8) as floats.
inline __m256 f16x8(const uint16_t* h, int64_t g) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + g)));
}

// The same, lanes at or past `end` zero (never read past the row's table). A short tail loads the table's last 8
// values and moves them down: copying it through the stack (a store-forwarding stall per call) took 20% of the
// decode tile at K = 1536 (12 groups of 128: a tail at every refresh of its scales, zero points and bias).
inline __m256 f16x8(const uint16_t* h, int64_t g, int64_t end) {
    if (g + 8 <= end) return f16x8(h, g);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    if (end >= 8) {
        const int shift = static_cast<int>(g + 8 - end);  // 1 .. 7: lane i takes the loaded lane i + shift
        const __m256i from = _mm256_add_epi32(lane, _mm256_set1_epi32(shift));
        const __m256 moved = _mm256_permutevar8x32_ps(f16x8(h, end - 8), from);
        return _mm256_and_ps(moved, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8 - shift), lane)));
    }
    alignas(16) uint16_t t[8] = {};
    for (int64_t i = g; i < end; ++i) t[i - g] = h[i];
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

// A weight row's zero-point terms bias[m] = sum_g s[g] z[g] xs[m, g] for rows [m0, m0 + MT) of x; sz: the row's
// [G scales, G zero points], f16 as the IR has them (lowbit_kernel.h). Eight groups per step: the products cost a
// multiply per 8 groups, against the 4 bytes per group a stored f32 product added to every pass's reads.
template <int MT>
inline void row_bias(const LowbitArgs& a, const uint16_t* sz, const float* xs, int64_t m0, float* bias) {
    __m256 bv[MT];
    for (int m = 0; m < MT; ++m) bv[m] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= a.G; g += 8) {
        const __m256 b = _mm256_mul_ps(f16x8(sz, g), f16x8(sz + a.G, g));
        for (int m = 0; m < MT; ++m) bv[m] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xs + (m0 + m) * a.G + g), bv[m]);
    }
    for (int m = 0; m < MT; ++m) bias[m] = hsum(bv[m]);
    for (; g < a.G; ++g) {
        const float b = _cvtsh_ss(sz[g]) * _cvtsh_ss(sz[a.G + g]);
        for (int m = 0; m < MT; ++m) bias[m] += b * xs[(m0 + m) * a.G + g];
    }
}

// Weight rows [n0, n0 + NR) against rows [m0, m0 + MT) of x: MT x NR independent accumulator chains. One chain
// (NR = 1 at M = 1) waits on its FMA's latency every pair of blocks; NR weight rows per pass share each activation
// load and keep NR chains in flight. MT x NR <= CHAINS.
template <int MT, int NR, bool W8>
inline void tile(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m0, int64_t n0) {
    const int64_t blocks = a.Kp / BLOCK, pairs = (blocks + 1) / 2, full = blocks / 2;
    const int64_t pair_bytes = W8 ? 2 * BLOCK : BLOCK, stride = a.rg * pair_bytes;
    const int64_t per_group = a.gs / BLOCK;  // blocks per group: 1 (Q4_1) or even (4: NNCF's g128)
    const uint8_t* w[NR];     // the row's first pair
    const uint8_t* last[NR];  // its unpaired last block
    int64_t off[NR];          // w[r]'s offset in its group of rows
    const uint16_t* sf[NR];   // the row's group scales (f16)
    alignas(32) float sb[NR][8];  // eight of them as floats: groups [g - g % 8, g - g % 8 + 8) of the pass
    float bias[NR][MT];
    __m256 acc[MT][NR];
    for (int r = 0; r < NR; ++r) {
        const int64_t n = n0 + r, in_group = n % a.rg;
        const uint8_t* group = a.w + (n - in_group) * (W8 ? a.Kp : a.Kp / 2);
        off[r] = in_group * pair_bytes;
        w[r] = group + off[r];
        last[r] = group + full * stride + in_group * (pair_bytes / 2);
        sf[r] = a.sz + (n0 + r) * 2 * a.G;
        row_bias<MT>(a, sf[r], xs, m0, bias[r]);
        for (int m = 0; m < MT; ++m) acc[m][r] = _mm256_setzero_ps();
    }
    const int8_t* xrow = xq + m0 * a.Kp;
    const float* drow = dxv + m0 * pairs * 8;
    if (per_group == 1) {
        // Groups of one block (Q4_1): the pair's two scales as lanes 0-3 / 4-7.
        for (int64_t p = 0; p < full; ++p) {
            __m256i xl[MT], xh[MT];
            __m256 dv[MT];
            load_x<MT>(xrow, drow, a.Kp, pairs, p, xl, xh, dv);
            if (p % 4 == 0)
                for (int r = 0; r < NR; ++r) _mm256_store_ps(sb[r], f16x8(sf[r], 2 * p, a.G));
            for (int r = 0; r < NR; ++r) {
                const float* s = sb[r] + 2 * (p % 4);
                const __m256 sv = _mm256_set_m128(_mm_broadcast_ss(s + 1), _mm_broadcast_ss(s));
                prefetch(w[r], p, stride, off[r]);
                __m256i lo, hi;
                load_pair<W8>(w[r], p, stride, lo, hi);
                for (int m = 0; m < MT; ++m)
                    acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2<W8>(lo, xl[m], hi, xh[m])),
                                                _mm256_mul_ps(dv[m], sv), acc[m][r]);
            }
        }
    } else {
        // Groups of an even number of blocks: accumulate the group's pairs, then scale once.
        const int64_t pairs_per_group = per_group / 2;
        for (int64_t g = 0; g * pairs_per_group < full; ++g) {
            __m256 gacc[MT][NR];
            for (int m = 0; m < MT; ++m)
                for (int r = 0; r < NR; ++r) gacc[m][r] = _mm256_setzero_ps();
            const int64_t p1 = (g + 1) * pairs_per_group < full ? (g + 1) * pairs_per_group : full;
            for (int64_t p = g * pairs_per_group; p < p1; ++p) {
                __m256i xl[MT], xh[MT];
                __m256 dv[MT];
                load_x<MT>(xrow, drow, a.Kp, pairs, p, xl, xh, dv);
                for (int r = 0; r < NR; ++r) {
                    prefetch(w[r], p, stride, off[r]);
                    __m256i lo, hi;
                    load_pair<W8>(w[r], p, stride, lo, hi);
                    for (int m = 0; m < MT; ++m)
                        gacc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2<W8>(lo, xl[m], hi, xh[m])), dv[m],
                                                     gacc[m][r]);
                }
            }
            if (g % 8 == 0)
                for (int r = 0; r < NR; ++r) _mm256_store_ps(sb[r], f16x8(sf[r], g, a.G));
            for (int r = 0; r < NR; ++r) {
                const __m256 vs = _mm256_broadcast_ss(sb[r] + g % 8);
                for (int m = 0; m < MT; ++m) acc[m][r] = _mm256_fmadd_ps(gacc[m][r], vs, acc[m][r]);
            }
        }
    }
    if (blocks % 2) {  // the last block alone: [even 16, odd 16], 128-bit halves
        const int64_t b = blocks - 1;
        for (int r = 0; r < NR; ++r) {
            const float s = _cvtsh_ss(sf[r][b / per_group]);
            __m128i lo, hi;
            if (W8) {  // [even 16, odd 16], as the activations
                lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(last[r]));
                hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(last[r] + 16));
            } else {
                const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(last[r]));
                const __m128i m4 = _mm_set1_epi8(0x0f);
                lo = _mm_and_si128(raw, m4);
                hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
            }
            for (int m = 0; m < MT; ++m) {
                const int8_t* xp = xrow + m * a.Kp + b * BLOCK;
                const __m128i xlo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xp));
                const __m128i xhi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xp + 16));
                // u8 weights through their dot (zero upper halves add nothing).
                const __m128i dot =
                    W8 ? _mm256_castsi256_si128(LOWBIT_DOT2_W8(_mm256_zextsi128_si256(lo), _mm256_zextsi128_si256(xlo),
                                                            _mm256_zextsi128_si256(hi), _mm256_zextsi128_si256(xhi)))
                       : _mm_madd_epi16(_mm_add_epi16(_mm_maddubs_epi16(lo, xlo), _mm_maddubs_epi16(hi, xhi)),
                                        _mm_set1_epi16(1));
                const __m128 d = _mm_loadu_ps(drow + (m * pairs + pairs - 1) * 8);  // its octets' scales
                const __m128 scaled = _mm_mul_ps(_mm_cvtepi32_ps(dot), _mm_mul_ps(d, _mm_set1_ps(s)));
                const __m256 part = _mm256_castps128_ps256(scaled);
                acc[m][r] = _mm256_add_ps(acc[m][r], _mm256_insertf128_ps(part, _mm_setzero_ps(), 1));
            }
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int r = 0; r < NR; ++r) a.y[(m0 + m) * a.N + n0 + r] = hsum(acc[m][r]) - bias[r][m];
}

// Rows [n0, n1) of the output for rows [m0, m0 + MT) of x, NR weight rows per pass (then one at a time).
template <int MT, int NR, bool W8>
inline void rows_tile(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m0,
                      int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) tile<MT, NR, W8>(a, xq, dxv, xs, m0, n);
    for (; n < n1; ++n) tile<MT, 1, W8>(a, xq, dxv, xs, m0, n);
}

// Weight rows per pass for MT rows of x.
constexpr int nr(int mt) { return CHAINS / mt > 1 ? CHAINS / mt : 1; }

// Weights in groups of rg rows (lowbit_kernel.h) are read a whole group per pass (MT = 1, NR = CHAINS rows: one
// contiguous run), once per row of x while the group sits in L1/L2. MT = 4 passes of one row each would read every
// line of a group in four strided half-passes. Standalone on the 2-vCPU AVX2 EPYC (1 thread, 10 layers of NNCF u4
// g128, thread CPU time, medians of 8, load 10; 8960x1536 / 1536x8960), this order against row-major weights with
// MT = 4: M = 1 1.67 / 1.31 ms vs 2.63 / 1.50; M = 2 1.98 / 1.92 vs 2.72 / 2.11; M = 4 3.75 / 3.23 vs 3.10 / 2.36
// (slower: compute-bound there, MT = 4 shares each unpacked weight); M = 16 12.9 / 9.3 vs 10.7 / 11.6.

// From GEMM_ROWS rows of x on, a group's weight rows meet MTILE rows of x per pass, GEMM_NR weight rows at a time
// (the rest one row of x per pass): each unpacked weight serves 4 rows of x, each loaded row of x 2 weight rows.
// Quiet AVX2 EPYC (bench.kernels, 8 layers, 7 reps; ours / OpenVINO's time at 8960x1536 / 1536x8960 / 1536x1536),
// one row of x per pass -> this: M = 4 0.74 / 0.57 / 0.82 -> 0.62 / 0.66 / 0.66; M = 8 1.09 / 0.81 / 1.11 ->
// 0.84 / 0.80 / 0.87; M = 12 1.20 / 0.90 / 1.24 -> 0.99 / 0.89 / 0.97; M = 16 1.23 / 0.98 -> 1.06 / 0.94 / 1.04;
// M = 64 / 256 still 1.1-1.3. This general tile spills its accumulators (prefill_tile below does not); it now runs
// only the grouped weights prefill_fits refuses (u8, an unpaired last block).
constexpr int64_t GEMM_ROWS = 4;
constexpr int GEMM_NR = 2;
// From this many rows of x on, weights prefill_fits takes run prefill_rows rather than the general tile above.
// Quiet AVX2 EPYC, bench.kernels as above, ours / OpenVINO's time, general tile -> prefill tile: M = 4 0.58 / 0.56 /
// 0.66 -> 0.45 / 0.48 / 0.51, M = 8 0.93 / 0.77 / 0.88 -> 0.61 / 0.61 / 0.65, M = 16 1.09 / 0.93 / 1.05 -> 0.73 /
// 0.68 / 0.77, M = 64 1.24 / 1.14 / 1.28 -> 0.88 / 0.78 / 0.90 (one run each, the scratch aligned in both).
constexpr int64_t PREFILL_ROWS = 4;

// The prefill tile: rows [m0, m0 + 4) of x against weight rows [n0, n0 + NR) of one group of rows (u4), an even
// number of blocks, groups of PPG pairs of blocks (1, 2, 4: g64, g128, g256) or, PPG = 0, of one block (Q4_1's g32:
// a pair's two scales as lanes 0-3 / 4-7, as dxv). Each pair's NR weight rows are unpacked first and every row of x
// (2 registers and its scales) meets them; the 4 x NR group sums fold into an L1 array once per group. The general
// tile keeps 4 x NR group sums, 4 x NR totals and 12 registers of x live, twice AVX2's 16: the compiler spilled
// the accumulators and every FMA went through the stack. Standalone (1 thread, weights in L2, 64-byte aligned
// scratch, M = 64, u4 g128; quiet AVX2 EPYC): 1536 / 8960 long rows 36 / 41 -> 54 / 64 MAC/ns, where OpenVINO's
// f32 GEMM runs 40-43 per thread. PPG is a compile-time count: unrolling the group's two pairs took 50 -> 53 MAC/ns
// at K = 8960 (before the aligned scratch). Left: the per-pass row_bias and horizontal sums, ~8% at K = 1536.
template <int NR, int PPG>
inline void prefill_tile(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m0,
                         int64_t n0) {
    constexpr int MT = 4;
    const int64_t pairs = a.Kp / (2 * BLOCK), stride = a.rg * BLOCK;
    const uint8_t* w[NR];
    const uint16_t* sf[NR];
    float bias[NR][MT];
    for (int r = 0; r < NR; ++r) {
        const int64_t n = n0 + r, in_group = n % a.rg;
        w[r] = a.w + (n - in_group) * (a.Kp / 2) + in_group * BLOCK;
        sf[r] = a.sz + n * 2 * a.G;
        row_bias<MT>(a, sf[r], xs, m0, bias[r]);
    }
    const int8_t* xr[MT];
    const float* dr[MT];
    for (int m = 0; m < MT; ++m) {
        xr[m] = xq + (m0 + m) * a.Kp;
        dr[m] = dxv + (m0 + m) * pairs * 8;
    }
    alignas(32) float acc[MT][NR][8] = {};
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (int64_t g = 0, p = 0; p < pairs; ++g) {
        __m256 gacc[MT][NR];
        for (int m = 0; m < MT; ++m)
            for (int r = 0; r < NR; ++r) gacc[m][r] = _mm256_setzero_ps();
        constexpr int64_t STEP = PPG ? PPG : 1;
        const int64_t p1 = p + STEP < pairs ? p + STEP : pairs;
        for (; p < p1; ++p) {
            __m256i lo[NR], hi[NR];
            for (int r = 0; r < NR; ++r) {
                const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + p * stride));
                lo[r] = _mm256_and_si256(raw, mask);
                hi[r] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            }
            for (int m = 0; m < MT; ++m) {
                const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[m] + p * 2 * BLOCK));
                const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[m] + p * 2 * BLOCK + BLOCK));
                const __m256 dv = _mm256_loadu_ps(dr[m] + p * 8);
                for (int r = 0; r < NR; ++r)
                    gacc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2<false>(lo[r], xl, hi[r], xh)), dv, gacc[m][r]);
            }
        }
        for (int r = 0; r < NR; ++r) {
            const __m256 s = PPG ? _mm256_set1_ps(_cvtsh_ss(sf[r][g]))
                                 : _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(sf[r][2 * g + 1])),
                                                   _mm_set1_ps(_cvtsh_ss(sf[r][2 * g])));
            for (int m = 0; m < MT; ++m)
                _mm256_store_ps(acc[m][r], _mm256_fmadd_ps(gacc[m][r], s, _mm256_load_ps(acc[m][r])));
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int r = 0; r < NR; ++r) a.y[(m0 + m) * a.N + n0 + r] = hsum(_mm256_load_ps(acc[m][r])) - bias[r][m];
}

// Whether prefill_tile takes these weights: u4 in groups of an even number of rows, groups of 32, 64, 128 or 256
// values, an even number of blocks (rewrite.prefill_fits says the same for the backends).
inline bool prefill_fits(const LowbitArgs& a) {
    return a.bits == 4 && a.rg % 2 == 0 && (a.gs == 32 || a.gs == 64 || a.gs == 128 || a.gs == 256) &&
           (a.Kp / BLOCK) % 2 == 0;
}

// Weight rows per block of prefill passes: every 4 rows of x sweep one block, which stays in L2 (~64 KB of u4).
inline int64_t prefill_block_rows(const LowbitArgs& a) {
    const int64_t rows = (int64_t{64} << 10) / (a.Kp / 2) / a.rg * a.rg;
    return rows > a.rg ? rows : a.rg;
}

// The decode tile: one row of x against the CHAINS (4 on AVX2) weight rows of one group of rows (u4, an even number of
// blocks, groups of PPG pairs of blocks or, PPG = 0, of one block, as prefill_tile). The general tile with MT = 1
// does the same dots, but its group loop (a runtime count of pairs, a prefetch test per row and pair, accumulators
// spilled across groups, a pass of its own for the zero-point terms) cost as much again as the dots on a Zen 1 EPYC,
// whose vpmaddubsw and vpmaddwd share one 128-bit pipe: there the dots alone, looped in registers, ran 7.7 MAC per
// cycle, the general tile 4.2 (standalone, 1 thread, weights in L2). Here a group's pairs are unrolled, each pair
// prefetches the group's lines once, and the group scales are converted 8 at a time along with the zero-point
// terms. Quiet Zen 1, bench.kernels (u4 g128, 2 threads, 8 layers, 7 reps), this / the general tile's time at M = 1
// / 2 / 3: 8960 x 1536 0.80 / 0.79 / 0.78, 1536 x 8960 0.90 / 0.87 / 0.84, 1536 x 1536 0.91 / 0.71 / 0.83, 2048 x
// 1536 0.85 / 0.81 / 0.83; the Qwen2.5-1.5B decode step (bench.profile) 91 -> 80 ms, its MLP 58 -> 49 ms. Four rows
// of x still go to the prefill tile (at M = 4-16 this tile row by row took 1.11-1.16x its time). Runs every row of
// x the prefill tile leaves: decode steps (M = 1 .. 3), the rows past a multiple of 4, the residual's rows.
template <int PPG>
inline void decode_tile(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m,
                        int64_t n0) {
    constexpr int NR = CHAINS;
    const int64_t pairs = a.Kp / (2 * BLOCK), stride = a.rg * BLOCK;
    const int64_t in_group = n0 % a.rg;
    const uint8_t* w = a.w + (n0 - in_group) * (a.Kp / 2) + in_group * BLOCK;  // the pass's rows are adjacent
    const uint16_t* sf[NR];
    for (int r = 0; r < NR; ++r) sf[r] = a.sz + (n0 + r) * 2 * a.G;
    const int8_t* xr = xq + m * a.Kp;
    const float* dr = dxv + m * pairs * 8;
    const float* xsr = xs + m * a.G;
    const __m256i mask = _mm256_set1_epi8(0x0f);
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    alignas(32) float sb[NR][8];  // the scales of groups [g, g + 8) as floats
    // Groups [g, g + 8): their scales to sb, and their zero-point terms s z xs subtracted from the accumulators (which
    // are summed at the end) rather than in a pass of their own (row_bias): at K = 1536 that pass took 8% of the tile.
    const auto refresh = [&](int64_t g) {
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(a.G - g)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 sums = _mm256_and_ps(_mm256_loadu_ps(xsr + g), _mm256_castsi256_ps(live));  // xs: 8 spare floats
        for (int r = 0; r < NR; ++r) {
            const __m256 sv = f16x8(sf[r], g, a.G);
            _mm256_store_ps(sb[r], sv);
            acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(sv, f16x8(sf[r] + a.G, g, a.G)), sums, acc[r]);
        }
    };
    // Pair p's dots of the NR rows, each times the pair's octet scales (dv, or dv * the two groups' scales, PPG = 0).
    const auto pair = [&](int64_t p, __m256* sums) {
        const uint8_t* wp = w + p * stride;
        for (int line = 0; line < NR * BLOCK; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH + line), _MM_HINT_T0);
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + p * 2 * BLOCK));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + p * 2 * BLOCK + BLOCK));
        const __m256 dv = _mm256_loadu_ps(dr + p * 8);
        for (int r = 0; r < NR; ++r) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + r * BLOCK));
            const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            const __m256 d = PPG ? dv
                                 : _mm256_mul_ps(dv, _mm256_set_m128(_mm_broadcast_ss(sb[r] + 2 * (p % 4) + 1),
                                                                     _mm_broadcast_ss(sb[r] + 2 * (p % 4))));
            sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2<false>(lo, xl, hi, xh)), d, sums[r]);
        }
    };
    if (PPG == 0) {  // groups of one block: a pair's two scales as lanes 0-3 / 4-7, as dv's
        for (int64_t p = 0; p < pairs; ++p) {
            if (p % 4 == 0) refresh(2 * p);
            pair(p, acc);
        }
    } else {  // groups of PPG pairs, each scaled once (the last one may be short: K not a multiple of the group)
        const auto fold = [&](int64_t g, const __m256* gacc) {
            if (g % 8 == 0) refresh(g);
            for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(gacc[r], _mm256_broadcast_ss(sb[r] + g % 8), acc[r]);
        };
        constexpr int STEP = PPG ? PPG : 1;
        const int64_t full = pairs / STEP;
        for (int64_t g = 0; g < full; ++g) {
            __m256 gacc[NR];
            for (int r = 0; r < NR; ++r) gacc[r] = _mm256_setzero_ps();
            for (int i = 0; i < STEP; ++i) pair(g * STEP + i, gacc);
            fold(g, gacc);
        }
        if (full * STEP < pairs) {
            __m256 gacc[NR];
            for (int r = 0; r < NR; ++r) gacc[r] = _mm256_setzero_ps();
            for (int64_t p = full * STEP; p < pairs; ++p) pair(p, gacc);
            fold(full, gacc);
        }
    }
    for (int r = 0; r < NR; ++r) a.y[m * a.N + n0 + r] = hsum(acc[r]);
}

// Rows [n0, n1) (n0 a multiple of a.rg) for row m of x: decode tiles where the weights take them, CHAINS rows at a
// time, else the general tile.
template <bool W8>
inline void decode_rows(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m,
                        int64_t n0, int64_t n1) {
    if (W8 || !prefill_fits(a) || a.rg % CHAINS || n1 - n0 < CHAINS) {
        rows_tile<1, nr(1), W8>(a, xq, dxv, xs, m, n0, n1);
        return;
    }
    int64_t n = n0;
    for (; n + CHAINS <= n1; n += CHAINS) {
        switch (a.gs) {
            case 32: decode_tile<0>(a, xq, dxv, xs, m, n); break;
            case 64: decode_tile<1>(a, xq, dxv, xs, m, n); break;
            case 128: decode_tile<2>(a, xq, dxv, xs, m, n); break;
            default: decode_tile<4>(a, xq, dxv, xs, m, n); break;
        }
    }
    if (n < n1) rows_tile<1, nr(1), W8>(a, xq, dxv, xs, m, n, n1);
}

template <int PPG>
inline void prefill_rows(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t n0,
                         int64_t n1) {
    const int64_t tiled = a.M / MTILE * MTILE, block = prefill_block_rows(a);
    for (int64_t nb = n0; nb < n1; nb += block) {
        const int64_t ne = nb + block < n1 ? nb + block : n1;
        for (int64_t m = 0; m < tiled; m += MTILE) {
            int64_t n = nb;
            for (; n + GEMM_NR <= ne; n += GEMM_NR) prefill_tile<GEMM_NR, PPG>(a, xq, dxv, xs, m, n);
            if (n < ne) tile<MTILE, 1, false>(a, xq, dxv, xs, m, n);  // an odd last row (N odd)
        }
        for (int64_t m = tiled; m < a.M; ++m) decode_rows<false>(a, xq, dxv, xs, m, nb, ne);
    }
}

#ifdef LOWBIT_ZMM
// Rows of x on 512-bit registers (kernel_avx512vnni.cpp defines LOWBIT_ZMM): each step reads 64 bytes of a weight
// row into one zmm, two pairs of blocks of u4 or one pair of u8 (the LM head), so each unpack, dot, convert and FMA
// covers twice the weights of the 256-bit tile. Row-major rows (u4 and u8 where lanes_tile's layout does not fit:
// rewrite.layout), groups of a multiple of 128 (u4) or 64 (u8) values, K a multiple of the group. On a 2-vCPU
// AVX-512 Zen 5 EPYC (a standalone harness over kernel_avx512vnni.cpp, 1 thread, M = 1, u4 g128, weights in L3)
// 1536 / 8960 long rows ran 25-28 -> 45 GB/s; from memory (40 layers, 2 threads, medians of 8 interleaved runs) no
// faster until the prefetch changed, below.
inline bool zmm_fits(const LowbitArgs& a) {
    const int64_t step = a.bits == 4 ? 128 : 64;  // weights per zmm step
    return a.rg == 1 && a.gs % step == 0 && a.K % a.gs == 0;
}

// Step q (64 bytes) of a tile's row r (its steps from `row`), with the next tile's run (`next`, the row after the
// tile's last) prefetched in order.
template <int NR>
inline __m512i zmm_step(const uint8_t* row, const uint8_t* next, int64_t q, int r) {
    _mm_prefetch(reinterpret_cast<const char*>(next + (q * NR + r) * 64), _MM_HINT_T0);
    return _mm512_loadu_si512(row + q * 64);
}

// Step q of a row of x (xm, its scales dm): u8, pair q as it is stored (even halves, odd halves) and its 8 scales in
// both halves; u4, pairs 2q and 2q + 1 in quantize_rows' `wide` layout ([even 2q, even 2q + 1], [odd 2q, odd 2q + 1])
// and their 16 scales in a row.
template <bool W8>
inline void zmm_x(const int8_t* xm, const float* dm, int64_t q, __m512i& xl, __m512i& xh, __m512& dv) {
    if (W8) {
        xl = xh = _mm512_loadu_si512(xm + q * 64);  // xh: unused by u8's dot
        dv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(dm + q * 8))));
    } else {
        xl = _mm512_loadu_si512(xm + q * 128);
        xh = _mm512_loadu_si512(xm + q * 128 + 64);
        dv = _mm512_loadu_ps(dm + q * 16);
    }
}

// A weight step's halves: u4 its low and high nibbles, u8 the bytes as read (lo; hi unused).
template <bool W8>
inline void zmm_unpack(__m512i raw, __m512i& lo, __m512i& hi) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    lo = W8 ? raw : _mm512_and_si512(raw, mask);
    hi = W8 ? raw : _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
}

// The step's dot with a row of x's step as 16 i32 lanes (one per octet of x).
template <bool W8>
inline __m512i zmm_dot(__m512i lo, __m512i hi, __m512i xl, __m512i xh) {
    const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl);
    return W8 ? d : _mm512_dpbusd_epi32(d, hi, xh);
}

// Weight rows [n0, n0 + NR) against rows [m0, m0 + MT) of x. Row-major weights: the tile's rows are
// one contiguous run read across (NR rows, 64 bytes each per step), so neither the hardware prefetcher nor a fixed
// distance ahead in each row (PREFETCH: at K = 1536 a u4 row is 768 bytes) keeps the lines coming: each step
// prefetches NR lines of the next tile's run in order, one tile ahead. Same harness from memory, 2 threads, M = 1:
// 8960 x 1536 / 1536 x 8960 388 / 419 us a layer (256-bit tile) -> 361 / 350 (zmm, PREFETCH) -> 288 / 329 (zmm,
// the next tile); one tile ahead was as fast as two or three. Each weight step is unpacked once for the MT rows of x.
template <int MT, int NR, bool W8>
inline void tile_zmm(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m0, int64_t n0) {
    constexpr int64_t STEP = W8 ? 64 : 128;  // weights per step
    const int64_t steps = a.Kp / STEP, per_group = a.gs / STEP, row_bytes = W8 ? a.Kp : a.Kp / 2;
    const uint8_t* w[NR];
    const uint16_t* sf[NR];
    float bias[NR][MT];
    __m512 acc[MT][NR];
    for (int r = 0; r < NR; ++r) {
        w[r] = a.w + (n0 + r) * row_bytes;
        sf[r] = a.sz + (n0 + r) * 2 * a.G;
        row_bias<MT>(a, sf[r], xs, m0, bias[r]);
        for (int m = 0; m < MT; ++m) acc[m][r] = _mm512_setzero_ps();
    }
    const uint8_t* next = a.w + (n0 + NR) * row_bytes;  // past the last row: a prefetch never faults
    const int64_t xstride = a.Kp, dstride = a.Kp / 64 * 8;
    const int8_t* xr = xq + m0 * xstride;
    const float* dr = dxv + m0 * dstride;
    for (int64_t g = 0, q = 0; q < steps; ++g) {
        __m512 gacc[MT][NR];
        for (int m = 0; m < MT; ++m)
            for (int r = 0; r < NR; ++r) gacc[m][r] = _mm512_setzero_ps();
        for (const int64_t end = q + per_group; q < end; ++q) {
            __m512i xl[MT], xh[MT];
            __m512 dv[MT];
            for (int m = 0; m < MT; ++m) {
                zmm_x<W8>(xr + m * xstride, dr + m * dstride, q, xl[m], xh[m], dv[m]);
                // At M = 1, x held in registers: g++ otherwise folds its loads into every row's dot, 3 loads per
                // row and step beside the weights' and the prefetches, 2-3% slower standalone (2 threads, medians
                // of 16 interleaved runs at 8960 x 1536 and 1536 x 1536); at M = 2-8 no different either way.
                if (MT == 1 && W8) __asm__("" : "+v"(xl[m]), "+v"(dv[m]));
                if (MT == 1 && !W8) __asm__("" : "+v"(xl[m]), "+v"(xh[m]), "+v"(dv[m]));
            }
            for (int r = 0; r < NR; ++r) {
                __m512i lo, hi;
                zmm_unpack<W8>(zmm_step<NR>(w[r], next, q, r), lo, hi);
                for (int m = 0; m < MT; ++m) {
                    const __m512 d = _mm512_cvtepi32_ps(zmm_dot<W8>(lo, hi, xl[m], xh[m]));
                    gacc[m][r] = _mm512_fmadd_ps(d, dv[m], gacc[m][r]);
                }
            }
        }
        for (int r = 0; r < NR; ++r) {
            const __m512 s = _mm512_set1_ps(_cvtsh_ss(sf[r][g]));
            for (int m = 0; m < MT; ++m) acc[m][r] = _mm512_fmadd_ps(gacc[m][r], s, acc[m][r]);
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int r = 0; r < NR; ++r) a.y[(m0 + m) * a.N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]) - bias[r][m];
}

// One row of x (decode) against NR row-major u4 weight rows. The group scales come 16 at a time per row
// (a masked load and convert, then a permute per group) instead of a scalar load, insert, convert and broadcast per
// row and group, which at g128 (a step a group) is per row and step: standalone on the Zen 4 EPYC, weights in L2 /
// L3, 23.8 -> 31.3 GB/s (row-major). More rows of x leave no registers for the scales (tile_zmm), and u8 weights (a
// group per row: the head) lost with it (bench.kernels at M = 1: 1.0 of OpenVINO's time against 0.81-0.87).
template <int NR>
inline void decode_zmm(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m0,
                       int64_t n0) {
    const int64_t steps = a.Kp / 128, per_group = a.gs / 128, row_bytes = a.Kp / 2;
    const uint8_t* w[NR];
    const uint16_t* sf[NR];
    float bias[NR][1];
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) {
        const int64_t n = n0 + r;
        w[r] = a.w + n * row_bytes;
        sf[r] = a.sz + n * 2 * a.G;
        row_bias<1>(a, sf[r], xs, m0, bias[r]);
        acc[r] = _mm512_setzero_ps();
    }
    const uint8_t* next = a.w + (n0 + NR) * row_bytes;  // the next tile's run (tile_zmm)
    const int8_t* xr = xq + m0 * a.Kp;
    const float* dr = dxv + m0 * (a.Kp / 64 * 8);
    __m512 s16[NR];
    for (int64_t g = 0, q = 0; q < steps; ++g) {
        if (g % 16 == 0) {
            const __mmask16 k = a.G - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (a.G - g)) - 1);
            for (int r = 0; r < NR; ++r) s16[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, sf[r] + g));
        }
        __m512 gacc[NR];
        for (const int64_t end = q + per_group; q < end; ++q) {
            __m512i xl, xh;
            __m512 dv;
            zmm_x<false>(xr, dr, q, xl, xh, dv);
            __asm__("" : "+v"(xl), "+v"(xh), "+v"(dv));  // in registers, as tile_zmm's at M = 1
            const bool first = q + per_group == end;  // the group's first step
            for (int r = 0; r < NR; ++r) {
                __m512i lo, hi;
                zmm_unpack<false>(zmm_step<NR>(w[r], next, q, r), lo, hi);
                const __m512 d = _mm512_cvtepi32_ps(zmm_dot<false>(lo, hi, xl, xh));
                gacc[r] = first ? _mm512_mul_ps(d, dv) : _mm512_fmadd_ps(d, dv, gacc[r]);
            }
        }
        const __m512i lane = _mm512_set1_epi32(static_cast<int>(g % 16));
        for (int r = 0; r < NR; ++r) acc[r] = _mm512_fmadd_ps(gacc[r], _mm512_permutexvar_ps(lane, s16[r]), acc[r]);
    }
    for (int r = 0; r < NR; ++r) a.y[m0 * a.N + n0 + r] = _mm512_reduce_add_ps(acc[r]) - bias[r][0];
}

// Weight rows [n0, n1) against rows [m0, m0 + MT) of x, NR at a time (MT x NR accumulator chains: CHAINS at M = 1).
template <int MT, bool W8>
inline void zmm_pass(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m0, int64_t n0,
                     int64_t n1) {
    constexpr int NR = MT == 1 ? CHAINS : MT == 2 ? 4 : 2;
    int64_t n = n0;
    if (MT == 1 && !W8) {
        for (; n + NR <= n1; n += NR) decode_zmm<NR>(a, xq, dxv, xs, m0, n);
        for (; n < n1; ++n) decode_zmm<1>(a, xq, dxv, xs, m0, n);
        return;
    }
    for (; n + NR <= n1; n += NR) tile_zmm<MT, NR, W8>(a, xq, dxv, xs, m0, n);
    for (; n < n1; ++n) tile_zmm<MT, 1, W8>(a, xq, dxv, xs, m0, n);
}

// Rows of x up to ZMM_MT per pass (MT x NR accumulators and group accumulators, MT rows of x and their scales fill the
// 32 zmm registers); past that, the passes sweep blocks of weight rows that stay in L2
// (ZMM_BLOCK bytes), so the weights come from memory once. Against OpenVINO's kernels on a 2-vCPU Zen 5 EPYC
// (bench.kernels --formats u4a:128 --layers 8 --reps 7 --isa avx512vnni --precision default; 8960x1536 / 1536x8960 /
// 1536x1536), where the 256-bit tile took 0.78 / 0.84 / 0.73 at M = 2, 1.07 / 0.92 / 0.90 at M = 4 and 1.55 / 1.52 /
// 1.12 at M = 8: M = 2 0.44 / 0.59 / 0.63, M = 4 0.58 / 0.55 / 0.77, M = 8 0.76 / 0.85 / 1.12; at M = 64 1.47 / 1.31
// (prefill keeps OpenVINO's there: kernels.KERNEL_ROWS). x in quantize_rows' `wide` layout (one load per 512-bit
// operand instead of two and an insert) took the standalone harness 0.90 / 0.89 of the time at M = 4 / 8.
constexpr int64_t ZMM_MT = 4, ZMM_BLOCK = int64_t{256} << 10;

template <bool W8>
inline void rows_zmm(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t n0, int64_t n1) {
    const int64_t row_bytes = W8 ? a.Kp : a.Kp / 2;
    const int64_t block = a.M <= ZMM_MT ? n1 - n0 : std::max<int64_t>(CHAINS, ZMM_BLOCK / row_bytes);
    for (int64_t nb = n0; nb < n1; nb += block) {
        const int64_t ne = std::min(n1, nb + block);
        for (int64_t m = 0; m < a.M; m += ZMM_MT) {
            switch (std::min(ZMM_MT, a.M - m)) {
                case 1: zmm_pass<1, W8>(a, xq, dxv, xs, m, nb, ne); break;
                case 2: zmm_pass<2, W8>(a, xq, dxv, xs, m, nb, ne); break;
                case 3: zmm_pass<3, W8>(a, xq, dxv, xs, m, nb, ne); break;
                default: zmm_pass<4, W8>(a, xq, dxv, xs, m, nb, ne); break;
            }
        }
    }
}

// u4 in lanes (slot 0: rewrite.lanes_layout): rows in groups of LANE_ROWS, and per 8 values of K (a chunk) the
// group's 16 rows 4 bytes each, one after the other (a row's values 8c .. 8c + 3 in the low nibbles, 8c + 4 .. 8c + 7
// in the high ones); the scale table by groups of rows too, per group of K the 16 rows' scales, then their zero
// points. A 64-byte load is then one chunk of 16 rows, each i32 lane of a vpdpbusd one row, and x goes in as a
// broadcast dword (natural order) folded into the dot. Each load and unpack serves up to 8 rows of x, the dots of a
// run of `span` octets (x's scale: a.xspan) add up in i32 before one convert and FMA, the group scale is one FMA per
// group for 16 rows, and the outputs leave as one store per 16 rows (no horizontal sums). tile_zmm (lanes = octets of
// one row) converts and multiplies per 128 weights and row of x, unpacks per 2-4 rows of x and sums each output
// across its lanes; on split 512-bit units (Zen 4) it ran compute-bound from M = 4. Against OpenVINO's kernels there
// (bench.kernels --formats u4a:128 --layers 24 --reps 5 --precision default; 8960x1536 / 1536x8960 / 1536x1536 /
// 2048x1536): M = 1 0.72 / 0.58 / 0.45 / 0.43 (row-major grouped by 8 before, paired in one process: this layout
// 0.91-1.0 of its time), M = 4 0.57 / 0.63 / 0.46 / 0.43 (before 0.96 / 0.84-1.02 / 0.79), M = 8 0.56 / 0.56 / 0.50
// / 0.49 (before 1.22-1.23 / 1.0-1.08 / 1.14), M = 32 0.84 / 0.67 / 0.69 / 0.68; at M = 64-512 0.77-0.86 (8 layers).
constexpr int64_t LANE_ROWS = 16;

inline bool lanes_fits(const LowbitArgs& a) {
    return a.slot == 0 && a.rg == LANE_ROWS && a.gs % 32 == 0 && a.K % a.gs == 0;
}

// Rows of x [m0, m0 + MT) against the group of 16 weight rows at n0, x's scale per `SPAN` octets. MT x 3 accumulators
// (i32 per span, the group's, the total) and the unpacked weights fill the 32 registers at MT = 8. At MT <= 2 the
// group sums alternate between two sets, so their FMA chain's latency never waits on one. u8 (W8: the LM head) in
// lanes: a 64-byte chunk is 4 values of K of the 16 rows, one vpdpbusd as read, two chunks an octet.
// TWO (one row, the op's `residual`: u4, and u8 with residual 1): x = d (q + r / 128) with r x's rounding error in
// 1/128ths of its octet's step (quantize_block's `second`, after the first digits in xq), two more vpdpbusd per chunk
// (u8: one) and the sum 128 q + r in i32, so x's rounding error is ~1/128 of one digit's. At Qwen2.5-1.5B on the
// AMX Xeon (bench.quality's 8 prompts, precision default) it took the next-token TVD from OpenVINO's kernels 0.0113
// -> 0.0081, and in f32 0.0084 -> 0.0001, for 1.069 of the decode step's time (one engine switching it every 16
// steps, medians of 23 paired blocks; the u8 head too: 0.0079 for 1.115; x's second digit alone, not used by the
// tile: 1.004): an option (kernels.RESIDUAL_ENV).
// The run is prefetched AHEAD bytes ahead (0: not; L2_AHEAD: into L2, OneRowAhead), from 2 rows of x 2 KB everywhere
// (Zen 4, 1 thread, standalone: M = 2 without it 0.73 of a plain 512-bit streaming read's rate against 0.83; M = 4 / 8:
// 0.52 / 0.23 against 0.58 / 0.33; 1 KB instead on the 2-vCPU Intel Xeon with AMX, 80 layers 8960 x 1536 u4 g128 from
// memory, 2 threads: 0.97-1.07 / 1.05-1.11 of 2 KB's time at M = 4 / 8). At one row of x the CPUs differ
// (OneRowAhead); on Zen 4, 1 thread from memory (1536 x 1536 u4 g128 x 100, 3-5 interleaved runs), the hardware's
// prefetch alone read faster (0.99-1.05 against 0.85; 1-8 KB ahead at T0 or T1: 0.77-1.02), its 2-thread step not
// measured with against without.
template <bool W8, bool INTEL>
struct OneRowAhead {
    // The 2-vCPU Zen 5 EPYC (full-width 512-bit units), one engine switching the prefetch every 16 single-token
    // steps, medians of 40-60 paired blocks in both orders: the step took 0.943-0.966 of its time with u4 2 KB ahead
    // at Qwen2.5-1.5B, 0.923-0.927 at Llama-3.2-3B, 0.954-0.961 at the default 135M model; 4 KB against 2 KB
    // 0.971-0.986 at 1.5B and 0.953-0.978 at 3B, 8 KB against 4 KB 0.997-1.004, 1 KB against 2 KB 1.038; the u8 head
    // prefetched too 1.009 (p25-p75 0.95-1.05): AMD's 4 KB and none. The 2-vCPU Intel Xeon with AMX (Sapphire Rapids
    // class; bench.kernels, 2 threads, weights from memory, two interleaved runs each, times against 4 KB's): 8960 x
    // 1536 u4 g128 x 80 at none 0.97-0.99, 0.5 KB 0.91-0.98, 1 KB 0.87, 1.5 KB 0.86-0.89, 2 KB 0.83-0.89, 3 KB
    // 0.89-0.91, 8 KB 1.19-1.20; the u8 head (151936 x 1536 x 3) 2 KB ahead against none 0.87-0.90: Intel's 2 KB both.
    static constexpr int64_t L1 = INTEL ? 2048 : W8 ? 0 : 4096;
    // Beside that, a second run L2_* bytes ahead into L2 (prefetcht2): on the Intel Xeon the u4 loop at one row read
    // ~12 GB/s a thread against 15.4 for a plain streaming read, with the first prefetch's distance already tuned.
    // The same engine switching it every 16 single-token steps (medians of 24-31 paired blocks): the step took 0.933-
    // 0.937 of its time with it 8 KB ahead at Qwen2.5-1.5B (4 KB 0.934, 12 KB 0.930, 16 KB 0.965; prefetcht1 8 KB
    // 0.943), 0.934 at Llama-3.2-3B, 0.914 at the default 135M model. Not the u8 head (bench.kernels 151936 x 1536 x 3
    // with it: 1.02-1.06 of its time) nor 2-8 rows of x (0.92-1.20 at 8960 x 1536 x 80), and not AMD (unmeasured).
    static constexpr int64_t L2 = INTEL && !W8 ? 8192 : 0;
};

inline bool intel_cpu() {
    static const bool intel = (__builtin_cpu_init(), __builtin_cpu_is("intel"));
    return intel;
}

template <int MT, int SPAN, bool W8, int64_t AHEAD = 2048, int64_t L2_AHEAD = 0, bool TWO = false>
inline void lanes_tile(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m0,
                       int64_t n0) {
    constexpr int SETS = MT <= 2 ? 2 : 1;
    constexpr int64_t VALUES = W8 ? 4 : 8;           // of K per 64-byte chunk of the 16 rows
    constexpr int64_t OCTET_BYTES = 64 * 8 / VALUES;  // one octet of K of the 16 rows
    constexpr int CHUNKS = SPAN * 8 / VALUES;          // per span
    const int64_t per_group = a.gs / 8, dstride = lowbit_dx_floats(1, a.Kp);
    const uint8_t* w = a.w + n0 * (W8 ? a.Kp : a.Kp / 2);
    const uint16_t* st = a.sz + n0 * 2 * a.G;  // [G][16 scales, 16 zero points]
    const __m512i mask = _mm512_set1_epi8(0x0f);
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < a.G; ++g) {  // the zero points' terms: acc = -sum_g s z xs
        const __m256i* t = reinterpret_cast<const __m256i*>(st + g * 32);
        const __m512 sz =
            _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(t)), _mm512_cvtph_ps(_mm256_loadu_si256(t + 1)));
        for (int m = 0; m < MT; ++m) acc[m] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(xs[(m0 + m) * a.G + g]), acc[m]);
    }
    // One span of chunks from c into the group sums gsum.
    auto span = [&](int64_t c, __m512* gsum) __attribute__((always_inline)) {
        __m512i dot[MT], dot2[MT];
        for (int m = 0; m < MT; ++m) dot[m] = dot2[m] = _mm512_setzero_si512();
        for (int j = 0; j < CHUNKS; ++j) {
            const uint8_t* p = w + c * OCTET_BYTES + j * 64;
            if constexpr (AHEAD > 0) _mm_prefetch(reinterpret_cast<const char*>(p + AHEAD), _MM_HINT_T0);
            if constexpr (L2_AHEAD > 0) _mm_prefetch(reinterpret_cast<const char*>(p + L2_AHEAD), _MM_HINT_T2);
            __m512i raw = _mm512_loadu_si512(p);
            __asm__("" : "+v"(raw));  // one load: GCC folds one into each unpacking op, two 512-bit loads
            const __m512i lo = W8 ? raw : _mm512_and_si512(raw, mask);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);  // u4 only
            for (int m = 0; m < MT; ++m) {
                const int32_t* xv = reinterpret_cast<const int32_t*>(xq + (m0 + m) * a.Kp + c * 8 + j * VALUES);
                dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(xv[0]));
                if constexpr (!W8) dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(xv[1]));
                if constexpr (TWO) {  // the second digits, after the first (quantize_rows' xq2)
                    const int32_t* rv =
                        reinterpret_cast<const int32_t*>(xq + (a.M + m0 + m) * a.Kp + c * 8 + j * VALUES);
                    dot2[m] = _mm512_dpbusd_epi32(dot2[m], lo, _mm512_set1_epi32(rv[0]));
                    if constexpr (!W8) dot2[m] = _mm512_dpbusd_epi32(dot2[m], hi, _mm512_set1_epi32(rv[1]));
                }
            }
        }
        // TWO: 128 first digits + the second, in 1/128ths of d (|dot| <= 8 x 15 x 127, u8 8 x 255 x 128,
        // before the shift).
        constexpr float unit = TWO ? 1.f / 128 : 1.f;
        for (int m = 0; m < MT; ++m) {
            if constexpr (TWO) dot[m] = _mm512_add_epi32(_mm512_slli_epi32(dot[m], 7), dot2[m]);
            gsum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(dxv[(m0 + m) * dstride + c] * unit),
                                      gsum[m]);
        }
    };
    for (int64_t g = 0, c = 0; g < a.G; ++g) {
        __m512 gsum[SETS][MT];
        for (int k = 0; k < SETS; ++k)
            for (int m = 0; m < MT; ++m) gsum[k][m] = _mm512_setzero_ps();
        const int64_t end = c + per_group;
        if (SETS == 2)
            for (; c + 2 * SPAN <= end; c += 2 * SPAN) {
                span(c, gsum[0]);
                span(c + SPAN, gsum[SETS - 1]);
            }
        for (; c < end; c += SPAN) span(c, gsum[0]);
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + g * 32)));
        for (int m = 0; m < MT; ++m)
            acc[m] = _mm512_fmadd_ps(SETS == 2 ? _mm512_add_ps(gsum[0][m], gsum[SETS - 1][m]) : gsum[0][m], s, acc[m]);
    }
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(a.y + (m0 + m) * a.N + n0, acc[m]);
}

// One row of x against the group of 16 weight rows at n0, prefetched as this CPU's vendor reads fastest
// (OneRowAhead), with x's second digits where a.digits is 2 (u4, and u8 with the op's residual 1: the i8 head,
// rewrite.SYMMETRIC_I8).
template <int SPAN, bool W8, bool INTEL>
inline void one_row(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t m, int64_t n) {
    using P = OneRowAhead<W8, INTEL>;
    if constexpr (SPAN == 1) {  // a.digits 2: one row whose x has a scale per octet (xspan 1)
        if (a.digits == 2) return lanes_tile<1, SPAN, W8, P::L1, P::L2, true>(a, xq, dxv, xs, m, n);
    }
    lanes_tile<1, SPAN, W8, P::L1, P::L2>(a, xq, dxv, xs, m, n);
}

// Weight rows [n0, n1) (whole groups: N is a multiple of 16) against every row of x, 8 rows of x at a time (a group's
// rows stay in L2 between: 70 KB at K = 8960).
template <int SPAN, bool W8>
inline void lanes_rows(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t n0,
                       int64_t n1) {
    const bool intel = intel_cpu();
    for (int64_t n = n0; n < n1; n += LANE_ROWS)
        for (int64_t m = 0; m < a.M; m += 8) {
            switch (std::min<int64_t>(8, a.M - m)) {
                case 1:
                    if (intel)
                        one_row<SPAN, W8, true>(a, xq, dxv, xs, m, n);
                    else
                        one_row<SPAN, W8, false>(a, xq, dxv, xs, m, n);
                    break;
                case 2: lanes_tile<2, SPAN, W8>(a, xq, dxv, xs, m, n); break;
                case 3: lanes_tile<3, SPAN, W8>(a, xq, dxv, xs, m, n); break;
                case 4: lanes_tile<4, SPAN, W8>(a, xq, dxv, xs, m, n); break;
                case 5: lanes_tile<5, SPAN, W8>(a, xq, dxv, xs, m, n); break;
                case 6: lanes_tile<6, SPAN, W8>(a, xq, dxv, xs, m, n); break;
                case 7: lanes_tile<7, SPAN, W8>(a, xq, dxv, xs, m, n); break;
                default: lanes_tile<8, SPAN, W8>(a, xq, dxv, xs, m, n); break;
            }
        }
}
#endif

// How quantize_rows lays x out for the tiles of `a`.
inline XOrder x_order(const LowbitArgs& a) {
#ifdef LOWBIT_ZMM
    if (lanes_fits(a)) return XOrder::natural;
    return a.bits == 4 && zmm_fits(a) ? XOrder::wide : XOrder::paired;
#else
    (void)a;
    return XOrder::paired;
#endif
}

template <bool W8>
inline void rows_of(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t n0, int64_t n1) {
#ifdef LOWBIT_ZMM
    if (lanes_fits(a)) {
        if (a.xspan == 4)
            lanes_rows<4, W8>(a, xq, dxv, xs, n0, n1);
        else
            lanes_rows<1, W8>(a, xq, dxv, xs, n0, n1);
        return;
    }
    if (zmm_fits(a)) {
        rows_zmm<W8>(a, xq, dxv, xs, n0, n1);
        return;
    }
#endif
    if (a.M >= PREFILL_ROWS && prefill_fits(a)) {
        switch (a.gs) {
            case 32: prefill_rows<0>(a, xq, dxv, xs, n0, n1); break;
            case 64: prefill_rows<1>(a, xq, dxv, xs, n0, n1); break;
            case 128: prefill_rows<2>(a, xq, dxv, xs, n0, n1); break;
            default: prefill_rows<4>(a, xq, dxv, xs, n0, n1); break;
        }
        return;
    }
    if (a.rg > 1) {  // grouped rows (rewrite.py's u4): whole groups per pass, once per row of x (see above)
        const int64_t tiled = a.M >= GEMM_ROWS ? a.M / MTILE * MTILE : 0;
        for (int64_t n = n0; n < n1; n += nr(1)) {
            const int64_t e = n + nr(1) < n1 ? n + nr(1) : n1;
            for (int64_t m = 0; m < tiled; m += MTILE) rows_tile<MTILE, GEMM_NR, W8>(a, xq, dxv, xs, m, n, e);
            for (int64_t m = tiled; m < a.M; ++m) decode_rows<W8>(a, xq, dxv, xs, m, n, e);
        }
        return;
    }
    int64_t m0 = 0;
    for (; m0 + MTILE <= a.M; m0 += MTILE) rows_tile<MTILE, nr(MTILE), W8>(a, xq, dxv, xs, m0, n0, n1);
    switch (a.M - m0) {
        case 3: rows_tile<3, nr(3), W8>(a, xq, dxv, xs, m0, n0, n1); break;
        case 2: rows_tile<2, nr(2), W8>(a, xq, dxv, xs, m0, n0, n1); break;
        case 1: rows_tile<1, nr(1), W8>(a, xq, dxv, xs, m0, n0, n1); break;
        default: break;
    }
}

inline void rows(const LowbitArgs& a, const int8_t* xq, const float* dxv, const float* xs, int64_t n0, int64_t n1) {
    if (a.bits == 8)
        rows_of<true>(a, xq, dxv, xs, n0, n1);
    else
        rows_of<false>(a, xq, dxv, xs, n0, n1);
}

// silu(g) * u = g u / (1 + exp(-g)), 8 at a time (vec_exp.hpp), the rest of n one at a time with std::exp.
inline void swiglu(const float* g, const float* u, int64_t n, float* out) {
    using V = Avx2;
    int64_t i = 0;
    for (; i + V::W <= n; i += V::W) {
        const V::vec gv = V::load(g + i), e = vexp<V>(V::sub(V::zero(), gv));  // exp(-g)
        V::store(out + i, _mm256_div_ps(V::mul(gv, V::load(u + i)), V::add(V::set1(1.f), e)));
    }
    for (; i < n; ++i) out[i] = g[i] * u[i] / (1.f + std::exp(-g[i]));
}

}  // namespace

// The per-ISA entry point (lowbit_kernel.h) of the translation unit that includes this file.
#define LOWBIT_ENTRY(NAME)                                                                      \
    LowbitKernel lowbit_kernel_##NAME() {                                                       \
        return {#NAME,                                                                          \
                [](const LowbitArgs& a, int8_t* xq, float* dx, float* xs, int64_t b0, int64_t b1) { \
                    quantize_rows(a.x, a.M, a.K, a.Kp, a.gs, a.G, xq, dx, xs, b0, b1, x_order(a),              \
                                  static_cast<int>(a.xspan), a.digits == 2 ? xq + a.M * a.Kp : nullptr);        \
                },                                                                              \
                rows, swiglu};                                                                  \
    }
