// What the DecodeAttention op (decode_attention.cpp) and its AVX2 kernels (attention_avx2.cpp) share.
//
// The KV cache is the CPU plugin's u8 cache quantized by token (KEY_CACHE_QUANT_MODE=BY_TOKEN, which the backend
// sets for every graph, so the plugin's prefill and our decode steps read and write one layout): tensors [blocks,
// kv heads, block size, row], a row = head_size / group groups of (f32 scale, f32 zero point, group u8 values),
// x = (u8 - zp) * scale; the key and the value cache each have their group size.
#pragma once
#include <cstdint>

struct AttentionArgs {
    const float* q;               // [T, H * hs]: one token of each of T sequences
    const float* k;               // [T, Hkv * hs]
    const float* v;               // [T, Hkv * hs]
    uint8_t* key_cache;           // [blocks, Hkv, bs, hs + 8]
    uint8_t* value_cache;         // same
    const int32_t* past_lens;     // [T]: tokens of each sequence before this one
    const int32_t* block_indices; // the blocks of sequence t: [block_begins[t], block_begins[t + 1])
    const int32_t* block_begins;  // [T + 1]
    float* out;                   // [T, H * hs]
    int64_t T, H, Hkv, hs, bs;
    int64_t key_group, value_group;  // values per quantization group of a row (head_size: one per row)
    float scale;                  // on q . k (1 / sqrt(hs) as the model says)
};

// Bytes of one token's row (for a group size) and of one block of one cache tensor.
inline int64_t attention_row(int64_t hs, int64_t group) { return hs / group * (8 + group); }
inline int64_t attention_block(const AttentionArgs& a, int64_t group) {
    return a.Hkv * a.bs * attention_row(a.hs, group);
}

// Quantizes n floats of a new token's key or value into its row, in groups of `group` (scale, zero point, u8s).
using AttentionStoreFn = void (*)(const float* x, int64_t n, int64_t group, uint8_t* row);
// Sequence t's kv head g over its tokens [from, to) for the heads that share g: per head r (of R = H / Hkv) the max
// score m[r], the sum of exp(score - m[r]) l[r], and acc[r * hs ..] = sum of exp(score - m[r]) * v. Scratch: scores
// 2 (to - from) R + 16 floats, rows 2 (to - from) pointers.
using AttentionPartFn = void (*)(const AttentionArgs& a, int64_t t, int64_t g, int64_t from, int64_t to, float* m,
                                 float* l, float* acc, float* scores, const uint8_t** rows);

struct AttentionKernel {
    const char* name;
    AttentionStoreFn store;
    AttentionPartFn part;
};

AttentionKernel attention_kernel_avx2();
AttentionKernel attention_kernel_avx512();
