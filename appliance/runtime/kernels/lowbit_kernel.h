// What the dispatcher (lowbit_matmul.cpp) and the per-ISA kernels share: the arguments and one entry per ISA.
#pragma once
#include <cstdint>

struct LowbitArgs {
    const float* x;         // [M, K]
    const uint8_t* w;       // bits 4: rows of Kp / 2 bytes, u4 two per byte, low nibble first; Kp = K rounded up
                            // to 32. bits 8: rows of Kp bytes, each pair of 32-blocks as the activations are
                            // (lowbit_kernel.hpp). Rows in groups of rg (N rounded up to rg, zero rows past N): a
                            // group holds its rows' first pairs of blocks one after the other, then their second
                            // pairs, ..., then their unpaired last blocks; rg = 1 is plain row-major.
    const uint16_t* sz;     // [N, 2 G] f16: per row its G group scales, then its G zero points (the IR's values,
                            // rewrite.scale_table: a u4 / u8 zero point is exact in f16)
    float* y;               // [M, N]
    int64_t M, N, K, Kp, gs, G;
    int64_t bits;           // 4 or 8 (8: u8 on the VNNI paths, s8 = u8 - 128 on AVX2: rewrite.U8_ISAS)
    int64_t rg;             // weight rows per group (w)
    int64_t slot;           // 1; 0: in lanes, per group of 16 rows and 8 values of K (u4; u8: 4) each row's 4 bytes
                            // in turn, sz by groups of 16 rows too (lowbit_kernel.hpp lanes_tile)
    int64_t xspan;          // octets of x per activation scale: 1, or 4 in lanes (LANES_BLOCK_ROWS)
    int64_t digits;         // 1; 2 (lanes, one row of x, xspan 1): x's int8 rounding error as a second int8 digit,
                            // after the first digits in the scratch (xq [2, M, Kp]: lowbit_kernel.hpp lanes_tile)
};

// The lanes tile's activations get one scale per block of 32 (xspan 4) from this many rows of x, one per octet below:
// paired in one process on the Zen 4 EPYC (2 threads, 24 layers from memory, 15 interleaved reps), the per-octet /
// per-block time at M = 2 / 4 / 8 was 0.94-1.0 / 1.0-1.11 / 1.07-1.15 at the Qwen2.5-1.5B shapes, and against the
// plugin's at M = 64 / 512 per octet took 0.88-1.03 / 0.95-1.03 where per block took 0.77-0.86. The next token after
// a prefill on ours moved no further from OpenVINO's (bench.quality --prompts 8 --precision default --kernels auto
// openvino at Qwen2.5-1.5B: TVD median 0.0215 per block, 0.0216 per octet; from fp32 0.2373 / 0.2366, OpenVINO's
// 0.2375). A block's one scale is the rounding of llama.cpp's q8 activations. Below 4 rows too it moved the decode
// step's token further (TVD 0.0227 from OpenVINO's against 0.0216) for no time measurable from memory (1 thread, 24
// layers, paired processes: per block took 0.92-1.03 of per octet's time at M = 1). u8 in lanes (the LM head) takes
// a block's scale at every row count: a chunk there is one vpdpbusd, a convert and FMA per octet came every two
// chunks, and per octet the TVD was the same (0.0227 / 0.0276 against 0.0227 / 0.0277, the u4 layers per block).
constexpr int64_t LANES_BLOCK_ROWS = 4;

// Floats of the per-block activation scales (dxv [M, pairs of blocks, 8]) the scratch needs.
inline int64_t lowbit_dx_floats(int64_t M, int64_t Kp) { return M * ((Kp / 32 + 1) / 2) * 8; }

// Quantizes blocks [b0, b1) of x into the scratch buffers (xq [M, Kp], dxv, xs [M, G] and 8 floats more: the decode
// tile reads 8 groups' sums at a time); runs rows [n0, n1).
using QuantizeFn = void (*)(const LowbitArgs&, int8_t*, float*, float*, int64_t, int64_t);
using RowsFn = void (*)(const LowbitArgs&, const int8_t*, const float*, const float*, int64_t, int64_t);

// out[i] = silu(gate[i]) * up[i] for i < n (the SwiGLU of a gate and an up projection computed by one op).
using GateFn = void (*)(const float* gate, const float* up, int64_t n, float* out);

struct LowbitKernel {
    const char* name;
    QuantizeFn quantize;
    RowsFn rows;
    GateFn gate;
};

LowbitKernel lowbit_kernel_avx2();
LowbitKernel lowbit_kernel_avxvnni();
LowbitKernel lowbit_kernel_avx512vnni();
