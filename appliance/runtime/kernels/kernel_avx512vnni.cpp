// The avx512vnni instance of lowbit_kernel.hpp (compiled with its own -m flags: CMakeLists.txt).
#include <immintrin.h>

namespace {
// AVX512-VNNI on 256-bit registers (EVEX vpdpbusd, needs AVX512VL), and one row of x (decode) on 512-bit ones
// (LOWBIT_ZMM: lowbit_kernel.hpp tile_zmm). On the AMX box (Sapphire Rapids) two pairs of blocks per 512-bit register
// were no faster standalone (1 thread, 1536 x 1536 g128, best of 200, 3 interleaved runs: 2.31 / 2.45 / 1.40 ns per
// 32 weights at M = 1 against 2.76 / 2.54 / 1.67); on a Zen 5 EPYC, whose 512-bit units are full width, the op at
// M = 1 took 0.33-0.54 of OpenVINO's time against the 256-bit tile's 0.59-0.81 (bench.kernels, 2 threads, 8
// layers, the Qwen2.5-1.5B and Llama-3.2-3B shapes; docs/performance.md).
inline __m256i dot2_avx512vnni(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
}
#define LOWBIT_DOT2 dot2_avx512vnni
#define LOWBIT_CHAINS 8  // 32 ymm registers (lowbit_kernel.hpp)
#define LOWBIT_ZMM      // one row of x on 512-bit registers (lowbit_kernel.hpp tile_zmm)
}  // namespace

#include <chrono>

#include "lowbit_kernel.hpp"

LOWBIT_ENTRY(avx512vnni)

namespace {
// Seconds for `iters` rounds of 10 independent vpdpbusd chains on registers of type V (throughput, not latency: 10
// chains cover the instruction's latency), all ten named so they stay in registers (an array of accumulators went
// through the stack: 1.1 instead of 1.9 on the Zen 4 box); the asm keeps them live so nothing folds.
#define ZC_STEP(v) v = dot(v, a, b);
template <typename V, V (*dot)(V, V, V)>
double dot_seconds(V a, V b, int64_t iters) {
    V v0 = a, v1 = a, v2 = a, v3 = a, v4 = a, v5 = a, v6 = a, v7 = a, v8 = a, v9 = a;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i) {
        ZC_STEP(v0) ZC_STEP(v1) ZC_STEP(v2) ZC_STEP(v3) ZC_STEP(v4) ZC_STEP(v5) ZC_STEP(v6) ZC_STEP(v7) ZC_STEP(v8)
        ZC_STEP(v9)
        __asm__ volatile("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3), "+v"(v4), "+v"(v5), "+v"(v6), "+v"(v7),
                         "+v"(v8), "+v"(v9));
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
#undef ZC_STEP
__m512i dot512(__m512i v, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(v, a, b); }
__m256i dot256(__m256i v, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(v, a, b); }
}  // namespace

// How long a 512-bit vpdpbusd takes against a 256-bit one (lowbit_kernel.h): the fastest of 7 interleaved trials
// of each, ~0.1 ms at the library's first use. ~2 where a 512-bit instruction runs as two 256-bit halves (Zen 4:
// 0.271 / 0.143 ns an instruction, 1.9); ~1 expected where the units are 512 bits wide (Zen 5, Intel's server
// cores; not yet measured).
double lowbit_zmm_cost() {
    constexpr int64_t iters = 2000;
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    const __m256i a2 = _mm512_castsi512_si256(a), b2 = _mm512_castsi512_si256(b);
    double zmm = 1e9, ymm = 1e9;
    dot_seconds<__m512i, dot512>(a, b, iters);  // the units awake at full clock before any trial counts
    for (int trial = 0; trial < 7; ++trial) {
        zmm = std::min(zmm, dot_seconds<__m512i, dot512>(a, b, iters));
        ymm = std::min(ymm, dot_seconds<__m256i, dot256>(a2, b2, iters));
    }
    return ymm > 0 ? zmm / ymm : 0.0;
}
