// DecodeAttention: paged attention of one new token per row over the CPU plugin's u8 KV cache quantized by token
// (attention_kernel.h), as an OpenVINO custom op in the graphs of rows (backends/row_graphs.py; attention.py puts it
// in place of PagedAttentionExtension there; prefill keeps the plugin's). Inputs: q [T, H * hs], k and v
// [T, Hkv * hs], the key and the value pool (i32 [3]: the address of the cache tensor's memory, u8 [blocks, Hkv, bs,
// row] as attention_kernel.h lays it out, in its low and high 32 bits, then its number of blocks; i32, since the CPU
// plugin runs i64 as i32), past_lens [T], block_indices, block_indices_begins [T + 1], and with `rope` 1 cos and sin
// (f32 [T, hs]). Attributes: heads, kv_heads, head_size, block_size, key_group, value_group (values per quantization
// group of a row), scale, wide (0: the 256-bit kernels even where the CPU has AVX-512, as APPLIANCE_KERNELS_ISA asks
// for a narrower path: attention.py), rope (1: q and k arrive before their rotary embedding, which the op applies as
// the graph did: x * cos + rotate_half(x) * sin per head, rope.py). Output f32 [T, H * hs].
// The pools come as addresses, not as the cache tensors themselves: a graph input of the pool's static shape made
// the CPU plugin allocate and write a buffer of the pool's size for every compiled graph, and touch all of the
// backend's pool when it was bound (attention.py says what that cost). The backend allocates the pool before these
// graphs compile and frees it after them.
// It writes each row's new key and value into the cache and attends over past_lens[t] + 1 tokens. Every row's key
// and value are written before any row attends, so rows t.. of one sequence at past_lens p, p + 1, .. (its tokens
// of one step, each a row with the sequence's block table) attend causally, as in a step of several tokens.
// Why, with measurements: attention.py.
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/op/op.hpp>
#include <vector>

#include "attention_kernel.h"

void appliance_end_read_ahead();  // lowbit_matmul.cpp

namespace {

// The 512-bit kernels where they are `wide`-allowed, the CPU has them and a group is whole vectors of 16, else the
// 256-bit ones (the CPU asked once: every layer of every step calls this).
AttentionKernel kernel_for(int64_t group, bool wide) {
    static const bool avx512 = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    }();
    return wide && avx512 && group % 16 == 0 ? attention_kernel_avx512() : attention_kernel_avx2();
}

// Rows of `heads` heads of hs values per token (x [T, heads * hs]) rotated into out: x * cos + rotate_half(x) * sin,
// rotate_half(x) = [-x[hs/2:], x[:hs/2]], with the token's row of cos and sin (HF's apply_rotary_pos_emb, which the
// graph's own nodes computed).
void rotate(const float* x, const float* cos, const float* sin, int64_t T, int64_t heads, int64_t hs, float* out) {
    const int64_t half = hs / 2;
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos + t * hs, *s = sin + t * hs;
        for (int64_t h = 0; h < heads; ++h) {
            const float* v = x + (t * heads + h) * hs;
            float* o = out + (t * heads + h) * hs;
            for (int64_t d = 0; d < half; ++d) {
                o[d] = v[d] * c[d] - v[d + half] * s[d];
                o[d + half] = v[d + half] * c[d + half] + v[d] * s[d + half];
            }
        }
    }
}

}  // namespace

namespace appliance {

class DecodeAttention : public ov::op::Op {
public:
    OPENVINO_OP("DecodeAttention", "appliance");

    DecodeAttention() = default;
    DecodeAttention(const ov::OutputVector& args, int64_t heads, int64_t kv_heads, int64_t head_size, int64_t block_size,
                    int64_t key_group, int64_t value_group, float scale, int64_t wide, int64_t rope)
        : Op(args), m_heads(heads), m_kv_heads(kv_heads), m_head_size(head_size), m_block_size(block_size),
          m_key_group(key_group), m_value_group(value_group), m_wide(wide), m_rope(rope), m_scale(scale) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        OPENVINO_ASSERT(m_rope == 0 || m_rope == 1, "DecodeAttention: rope must be 0 or 1");
        OPENVINO_ASSERT(get_input_size() == (m_rope ? 10u : 8u),
                        "DecodeAttention takes q, k, v, key_pool, value_pool, past_lens, block_indices, "
                        "block_indices_begins, and with rope 1 cos and sin");
        OPENVINO_ASSERT(!m_rope || m_head_size % 2 == 0, "DecodeAttention: rope needs an even head_size");
        OPENVINO_ASSERT(m_heads > 0 && m_kv_heads > 0 && m_heads % m_kv_heads == 0 && m_heads / m_kv_heads <= 64,
                        "DecodeAttention: heads must be 1..64 times kv_heads");
        OPENVINO_ASSERT(m_head_size > 0, "DecodeAttention: head_size must be positive");
        for (int64_t group : {m_key_group, m_value_group})
            OPENVINO_ASSERT(group > 0 && group % 8 == 0 && m_head_size % group == 0,
                            "DecodeAttention: a group size must be a multiple of 8 dividing head_size");
        OPENVINO_ASSERT(m_block_size > 0, "DecodeAttention: block_size must be positive");
        for (size_t i : {3, 4})
            OPENVINO_ASSERT(get_input_element_type(i) == ov::element::i32 &&
                                get_input_partial_shape(i).compatible(ov::PartialShape{3}),
                            "DecodeAttention: a pool is i32 [3]: its address (low, high 32 bits), its blocks");
        for (size_t i = 8; i < get_input_size(); ++i)
            OPENVINO_ASSERT(get_input_element_type(i) == ov::element::f32, "DecodeAttention: cos and sin must be f32");
        auto out = get_input_partial_shape(0);
        set_output_type(0, ov::element::f32, out);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<DecodeAttention>(args, m_heads, m_kv_heads, m_head_size, m_block_size, m_key_group,
                                                 m_value_group, m_scale, m_wide, m_rope);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("heads", m_heads);
        visitor.on_attribute("kv_heads", m_kv_heads);
        visitor.on_attribute("head_size", m_head_size);
        visitor.on_attribute("block_size", m_block_size);
        visitor.on_attribute("key_group", m_key_group);
        visitor.on_attribute("value_group", m_value_group);
        visitor.on_attribute("scale", m_scale);
        visitor.on_attribute("wide", m_wide);
        visitor.on_attribute("rope", m_rope);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        // First, before any check can throw: a read-ahead left running would otherwise outlive a failed inference.
        appliance_end_read_ahead();
        AttentionArgs a{};
        a.H = m_heads;
        a.Hkv = m_kv_heads;
        a.hs = m_head_size;
        a.bs = m_block_size;
        a.key_group = m_key_group;
        a.value_group = m_value_group;
        a.scale = m_scale;
        a.T = static_cast<int64_t>(inputs[5].get_size());
        const ov::Shape qs = inputs[0].get_shape();
        OPENVINO_ASSERT(ov::shape_size(qs) == static_cast<size_t>(a.T * a.H * a.hs) &&
                            inputs[1].get_size() == static_cast<size_t>(a.T * a.Hkv * a.hs) &&
                            inputs[2].get_size() == inputs[1].get_size(),
                        "DecodeAttention: q, k, v must hold one token per sequence");
        OPENVINO_ASSERT(inputs[7].get_size() == static_cast<size_t>(a.T + 1),
                        "DecodeAttention: block_indices_begins must hold T + 1 offsets");
        OPENVINO_ASSERT(inputs[3].get_size() == 3 && inputs[4].get_size() == 3,
                        "DecodeAttention: a pool is i32 [3]: its address (low, high 32 bits), its blocks");
        const auto address = [](const ov::Tensor& pool) {
            const auto* p = pool.data<const int32_t>();
            return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(static_cast<uint32_t>(p[0])) |
                                              static_cast<uintptr_t>(static_cast<uint32_t>(p[1])) << 32);
        };
        const int32_t blocks = inputs[3].data<const int32_t>()[2];
        a.key_cache = address(inputs[3]);
        a.value_cache = address(inputs[4]);
        OPENVINO_ASSERT(a.key_cache && a.value_cache && blocks > 0 && blocks == inputs[4].data<const int32_t>()[2],
                        "DecodeAttention: the pools must be two addresses of as many blocks");
        a.q = inputs[0].data<const float>();
        a.k = inputs[1].data<const float>();
        a.v = inputs[2].data<const float>();
        a.past_lens = inputs[5].data<const int32_t>();
        a.block_indices = inputs[6].data<const int32_t>();
        a.block_begins = inputs[7].data<const int32_t>();
        const auto nidx = static_cast<int64_t>(inputs[6].get_size());
        if (m_rope) {  // q and k rotated into scratch kept between calls, the rest of the op as without
            const auto row = static_cast<size_t>(a.T * a.hs);
            OPENVINO_ASSERT(inputs[8].get_size() == row && inputs[9].get_size() == row,
                            "DecodeAttention: cos and sin must hold head_size values per sequence");
            thread_local std::vector<float> q, k;
            q.resize(static_cast<size_t>(a.T * a.H * a.hs));
            k.resize(static_cast<size_t>(a.T * a.Hkv * a.hs));
            const float *cs = inputs[8].data<const float>(), *sn = inputs[9].data<const float>();
            rotate(a.q, cs, sn, a.T, a.H, a.hs, q.data());
            rotate(a.k, cs, sn, a.T, a.Hkv, a.hs, k.data());
            a.q = q.data();
            a.k = k.data();
        }
        outputs[0].set_shape(qs);
        a.out = outputs[0].data<float>();
        if (a.T == 0) return true;
        // Every block a step reads must be the sequence's and inside the pool: a bad table is an error, not a read
        // outside the tensors.
        for (int64_t t = 0; t < a.T; ++t) {
            const int64_t b0 = a.block_begins[t], b1 = a.block_begins[t + 1], len = int64_t{a.past_lens[t]} + 1;
            OPENVINO_ASSERT(a.past_lens[t] >= 0 && b0 >= 0 && b0 <= b1 && b1 <= nidx && (b1 - b0) * a.bs >= len,
                            "DecodeAttention: sequence ", t, " has too few blocks for ", len, " tokens");
            for (int64_t b = b0; b < b1; ++b)
                OPENVINO_ASSERT(a.block_indices[b] >= 0 && a.block_indices[b] < blocks,
                                "DecodeAttention: block index out of the pool");
        }
        const AttentionKernel kernel = kernel_for(std::min(a.key_group, a.value_group), m_wide != 0);
        // The new token's key and value first: the parts below read it from the cache like every other token.
        for (int64_t t = 0; t < a.T; ++t) {
            const int64_t p = a.past_lens[t], block = a.block_indices[a.block_begins[t] + p / a.bs];
            for (int64_t g = 0; g < a.Hkv; ++g) {
                const int64_t slot = g * a.bs + p % a.bs;
                kernel.store(a.k + (t * a.Hkv + g) * a.hs, a.hs, a.key_group,
                             a.key_cache + block * attention_block(a, a.key_group) + slot * attention_row(a.hs, a.key_group));
                kernel.store(a.v + (t * a.Hkv + g) * a.hs, a.hs, a.value_group,
                             a.value_cache + block * attention_block(a, a.value_group) +
                                 slot * attention_row(a.hs, a.value_group));
            }
        }
        run(a, kernel);
        return true;
    }

private:
    // Parts of (sequence, kv head, run of tokens), about four per thread, merged by their maxima (flash decoding).
    void run(const AttentionArgs& a, const AttentionKernel& kernel) const {
        const int64_t R = a.H / a.Hkv, hs = a.hs;
        const int64_t threads = tbb::this_task_arena::max_concurrency();
        int64_t longest = 1;
        for (int64_t t = 0; t < a.T; ++t) longest = std::max<int64_t>(longest, a.past_lens[t] + 1);
        const int64_t want = (4 * threads + a.T * a.Hkv - 1) / (a.T * a.Hkv);
        // at least 64 tokens a part: a shorter one costs more to merge than it spreads
        const int64_t span = std::max<int64_t>(64, (longest + want - 1) / want);
        const int64_t parts = (longest + span - 1) / span, tasks = a.T * a.Hkv * parts;
        thread_local std::vector<float> stats;
        stats.assign(static_cast<size_t>(tasks * R * (2 + hs)), 0.f);
        float* const st = stats.data();
        auto part = [&](int64_t task) {
            const int64_t t = task / (a.Hkv * parts), g = task / parts % a.Hkv, c = task % parts;
            const int64_t len = int64_t{a.past_lens[t]} + 1, from = c * span, to = std::min(len, from + span);
            float* m = st + task * R * (2 + hs);
            if (from >= to) {
                std::fill(m, m + R, -INFINITY);
                return;
            }
            thread_local std::vector<float> scores;
            thread_local std::vector<const uint8_t*> rows;
            scores.resize(static_cast<size_t>(2 * span * R + 16));
            rows.resize(static_cast<size_t>(2 * span));
            kernel.part(a, t, g, from, to, m, m + R, m + 2 * R, scores.data(), rows.data());
        };
        if (threads <= 1 || tasks == 1) {
            for (int64_t i = 0; i < tasks; ++i) part(i);
        } else {
            tbb::parallel_for(int64_t{0}, tasks, part);
        }
        for (int64_t t = 0; t < a.T; ++t)
            for (int64_t g = 0; g < a.Hkv; ++g)
                for (int64_t r = 0; r < R; ++r) {
                    float top = -INFINITY;
                    for (int64_t c = 0; c < parts; ++c) top = std::max(top, st[((t * a.Hkv + g) * parts + c) * R * (2 + hs) + r]);
                    float* out = a.out + t * a.H * hs + (g * R + r) * hs;
                    std::fill(out, out + hs, 0.f);
                    float total = 0.f;
                    for (int64_t c = 0; c < parts; ++c) {
                        const float* s = st + ((t * a.Hkv + g) * parts + c) * R * (2 + hs);
                        if (s[r] == -INFINITY) continue;
                        const float w = std::exp(s[r] - top);
                        total += w * s[R + r];
                        const float* acc = s + 2 * R + r * hs;
                        for (int64_t d = 0; d < hs; ++d) out[d] += w * acc[d];
                    }
                    const float inv = total > 0.f ? 1.f / total : 0.f;
                    for (int64_t d = 0; d < hs; ++d) out[d] *= inv;
                }
    }

    int64_t m_heads = 1, m_kv_heads = 1, m_head_size = 64, m_block_size = 32, m_key_group = 64, m_value_group = 64;
    int64_t m_wide = 1;
    int64_t m_rope = 0;
    float m_scale = 1.f;
};

}  // namespace appliance

ov::Extension::Ptr decode_attention_extension() {
    return std::make_shared<ov::OpExtension<appliance::DecodeAttention>>();
}
