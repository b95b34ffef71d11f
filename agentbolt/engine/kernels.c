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

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 float32 of a row: bfloat16 widened (a shift into the high half) or float32 as they are. */
static inline __m512 load16(const void *row, int64_t i, int is_bf16) {
    if (is_bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + i);
}

/* Sixteen dot products, one per vector of partial sums, as one vector (lane r: the sum of v[r]):
 * halves, then quarters, then pairs are added across the vectors (45 instructions, not 16 full
 * horizontal sums), and one permutation puts the sums in order. */
static inline __m512 sum16(__m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    __m512 x = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    /* lane 4j + k of x holds row j + 4k */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, x);
}

/* exp_nonpositive on 16 lanes. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
}

/* Which of columns l..l+n-1 (n <= 16) hold a token. */
static inline __mmask16 tokens16(const int64_t *ok, int64_t l, int64_t n) {
    __mmask16 m = 0;
    for (int64_t j = 0; j < n; j++) m |= (__mmask16)((ok[l + j] != 0) << j);
    return m;
}

/* attend() for 64 dimensions and at most 4 query heads per key-value head, in AVX-512. */
static inline __attribute__((always_inline)) void attend64(
    const void *q, const void *k, const void *v, const int64_t *ok, void *out, const int64_t G,
    int64_t L, int64_t k_sl, int64_t v_sl, float scale, float *scores, int is_bf16) {
    size_t esize = is_bf16 ? 2 : 4;
    __m512 qf[4][4], acc[4][4];
    float top[4], total[4];
    for (int64_t g = 0; g < G; g++) {
        for (int c = 0; c < 4; c++) {
            qf[g][c] = _mm512_mul_ps(load16((const char *)q + g * 64 * esize, 16 * c, is_bf16), _mm512_set1_ps(scale));
            acc[g][c] = _mm512_setzero_ps();
        }
    }
    const int64_t Lp = (L + 15) & ~(int64_t)15;
    for (int64_t g = 0; g < G; g++) {
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int64_t l0 = 0; l0 < L; l0 += 16) {
            int64_t n = L - l0 < 16 ? L - l0 : 16;
            __m512 part[16];
            for (int j = 0; j < 16; j++) {
                if (j < n) {
                    const char *k_l = (const char *)k + (l0 + j) * k_sl * esize;
                    __m512 a = _mm512_mul_ps(qf[g][0], load16(k_l, 0, is_bf16));
                    a = _mm512_fmadd_ps(qf[g][1], load16(k_l, 16, is_bf16), a);
                    a = _mm512_fmadd_ps(qf[g][2], load16(k_l, 32, is_bf16), a);
                    part[j] = _mm512_fmadd_ps(qf[g][3], load16(k_l, 48, is_bf16), a);
                } else {
                    part[j] = _mm512_setzero_ps();
                }
            }
            __mmask16 m = tokens16(ok, l0, n);
            __m512 s = _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), sum16(part));
            _mm512_storeu_ps(scores + g * Lp + l0, s);
            best = _mm512_max_ps(best, s);
        }
        top[g] = _mm512_reduce_max_ps(best);
        __m512 sum = _mm512_setzero_ps(), m_g = _mm512_set1_ps(top[g]);
        for (int64_t l0 = 0; l0 < L; l0 += 16) {
            __m512 s = _mm512_loadu_ps(scores + g * Lp + l0);
            __m512 p = exp16(_mm512_sub_ps(s, m_g)); /* -inf (no token): 0; past L: not stored */
            p = _mm512_maskz_mov_ps(tokens16(ok, l0, L - l0 < 16 ? L - l0 : 16), p);
            _mm512_storeu_ps(scores + g * Lp + l0, p);
            sum = _mm512_add_ps(sum, p);
        }
        total[g] = _mm512_reduce_add_ps(sum);
    }
    for (int64_t l = 0; l < L; l++) {
        if (!ok[l]) continue;
        const char *v_l = (const char *)v + l * v_sl * esize;
        __m512 vf[4];
        for (int c = 0; c < 4; c++) vf[c] = load16(v_l, 16 * c, is_bf16);
        for (int64_t g = 0; g < G; g++) {
            __m512 p = _mm512_set1_ps(scores[g * Lp + l]);
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        float o[64];
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv)));
        if (is_bf16) {
            for (int d = 0; d < 64; d++) ((uint16_t *)out)[g * 64 + d] = float_to_bf16(o[d]);
        } else {
            memcpy((float *)out + g * 64, o, sizeof o);
        }
    }
}
#define HAVE_ATTEND64 1
#endif

/* One (row, key-value head) of the batch: item = row * KV + head. */
static inline __attribute__((always_inline)) void attention_item(
    int64_t item, const char *q, const char *k, const char *v, const int64_t *mask, char *out,
    int64_t KV, int64_t G, int64_t D, int64_t L, int64_t k_sb, int64_t k_sh, int64_t k_sl,
    int64_t v_sb, int64_t v_sh, int64_t v_sl, int64_t mask_sb, float scale, float *scores, int is_bf16) {
    size_t esize = is_bf16 ? 2 : 4;
    int64_t b = item / KV, h = item % KV;
    const char *q_i = q + item * G * D * esize;
    const char *k_i = k + (b * k_sb + h * k_sh) * esize;
    const char *v_i = v + (b * v_sb + h * v_sh) * esize;
    char *o_i = out + item * G * D * esize;
    const int64_t *ok = mask + b * mask_sb;
#ifdef HAVE_ATTEND64
    if (D == 64 && G == 3)
        attend64(q_i, k_i, v_i, ok, o_i, 3, L, k_sl, v_sl, scale, scores, is_bf16);
    else if (D == 64 && G <= 4)
        attend64(q_i, k_i, v_i, ok, o_i, G, L, k_sl, v_sl, scale, scores, is_bf16);
    else
#endif
        if (D == 64)
        attend(q_i, k_i, v_i, ok, o_i, G, 64, L, k_sl, v_sl, scale, scores, is_bf16);
    else if (D == 128)
        attend(q_i, k_i, v_i, ok, o_i, G, 128, L, k_sl, v_sl, scale, scores, is_bf16);
    else
        attend(q_i, k_i, v_i, ok, o_i, G, D, L, k_sl, v_sl, scale, scores, is_bf16);
}

/* The exported entry points: 0 done, 1 shapes it does not take, 2 out of memory. The parallel
 * region is written out in each so that the dtype is a constant inside it. */
#define DEFINE_DECODE_ATTENTION(NAME, T, IS_BF16)                                                  \
    int NAME(const T *q, const T *k, const T *v, const int64_t *mask, T *out, int64_t B,           \
             int64_t KV, int64_t G, int64_t D, int64_t L, int64_t k_sb, int64_t k_sh,              \
             int64_t k_sl, int64_t v_sb, int64_t v_sh, int64_t v_sl, int64_t mask_sb,              \
             float scale) {                                                                        \
        if (D > MAX_D || G > MAX_G || D < 1 || G < 1 || L < 0) return 1;                           \
        int failed = 0;                                                                            \
        _Pragma("omp parallel") {                                                                  \
            float *scores = malloc(sizeof(float) * (size_t)(G * (L + 16)));                        \
            if (scores == NULL) {                                                                  \
                _Pragma("omp atomic write") failed = 1;                                            \
            }                                                                                      \
            _Pragma("omp for schedule(static)") for (int64_t item = 0; item < B * KV; item++) {    \
                if (scores != NULL)                                                                \
                    attention_item(item, (const char *)q, (const char *)k, (const char *)v, mask,  \
                                   (char *)out, KV, G, D, L, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl,   \
                                   mask_sb, scale, scores, IS_BF16);                               \
            }                                                                                      \
            free(scores);                                                                          \
        }                                                                                          \
        return failed ? 2 : 0;                                                                     \
    }

DEFINE_DECODE_ATTENTION(decode_attention_bf16, uint16_t, 1)
DEFINE_DECODE_ATTENTION(decode_attention_f32, float, 0)

/* ---------------------------------------------------------------- the elementwise work of a layer
 * Same arithmetic as the engine's PyTorch ops, each step rounded to the model's dtype where
 * PyTorch's bfloat16 ops round (float32: no rounding), in one pass instead of one op per step. */

static inline float round_to(float x, int is_bf16) { return is_bf16 ? bf16_to_float(float_to_bf16(x)) : x; }

static inline void store(void *row, int64_t i, float x, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)row)[i] = float_to_bf16(x);
    else
        ((float *)row)[i] = x;
}

/* x += residual (rounded), then h = weight * rms_norm(x) (bfloat16: the normalised row rounded
 * before the weight's product, as LlamaRMSNorm does; float32: one product), one row of n
 * elements; residual may be NULL (only the norm). */
static inline __attribute__((always_inline)) void add_rms_norm_row(void *x_r, const void *res_r,
                                                                    const void *weight, void *h_r,
                                                                    int64_t n, float eps, int is_bf16) {
    float sq = 0.0f;
    if (res_r != NULL) {
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < n; i++) {
            float a = round_to(load(x_r, i, is_bf16) + load(res_r, i, is_bf16), is_bf16);
            store(x_r, i, a, is_bf16);
            sq += a * a;
        }
    } else {
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < n; i++) {
            float a = load(x_r, i, is_bf16);
            sq += a * a;
        }
    }
    float inv = 1.0f / sqrtf(sq / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float normed = round_to(load(x_r, i, is_bf16) * inv, is_bf16);
        store(h_r, i, load(weight, i, is_bf16) * normed, is_bf16);
    }
}

/* silu(x) = x * sigmoid(x), from exp of a non-positive number on both sides of 0. */
static inline float silu(float x) {
    float e = exp_nonpositive(-fabsf(x));
    return x >= 0.0f ? x / (1.0f + e) : x * e / (1.0f + e);
}

#ifdef HAVE_ATTEND64
/* float32 -> bfloat16 on 16 lanes: to nearest, ties to even; NaN stays NaN. */
static inline __m256i to_bf16_16(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

static inline __m512 round16(__m512 x, int is_bf16) {
    if (!is_bf16) return x;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_16(x)), 16));
}

static inline void store16(void *row, int64_t i, __m512 x, int is_bf16) {
    if (is_bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)row + i), to_bf16_16(x));
    else
        _mm512_storeu_ps((float *)row + i, x);
}

static inline __m512 silu16(__m512 x) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 num = _mm512_mask_mul_ps(x, neg, x, e); /* x >= 0: x; x < 0: x * e */
    return _mm512_div_ps(num, denom);
}
#endif

/* out = silu(gate) (rounded) * up, one row of n elements. */
static inline __attribute__((always_inline)) void silu_mul_row(const void *g_r, const void *u_r,
                                                                void *o_r, int64_t n, int is_bf16) {
    int64_t i = 0;
#ifdef HAVE_ATTEND64
    for (; i + 16 <= n; i += 16) {
        __m512 a = round16(silu16(load16(g_r, i, is_bf16)), is_bf16);
        store16(o_r, i, _mm512_mul_ps(a, load16(u_r, i, is_bf16)), is_bf16);
    }
#endif
    for (; i < n; i++) {
        float a = round_to(silu(load(g_r, i, is_bf16)), is_bf16);
        store(o_r, i, a * load(u_r, i, is_bf16), is_bf16);
    }
}

/* The exported entry points of the two above, per dtype (the dtype a constant inside each loop). */
#define DEFINE_ROW_KERNELS(SUFFIX, T, IS_BF16)                                                     \
    int add_rms_norm_##SUFFIX(T *x, const T *residual, const T *weight, T *h, int64_t rows,          \
                              int64_t n, int64_t x_s, int64_t r_s, int64_t h_s, float eps) {        \
        _Pragma("omp parallel for schedule(static) if (rows * n >= 32768)")                        \
        for (int64_t r = 0; r < rows; r++)                                                         \
            add_rms_norm_row(x + r * x_s, residual != NULL ? residual + r * r_s : NULL, weight,     \
                             h + r * h_s, n, eps, IS_BF16);                                        \
        return 0;                                                                                  \
    }                                                                                              \
    int silu_mul_##SUFFIX(const T *gate, const T *up, T *out, int64_t rows, int64_t n,             \
                          int64_t g_s, int64_t u_s, int64_t o_s) {                                 \
        _Pragma("omp parallel for schedule(static) if (rows * n >= 32768)")                        \
        for (int64_t r = 0; r < rows; r++)                                                         \
            silu_mul_row(gate + r * g_s, up + r * u_s, out + r * o_s, n, IS_BF16);                 \
        return 0;                                                                                  \
    }

DEFINE_ROW_KERNELS(bf16, uint16_t, 1)
DEFINE_ROW_KERNELS(f32, float, 0)

/* ------------------------------------------------------------------ RoPE and the cache's new column
 * One decode step of one layer: the rotary embedding of each row's query and key heads (PyTorch's
 * ``x * cos + roll(x, D/2) * sin_signed``, each product and the sum rounded to the dtype), the
 * rotated queries into q_out [B, H, D], the rotated keys and the values into column ``column`` of
 * the cache buffers. q, k, v: rows with strides q_s, k_s, v_s (heads contiguous inside a row);
 * cos, sin_signed: [B, D] contiguous. */
static inline __attribute__((always_inline)) void rope_row(const void *x, const void *cos,
                                                            const void *sin, void *out, int64_t D,
                                                            int is_bf16) {
    int64_t half = D / 2;
#ifdef HAVE_ATTEND64
    if (half % 16 == 0 && D <= MAX_D) { /* whole vectors: the roll moves blocks of 16 */
        __m512 blocks[MAX_D / 16];
        int64_t nb = D / 16, shift = half / 16;
        for (int64_t c = 0; c < nb; c++) blocks[c] = load16(x, 16 * c, is_bf16);
        for (int64_t c = 0; c < nb; c++) {
            __m512 a = round16(_mm512_mul_ps(blocks[c], load16(cos, 16 * c, is_bf16)), is_bf16);
            __m512 b = round16(_mm512_mul_ps(blocks[(c + shift) % nb], load16(sin, 16 * c, is_bf16)), is_bf16);
            store16(out, 16 * c, _mm512_add_ps(a, b), is_bf16);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < D; i++) {
        float rolled = load(x, i < half ? i + half : i - half, is_bf16);
        float a = round_to(load(x, i, is_bf16) * load(cos, i, is_bf16), is_bf16);
        float b = round_to(rolled * load(sin, i, is_bf16), is_bf16);
        store(out, i, a + b, is_bf16);
    }
}

#define DEFINE_ROPE_APPEND(NAME, T, IS_BF16)                                                       \
    int NAME(const T *q, const T *k, const T *v, int64_t q_s, int64_t k_s, int64_t v_s,            \
             const T *cos, const T *sin, T *q_out, T *buf_k, T *buf_v, int64_t B, int64_t H,       \
             int64_t KV, int64_t D, int64_t k_sb, int64_t k_sh, int64_t k_sl, int64_t v_sb,        \
             int64_t v_sh, int64_t v_sl, int64_t column) {                                         \
        if (D % 2 || D < 2) return 1;                                                              \
        _Pragma("omp parallel for schedule(static) if (B * (H + KV) * D >= 32768)")                \
        for (int64_t b = 0; b < B; b++) {                                                          \
            const T *c = cos + b * D, *s = sin + b * D;                                            \
            for (int64_t h = 0; h < H; h++)                                                        \
                rope_row(q + b * q_s + h * D, c, s, q_out + (b * H + h) * D, D, IS_BF16);          \
            for (int64_t h = 0; h < KV; h++) {                                                     \
                rope_row(k + b * k_s + h * D, c, s, buf_k + b * k_sb + h * k_sh + column * k_sl,   \
                         D, IS_BF16);                                                              \
                memcpy(buf_v + b * v_sb + h * v_sh + column * v_sl, v + b * v_s + h * D,           \
                       sizeof(T) * (size_t)D);                                                     \
            }                                                                                      \
        }                                                                                          \
        return 0;                                                                                  \
    }

DEFINE_ROPE_APPEND(rope_append_bf16, uint16_t, 1)
DEFINE_ROPE_APPEND(rope_append_f32, float, 0)

/* ------------------------------------------------------------------ a decode step's logits
 * Per row of n logits: the maximum, the first column holding it, and log(sum(exp(x - max))), so
 * that log_softmax(x)[j] = (x[j] - max) - logsum. 1 when a row holds NaN (PyTorch decides then). */
static inline __attribute__((always_inline)) int row_stats(const void *x, int64_t n, float *top,
                                                           int64_t *arg, float *logsum, int is_bf16) {
    float m = -INFINITY;
    int64_t i = 0;
    int nan = 0;
#ifdef HAVE_ATTEND64
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = load16(x, i, is_bf16);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
    }
    nan = unordered != 0;
    m = _mm512_reduce_max_ps(best);
#endif
    for (; i < n; i++) {
        float v = load(x, i, is_bf16);
        nan |= v != v;
        m = v > m ? v : m;
    }
    if (nan) return 1;
    int64_t first = 0;
#ifdef HAVE_ATTEND64
    for (__m512 mv = _mm512_set1_ps(m); first + 16 <= n; first += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(load16(x, first, is_bf16), mv, _CMP_EQ_OQ);
        if (hit) {
            first += __builtin_ctz((unsigned)hit);
            break;
        }
    }
#endif
    while (first < n && load(x, first, is_bf16) != m) first++;
    /* Summed in double, in vector lanes: in float32 each of the tens of thousands of small terms
     * added to a running sum near 1 loses up to half an ulp, and the log-sum-exp comes out low
     * (1e-4 to 2e-4 nats on SmolLM2's 49,152, in 16 float lanes as in one). */
    double sum = 0.0;
    i = 0;
#ifdef HAVE_ATTEND64
    __m512 mv = _mm512_set1_ps(m);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(load16(x, i, is_bf16), mv));
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    sum = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
#endif
    double rest = 0.0;
#pragma omp simd reduction(+ : rest)
    for (int64_t j = i; j < n; j++) rest += (double)exp_nonpositive(load(x, j, is_bf16) - m);
    *top = m;
    *arg = first < n ? first : 0;
    *logsum = (float)log(sum + rest);
    return 0;
}

#define DEFINE_ROW_STATS(NAME, T, IS_BF16)                                                         \
    int NAME(const T *x, int64_t rows, int64_t n, int64_t stride, float *top, int64_t *arg,        \
             float *logsum) {                                                                      \
        int failed = 0;                                                                            \
        _Pragma("omp parallel for schedule(static) if (rows * n >= 32768)")                        \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            if (row_stats(x + r * stride, n, top + r, arg + r, logsum + r, IS_BF16)) {              \
                _Pragma("omp atomic write") failed = 1;                                            \
            }                                                                                      \
        }                                                                                          \
        return failed;                                                                             \
    }

DEFINE_ROW_STATS(row_stats_bf16, uint16_t, 1)
DEFINE_ROW_STATS(row_stats_f32, float, 0)

/* The version of this file's interface; kernels.py refuses a library that reports another. */
int kernels_abi(void) { return 3; }

/* 1 where the AVX-512 loops were compiled in, 0 for the portable loops alone. */
int kernels_avx512(void) {
#ifdef HAVE_ATTEND64
    return 1;
#else
    return 0;
#endif
}
