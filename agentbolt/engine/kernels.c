/* The engine's decode-step attention on the CPU: one query position per row.
 *
 * Built on first use by agentbolt/engine/kernels.py with the system's C compiler
 * (cc -O3 -march=native -fopenmp) and called through ctypes; see that module for why and for
 * what it replaces. OpenMP here is the runtime PyTorch has already loaded (libgomp.so.1), so the
 * parallel loop below runs on the calling thread's team with PyTorch's thread count.
 *
 * Layouts (element strides; the last dimension of every tensor is contiguous):
 *   q    [B, KV, G, D]  the query heads that share a key-value head, contiguous
 *   k, v [B, KV, L, D]  the cache's first L columns (any row, head and column strides)
 *   mask [B, L]         int64, nonzero where the column holds a token of that row
 *   out  [B, KV, G, D]  contiguous
 * Scores and softmax are float32, the weighted sum of the values too; the result is rounded to
 * the input type once (bfloat16: to nearest, ties to even). A row without any token gets zeros.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 256
#define MAX_G 16

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* exp(x) for x <= 0 (scores minus their maximum): Cody-Waite range reduction and a degree-6
 * polynomial, within 2 ulp of expf; 0 below -87.3 (where expf is denormal or 0). Written so the
 * compiler can vectorise loops that call it. */
static inline float exp_nonpositive(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float under = x < -87.3f ? 0.0f : 1.0f;
    x = x < -87.3f ? -87.3f : x;
    float n = floorf(x * log2e + 0.5f);
    float r = x - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale * under;
}

/* Loads element i of a row as float32: bfloat16 (is_bf16) or float32. */
static inline float load(const void *row, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* One (row, key-value head): its G query heads against the row's L cached columns. D is a
 * compile-time constant in the callers below, so the loops over it vectorise. */
static inline __attribute__((always_inline)) void attend(
    const void *q, const void *k, const void *v, const int64_t *ok, void *out, int64_t G,
    const int64_t D, int64_t L, int64_t k_sl, int64_t v_sl, float scale, float *scores, int is_bf16) {
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], kf[MAX_D], vf[MAX_D], top[MAX_G], total[MAX_G];
    size_t esize = is_bf16 ? 2 : 4;
    for (int64_t g = 0; g < G; g++) {
        const char *q_g = (const char *)q + g * D * esize;
        for (int64_t d = 0; d < D; d++) qf[g][d] = load(q_g, d, is_bf16) * scale;
        for (int64_t d = 0; d < D; d++) acc[g][d] = 0.0f;
        top[g] = -INFINITY;
    }
    for (int64_t l = 0; l < L; l++) {
        if (!ok[l]) continue;
        const char *k_l = (const char *)k + l * k_sl * esize;
        for (int64_t d = 0; d < D; d++) kf[d] = load(k_l, d, is_bf16);
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; d++) s += qf[g][d] * kf[d];
            scores[g * L + l] = s;
            top[g] = s > top[g] ? s : top[g];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *s_g = scores + g * L, m = top[g], sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < L; l++) {
            float p = ok[l] ? exp_nonpositive(s_g[l] - m) : 0.0f;
            s_g[l] = p;
            sum += p;
        }
        total[g] = sum;
    }
    for (int64_t l = 0; l < L; l++) {
        if (!ok[l]) continue;
        const char *v_l = (const char *)v + l * v_sl * esize;
        for (int64_t d = 0; d < D; d++) vf[d] = load(v_l, d, is_bf16);
        for (int64_t g = 0; g < G; g++) {
            float p = scores[g * L + l];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * vf[d];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        if (is_bf16) {
            uint16_t *o = (uint16_t *)out + g * D;
            for (int64_t d = 0; d < D; d++) o[d] = float_to_bf16(acc[g][d] * inv);
        } else {
            float *o = (float *)out + g * D;
            for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
        }
    }
}

static int decode_attention(const void *q, const void *k, const void *v, const int64_t *mask,
                            void *out, int64_t B, int64_t KV, int64_t G, int64_t D, int64_t L,
                            int64_t k_sb, int64_t k_sh, int64_t k_sl, int64_t v_sb, int64_t v_sh,
                            int64_t v_sl, int64_t mask_sb, float scale, int is_bf16) {
    if (D > MAX_D || G > MAX_G || D < 1 || G < 1 || L < 0) return 1;
    size_t esize = is_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(G * (L > 0 ? L : 1)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * KV; item++) {
            if (scores == NULL) continue;
            int64_t b = item / KV, h = item % KV;
            const char *q_i = (const char *)q + item * G * D * esize;
            const char *k_i = (const char *)k + (b * k_sb + h * k_sh) * esize;
            const char *v_i = (const char *)v + (b * v_sb + h * v_sh) * esize;
            char *o_i = (char *)out + item * G * D * esize;
            const int64_t *ok = mask + b * mask_sb;
            if (D == 64 && G == 3)
                attend(q_i, k_i, v_i, ok, o_i, 3, 64, L, k_sl, v_sl, scale, scores, is_bf16);
            else if (D == 64)
                attend(q_i, k_i, v_i, ok, o_i, G, 64, L, k_sl, v_sl, scale, scores, is_bf16);
            else if (D == 128)
                attend(q_i, k_i, v_i, ok, o_i, G, 128, L, k_sl, v_sl, scale, scores, is_bf16);
            else
                attend(q_i, k_i, v_i, ok, o_i, G, D, L, k_sl, v_sl, scale, scores, is_bf16);
        }
        free(scores);
    }
    return failed ? 2 : 0;
}

int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                          const int64_t *mask, uint16_t *out, int64_t B, int64_t KV, int64_t G,
                          int64_t D, int64_t L, int64_t k_sb, int64_t k_sh, int64_t k_sl,
                          int64_t v_sb, int64_t v_sh, int64_t v_sl, int64_t mask_sb, float scale) {
    return decode_attention(q, k, v, mask, out, B, KV, G, D, L, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl,
                            mask_sb, scale, 1);
}

int decode_attention_f32(const float *q, const float *k, const float *v, const int64_t *mask,
                         float *out, int64_t B, int64_t KV, int64_t G, int64_t D, int64_t L,
                         int64_t k_sb, int64_t k_sh, int64_t k_sl, int64_t v_sb, int64_t v_sh,
                         int64_t v_sl, int64_t mask_sb, float scale) {
    return decode_attention(q, k, v, mask, out, B, KV, G, D, L, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl,
                            mask_sb, scale, 0);
}

/* The version of this file's interface; kernels.py refuses a library that reports another. */
int kernels_abi(void) { return 1; }
