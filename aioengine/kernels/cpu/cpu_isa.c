/* The ISA level this library was compiled for, read off the compiler's own macros: the loader checks it
 * against the level it asked for (kernels/cpu/isa.py), so a library never runs where its level was not meant. */
#include "cpu_kernels.h"

int aioengine_isa_level(void) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 3; /* avx512-bf16 */
#elif defined(__AVX512F__) && defined(__AVX512BW__)
    return 2; /* avx512 */
#elif defined(__AVX2__) && defined(__FMA__)
    return 1; /* avx2 */
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return 4; /* neon */
#else
    return 0;
#endif
}
