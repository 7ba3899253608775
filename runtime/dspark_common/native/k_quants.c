// GGUF files' K-quant matrices (Q4_K, Q5_K, Q6_K) multiplied as llama.cpp's CPU backend multiplies them
// (ggml's vec_dot_q{4,5,6}_K_q8_K), with the file's own codes and scales:
//   KQuantMatMul(x [.., K] float, codes, high, scales, mins, supers) -> y [.., N] float
//   KQuantGather(ids [..] int64, codes, high, scales, mins, supers) -> rows [.., K] float (a tied embedding's rows)
//
// Weights (dspark_common.k_quant_rows packs them), in tiles of 8 output columns:
//   codes  [N/8, K/32, 128] uint8: each code's low 4 bits, laid out as int4_rows.c's (chunk c of a block of 32
//          holds k = 8c..8c+3 of each column in its low nibbles, 8c+4..8c+7 in its high ones, a column a lane);
//   high   [N/8, K/32, 32·h] uint8: the codes' upper bits (h = 0 for Q4_K, 1 for Q5_K, 2 for Q6_K), byte for
//          byte beside the nibbles: the bits of the half (chunk c, low or high nibble) s = 2c + half at h·s;
//   scales [N/8, K/32 or K/16, 8]: Q4_K/Q5_K's 6-bit sc per 32 (uint8), Q6_K's signed scale per 16 (int8);
//   mins   [N/8, K/32, 8] uint8: Q4_K/Q5_K's 6-bit m per 32 ([N/8, K/32, 0] for Q6_K);
//   supers [N/8, K/256, 2 or 1, 8] float32: per 256 weights d and dmin (Q6_K: d).
// Q4_K/Q5_K: w = d·sc·q - dmin·m (q < 16 or < 32); Q6_K: w = d·sc·(q - 32) (q < 64); the type follows from h.
// Activations: ggml's Q8_K, per 256 values iscale = 127/max|x|, codes rint(x·iscale), scale 1/iscale. Every
// integer sum is ggml's: per 32 (Q6_K: 16) values Σ q·a by vpmaddubsw in int16 (no saturation: at most 30480),
// times the block's sc in int32, the m (Q6_K: 32·sc) terms from the activations' block sums; per 256 one float
// step, d_x·d_w·Σ - d_x·dmin·Σ m·sums. Only the float order of the steps differs from ggml's. Each row computes
// alone: its result does not depend on the other rows of its batch.
#include <immintrin.h>
#include <stdlib.h>

#include "ort_abi.h"

#define SUPER 256      // weights per super-block: one d (and dmin)
#define ROW_TILE 4     // rows sharing one unpacking of a weight tile
#define TILES_PER_TASK 8

enum { Q4_K = 0, Q5_K = 1, Q6_K = 2 };  // = the bytes of upper bits per block of 32, over 32

typedef struct {
    const uint8_t *codes, *high, *scales, *mins;
    const float* supers;
    int kind, K, N;
} KQuant;

typedef struct {
    int8_t* codes;   // [M, K]
    float* scales;   // [M, K/256]
    int32_t* pairs;  // [M, K/256, 4 (per 32) or 8 (per 16)]: block sums of the codes, two int16 to an int32
} Q8K;

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

static inline float hmax_ps(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t pair(int32_t low, int32_t high) { return (int32_t)((uint32_t)(uint16_t)low | ((uint32_t)high << 16)); }

// x [M, K] -> Q8K, the block sums over `group` (32 or 16) values.
static void quantize_q8_k(const float* x, int M, int K, int group, Q8K q) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
    const int supers = K / SUPER, per_super = SUPER / group / 2;
    for (int m = 0; m < M; m++)
        for (int s = 0; s < supers; s++) {
            const float* v = x + (size_t)m * K + (size_t)s * SUPER;
            int8_t* codes = q.codes + (size_t)m * K + (size_t)s * SUPER;
            int32_t* pairs = q.pairs + ((size_t)m * supers + s) * per_super;
            __m256 peaks = _mm256_setzero_ps();
            for (int k = 0; k < SUPER; k += 8)
                peaks = _mm256_max_ps(peaks, _mm256_and_ps(_mm256_loadu_ps(v + k), magnitude));
            const float peak = hmax_ps(peaks);
            if (peak == 0.f) {  // ggml: scale 0, codes 0
                q.scales[(size_t)m * supers + s] = 0.f;
                memset(codes, 0, SUPER);
                memset(pairs, 0, sizeof(int32_t) * per_super);
                continue;
            }
            const float iscale = 127.f / peak;
            q.scales[(size_t)m * supers + s] = 1.f / iscale;
            const __m256 multiplier = _mm256_set1_ps(iscale);
            int32_t sums[16];  // per 16 values
            for (int b = 0; b < SUPER / 32; b++) {
                __m256i c[4];
                for (int j = 0; j < 4; j++)
                    c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 32 * b + 8 * j), multiplier));
                sums[2 * b] = hsum_epi32(_mm256_add_epi32(c[0], c[1]));
                sums[2 * b + 1] = hsum_epi32(_mm256_add_epi32(c[2], c[3]));
                const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
                _mm256_storeu_si256((__m256i*)(codes + 32 * b), _mm256_permutevar8x32_epi32(bytes, order));
            }
            for (int p = 0; p < per_super; p++)
                pairs[p] = group == 16 ? pair(sums[2 * p], sums[2 * p + 1])
                                       : pair(sums[4 * p] + sums[4 * p + 1], sums[4 * p + 2] + sums[4 * p + 3]);
        }
}

// 8 bytes (one per column) as int16 pairs (v, v) in int32 lanes: what vpmaddwd multiplies a lane's two sums by.
static inline __m256i column_pairs(__m256i lanes) {
    return _mm256_or_si256(_mm256_and_si256(lanes, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(lanes, 16));
}
static inline __m256i unsigned_columns(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256i signed_columns(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

// The upper bits of the half s (0..7) of a block, moved to bit 4 of each byte: Q5_K one bit, Q6_K two.
static inline __m256i upper_bits(int kind, __m256i first, __m256i second, int s) {
    if (kind == Q5_K) {
        const __m256i bit = _mm256_and_si256(first, _mm256_set1_epi8((char)(1 << s)));
        return s < 4 ? _mm256_slli_epi16(bit, 4 - s) : _mm256_srli_epi16(bit, s - 4);
    }
    const __m256i plane = s < 4 ? first : second;
    const __m256i bits = _mm256_and_si256(_mm256_srli_epi16(plane, 2 * (s % 4)), _mm256_set1_epi8(3));
    return _mm256_slli_epi16(bits, 4);
}

// y[r, col..col+8] for `rows` rows of the activations and the 8 columns of tile `t`.
static inline __attribute__((always_inline)) void tile(const KQuant* w, const Q8K* q, int kind, int rows, int t,
                                                       int m, float* y) {
    const int K = w->K, blocks = K / 32, supers = K / SUPER, per_super = kind == Q6_K ? 8 : 4;
    const int super_floats = kind == Q6_K ? 8 : 16, high_bytes = 32 * kind;
    const uint8_t* codes = w->codes + (size_t)t * blocks * 128;
    const uint8_t* high = w->high + (size_t)t * blocks * high_bytes;
    const uint8_t* scales = w->scales + (size_t)t * blocks * 8 * (kind == Q6_K ? 2 : 1);
    const uint8_t* mins = w->mins + (size_t)t * blocks * 8;
    const float* super_scales = w->supers + (size_t)t * supers * super_floats;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 acc[ROW_TILE];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int s = 0; s < supers; s++) {
        __m256i sums[ROW_TILE];
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
        for (int j = 0; j < SUPER / 32; j++) {
            const int b = s * (SUPER / 32) + j;
            const __m256i first = kind == Q4_K ? nibble : _mm256_loadu_si256((const __m256i*)(high + (size_t)b * high_bytes));
            const __m256i second = kind == Q6_K ? _mm256_loadu_si256((const __m256i*)(high + (size_t)b * high_bytes + 32)) : first;
            const __m256i scale_a = kind == Q6_K ? column_pairs(signed_columns(scales + (size_t)b * 16))
                                                 : column_pairs(unsigned_columns(scales + (size_t)b * 8));
            const __m256i scale_b = kind == Q6_K ? column_pairs(signed_columns(scales + (size_t)b * 16 + 8)) : scale_a;
            __m256i part[ROW_TILE];
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) part[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i*)(codes + (size_t)b * 128 + 32 * c));
                __m256i low = _mm256_and_si256(packed, nibble);
                __m256i upper = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
                if (kind != Q4_K) {
                    low = _mm256_or_si256(low, upper_bits(kind, first, second, 2 * c));
                    upper = _mm256_or_si256(upper, upper_bits(kind, first, second, 2 * c + 1));
                }
#pragma GCC unroll 4
                for (int r = 0; r < rows; r++) {
                    const float* x = (const float*)(q->codes + (size_t)(m + r) * K + 32 * b + 8 * c);
                    const __m256i products = _mm256_add_epi16(
                        _mm256_maddubs_epi16(low, _mm256_castps_si256(_mm256_broadcast_ss(x))),
                        _mm256_maddubs_epi16(upper, _mm256_castps_si256(_mm256_broadcast_ss(x + 1))));
                    if (kind == Q6_K) {  // a scale per 16 values: chunks 0-1 and 2-3
                        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(products, c < 2 ? scale_a : scale_b));
                        __asm__("" : "+x"(sums[r]));
                        continue;
                    }
                    part[r] = _mm256_add_epi16(part[r], products);
                    __asm__("" : "+x"(part[r]));  // a chunk's sums are done before the next chunk's loads
                    if (kind == Q5_K && c % 2 == 1) {  // codes up to 31: at most 4 products a lane in int16
                        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(part[r], scale_a));
                        part[r] = _mm256_setzero_si256();
                    }
                }
            }
            if (kind == Q4_K)
#pragma GCC unroll 4
                for (int r = 0; r < rows; r++) sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(part[r], scale_a));
        }
        // per column the int16 pairs that multiply the activations' block sums: m (Q6_K: sc) of two blocks
        __m256i terms[8];
#pragma GCC unroll 8
        for (int p = 0; p < per_super; p++)
            terms[p] = kind == Q6_K
                ? _mm256_or_si256(_mm256_and_si256(signed_columns(scales + ((size_t)s * 16 + 2 * p) * 8), _mm256_set1_epi32(0xFFFF)),
                                  _mm256_slli_epi32(signed_columns(scales + ((size_t)s * 16 + 2 * p + 1) * 8), 16))
                : _mm256_or_si256(unsigned_columns(mins + ((size_t)s * 8 + 2 * p) * 8),
                                  _mm256_slli_epi32(unsigned_columns(mins + ((size_t)s * 8 + 2 * p + 1) * 8), 16));
        const __m256 d = _mm256_loadu_ps(super_scales + (size_t)s * super_floats);
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const int32_t* pairs = q->pairs + ((size_t)(m + r) * supers + s) * per_super;
            __m256i offsets = _mm256_setzero_si256();  // Σ m·(block sum) per column; Q6_K: Σ sc·(16-sum)
#pragma GCC unroll 8
            for (int p = 0; p < per_super; p++)
                offsets = _mm256_add_epi32(offsets, _mm256_madd_epi16(terms[p], _mm256_set1_epi32(pairs[p])));
            const __m256 row_scale = _mm256_set1_ps(q->scales[(size_t)(m + r) * supers + s]);
            if (kind == Q6_K) {  // (q - 32)·sc: the 32s as 32·sc times the 16-sums, in integers
                const __m256i total = _mm256_sub_epi32(sums[r], _mm256_slli_epi32(offsets, 5));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(row_scale, d), _mm256_cvtepi32_ps(total), acc[r]);
            } else {
                const __m256 dmin = _mm256_loadu_ps(super_scales + (size_t)s * super_floats + 8);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(row_scale, d), _mm256_cvtepi32_ps(sums[r]), acc[r]);
                acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(row_scale, dmin), _mm256_cvtepi32_ps(offsets), acc[r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + (size_t)r * w->N + 8 * t, acc[r]);
}

// `tile` compiled for each type and row count, so that its sums and accumulators stay in registers.
#define ROWS_OF(kind)                                                   \
    switch (rows) {                                                     \
        case 1: tile(w, q, kind, 1, t, m, y); break;                    \
        case 2: tile(w, q, kind, 2, t, m, y); break;                    \
        case 3: tile(w, q, kind, 3, t, m, y); break;                    \
        default: tile(w, q, kind, ROW_TILE, t, m, y);                   \
    }
static void tile_of(const KQuant* w, const Q8K* q, int rows, int t, int m, float* y) {
    switch (w->kind) {
        case Q4_K: ROWS_OF(Q4_K) break;
        case Q5_K: ROWS_OF(Q5_K) break;
        default: ROWS_OF(Q6_K)
    }
}

typedef struct {
    KQuant w;
    Q8K q;
    int M;
    float* y;
} Product;

static void product_task(void* data, size_t task) {
    const Product* p = (const Product*)data;
    const int tiles = p->w.N / 8;
    const int last = (int)((task + 1) * TILES_PER_TASK) < tiles ? (int)((task + 1) * TILES_PER_TASK) : tiles;
    for (int t = (int)(task * TILES_PER_TASK); t < last; t++)
        for (int m = 0; m < p->M; m += ROW_TILE)
            tile_of(&p->w, &p->q, p->M - m < ROW_TILE ? p->M - m : ROW_TILE, t, m, p->y + (size_t)m * p->w.N);
}

// The weights of inputs 1..5, their type from the width of the upper bits.
static KQuant weights_of(OrtKernelContext* context, int K) {
    const Tensor codes = input(context, 1), high = input(context, 2), scales = input(context, 3),
                 mins = input(context, 4), supers = input(context, 5);
    KQuant w = {(const uint8_t*)codes.data, (const uint8_t*)high.data, (const uint8_t*)scales.data,
                (const uint8_t*)mins.data, (const float*)supers.data, (int)(high.dims[2] / 32), K,
                (int)codes.dims[0] * 8};
    return w;
}

static void matmul_compute(void* kernel, OrtKernelContext* context) {
    (void)kernel;
    const Tensor x = input(context, 0);
    const int K = (int)x.dims[x.rank - 1], M = (int)leading(&x);
    Product p = {weights_of(context, K), {0}, M, NULL};
    p.y = product_output(context, &x, p.w.N);
    if (M == 0) return;
    const int group = p.w.kind == Q6_K ? 16 : 32;
    p.q.codes = (int8_t*)malloc((size_t)M * K);
    p.q.scales = (float*)malloc(sizeof(float) * (size_t)M * (K / SUPER));
    p.q.pairs = (int32_t*)malloc(sizeof(int32_t) * (size_t)M * (K / group / 2));
    quantize_q8_k((const float*)x.data, M, K, group, p.q);
    parallel_for(context, product_task, (size_t)(p.w.N / 8 + TILES_PER_TASK - 1) / TILES_PER_TASK, &p);
    free(p.q.codes);
    free(p.q.scales);
    free(p.q.pairs);
}

// Rows `ids` of the [N, K] matrix (a tied head's columns are the embedding's rows), dequantized as ggml does:
// (d·sc)·q - dmin·m, Q6_K (d·sc)·(q - 32).
static void gather_compute(void* kernel, OrtKernelContext* context) {
    (void)kernel;
    const Tensor ids = input(context, 0), codes = input(context, 1);
    const int blocks = (int)codes.dims[1], K = blocks * 32;
    const KQuant w = weights_of(context, K);
    const int high_bytes = 32 * w.kind, super_floats = w.kind == Q6_K ? 8 : 16;
    int64_t count;
    float* rows = gather_output(context, &ids, K, &count);
    for (int64_t r = 0; r < count; r++) {
        const int64_t id = ((const int64_t*)ids.data)[r], t = id / 8;
        const int column = (int)(id % 8);
        for (int b = 0; b < blocks; b++) {
            const float* supers = w.supers + ((size_t)t * (K / SUPER) + b / 8) * super_floats;
            const uint8_t* scales = w.scales + (size_t)t * blocks * 8 * (w.kind == Q6_K ? 2 : 1);
            for (int c = 0; c < 4; c++)
                for (int half = 0; half < 2; half++)
                    for (int k = 0; k < 4; k++) {
                        const size_t byte = (size_t)column * 4 + k;
                        const uint8_t packed = w.codes[((size_t)t * blocks + b) * 128 + 32 * c + byte];
                        int code = half ? packed >> 4 : packed & 0x0F;
                        const int s = 2 * c + half;
                        const uint8_t* upper = w.high + ((size_t)t * blocks + b) * high_bytes;
                        if (w.kind == Q5_K) code |= ((upper[byte] >> s) & 1) << 4;
                        if (w.kind == Q6_K) code |= ((upper[32 * (s / 4) + byte] >> (2 * (s % 4))) & 3) << 4;
                        float value;
                        if (w.kind == Q6_K) {
                            const int8_t sc = (int8_t)scales[((size_t)2 * b + c / 2) * 8 + column];
                            value = (supers[column] * (float)sc) * (float)(code - 32);
                        } else {
                            const float sc = scales[(size_t)b * 8 + column],
                                        mn = w.mins[((size_t)t * blocks + b) * 8 + column];
                            value = (supers[column] * sc) * (float)code - supers[8 + column] * mn;
                        }
                        rows[r * K + 32 * b + 8 * c + 4 * half + k] = value;
                    }
        }
    }
}

static const char* matmul_name(const OrtCustomOp* op) { (void)op; return "KQuantMatMul"; }
static const char* gather_name(const OrtCustomOp* op) { (void)op; return "KQuantGather"; }
static int matmul_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 || i == 5 ? FLOAT : UINT8; }
static int gather_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? INT64 : i == 5 ? FLOAT : UINT8; }
static size_t six(const OrtCustomOp* op) { (void)op; return 6; }

const OrtCustomOp K_QUANT_MATMUL = DSPARK_OP(matmul_name, matmul_input_type, six, matmul_compute);
const OrtCustomOp K_QUANT_GATHER = DSPARK_OP(gather_name, gather_input_type, six, gather_compute);
