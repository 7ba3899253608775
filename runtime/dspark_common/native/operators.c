// DSpark's ONNX Runtime operators (domain ai.dspark), one library built by dspark_common.native from this folder's
// sources: int4_rows.c (w4a8 engines), k_quants.c (GGUF files' K-quant blocks as ggml computes them) and
// attention.c (the attention of targets on those products).
#include "ort_abi.h"

const void* const* ort_api;

extern const OrtCustomOp INT4_ROWS_MATMUL, INT4_ROWS_GATHER, K_QUANT_MATMUL, K_QUANT_GATHER, CACHED_ATTENTION,
    BLOCK_ATTENTION;

void* stateless_kernel(const OrtCustomOp* op, const void* api, const OrtKernelInfo* info) {
    (void)op, (void)api, (void)info;
    return (void*)1;
}
const char* cpu_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
int float_output(const OrtCustomOp* op, size_t i) { (void)op, (void)i; return FLOAT; }
size_t one_output(const OrtCustomOp* op) { (void)op; return 1; }
void destroy_kernel(void* kernel) { (void)kernel; }
int required(const OrtCustomOp* op, size_t i) { (void)op, (void)i; return 0; }
int default_memory(const OrtCustomOp* op, size_t i) { (void)op, (void)i; return 0; }
int single_arity(const OrtCustomOp* op) { (void)op; return 1; }

static OrtStatus* failure(const char* message) {
    return CALL(CREATE_STATUS, OrtStatus* (*)(int, const char*), ORT_FAIL, message);
}

// ONNX Runtime's entry point for `SessionOptions.register_custom_ops_library`.
__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                   const OrtApiBase* base) {
    ort_api = base->GetApi(16);
    if (!ort_api) return NULL;  // cannot even report: ONNX Runtime older than 1.16
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return failure("the ai.dspark operators need a CPU with AVX2, FMA and F16C");
    OrtCustomOpDomain* domain = NULL;
    OrtStatus* status = CALL(CREATE_CUSTOM_OP_DOMAIN, OrtStatus* (*)(const char*, OrtCustomOpDomain**), "ai.dspark",
                             &domain);
    const OrtCustomOp* ops[] = {&INT4_ROWS_MATMUL, &INT4_ROWS_GATHER, &K_QUANT_MATMUL, &K_QUANT_GATHER,
                                &CACHED_ATTENTION, &BLOCK_ATTENTION};
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]) && !status; i++)
        status = CALL(CUSTOM_OP_DOMAIN_ADD, OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*), domain, ops[i]);
    if (!status) status = CALL(ADD_CUSTOM_OP_DOMAIN, OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*), options,
                               domain);
    return status;
}
