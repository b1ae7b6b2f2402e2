/* A prompt chunk's causal attention in float32, read straight from the paged bf16 blocks, at close to the speed of
 * the CPU's float32 multiply-adds, and with every query's floats independent of the chunk it came in.
 *
 * Queries at positions [start, start + n), q [n, heads, d] (rows `q_row` floats apart, heads d apart), attend over
 * keys [0, their own position] of a pool [blocks, 2 (K, V), B, kv_heads, d] of bf16 through a block table; out is
 * [n, heads, d] float32. Query head i reads KV head i / group.
 *
 * Lanes are queries. A task is one KV head and RB = 16 consecutive queries; its vectors are the query heads that
 * share the KV head, up to GV at a time (16 lanes each), so each K and V value is loaded once for GV × 16 queries
 * and multiplied in with a broadcast: no horizontal sum anywhere, and the softmax runs down the lanes.
 *
 * First K and V of keys [0, end) are widened from bf16 to float32 rows, per KV head, in whole tiles (one pass,
 * shared by every task). Keys are then taken in tiles of KT at absolute positions (tile t is keys [t·KT,
 * (t + 1)·KT)). Per tile: every lane's scores, each summed over d in order from 0, in powers of 2 (Q is scaled by
 * log2(e)/√d); keys after a lane's position masked to −inf; the running maximum m and sum l updated, what was
 * summed rescaled by 2^(m_old − m_new); then the V rows weighed in, key by key in order. A lane's arithmetic is
 * therefore fixed by its own query, its position and the keys before it: the same floats whichever chunk, task or
 * thread computed it (a tile past a lane's position adds exact zeros and rescales by exactly 1), so a hit's rows
 * are a cold prefill's bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RB 16          /* queries per task: one vector's lanes */
#define GV 3           /* query heads per pass: vectors of lanes */
#define KT 64          /* keys per tile; a divisor of the block size */
#define KU 8           /* keys per register block of the scores */
#define MAX_D 256      /* head dimension, a multiple of 8 */
#define MAX_GROUP 64   /* query heads per KV head */

#define AVX512 __attribute__((target("avx512f")))

/* 2^x per lane, within 1 ulp: 2^n · (1 + f·P(f)) with n = x rounded, f = x − n in [−0.5, 0.5], P of degree 5
 * fitted to (2^f − 1)/f at Chebyshev points (max relative error 9.5e-8 in float32). x below −200 (−inf too, a
 * masked score) gives exactly 0. */
AVX512 static inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-200.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5461447765119374e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3390866806730628e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618056938052177e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503569543361664e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650718688965e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471824645996e-1f));
    return _mm512_scalef_ps(_mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f)), n);
}

/* Keys [k0, k0 + nk) of KV head h (nk ≤ B − k0 mod B: within one block) as float32 rows of d into kf and vf:
 * bf16 → float32 is the 16 bits moved up. */
AVX512 static void rows_f32(const uint16_t *pool, const int64_t *table, Py_ssize_t block_stride, Py_ssize_t half,
                            int B, int kvh, int h, int d, Py_ssize_t k0, int nk, float *kf, float *vf) {
    const uint16_t *blk = pool + table[k0 / B] * block_stride + (Py_ssize_t)(k0 % B) * kvh * d + (Py_ssize_t)h * d;
    for (int j = 0; j < nk; j++) {
        const uint16_t *kr = blk + (Py_ssize_t)j * kvh * d, *vr = kr + half;
        float *kd = kf + (Py_ssize_t)j * d, *vd = vf + (Py_ssize_t)j * d;
        int c = 0;
        for (; c + 16 <= d; c += 16) {
            const __m512i kk = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(kr + c)));
            const __m512i vv = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr + c)));
            _mm512_storeu_ps(kd + c, _mm512_castsi512_ps(_mm512_slli_epi32(kk, 16)));
            _mm512_storeu_ps(vd + c, _mm512_castsi512_ps(_mm512_slli_epi32(vv, 16)));
        }
        if (c < d) {   /* d mod 16 = 8 */
            const __m256i kk = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(kr + c)));
            const __m256i vv = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(vr + c)));
            _mm256_storeu_ps(kd + c, _mm256_castsi256_ps(_mm256_slli_epi32(kk, 16)));
            _mm256_storeu_ps(vd + c, _mm256_castsi256_ps(_mm256_slli_epi32(vv, 16)));
        }
    }
}

/* One pass: R query heads (vectors) × RB queries over keys [0, end) of one KV head, kf and vf its float32 rows
 * (whole tiles: rows past `end` are finite). qt [d][R·16] is the queries, scaled, transposed; pos the lanes'
 * positions; ot [d][R·16] receives the unnormalized output and l[R] the sums. */
__attribute__((target("avx512f"), always_inline)) static inline void pass(
        const float *kf, const float *vf, int d, Py_ssize_t end, int R, const float *qt, __m512 lane_pos,
        float *ot, __m512 *l_out, float *s) {
    const int W = R * 16;
    __m512 m[GV], l[GV], alpha[GV];
    for (int r = 0; r < R; r++)
        m[r] = _mm512_set1_ps(-INFINITY), l[r] = _mm512_setzero_ps();
    memset(ot, 0, sizeof(float) * d * W);
    const float first = _mm512_reduce_min_ps(lane_pos);
    for (Py_ssize_t k0 = 0; k0 < end; k0 += KT) {
        const int nk = (int)(end - k0 < KT ? end - k0 : KT);
        const float *kt = kf + k0 * d, *vt = vf + k0 * d;
        /* scores s[j][lanes]: KU keys × R vectors of accumulators, each summed over d in order */
        for (int j0 = 0; j0 < nk; j0 += KU) {
            __m512 acc[KU][GV];
            for (int u = 0; u < KU; u++)
                for (int r = 0; r < GV; r++)
                    acc[u][r] = _mm512_setzero_ps();
            const float *qc = qt, *kc = kt + (Py_ssize_t)j0 * d;
            for (int c = 0; c < d; c++, qc += W, kc++) {
                __m512 qv[GV];
                for (int r = 0; r < R; r++)
                    qv[r] = _mm512_loadu_ps(qc + 16 * r);
                for (int u = 0; u < KU; u++) {   /* keys past `end` in the tile: computed, never stored */
                    const __m512 b = _mm512_set1_ps(kc[u * d]);
                    for (int r = 0; r < R; r++)
                        acc[u][r] = _mm512_fmadd_ps(qv[r], b, acc[u][r]);
                }
            }
            const int ju = nk - j0 < KU ? nk - j0 : KU;
            for (int u = 0; u < ju; u++)
                for (int r = 0; r < R; r++)
                    _mm512_storeu_ps(s + (j0 + u) * W + 16 * r, acc[u][r]);
        }
        /* keys after a lane's position: −inf (only in tiles that reach past the first lane's position); the
         * running maximum and sum; the scores turned into weights in place */
        const int masked = (float)(k0 + nk - 1) > first;
        for (int r = 0; r < R; r++) {
            __m512 mx = m[r];
            for (int j = 0; j < nk; j++) {
                __m512 x = _mm512_loadu_ps(s + j * W + 16 * r);
                if (masked) {
                    const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_set1_ps((float)(k0 + j)), lane_pos, _CMP_LE_OQ);
                    x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), x);
                    _mm512_storeu_ps(s + j * W + 16 * r, x);
                }
                mx = _mm512_max_ps(mx, x);
            }
            alpha[r] = exp2_16(_mm512_sub_ps(m[r], mx));   /* 1 exactly where the maximum stays, 0 from −inf */
            __m512 sum = _mm512_mul_ps(l[r], alpha[r]);
            for (int j = 0; j < nk; j++) {   /* a masked score's weight: exactly 0 */
                const __m512 p = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + j * W + 16 * r), mx));
                _mm512_storeu_ps(s + j * W + 16 * r, p);
                sum = _mm512_add_ps(sum, p);
            }
            l[r] = sum;
            m[r] = mx;
        }
        /* what was summed, rescaled, then the V rows weighed in: 8 dimensions × R vectors of accumulators, key
         * by key in order */
        for (int c0 = 0; c0 < d; c0 += 8) {
            __m512 o[8][GV];
            for (int u = 0; u < 8; u++)
                for (int r = 0; r < R; r++)
                    o[u][r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (c0 + u) * W + 16 * r), alpha[r]);
            const float *sj = s, *vr = vt + c0;
            for (int j = 0; j < nk; j++, sj += W, vr += d) {
                __m512 pv[GV];
                for (int r = 0; r < R; r++)
                    pv[r] = _mm512_loadu_ps(sj + 16 * r);
                for (int u = 0; u < 8; u++) {
                    const __m512 b = _mm512_set1_ps(vr[u]);
                    for (int r = 0; r < R; r++)
                        o[u][r] = _mm512_fmadd_ps(pv[r], b, o[u][r]);
                }
            }
            for (int u = 0; u < 8; u++)
                for (int r = 0; r < R; r++)
                    _mm512_storeu_ps(ot + (c0 + u) * W + 16 * r, o[u][r]);
        }
    }
    for (int r = 0; r < R; r++)
        l_out[r] = l[r];
}

/* The pass for R and d = 64 known at compile time, so its accumulators stay in registers. */
#define PASS_R(NAME, RV)                                                                                          \
    AVX512 static void NAME(const float *kf, const float *vf, int d, Py_ssize_t end, const float *qt, __m512 pos, \
                            float *ot, __m512 *l, float *s) {                                                     \
        if (d == 64)                                                                                              \
            pass(kf, vf, 64, end, RV, qt, pos, ot, l, s);                                                         \
        else                                                                                                      \
            pass(kf, vf, d, end, RV, qt, pos, ot, l, s);                                                          \
    }
PASS_R(pass1, 1)
PASS_R(pass2, 2)
PASS_R(pass3, 3)

#define WORK_FLOATS (2 * MAX_D * GV * 16 + KT * GV * 16)   /* a thread's qt, ot and s */

/* One task: queries [i0, i0 + RB) ∩ [0, n) of every query head that reads KV head h, GV heads at a time; kf, vf
 * are that KV head's float32 rows. */
AVX512 static void task(const float *q, Py_ssize_t q_row, const float *kf, const float *vf, int h, int group,
                        int d, Py_ssize_t start, Py_ssize_t n, Py_ssize_t i0, float scale, float *out,
                        Py_ssize_t heads, float *work) {
    float *qt = work, *ot = qt + MAX_D * GV * 16, *s = ot + MAX_D * GV * 16;
    const int rows = (int)(n - i0 < RB ? n - i0 : RB);
    const Py_ssize_t end = start + i0 + rows;   /* keys this task reads: up to its last query's position */
    float posv[16];
    for (int i = 0; i < 16; i++)   /* lanes past the chunk repeat its last query, and are not written out */
        posv[i] = (float)(start + i0 + (i < rows ? i : rows - 1));
    const __m512 pos = _mm512_loadu_ps(posv);
    for (int g0 = 0; g0 < group; g0 += GV) {
        const int R = group - g0 < GV ? group - g0 : GV, W = R * 16;
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 16; i++) {
                const float *src = q + (i0 + (i < rows ? i : rows - 1)) * q_row + (Py_ssize_t)(h * group + g0 + r) * d;
                for (int c = 0; c < d; c++)
                    qt[c * W + 16 * r + i] = src[c] * scale;   /* scale · log2(e): scores in powers of 2 */
            }
        __m512 l[GV];
        if (R == 3)
            pass3(kf, vf, d, end, qt, pos, ot, l, s);
        else if (R == 2)
            pass2(kf, vf, d, end, qt, pos, ot, l, s);
        else
            pass1(kf, vf, d, end, qt, pos, ot, l, s);
        for (int r = 0; r < R; r++) {
            float lr[16];
            _mm512_storeu_ps(lr, l[r]);
            for (int i = 0; i < rows; i++) {
                float *dst = out + ((i0 + i) * heads + h * group + g0 + r) * d;
                for (int c = 0; c < d; c++)
                    dst[c] = ot[c * W + 16 * r + i] / lr[i];
            }
        }
    }
}

/* causal(q_ptr, q_row, pool_ptr, blocks, table_ptr, table_len, out_ptr, start, n, heads, kv_heads, d, B, scale,
 * threads): the caller (prompt_attend.py) checks dtypes, shapes and contiguity and keeps the tensors alive; the
 * table's entries are checked here against `blocks`. The GIL is released. */
static PyObject *causal(PyObject *self, PyObject *args) {
    uintptr_t qp, pp, tp, op;
    Py_ssize_t q_row, blocks, table_len, start, n, heads, kvh, d, B;
    float scale;
    int threads;
    if (!PyArg_ParseTuple(args, "knknnknnnnnnnfi", &qp, &q_row, &pp, &blocks, &tp, &table_len, &op, &start, &n,
                          &heads, &kvh, &d, &B, &scale, &threads))
        return NULL;
    if (n < 1 || start < 0 || kvh < 1 || heads % kvh || heads / kvh > MAX_GROUP || d < 8 || d > MAX_D || d % 8
        || B < KT || B % KT || threads < 1 || q_row < heads * d) {
        PyErr_SetString(PyExc_ValueError, "causal: bad shape (d a multiple of 8 up to 256, block size a multiple "
                                          "of 64, group up to 64)");
        return NULL;
    }
    const int64_t *table = (const int64_t *)tp;
    const uint16_t *pool = (const uint16_t *)pp;
    const Py_ssize_t used = (start + n + B - 1) / B;
    if (used > table_len) {
        PyErr_SetString(PyExc_ValueError, "causal: the block table is shorter than the keys");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < used; i++)
        if (table[i] < 0 || table[i] >= blocks) {
            PyErr_SetString(PyExc_ValueError, "causal: a block id outside the pool");
            return NULL;
        }
    const int group = (int)(heads / kvh);
    const Py_ssize_t end = start + n, padded = (end + KT - 1) / KT * KT, per_head = (n + RB - 1) / RB;
    const Py_ssize_t half = B * kvh * d, bs = 2 * half, tiles = padded / KT, tasks = kvh * per_head;
    /* K and V of keys [0, end) as float32, [kv_heads][K, V][padded][d], zeros after `end` */
    float *kv = aligned_alloc(64, sizeof(float) * kvh * 2 * padded * d);
    float *work = aligned_alloc(64, sizeof(float) * WORK_FLOATS * threads);
    if (kv == NULL || work == NULL) {
        free(kv), free(work);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (Py_ssize_t t = 0; t < kvh * tiles; t++) {
            const int h = (int)(t / tiles);
            const Py_ssize_t k0 = t % tiles * KT, nk = end - k0 < KT ? end - k0 : KT;
            float *kf = kv + (Py_ssize_t)h * 2 * padded * d + k0 * d, *vf = kf + padded * d;
            rows_f32(pool, table, bs, half, (int)B, (int)kvh, h, (int)d, k0, (int)nk, kf, vf);
            if (nk < KT) {
                memset(kf + nk * d, 0, sizeof(float) * (KT - nk) * d);
                memset(vf + nk * d, 0, sizeof(float) * (KT - nk) * d);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (Py_ssize_t t = 0; t < tasks; t++) {   /* the latest queries (the most keys) first */
            const int h = (int)(t % kvh);
            const float *kf = kv + (Py_ssize_t)h * 2 * padded * d;
            task((const float *)qp, q_row, kf, kf + padded * d, h, group, (int)d, start, n,
                 (per_head - 1 - t / kvh) * RB, scale, (float *)op, heads,
                 work + (Py_ssize_t)omp_get_thread_num() * WORK_FLOATS);
        }
    }
    Py_END_ALLOW_THREADS
    free(kv), free(work);
    Py_RETURN_NONE;
}

/* available(): whether this CPU has AVX-512F, which the kernel uses (the caller keeps torch's path if not). */
static PyObject *available(PyObject *self, PyObject *unused) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx512f"));
}

static PyMethodDef methods[] = {
    {"causal", causal, METH_VARARGS,
     "causal(q, q_row, pool, blocks, table, table_len, out, start, n, heads, kv_heads, d, B, scale, threads) "
     "(prompt_attend.py)"},
    {"available", available, METH_NOARGS, "Whether this CPU has AVX-512F, which the kernel uses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prompt_attend", NULL, -1, methods};

PyMODINIT_FUNC PyInit__prompt_attend(void) { return PyModule_Create(&module); }
