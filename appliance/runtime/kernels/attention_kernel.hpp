// The DecodeAttention kernels (attention_kernel.h) for one vector width, included by attention_avx2.cpp and
// attention_avx512.cpp, each compiled for its ISA with a traits struct V: the float vector type and its width W,
// the members vec_avx2.hpp lists, and CHUNKS (vectors of a value row's dims per pass: weigh below).
// Group sizes are multiples of W (decode_attention.cpp picks the width).
//
// Per token and kv head the key row is dequantized in registers for each group of up to 6 query heads of the kv
// head; the values' weighted sums stay in registers (up to 6 heads x CHUNKS vectors of dims) over every token of the
// part, so that a token costs its conversions and its FMAs, not loads and stores of the sums.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "attention_kernel.h"
#include "vec_exp.hpp"

namespace {

// Tokens ahead whose rows part() fetches while it scores the current one.
constexpr int64_t AHEAD = 8;

inline float f32_at(const uint8_t* p) {
    float f;
    std::copy_n(p, 4, reinterpret_cast<uint8_t*>(&f));
    return f;
}

// Query heads per pass over a token's key or value row: 6 fill the registers of weigh (6 heads x CHUNKS vectors of
// sums, CHUNKS of values and a broadcast weight: 15 of AVX2's 16, 29 of AVX-512's 32), so Qwen2.5's 6 heads per kv
// head dequantize each row once, where passes of 4 and 2 did it twice.
constexpr int64_t MAX_HEADS = 6;

// Calls f(std::integral_constant<int, NR>, r0) over the heads [0, R) in passes of at most MAX_HEADS, two passes even
// where two take them (8 heads: 4 + 4, not 6 + 2). No division: it runs per token.
template <typename F>
inline void by_heads(int64_t R, F&& f) {
    for (int64_t r = 0; r < R;) {
        const int64_t left = R - r;
        const int64_t nr = left <= MAX_HEADS ? left : left <= 2 * MAX_HEADS ? (left + 1) / 2 : MAX_HEADS;
        switch (nr) {
            case 6: f(std::integral_constant<int, 6>{}, r); break;
            case 5: f(std::integral_constant<int, 5>{}, r); break;
            case 4: f(std::integral_constant<int, 4>{}, r); break;
            case 3: f(std::integral_constant<int, 3>{}, r); break;
            case 2: f(std::integral_constant<int, 2>{}, r); break;
            default: f(std::integral_constant<int, 1>{}, r); break;
        }
        r += nr;
    }
}

// Dots of NR query heads with one key row, each W values dequantized in registers as (u8 - zp) * scale of its group.
template <int NR>
inline void dots(const float* const* q, const uint8_t* row, int64_t hs, int64_t group, float* out) {
    typename V::vec acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = V::zero();
    for (int64_t g0 = 0; g0 < hs; g0 += group, row += 8 + group) {
        const float sc = f32_at(row);
        const auto s = V::set1(sc), c = V::set1(-f32_at(row + 4) * sc);
        for (int64_t d = 0; d < group; d += V::W) {
            const auto k = V::fmadd(V::load_u8(row + 8 + d), s, c);
            for (int r = 0; r < NR; ++r) acc[r] = V::fmadd(V::load(q[r] + g0 + d), k, acc[r]);
        }
    }
    int r = 0;
    for (; r + 4 <= NR; r += 4) V::hsum4(acc[r], acc[r + 1], acc[r + 2], acc[r + 3], out + r);
    for (; r < NR; ++r) out[r] = V::hsum(acc[r]);
}

// acc[r][d0 .. d0 + C W) = sum over the part's tokens of ws[i, r] * u_i for NR heads from r0, the C W dims inside one
// value group of the row (u: its u8s), minus corr[r]: ws = w s (the weight times the token's group scale) and corr =
// sum ws zp come once per group from part(), so a token costs its conversions and one broadcast and C FMAs a head.
// With w s and the zero-point term per head in this loop (scalar, and again for every chunk of dims) it cost ~20 of
// the ~28 instructions of a token's pass of 4 heads on AVX2.
template <int NR, int C>
inline void weigh(const AttentionArgs& a, const uint8_t* const* rows, const float* ws, const float* corr, int64_t n,
                  int64_t R, int64_t r0, int64_t d0, float* acc) {
    const int64_t group = a.value_group, at = d0 / group * (8 + group) + 8 + d0 % group;
    typename V::vec s[NR][C];
    for (int r = 0; r < NR; ++r)
        for (int c = 0; c < C; ++c) s[r][c] = V::zero();
#pragma GCC unroll 1
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t* row = rows[i] + at;
        const float* wi = ws + i * R + r0;
        typename V::vec u[C];
        for (int c = 0; c < C; ++c) u[c] = V::load_u8(row + c * V::W);
        for (int r = 0; r < NR; ++r) {
            const auto b = V::set1(wi[r]);
            for (int c = 0; c < C; ++c) s[r][c] = V::fmadd(b, u[c], s[r][c]);
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int c = 0; c < C; ++c)
            V::store(acc + (r0 + r) * a.hs + d0 + c * V::W, V::sub(s[r][c], V::set1(corr[r0 + r])));
}

void part(const AttentionArgs& a, int64_t t, int64_t g, int64_t from, int64_t to, float* m, float* l, float* acc,
          float* scores, const uint8_t** keys) {
    const int64_t R = a.H / a.Hkv, hs = a.hs, n = to - from;
    const int64_t krow = attention_row(hs, a.key_group), kblock = attention_block(a, a.key_group);
    const int64_t vrow = attention_row(hs, a.value_group), vblock = attention_block(a, a.value_group);
    const int32_t* blocks = a.block_indices + a.block_begins[t];
    const float* q[64];
    float d[64];
    for (int64_t r = 0; r < R; ++r) q[r] = a.q + t * a.H * hs + (g * R + r) * hs;
    // Row pointers of the part's tokens, block by block (no division per token).
    const uint8_t** rows = keys + n;
    for (int64_t i = 0, b = from / a.bs, at = from % a.bs; i < n; ++i) {
        const int64_t slot = g * a.bs + at;
        keys[i] = a.key_cache + int64_t{blocks[b]} * kblock + slot * krow;
        rows[i] = a.value_cache + int64_t{blocks[b]} * vblock + slot * vrow;
        if (++at == a.bs) at = 0, ++b;
    }
    // Scores [n, R]. The rows AHEAD tokens on, key and value, are fetched meanwhile: between two layers the weights
    // (tens of MB) push the cache out of L3.
    for (int64_t r = 0; r < R; ++r) m[r] = -INFINITY, l[r] = 0.f;
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) {
            const uint8_t *kn = keys[i + AHEAD], *vn = rows[i + AHEAD];  // i + AHEAD < n
            for (int64_t at = 0; at < krow; at += 64) __builtin_prefetch(kn + at);
            for (int64_t at = 0; at < vrow; at += 64) __builtin_prefetch(vn + at);
        }
        by_heads(R, [&](auto nr, int64_t r) { dots<nr()>(q + r, keys[i], hs, a.key_group, d + r); });
        for (int64_t r = 0; r < R; ++r) {
            const float x = a.scale * d[r];
            scores[i * R + r] = x;
            m[r] = std::max(m[r], x);
        }
    }
    // Weights exp(score - max) in place ([n, R] as one flat run), summed per head.
    {
        int64_t i = 0;
        const int64_t total = n * R;
        alignas(64) float mx[2 * 64 + 16];  // the maxima repeated with period R, for a vector at any offset
        for (int64_t j = 0; j < 2 * 64 + 16; ++j) mx[j] = m[j % R];
        for (; i + V::W <= total; i += V::W)
            V::store(scores + i, vexp<V>(V::sub(V::load(scores + i), V::load(mx + i % R))));
        for (; i < total; ++i) scores[i] = std::exp(scores[i] - m[i % R]);
    }
    // Per value group: ws = w s per token and head (after the scores: scratch past them) and corr = sum ws zp; the
    // first group's pass sums the weights too (in locals: summed into l[r], which may alias scores for all the
    // compiler knows, each add was a store and a chain of dependent adds, 8% of the op).
    constexpr int64_t C = V::CHUNKS;
    const int64_t group = a.value_group, step = group % (C * V::W) == 0 ? C * V::W : V::W;
    float* ws = scores + n * R + 16;
    float corr[64], sum[64] = {};
    const auto scale = [&](int64_t head, auto first) {
        for (int64_t r = 0; r < R; ++r) corr[r] = 0.f;
        for (int64_t i = 0; i < n; ++i) {
            const float sc = f32_at(rows[i] + head), zp = f32_at(rows[i] + head + 4);
            for (int64_t r = 0; r < R; ++r) {
                const float w = scores[i * R + r], x = w * sc;
                if constexpr (first()) sum[r] += w;
                ws[i * R + r] = x;
                corr[r] += x * zp;
            }
        }
    };
    for (int64_t v0 = 0; v0 < hs; v0 += group) {
        const int64_t head = v0 / group * (8 + group);
        if (v0 == 0) {
            scale(head, std::true_type{});
            for (int64_t r = 0; r < R; ++r) l[r] = sum[r];
        } else {
            scale(head, std::false_type{});
        }
        for (int64_t d0 = v0; d0 < v0 + group; d0 += step)
            by_heads(R, [&](auto nr, int64_t r) {
                if (step == C * V::W)
                    weigh<nr(), C>(a, rows, ws, corr, n, R, r, d0, acc);
                else
                    weigh<nr(), 1>(a, rows, ws, corr, n, R, r, d0, acc);
            });
    }
}

// Quantizes n floats into a row of groups as the plugin does: per group scale = (max - min) / 255, zp = -min /
// scale, u8 = round(x / scale + zp); a constant group (or NaN) gets scale 1e-4.
void store(const float* x, int64_t n, int64_t group, uint8_t* row) {
    for (int64_t g0 = 0; g0 < n; g0 += group, row += 8 + group) {
        float lo = x[g0], hi = x[g0];
        for (int64_t i = g0 + 1; i < g0 + group; ++i) {
            lo = std::min(lo, x[i]);
            hi = std::max(hi, x[i]);
        }
        float scale = (hi - lo) / 255.f;
        if (!(scale > 0.f)) scale = 1e-4f;
        const float zp = -lo / scale;
        for (int64_t i = 0; i < group; ++i) {
            const float y = std::nearbyint(x[g0 + i] / scale + zp);
            row[8 + i] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, y)));
        }
        std::copy_n(reinterpret_cast<const uint8_t*>(&scale), 4, row);
        std::copy_n(reinterpret_cast<const uint8_t*>(&zp), 4, row + 4);
    }
}

}  // namespace

#define ATTENTION_ENTRY(name) \
    AttentionKernel attention_kernel_##name() { return {#name, store, part}; }
