/* Runs one C kernel on inputs a test wrote, for a build the host cannot load (the NEON one, under qemu-user):
 *   kernel_harness CASE IN OUT
 * IN: int64 count, that many int64 parameters, then arrays, each an int64 byte length and its bytes. OUT: the
 * kernel's output array. The test compares it with the torch reference it computed on the host. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

static int64_t p[16];
static void *arr[12];
static int64_t len[12];

static int read_input(const char *path) {
    FILE *f = fopen(path, "rb");
    int64_t n = 0;
    if (f == NULL || fread(&n, 8, 1, f) != 1 || n > 16 || fread(p, 8, (size_t)n, f) != (size_t)n) return -1;
    for (int i = 0; i < 12 && fread(&len[i], 8, 1, f) == 1; i++) {
        arr[i] = malloc((size_t)len[i] + 64);
        if (arr[i] == NULL || fread(arr[i], 1, (size_t)len[i], f) != (size_t)len[i]) return -1;
    }
    fclose(f);
    return 0;
}

static int write_output(const char *path, const void *data, size_t bytes) {
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(data, 1, bytes, f) != bytes) return -1;
    return fclose(f);
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "level") == 0) { /* the build's own level and whether q8 is vectorized */
        printf("%d %d\n", aioengine_isa_level(), qgemv_q8_vectorized());
        return 0;
    }
    if (argc != 4 || read_input(argv[2]) != 0) return 2;
    const char *kernel = argv[1];
    if (strcmp(kernel, "qgemv_q8_f32") == 0) { /* p: m n k block limbs affine; arr: x u scale [mins] */
        const int64_t m = p[0], n = p[1], k = p[2];
        float *y = malloc((size_t)(m * n) * 4);
        const int status = qgemv_q8_f32(arr[0], k, arr[1], arr[2], p[5] ? arr[3] : NULL, p[3], NULL, y, n, m, n, k,
                                        NULL, NULL, (int)p[4], 1);
        return status != 0 ? 3 : write_output(argv[3], y, (size_t)(m * n) * 4);
    }
    if (strcmp(kernel, "qgemv_q8_argmax") == 0) { /* p: m n k block limbs; arr: x u scale scale_max (screened) */
        const int64_t m = p[0], n = p[1], k = p[2];
        int64_t *picks = malloc((size_t)m * 8);
        const int status = qgemv_q8_f32(arr[0], k, arr[1], arr[2], NULL, p[3], NULL, NULL, n, m, n, k, picks,
                                        arr[3], (int)p[4], 1);
        return status != 0 ? 3 : write_output(argv[3], picks, (size_t)m * 8);
    }
    if (strcmp(kernel, "qgemv_q8_bf16") == 0) { /* p: m n k block affine; arr: x (bf16) u scale [mins] */
        const int64_t m = p[0], n = p[1], k = p[2];
        uint16_t *y = malloc((size_t)(m * n) * 2);
        const int status = qgemv_q8_bf16(arr[0], k, arr[1], arr[2], p[4] ? arr[3] : NULL, p[3], NULL, y, n, m, n, k,
                                         OUT_BF16, NULL, 1);
        return status != 0 ? 3 : write_output(argv[3], y, (size_t)(m * n) * 2);
    }
    if (strcmp(kernel, "q4f_gemv_f32") == 0) { /* p: m n k; arr: x u scale mins */
        const int64_t m = p[0], n = p[1], k = p[2];
        float *y = malloc((size_t)(m * n) * 4);
        const int status = q4f_gemv_f32(arr[0], k, arr[1], arr[2], arr[3], NULL, y, n, m, n, k, 1);
        return status != 0 ? 3 : write_output(argv[3], y, (size_t)(m * n) * 4);
    }
    if (strcmp(kernel, "moe_q4f_f32") == 0) { /* p: T H I k E; arr: x ids weights, then stacked [E, ...]
                                                 * gate_up codes scales mins, down codes scales mins */
        const int64_t T = p[0], H = p[1], I = p[2], k = p[3], E = p[4];
        int64_t tables[6][64];
        const int64_t per[6] = {2 * I * H / 2, 2 * I * H / 32 * 4, 2 * I * H / 32 * 4, H * I / 2, H * I / 32 * 4,
                                H * I / 32 * 4}; /* bytes an expert */
        if (E > 64) return 2;
        for (int t = 0; t < 6; t++)
            for (int64_t e = 0; e < E; e++) tables[t][e] = (int64_t)((uint8_t *)arr[3 + t] + e * per[t]);
        float *y = malloc((size_t)(T * H) * 4);
        const int status = moe_q4f_f32(arr[0], T, H, I, k, arr[1], arr[2], tables[0], tables[1], tables[2],
                                       tables[3], tables[4], tables[5], E, y, 1);
        return status != 0 ? 3 : write_output(argv[3], y, (size_t)(T * H) * 4);
    }
    if (strcmp(kernel, "qgemv_int8_f32") == 0) { /* p: m n k; arr: x q scale */
        const int64_t m = p[0], n = p[1], k = p[2];
        float *y = malloc((size_t)(m * n) * 4);
        qgemv_int8_f32(arr[0], k, arr[1], arr[2], NULL, y, n, m, n, k, 1);
        return write_output(argv[3], y, (size_t)(m * n) * 4);
    }
    if (strcmp(kernel, "add_rms_norm_f32") == 0) { /* p: rows hidden eps*1e9; arr: x residual weight */
        const int64_t rows = p[0], h = p[1];
        float *out = malloc((size_t)(2 * rows * h) * 4);
        add_rms_norm_f32(arr[0], h, arr[1], h, out + rows * h, arr[2], out, rows, h, (float)p[2] * 1e-9f, 1);
        return write_output(argv[3], out, (size_t)(2 * rows * h) * 4);
    }
    if (strcmp(kernel, "rotary_f32") == 0) { /* p: tokens heads head_dim; arr: x positions cos2 sin2 */
        const int64_t t = p[0], h = p[1], d = p[2];
        float *out = malloc((size_t)(t * h * d) * 4);
        rotary_f32(arr[0], h * d, arr[1], arr[2], arr[3], out, t, h, d, 1);
        return write_output(argv[3], out, (size_t)(t * h * d) * 4);
    }
    if (strcmp(kernel, "decode_attention_f32") == 0) {
        /* p: reqs heads kv_heads head_dim block_size blocks_per_req scale*1e9 window; arr: q k v table seq_lens */
        const int64_t r = p[0], hq = p[1], hkv = p[2], d = p[3], bs = p[4];
        float *out = malloc((size_t)(r * hq * d) * 4);
        const int status = decode_attention_f32(arr[0], hq * d, arr[1], arr[2], arr[3], p[5], arr[4], out, (int)r,
                                                (int)hq, (int)hkv, (int)d, (int)bs, (float)p[6] * 1e-9f, (int)p[7],
                                                bs * hkv * d, hkv * d, d, 1);
        return status != 0 ? 3 : write_output(argv[3], out, (size_t)(r * hq * d) * 4);
    }
    return 4;
}
