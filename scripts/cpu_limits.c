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

// One core's rate of vpmaddubsw (32 u8 x s8 products each, the most any AVX2 integer product instruction does)
// with the vpaddw that keeps its sums, eight independent chains, nothing else issued: an upper bound on the
// products a second of any int8 matmul here. The activations pass through an empty asm each round, so that the
// compiler can neither hoist the products out of the loop nor keep the chains in memory.
double products_per_second(long iterations) {
    __m256i x = _mm256_set1_epi8(3);
    __m256i w0 = _mm256_set1_epi8(1), w1 = _mm256_set1_epi8(2), w2 = _mm256_set1_epi8(3), w3 = _mm256_set1_epi8(4);
    __m256i w4 = _mm256_set1_epi8(5), w5 = _mm256_set1_epi8(6), w6 = _mm256_set1_epi8(7), w7 = _mm256_set1_epi8(8);
    __m256i s0 = w0, s1 = w1, s2 = w2, s3 = w3, s4 = w4, s5 = w5, s6 = w6, s7 = w7;
    const double start = seconds();
    for (long i = 0; i < iterations; i++) {
        __asm__ volatile("" : "+x"(x));
        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(x, w0));
        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(x, w1));
        s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(x, w2));
        s3 = _mm256_add_epi16(s3, _mm256_maddubs_epi16(x, w3));
        s4 = _mm256_add_epi16(s4, _mm256_maddubs_epi16(x, w4));
        s5 = _mm256_add_epi16(s5, _mm256_maddubs_epi16(x, w5));
        s6 = _mm256_add_epi16(s6, _mm256_maddubs_epi16(x, w6));
        s7 = _mm256_add_epi16(s7, _mm256_maddubs_epi16(x, w7));
    }
    const double elapsed = seconds() - start;
    __asm__ volatile("" : : "x"(s0), "x"(s1), "x"(s2), "x"(s3), "x"(s4), "x"(s5), "x"(s6), "x"(s7));
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
