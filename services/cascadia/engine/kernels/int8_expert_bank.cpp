// An MoE expert bank on int8 weights and int8 inputs for the CPU, as one OpenVINO operation.
//
// The CPU plugin runs a bank either as its fused GatherMatmul (a matrix-vector product per
// (row, expert) pair, f32 arithmetic) or, grouped, as one small dynamic-shape matmul per expert,
// whose many nodes and gathers cost more than the weights' bytes at decode sizes. This operation
// reads each chosen expert's weights once per call and multiplies them with every row that chose
// it in int8 (AVX-512 VNNI), the inputs quantised symmetrically in groups of 32 along their length.
//
// Inputs: x [T, H] f32; index [T, K] i32 or i64; routing weight [T, K] f32;
//         gate_up [E, 2I/16, H/4, 16, 4] i8 (gate rows, then up rows, packed for VNNI);
//         gate_up scale [E, 2I] f32; down [E, H/16, I/4, 16, 4] i8; down scale [E, H] f32.
// Output: [T, H] f32, each row the sum of its chosen experts' outputs, in the order of its choices,
//         so a row's result does not depend on the other rows of the call.
// It runs only on a CPU with AVX-512 VNNI; the engine gives banks to it nowhere else.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "openvino/core/extension.hpp"
#include "openvino/core/op_extension.hpp"
#include "openvino/core/parallel.hpp"
#include "openvino/op/op.hpp"

namespace cascadia {

constexpr int kGroup = 32;    // input quantisation group, along the reduced dimension
constexpr int kLanes = 16;    // output channels per packed block
constexpr int kQuad = 4;      // reduced positions per 32-bit lane
constexpr int kRowTile = 8;   // rows multiplied per load of a weight block
constexpr int kBlocksPerItem = 4;

// Rows quantised for the kernel: each value as its int8 code plus 128 (an unsigned byte, as
// VNNI's first operand takes), and one scale per group.
struct QuantisedRows {
    std::vector<uint8_t> codes;
    std::vector<float> scales;
    int length = 0;
    const uint8_t* row(int64_t r) const { return codes.data() + r * length; }
    const float* row_scales(int64_t r) const { return scales.data() + r * (length / kGroup); }
};

// out[r][n] for the 16 channels of block `block` of packed weights `w` [N/16, K/4, 16, 4],
// for `count` rows (at most kRowTile): sum over groups of (integer dot product) * row scale,
// times the channel's scale. The integer dot products use codes + 128, so 128 * (sum of the
// group's weights) comes off each; that sum is one more VNNI product per weight load.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void block_rows_vnni(
    const int8_t* w, const float* channel_scale, int K, const uint8_t* const* codes, const float* const* scales,
    float* const* out) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (int g = 0; g < K / kGroup; ++g) {
        __m512i dot[R];
        for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
        __m512i weight_sum = _mm512_setzero_si512();
        const int8_t* wg = w + static_cast<int64_t>(g) * (kGroup / kQuad) * kLanes * kQuad;
        for (int q = 0; q < kGroup / kQuad; ++q) {
            const __m512i wv = _mm512_loadu_si512(wg + q * kLanes * kQuad);
            weight_sum = _mm512_dpbusd_epi32(weight_sum, ones, wv);
            for (int r = 0; r < R; ++r) {
                int32_t quad;
                std::memcpy(&quad, codes[r] + g * kGroup + q * kQuad, sizeof quad);
                dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(quad), wv);
            }
        }
        const __m512i offset = _mm512_slli_epi32(weight_sum, 7);
        for (int r = 0; r < R; ++r) {
            const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r], offset));
            total[r] = _mm512_fmadd_ps(exact, _mm512_set1_ps(scales[r][g]), total[r]);
        }
    }
    const __m512 scale = _mm512_loadu_ps(channel_scale);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], _mm512_mul_ps(total[r], scale));
}

static bool cpu_runs_vnni() {
    static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                  __builtin_cpu_supports("avx512vnni");
    return supported;
}

// Symmetric int8 codes in groups of 32, one scale per group (largest magnitude / 127), stored plus 128
// as unsigned bytes (VNNI's first operand); the conversion rounds to nearest even.
__attribute__((target("avx512f,avx512bw"))) static void quantise_row(const float* values, int length,
                                                                          uint8_t* codes, float* scales) {
    const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
    for (int g = 0; g < length / kGroup; ++g) {
        const __m512 first = _mm512_loadu_ps(values + g * kGroup);
        const __m512 second = _mm512_loadu_ps(values + g * kGroup + 16);
        const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second)));
        const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
        scales[g] = largest / 127.f;
        for (int half = 0; half < 2; ++half) {
            __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(half ? second : first, inverse));
            code = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(code, low), high), offset);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * kGroup + half * 16), _mm512_cvtepi32_epi8(code));
        }
    }
}

// swish(gate) * up * weight over a pair's row: e^x by 2^n * e^r, |r| <= ln2 / 2, with a degree-6
// polynomial for e^r (within 2 ulp of std::exp over the range that does not overflow)
__attribute__((target("avx512f"))) static void mix_row(const float* gate, const float* up, float weight,
                                                              int length, float* mixed) {
    const __m512 log2e = _mm512_set1_ps(1.44269504f), ln2_hi = _mm512_set1_ps(0.693359375f),
                 ln2_lo = _mm512_set1_ps(-2.12194440e-4f), one = _mm512_set1_ps(1.f);
    const __m512 c2 = _mm512_set1_ps(1.f / 2), c3 = _mm512_set1_ps(1.f / 6), c4 = _mm512_set1_ps(1.f / 24),
                 c5 = _mm512_set1_ps(1.f / 120), c6 = _mm512_set1_ps(1.f / 720);
    const __m512 scale = _mm512_set1_ps(weight);
    for (int i = 0; i < length; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(-87.f)),
                                       _mm512_set1_ps(88.f));
        const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r = _mm512_fnmadd_ps(n, ln2_lo, _mm512_fnmadd_ps(n, ln2_hi, x));
        __m512 poly = _mm512_fmadd_ps(c6, r, c5);
        poly = _mm512_fmadd_ps(poly, r, c4);
        poly = _mm512_fmadd_ps(poly, r, c3);
        poly = _mm512_fmadd_ps(poly, r, c2);
        poly = _mm512_fmadd_ps(poly, r, one);
        poly = _mm512_fmadd_ps(poly, r, one);
        const __m512 e = _mm512_scalef_ps(poly, n);  // e^-g
        const __m512 swish = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_storeu_ps(mixed + i, _mm512_mul_ps(_mm512_mul_ps(swish, _mm512_loadu_ps(up + i)), scale));
    }
}

static void block_rows(const int8_t* w, const float* channel_scale, int K, const uint8_t* const* codes,
                       const float* const* scales, float* const* out, int count) {
    switch (count) {
        case 1: return block_rows_vnni<1>(w, channel_scale, K, codes, scales, out);
        case 2: return block_rows_vnni<2>(w, channel_scale, K, codes, scales, out);
        case 3: return block_rows_vnni<3>(w, channel_scale, K, codes, scales, out);
        case 4: return block_rows_vnni<4>(w, channel_scale, K, codes, scales, out);
        case 5: return block_rows_vnni<5>(w, channel_scale, K, codes, scales, out);
        case 6: return block_rows_vnni<6>(w, channel_scale, K, codes, scales, out);
        case 7: return block_rows_vnni<7>(w, channel_scale, K, codes, scales, out);
        default: return block_rows_vnni<8>(w, channel_scale, K, codes, scales, out);
    }
}

// One projection of the bank: for each expert, its rows (`row_of` maps a sorted pair to the row of
// `input` it reads) times its packed weights [E, N/16, K/4, 16, 4], into `out` [pairs, N].
static void project(const int8_t* packed, const float* channel_scales, int N, int K, const QuantisedRows& input,
                    const std::vector<int64_t>& row_of, const std::vector<int64_t>& expert_start, float* out) {
    const int experts = static_cast<int>(expert_start.size()) - 1;
    const int blocks = N / kLanes;
    const int items_per_expert = (blocks + kBlocksPerItem - 1) / kBlocksPerItem;
    std::vector<int> active;
    for (int e = 0; e < experts; ++e)
        if (expert_start[e + 1] > expert_start[e]) active.push_back(e);
    const int64_t expert_bytes = static_cast<int64_t>(N) * K;
    ov::parallel_for(active.size() * items_per_expert, [&](size_t item) {
        const int e = active[item / items_per_expert];
        const int first_block = static_cast<int>(item % items_per_expert) * kBlocksPerItem;
        const int last_block = std::min(blocks, first_block + kBlocksPerItem);
        const uint8_t* codes[kRowTile];
        const float* scales[kRowTile];
        float* rows_out[kRowTile];
        for (int b = first_block; b < last_block; ++b) {
            const int8_t* w = packed + e * expert_bytes + static_cast<int64_t>(b) * K * kLanes;
            const float* channel_scale = channel_scales + static_cast<int64_t>(e) * N + b * kLanes;
            for (int64_t start = expert_start[e]; start < expert_start[e + 1]; start += kRowTile) {
                const int count = static_cast<int>(std::min<int64_t>(kRowTile, expert_start[e + 1] - start));
                for (int r = 0; r < count; ++r) {
                    codes[r] = input.row(row_of[start + r]);
                    scales[r] = input.row_scales(row_of[start + r]);
                    rows_out[r] = out + (start + r) * N + b * kLanes;
                }
                block_rows(w, channel_scale, K, codes, scales, rows_out, count);
            }
        }
    });
}

static void quantise_rows(const float* values, int64_t rows, int length, QuantisedRows& into) {
    into.length = length;
    into.codes.resize(rows * length);
    into.scales.resize(rows * (length / kGroup));
    ov::parallel_for(rows, [&](size_t r) {
        quantise_row(values + r * length, length, into.codes.data() + r * length,
                     into.scales.data() + r * (length / kGroup));
    });
}

class Int8ExpertBank : public ov::op::Op {
public:
    OPENVINO_OP("Int8ExpertBank", "cascadia");

    Int8ExpertBank() = default;
    explicit Int8ExpertBank(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 7, "Int8ExpertBank takes 7 inputs, got ", get_input_size());
        const auto& gate_up = get_input_partial_shape(3);
        const auto& down = get_input_partial_shape(5);
        NODE_VALIDATION_CHECK(this, gate_up.rank().compatible(5) && down.rank().compatible(5),
                              "packed weights must be [E, N/16, K/4, 16, 4]");
        NODE_VALIDATION_CHECK(this, get_input_element_type(3) == ov::element::i8 &&
                                        get_input_element_type(5) == ov::element::i8,
                              "packed weights must be i8");
        set_output_type(0, ov::element::f32, get_input_partial_shape(0));
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override {
        return std::make_shared<Int8ExpertBank>(new_args);
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto& x = inputs[0];
        const auto& index = inputs[1];
        const int64_t rows = static_cast<int64_t>(x.get_shape()[0]);
        const int hidden = static_cast<int>(x.get_shape()[1]);
        const int per_row = static_cast<int>(index.get_shape()[1]);
        const auto& gate_up_shape = inputs[3].get_shape();
        const int experts = static_cast<int>(gate_up_shape[0]);
        const int gate_up_width = static_cast<int>(gate_up_shape[1] * kLanes);
        const int inner = gate_up_width / 2;
        const auto& down_shape = inputs[5].get_shape();
        // shapes the graph guarantees, checked because a mismatch would read past the tensors
        OPENVINO_ASSERT(x.get_shape().size() == 2 && index.get_shape().size() == 2, "x and index must be 2-D");
        OPENVINO_ASSERT(index.get_shape()[0] == x.get_shape()[0] && inputs[2].get_shape() == index.get_shape(),
                        "x ", x.get_shape(), ", index ", index.get_shape(), " and weight ", inputs[2].get_shape(),
                        " must have the same rows and index and weight the same shape");
        OPENVINO_ASSERT(hidden % kGroup == 0 && inner % kGroup == 0, "hidden ", hidden, " and expert width ", inner,
                        " must be multiples of ", kGroup);
        OPENVINO_ASSERT(gate_up_shape == ov::Shape({size_t(experts), size_t(gate_up_width / kLanes),
                                                    size_t(hidden / kQuad), size_t(kLanes), size_t(kQuad)}),
                        "gate_up ", gate_up_shape, " does not match x ", x.get_shape());
        OPENVINO_ASSERT(down_shape == ov::Shape({size_t(experts), size_t(hidden / kLanes), size_t(inner / kQuad),
                                                 size_t(kLanes), size_t(kQuad)}),
                        "down ", down_shape, " does not match gate_up ", gate_up_shape);
        OPENVINO_ASSERT(inputs[4].get_size() == size_t(experts) * gate_up_width &&
                            inputs[6].get_size() == size_t(experts) * hidden,
                        "one scale per expert and output channel");
        OPENVINO_ASSERT(cpu_runs_vnni(), "Int8ExpertBank needs a CPU with AVX-512 VNNI");
        outputs[0].set_shape(x.get_shape());
        float* out = outputs[0].data<float>();
        if (rows == 0) return true;

        // the pairs in expert order, each expert's in row order (a stable counting sort)
        const int64_t pairs = rows * per_row;
        std::vector<int64_t> chosen(pairs);
        if (index.get_element_type() == ov::element::i64) {
            std::memcpy(chosen.data(), index.data<int64_t>(), pairs * sizeof(int64_t));
        } else {
            const int32_t* ids = index.data<int32_t>();
            for (int64_t p = 0; p < pairs; ++p) chosen[p] = ids[p];
        }
        std::vector<int64_t> expert_start(experts + 1, 0);
        for (int64_t p = 0; p < pairs; ++p) {
            if (chosen[p] < 0 || chosen[p] >= experts) OPENVINO_THROW("expert index ", chosen[p], " out of range");
            ++expert_start[chosen[p] + 1];
        }
        for (int e = 0; e < experts; ++e) expert_start[e + 1] += expert_start[e];
        std::vector<int64_t> slot_of(pairs), row_of(pairs), pair_of(pairs);
        {
            std::vector<int64_t> next(expert_start.begin(), expert_start.end() - 1);
            for (int64_t p = 0; p < pairs; ++p) {
                const int64_t slot = next[chosen[p]]++;
                slot_of[p] = slot;
                row_of[slot] = p / per_row;
                pair_of[slot] = p;
            }
        }

        QuantisedRows x_codes;
        quantise_rows(x.data<float>(), rows, hidden, x_codes);
        std::vector<float> gate_up(pairs * gate_up_width);
        project(inputs[3].data<int8_t>(), inputs[4].data<float>(), gate_up_width, hidden, x_codes, row_of,
                expert_start, gate_up.data());

        // swish(gate) * up * routing weight, quantised again for the down projection
        const float* routing = inputs[2].data<float>();
        QuantisedRows mixed_codes;
        mixed_codes.length = inner;
        mixed_codes.codes.resize(pairs * inner);
        mixed_codes.scales.resize(pairs * (inner / kGroup));
        ov::parallel_for(pairs, [&](size_t slot) {
            float* g = gate_up.data() + slot * gate_up_width;
            mix_row(g, g + inner, routing[pair_of[slot]], inner, g);  // in place over the pair's gate half
            quantise_row(g, inner, mixed_codes.codes.data() + slot * inner,
                         mixed_codes.scales.data() + slot * (inner / kGroup));
        });
        std::vector<int64_t> identity(pairs);
        for (int64_t s = 0; s < pairs; ++s) identity[s] = s;
        std::vector<float> down(pairs * hidden);
        project(inputs[5].data<int8_t>(), inputs[6].data<float>(), hidden, inner, mixed_codes, identity, expert_start,
                down.data());

        ov::parallel_for(rows, [&](size_t r) {
            float* target = out + r * hidden;
            std::memcpy(target, down.data() + slot_of[r * per_row] * hidden, hidden * sizeof(float));
            for (int k = 1; k < per_row; ++k) {
                const float* part = down.data() + slot_of[r * per_row + k] * hidden;
                for (int h = 0; h < hidden; ++h) target[h] += part[h];
            }
        });
        return true;
    }
};

}  // namespace cascadia

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<cascadia::Int8ExpertBank>>()}));
