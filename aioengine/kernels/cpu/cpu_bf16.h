/* bf16 <-> float32 for the CPU kernels (the attention and elementwise kernels, cpu_avx512.h): widening is
 * exact; narrowing rounds to nearest even and keeps a NaN a NaN, as torch does. Integer ops only, so
 * -ffast-math cannot change them. */
#ifndef AIOENGINE_CPU_BF16_H
#define AIOENGINE_CPU_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
