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
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_TILE 4  // rows sharing one unpacking of a weight tile

static inline __attribute__((always_inline)) void tile(const uint8_t* w, const uint16_t* scales, const int8_t* a, const int32_t* zero_sums,
                        const float* row_scales, int rows, int K, int N, int col, float* y) {
    const int blocks = K / 32;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i sums[ROW_TILE];
        for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i*)(w + (size_t)b * 128 + 32 * c));
            const __m256i low = _mm256_and_si256(packed, nibble);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            for (int r = 0; r < rows; r++) {
                const float* x = (const float*)(a + (size_t)r * K + 32 * b + 8 * c);  // 4 codes a lane, broadcast
                const __m256i first = _mm256_castps_si256(_mm256_broadcast_ss(x));      // by a load alone
                const __m256i second = _mm256_castps_si256(_mm256_broadcast_ss(x + 1));
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(low, first));
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(high, second));
            }
        }
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + (size_t)b * 8)));
        for (int r = 0; r < rows; r++) {
            const __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(sums[r], ones),
                                                 _mm256_set1_epi32(zero_sums[(size_t)r * blocks + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
        }
    }
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

// ---- ONNX Runtime's C ABI: the few entries used, by their slot in the OrtApi table (stable: ONNX Runtime only
// appends to it) and OrtCustomOp's layout (version 14 fields and the ones after, left empty).
typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtShapeInfo OrtShapeInfo;
typedef struct OrtApiBase {
    const void* const* (*GetApi)(uint32_t version);
    const char* (*GetVersionString)(void);
} OrtApiBase;

enum { FLOAT = 1, UINT8 = 2, INT64 = 7, FLOAT16 = 10 };  // ONNXTensorElementDataType
enum { ORT_FAIL = 1 };
enum {
    CREATE_STATUS = 0, CREATE_CUSTOM_OP_DOMAIN = 26, CUSTOM_OP_DOMAIN_ADD = 27, ADD_CUSTOM_OP_DOMAIN = 28,
    GET_TENSOR_MUTABLE_DATA = 51, GET_DIMENSIONS_COUNT = 61, GET_DIMENSIONS = 62, GET_TENSOR_TYPE_AND_SHAPE = 65,
    KERNEL_CONTEXT_GET_INPUT = 90, KERNEL_CONTEXT_GET_OUTPUT = 91, RELEASE_STATUS = 93,
    RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99, KERNEL_CONTEXT_PARALLEL_FOR = 274,
};
static const void* const* api;  // the OrtApi table
#define CALL(slot, type, ...) (((type)api[slot])(__VA_ARGS__))

typedef struct OrtCustomOp {
    uint32_t version;
    void* (*CreateKernel)(const struct OrtCustomOp*, const void*, const OrtKernelInfo*);
    const char* (*GetName)(const struct OrtCustomOp*);
    const char* (*GetExecutionProviderType)(const struct OrtCustomOp*);
    int (*GetInputType)(const struct OrtCustomOp*, size_t);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp*);
    int (*GetOutputType)(const struct OrtCustomOp*, size_t);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp*);
    void (*KernelCompute)(void*, OrtKernelContext*);
    void (*KernelDestroy)(void*);
    int (*GetInputCharacteristic)(const struct OrtCustomOp*, size_t);
    int (*GetOutputCharacteristic)(const struct OrtCustomOp*, size_t);
    int (*GetInputMemoryType)(const struct OrtCustomOp*, size_t);
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp*);
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp*);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp*);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp*);
    void* later[9];  // CreateKernelV2 .. ReleaseAliasMap: unused (version 14)
} OrtCustomOp;

// A tensor's data and shape (at most 8 axes).
typedef struct {
    void* data;
    int64_t dims[8];
    size_t rank;
} Tensor;

static Tensor input(OrtKernelContext* context, size_t index) {
    Tensor t = {0};
    const OrtValue* value = NULL;
    void* info = NULL;
    CALL(KERNEL_CONTEXT_GET_INPUT, OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**), context, index,
         &value);
    CALL(GET_TENSOR_MUTABLE_DATA, OrtStatus* (*)(const OrtValue*, void**), value, &t.data);
    CALL(GET_TENSOR_TYPE_AND_SHAPE, OrtStatus* (*)(const OrtValue*, void**), value, &info);
    CALL(GET_DIMENSIONS_COUNT, OrtStatus* (*)(const void*, size_t*), info, &t.rank);
    if (t.rank > 8) t.rank = 8;
    CALL(GET_DIMENSIONS, OrtStatus* (*)(const void*, int64_t*, size_t), info, t.dims, t.rank);
    CALL(RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, void (*)(void*), info);
    return t;
}

static void* output(OrtKernelContext* context, const int64_t* dims, size_t rank) {
    OrtValue* value = NULL;
    void* data = NULL;
    CALL(KERNEL_CONTEXT_GET_OUTPUT, OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**),
         context, 0, dims, rank, &value);
    CALL(GET_TENSOR_MUTABLE_DATA, OrtStatus* (*)(OrtValue*, void**), value, &data);
    return data;
}

static int64_t leading(const Tensor* t) {  // the product of all but the last axis
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < t->rank; i++) rows *= t->dims[i];
    return rows;
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
    int64_t dims[8];
    memcpy(dims, x.dims, sizeof(dims));
    dims[x.rank - 1] = N;
    float* y = (float*)output(context, dims, x.rank);
    if (M == 0) return;
    int8_t* a = (int8_t*)malloc((size_t)M * K);
    int32_t* zero_sums = (int32_t*)malloc(sizeof(int32_t) * (size_t)M * (K / 32));
    float* row_scales = (float*)malloc(sizeof(float) * (size_t)M);
    quantize_rows((const float*)x.data, M, K, a, zero_sums, row_scales);
    Product p = {(const uint8_t*)codes.data, (const uint16_t*)scales.data, a, zero_sums, row_scales, M, K, N, y};
    const size_t tasks = (size_t)(N / 8 + TILES_PER_TASK - 1) / TILES_PER_TASK;
    CALL(KERNEL_CONTEXT_PARALLEL_FOR, OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t,
                                                      void*), context, product_task, tasks, 0, &p);
    free(a);
    free(zero_sums);
    free(row_scales);
}

// Rows `ids` of the [N, K] matrix the codes hold (its columns as a head are the rows of the tied embedding).
static void gather_compute(void* kernel, OrtKernelContext* context) {
    (void)kernel;
    const Tensor ids = input(context, 0), codes = input(context, 1), scales = input(context, 2);
    const int blocks = (int)codes.dims[1], K = blocks * 32;
    int64_t dims[9], count = 1;
    for (size_t i = 0; i < ids.rank; i++) dims[i] = ids.dims[i], count *= ids.dims[i];
    dims[ids.rank] = K;
    float* rows = (float*)output(context, dims, ids.rank + 1);
    for (int64_t r = 0; r < count; r++) {
        const int64_t id = ((const int64_t*)ids.data)[r];
        const uint8_t* tile = (const uint8_t*)codes.data + (size_t)(id / 8) * blocks * 128;
        const uint16_t* tile_scales = (const uint16_t*)scales.data + (size_t)(id / 8) * blocks * 8;
        const int column = (int)(id % 8);
        for (int b = 0; b < blocks; b++) {
            const float scale = _cvtsh_ss(tile_scales[(size_t)b * 8 + column]);
            for (int c = 0; c < 4; c++)
                for (int k = 0; k < 4; k++) {
                    const uint8_t byte = tile[(size_t)b * 128 + 32 * c + 4 * column + k];
                    rows[r * K + 32 * b + 8 * c + k] = ((int)(byte & 0x0F) - 8) * scale;
                    rows[r * K + 32 * b + 8 * c + 4 + k] = ((int)(byte >> 4) - 8) * scale;
                }
        }
    }
}

static void* create_kernel(const OrtCustomOp* op, const void* ort_api, const OrtKernelInfo* info) {
    (void)op, (void)ort_api, (void)info;
    return (void*)1;  // stateless
}
static const char* matmul_name(const OrtCustomOp* op) { (void)op; return "Int4RowsMatMul"; }
static const char* gather_name(const OrtCustomOp* op) { (void)op; return "Int4RowsGather"; }
static const char* cpu(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int matmul_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? FLOAT : i == 1 ? UINT8 : FLOAT16; }
static int gather_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? INT64 : i == 1 ? UINT8 : FLOAT16; }
static size_t three(const OrtCustomOp* op) { (void)op; return 3; }
static size_t one(const OrtCustomOp* op) { (void)op; return 1; }
static int float_output(const OrtCustomOp* op, size_t i) { (void)op, (void)i; return FLOAT; }
static void destroy(void* kernel) { (void)kernel; }
static int required(const OrtCustomOp* op, size_t i) { (void)op, (void)i; return 0; }
static int default_memory(const OrtCustomOp* op, size_t i) { (void)op, (void)i; return 0; }
static int arity(const OrtCustomOp* op) { (void)op; return 1; }

static OrtCustomOp MATMUL = {14, create_kernel, matmul_name, cpu, matmul_input_type, three, float_output, one,
                             matmul_compute, destroy, required, required, default_memory, arity, arity, arity, arity,
                             {0}};
static OrtCustomOp GATHER = {14, create_kernel, gather_name, cpu, gather_input_type, three, float_output, one,
                             gather_compute, destroy, required, required, default_memory, arity, arity, arity, arity,
                             {0}};

static OrtStatus* failure(const char* message) {
    return CALL(CREATE_STATUS, OrtStatus* (*)(int, const char*), ORT_FAIL, message);
}

// ONNX Runtime's entry point for `SessionOptions.register_custom_ops_library`.
__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                   const OrtApiBase* base) {
    api = base->GetApi(16);
    if (!api) return NULL;  // cannot even report: ONNX Runtime older than 1.16
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return failure("the ai.dspark operators need a CPU with AVX2, FMA and F16C");
    OrtCustomOpDomain* domain = NULL;
    OrtStatus* status = CALL(CREATE_CUSTOM_OP_DOMAIN, OrtStatus* (*)(const char*, OrtCustomOpDomain**), "ai.dspark",
                             &domain);
    if (!status) status = CALL(CUSTOM_OP_DOMAIN_ADD, OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*), domain,
                               &MATMUL);
    if (!status) status = CALL(CUSTOM_OP_DOMAIN_ADD, OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*), domain,
                               &GATHER);
    if (!status) status = CALL(ADD_CUSTOM_OP_DOMAIN, OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*), options,
                               domain);
    return status;
}
