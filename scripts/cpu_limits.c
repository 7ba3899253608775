// The CPU's limits for scripts/kernel_ceiling.py: how fast all threads (OpenMP) read memory, and how many int8
// products one core's AVX2 multiplies make a second.
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>
#include <time.h>

static double seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec + now.tv_nsec * 1e-9;
}

// One core's rate of independent vpmaddubsw (32 u8 x s8 products each, the most any AVX2 integer product
// instruction does), nothing else issued: an upper bound on the products a second of any int8 matmul here.
double products_per_second(long iterations) {
    __m256i x = _mm256_set1_epi8(3), w[8], acc[8];
    for (int i = 0; i < 8; i++) w[i] = _mm256_set1_epi8((char)i), acc[i] = _mm256_setzero_si256();
    const double start = seconds();
    for (long i = 0; i < iterations; i++)
        for (int j = 0; j < 8; j++) {
            acc[j] = _mm256_maddubs_epi16(x, w[j]);
            __asm__ volatile("" : "+x"(acc[j]));
        }
    const double elapsed = seconds() - start;
    return iterations * 8 * 32.0 / elapsed;
}

// Bytes a second all threads read streaming through `bytes` of `buffer` (a multiple of 32 bytes a thread).
double read_rate(const uint8_t* buffer, size_t bytes) {
    long long checksum = 0;
    const double start = seconds();
#pragma omp parallel reduction(+ : checksum)
    {
        __m256i sum = _mm256_setzero_si256();
#pragma omp for schedule(static)
        for (size_t i = 0; i < bytes; i += 32) sum = _mm256_add_epi64(sum, _mm256_loadu_si256((const __m256i*)(buffer + i)));
        checksum += _mm256_extract_epi64(sum, 0);
    }
    const double elapsed = seconds() - start;
    __asm__ volatile("" : : "r"(checksum));
    return bytes / elapsed;
}
