// The few entries of ONNX Runtime's C ABI that DSpark's operators use, by their slot in the OrtApi table (stable:
// ONNX Runtime only appends to it), OrtCustomOp's layout (version 14 fields and the ones after, left empty), and
// what every operator shares: its inputs and output, the thread pool, the parts of an OrtCustomOp that are alike.
#ifndef DSPARK_ORT_ABI_H
#define DSPARK_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtApiBase {
    const void* const* (*GetApi)(uint32_t version);
    const char* (*GetVersionString)(void);
} OrtApiBase;

enum { FLOAT = 1, UINT8 = 2, INT32 = 6, INT64 = 7, FLOAT16 = 10 };  // ONNXTensorElementDataType
enum { ORT_FAIL = 1 };
enum {
    CREATE_STATUS = 0, CREATE_CUSTOM_OP_DOMAIN = 26, CUSTOM_OP_DOMAIN_ADD = 27, ADD_CUSTOM_OP_DOMAIN = 28,
    GET_TENSOR_MUTABLE_DATA = 51, GET_DIMENSIONS_COUNT = 61, GET_DIMENSIONS = 62, GET_TENSOR_TYPE_AND_SHAPE = 65,
    KERNEL_CONTEXT_GET_INPUT = 90, KERNEL_CONTEXT_GET_OUTPUT = 91, RELEASE_STATUS = 93,
    RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99, KERNEL_CONTEXT_PARALLEL_FOR = 274,
};
extern const void* const* ort_api;  // the OrtApi table, set by RegisterCustomOps
#define CALL(slot, type, ...) (((type)ort_api[slot])(__VA_ARGS__))

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

static inline Tensor input(OrtKernelContext* context, size_t index) {
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

static inline void* output_at(OrtKernelContext* context, size_t index, const int64_t* dims, size_t rank) {
    OrtValue* value = NULL;
    void* data = NULL;
    CALL(KERNEL_CONTEXT_GET_OUTPUT, OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**),
         context, index, dims, rank, &value);
    CALL(GET_TENSOR_MUTABLE_DATA, OrtStatus* (*)(OrtValue*, void**), value, &data);
    return data;
}

static inline void* output(OrtKernelContext* context, const int64_t* dims, size_t rank) {
    return output_at(context, 0, dims, rank);
}

// The output of a product of x [.., K] with N columns: x's shape, its last axis N.
static inline float* product_output(OrtKernelContext* context, const Tensor* x, int64_t N) {
    int64_t dims[8];
    memcpy(dims, x->dims, sizeof(dims));
    dims[x->rank - 1] = N;
    return (float*)output(context, dims, x->rank);
}

// The output of a gather of `ids` rows of width K: ids' shape and K.
static inline float* gather_output(OrtKernelContext* context, const Tensor* ids, int64_t K, int64_t* count) {
    int64_t dims[9];
    *count = 1;
    for (size_t i = 0; i < ids->rank; i++) dims[i] = ids->dims[i], *count *= ids->dims[i];
    dims[ids->rank] = K;
    return (float*)output(context, dims, ids->rank + 1);
}

static inline int64_t leading(const Tensor* t) {  // the product of all but the last axis
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < t->rank; i++) rows *= t->dims[i];
    return rows;
}

// `task(data, i)` for i < tasks on ONNX Runtime's own thread pool.
static inline void parallel_for(OrtKernelContext* context, void (*task)(void*, size_t), size_t tasks, void* data) {
    CALL(KERNEL_CONTEXT_PARALLEL_FOR, OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t,
                                                      void*), context, task, tasks, 0, data);
}

// The parts every DSpark operator has alike: stateless kernels on the CPU, one float output, required inputs.
void* stateless_kernel(const OrtCustomOp* op, const void* api, const OrtKernelInfo* info);
const char* cpu_provider(const OrtCustomOp* op);
int float_output(const OrtCustomOp* op, size_t i);
size_t one_output(const OrtCustomOp* op);
void destroy_kernel(void* kernel);
int required(const OrtCustomOp* op, size_t i);
int default_memory(const OrtCustomOp* op, size_t i);
int single_arity(const OrtCustomOp* op);

// An operator named `name` with `inputs` inputs of types `input_type` and `outputs` float outputs (one for DSPARK_OP).
#define DSPARK_OP_OUTPUTS(name, input_type, inputs, outputs, compute)                                               \
    {14, stateless_kernel, name, cpu_provider, input_type, inputs, float_output, outputs, compute, destroy_kernel,     \
     required, required, default_memory, single_arity, single_arity, single_arity, single_arity, {0}}
#define DSPARK_OP(name, input_type, inputs, compute) DSPARK_OP_OUTPUTS(name, input_type, inputs, one_output, compute)

#endif
