// DSpark's ONNX Runtime operators for `w4a8` engines (domain ai.dspark), built by dspark_common.native:
//   Int4RowsMatMul(x [.., K] float, codes [N/8, K/32, 128] uint8, scales [N/8, K/32, 8] float16) -> y [.., N] float
//   Int4RowsGather(ids [..] int64, codes, scales) -> rows [.., K] float (an embedding stored as a tied head's codes)
//
// Weights: int4 codes in blocks of 32 along K, one float16 scale per block and output column, stored unsigned
// (zero 8) in tiles of 8 columns: per tile and block 128 bytes, chunk c (32 bytes) holding k = 8c..8c+3 of each
// column in its low nibbles and k = 8c+4..8c+7 in its high ones, 4 consecutive k per column per 32-bit lane.
// Activations: int8, one scale per row (its largest magnitude maps to 127). vpmaddubsw multiplies the unsigned
// codes by the signed activations; a block's 32 products per column sum in int16 (at most 8 pair sums of
// 15 x 127 x 2 = 3810: no saturation), vpmaddwd makes them int32, the zero is taken off as 8 x the block's
// activation sum, and the block's dot is scaled in float32 with one FMA, blocks in order. Every row runs the same
// instructions whatever the other rows: its result does not depend on them (a token verified in a batch computes
// what it computes alone). Column tiles are shared out over ONNX Runtime's own thread pool.
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "ort_abi.h"

#define ROW_TILE 4  // rows sharing one unpacking of a weight tile
#define PREFETCH 4096  // bytes of codes read ahead: one and two rows, bound by memory, run 1.2x faster (AVX2 EPYC)

static inline __attribute__((always_inline)) void tile(const uint8_t* w, const uint16_t* scales, const int8_t* a, const int32_t* zero_sums,
                        const float* row_scales, int rows, int K, int N, int col, float* y) {
    const int blocks = K / 32;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        _mm_prefetch((const char*)(w + (size_t)b * 128 + PREFETCH), _MM_HINT_T0);  // the stream runs on into the next
        _mm_prefetch((const char*)(w + (size_t)b * 128 + PREFETCH + 64), _MM_HINT_T0);  // tile: prefetch past ends
        __m256i sums[ROW_TILE];
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i*)(w + (size_t)b * 128 + 32 * c));
            const __m256i low = _mm256_and_si256(packed, nibble);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const float* x = (const float*)(a + (size_t)r * K + 32 * b + 8 * c);  // 4 codes a lane, broadcast
                const __m256i first = _mm256_castps_si256(_mm256_broadcast_ss(x));      // by a load alone
                const __m256i second = _mm256_castps_si256(_mm256_broadcast_ss(x + 1));
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(low, first));
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(high, second));
                __asm__("" : "+x"(sums[r]));  // a chunk's sums are done before the next chunk's loads
            }
        }
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + (size_t)b * 8)));
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(sums[r], ones),
                                                 _mm256_set1_epi32(zero_sums[(size_t)r * blocks + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        _mm256_storeu_ps(y + (size_t)r * N + col, _mm256_mul_ps(acc[r], _mm256_set1_ps(row_scales[r])));
}

// `tile` compiled for each row count, so that its per-row sums and accumulators stay in registers.
static void tile_of_rows(const uint8_t* w, const uint16_t* scales, const int8_t* a, const int32_t* zero_sums,
                         const float* row_scales, int rows, int K, int N, int col, float* y) {
    switch (rows) {
        case 1: tile(w, scales, a, zero_sums, row_scales, 1, K, N, col, y); break;
        case 2: tile(w, scales, a, zero_sums, row_scales, 2, K, N, col, y); break;
        case 3: tile(w, scales, a, zero_sums, row_scales, 3, K, N, col, y); break;
        default: tile(w, scales, a, zero_sums, row_scales, ROW_TILE, K, N, col, y);
    }
}

// x [M, K] -> int8 codes (x / scale rounded to nearest even), 8 x each block's code sum [M, K/32], and one scale
// per row: its largest magnitude over 127 (at least FLT_MIN), as w8a8's graphs quantize a row.
static void quantize_rows(const float* x, int M, int K, int8_t* a, int32_t* zero_sums, float* row_scales) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
    for (int m = 0; m < M; m++) {
        const float* row = x + (size_t)m * K;
        __m256 peaks = _mm256_setzero_ps();
        for (int k = 0; k < K; k += 8) peaks = _mm256_max_ps(peaks, _mm256_and_ps(_mm256_loadu_ps(row + k), magnitude));
        float lanes[8], peak = 0.f;
        _mm256_storeu_ps(lanes, peaks);
        for (int i = 0; i < 8; i++) peak = fmaxf(peak, lanes[i]);
        const float scale = fmaxf(peak / 127.f, FLT_MIN);
        const __m256 divisor = _mm256_set1_ps(scale);
        row_scales[m] = scale;
        for (int b = 0; b < K / 32; b++) {
            __m256i q[4];
            for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(row + 32 * b + 8 * j), divisor));
            const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            int32_t parts[8], total = 0;
            _mm256_storeu_si256((__m256i*)parts, sum);
            for (int i = 0; i < 8; i++) total += parts[i];
            zero_sums[(size_t)m * (K / 32) + b] = 8 * total;
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i*)(a + (size_t)m * K + 32 * b), _mm256_permutevar8x32_epi32(bytes, order));
        }
    }
}

#define TILES_PER_TASK 8  // column tiles a thread-pool task computes

typedef struct {
    const uint8_t* codes;
    const uint16_t* scales;
    const int8_t* a;
    const int32_t* zero_sums;
    const float* row_scales;
    int M, K, N;
    float* y;
} Product;

static void product_task(void* data, size_t task) {
    const Product* p = (const Product*)data;
    const int tiles = p->N / 8, blocks = p->K / 32;
    const int last = (int)((task + 1) * TILES_PER_TASK) < tiles ? (int)((task + 1) * TILES_PER_TASK) : tiles;
    for (int t = (int)(task * TILES_PER_TASK); t < last; t++)
        for (int m = 0; m < p->M; m += ROW_TILE)
            tile_of_rows(p->codes + (size_t)t * blocks * 128, p->scales + (size_t)t * blocks * 8, p->a + (size_t)m * p->K,
                         p->zero_sums + (size_t)m * blocks, p->row_scales + m,
                         p->M - m < ROW_TILE ? p->M - m : ROW_TILE, p->K, p->N, 8 * t, p->y + (size_t)m * p->N);
}

static void matmul_compute(void* kernel, OrtKernelContext* context) {
    (void)kernel;
    const Tensor x = input(context, 0), codes = input(context, 1), scales = input(context, 2);
    const int K = (int)x.dims[x.rank - 1], N = (int)codes.dims[0] * 8, M = (int)leading(&x);
    float* y = product_output(context, &x, N);
    if (M == 0) return;
    int8_t* a = (int8_t*)malloc((size_t)M * K);
    int32_t* zero_sums = (int32_t*)malloc(sizeof(int32_t) * (size_t)M * (K / 32));
    float* row_scales = (float*)malloc(sizeof(float) * (size_t)M);
    quantize_rows((const float*)x.data, M, K, a, zero_sums, row_scales);
    Product p = {(const uint8_t*)codes.data, (const uint16_t*)scales.data, a, zero_sums, row_scales, M, K, N, y};
    const size_t tasks = (size_t)(N / 8 + TILES_PER_TASK - 1) / TILES_PER_TASK;
    parallel_for(context, product_task, tasks, &p);
    free(a);
    free(zero_sums);
    free(row_scales);
}

// Rows `ids` of the [N, K] matrix the codes hold (its columns as a head are the rows of the tied embedding): a
// block's 32 values from the column's four bytes in each of its chunks, (code - 8) x scale.
static void gather_compute(void* kernel, OrtKernelContext* context) {
    (void)kernel;
    const Tensor ids = input(context, 0), codes = input(context, 1), scales = input(context, 2);
    const int blocks = (int)codes.dims[1], K = blocks * 32;
    int64_t count;
    float* rows = gather_output(context, &ids, K, &count);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int64_t r = 0; r < count; r++) {
        const int64_t id = ((const int64_t*)ids.data)[r];
        const uint8_t* tile = (const uint8_t*)codes.data + (size_t)(id / 8) * blocks * 128 + 4 * (id % 8);
        const uint16_t* tile_scales = (const uint16_t*)scales.data + (size_t)(id / 8) * blocks * 8 + id % 8;
        for (int b = 0; b < blocks; b++) {
            const __m256 scale = _mm256_set1_ps(_cvtsh_ss(tile_scales[(size_t)b * 8]));
            int32_t words[4];
            for (int c = 0; c < 4; c++) memcpy(&words[c], tile + (size_t)b * 128 + 32 * c, 4);
            const __m128i packed = _mm_loadu_si128((const __m128i*)words);
            const __m128i low = _mm_and_si128(packed, nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
            const __m128i in_order[2] = {_mm_unpacklo_epi32(low, high), _mm_unpackhi_epi32(low, high)};  // k 0-15, 16-31
            for (int i = 0; i < 4; i++) {
                const __m128i bytes = i % 2 ? _mm_srli_si128(in_order[i / 2], 8) : in_order[i / 2];
                const __m256i centered = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), eight);
                _mm256_storeu_ps(rows + r * K + 32 * b + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(centered), scale));
            }
        }
    }
}

static const char* matmul_name(const OrtCustomOp* op) { (void)op; return "Int4RowsMatMul"; }
static const char* gather_name(const OrtCustomOp* op) { (void)op; return "Int4RowsGather"; }
static int matmul_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? FLOAT : i == 1 ? UINT8 : FLOAT16; }
static int gather_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? INT64 : i == 1 ? UINT8 : FLOAT16; }
static size_t three(const OrtCustomOp* op) { (void)op; return 3; }

const OrtCustomOp INT4_ROWS_MATMUL = DSPARK_OP(matmul_name, matmul_input_type, three, matmul_compute);
const OrtCustomOp INT4_ROWS_GATHER = DSPARK_OP(gather_name, gather_input_type, three, gather_compute);
