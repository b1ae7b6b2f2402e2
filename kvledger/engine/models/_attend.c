/* One query's attention over a sequence's K and V, heads first: a decode step's attention, at the speed of reading
 * K and V once.
 *
 * q is [kv_heads, group, d] (the query heads that share a KV head, grouped-query attention), k and v are
 * [kv_heads, end, d] with rows of d contiguous floats and any stride between heads, out is [kv_heads, group, d];
 * all float32. out[h][g] = softmax(scale · q[h][g] · k[h]ᵀ) · v[h], as torch's scaled_dot_product_attention
 * computes it without a mask (every position is at or before the query's).
 *
 * The positions of each head are cut into spans of SPAN (a fixed length, so the result does not depend on the
 * thread count); the spans of all heads are shared out between the threads of the OpenMP runtime torch loaded.
 * A span is read in tiles of TILE positions: the tile's scores (eight positions at a time, one AVX2 lane each),
 * then their exponentials against the running maximum (rescaling what was summed once per tile, not per
 * position), then the weighted sum of its V rows, each row loaded once for four query rows. The spans of a head are then merged in order, each weighed by
 * exp(its maximum − the head's). The exponential is Cephes' single-precision polynomial.
 */
#include "_avx2.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define SPAN 512        /* positions per task */
#define TILE 64         /* positions per tile: scores of group rows × TILE floats stay in L1 */
#define MAX_GROUP 16    /* query heads per KV head */
#define MAX_D 256       /* head dimension, a multiple of 8 */

/* The eight sums of a[0..7]'s lanes, in one vector. */
__attribute__((target("avx2,fma"))) static inline __m256 sums8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* One span [p0, p1) of one head: its maximum score m[g], its sum of exp(score − m[g]) l[g] and its weighted sum
 * of V rows acc[g][0..d) per query row g. `d` is a constant where inlined for d = 64. */
__attribute__((target("avx2,fma"), always_inline)) static inline void span(
        const float *q, const float *k, const float *v, Py_ssize_t p0, Py_ssize_t p1, int group, int d,
        float scale, float *m, float *l, float *acc) {
    float s[MAX_GROUP][TILE] __attribute__((aligned(32)));
    float spare[MAX_D] = {0};   /* where the V pass sums the rows it runs past the group's last */
    const int dv = d / 8;
    for (int g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < d; i++)
            acc[g * d + i] = 0.0f;
    }
    for (Py_ssize_t t0 = p0; t0 < p1; t0 += TILE) {
        const int n = (int)(p1 - t0 < TILE ? p1 - t0 : TILE);
        const float *kt = k + t0 * d, *vt = v + t0 * d;
        for (int g = 0; g < group; g++) {
            const float *qg = q + g * d;
            int j = 0;
            for (; j + 8 <= n; j += 8) {   /* eight positions' scores at once */
                __m256 a[8];
                for (int u = 0; u < 8; u++)
                    a[u] = _mm256_setzero_ps();
                for (int c = 0; c < dv; c++) {
                    const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
                    for (int u = 0; u < 8; u++)
                        a[u] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kt + (j + u) * d + 8 * c), a[u]);
                }
                _mm256_store_ps(s[g] + j, _mm256_mul_ps(sums8(a), _mm256_set1_ps(scale)));
            }
            for (; j < n; j++) {
                __m256 a = _mm256_setzero_ps();
                for (int c = 0; c < dv; c++)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(kt + j * d + 8 * c), a);
                s[g][j] = sum_lanes(a) * scale;
            }
            float mx = m[g];
            for (j = 0; j < n; j++)
                mx = s[g][j] > mx ? s[g][j] : mx;
            if (mx > m[g]) {   /* a new maximum: what was summed is rescaled once */
                const float corr = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
                l[g] *= corr;
                for (int i = 0; i < d; i++)
                    acc[g * d + i] *= corr;
                m[g] = mx;
            }
            const __m256 mv = _mm256_set1_ps(m[g]);
            __m256 lsum = _mm256_setzero_ps();
            for (j = 0; j + 8 <= n; j += 8) {
                const __m256 e = exp_lanes(_mm256_sub_ps(_mm256_load_ps(s[g] + j), mv));
                _mm256_store_ps(s[g] + j, e);
                lsum = _mm256_add_ps(lsum, e);
            }
            float ls = sum_lanes(lsum);
            if (j < n) {   /* the last n mod 8 scores, padded with lanes that exponentiate to 0 */
                float pad[8] __attribute__((aligned(32)));
                for (int u = 0; u < 8; u++)
                    pad[u] = j + u < n ? s[g][j + u] - m[g] : -INFINITY;
                _mm256_store_ps(pad, exp_lanes(_mm256_load_ps(pad)));
                for (int u = 0; j + u < n; u++) {
                    s[g][j + u] = pad[u];
                    ls += pad[u];
                }
            }
            l[g] += ls;
        }
        for (int g0 = 0; g0 < group; g0 += 4) {   /* the tile's V rows, weighed, into acc: four query rows a pass */
            const float *w[4];
            float *dst[4];
            for (int r = 0; r < 4; r++) {   /* rows past the group: the first row's weights, summed into `spare` */
                w[r] = s[g0 + r < group ? g0 + r : g0];
                dst[r] = g0 + r < group ? acc + (g0 + r) * d : spare;
            }
            for (int c = 0; c < dv; c++) {
                __m256 o0 = _mm256_loadu_ps(dst[0] + 8 * c), o1 = _mm256_loadu_ps(dst[1] + 8 * c);
                __m256 o2 = _mm256_loadu_ps(dst[2] + 8 * c), o3 = _mm256_loadu_ps(dst[3] + 8 * c);
                for (int j = 0; j < n; j++) {
                    const __m256 vv = _mm256_loadu_ps(vt + j * d + 8 * c);
                    o0 = _mm256_fmadd_ps(_mm256_set1_ps(w[0][j]), vv, o0);
                    o1 = _mm256_fmadd_ps(_mm256_set1_ps(w[1][j]), vv, o1);
                    o2 = _mm256_fmadd_ps(_mm256_set1_ps(w[2][j]), vv, o2);
                    o3 = _mm256_fmadd_ps(_mm256_set1_ps(w[3][j]), vv, o3);
                }
                _mm256_storeu_ps(dst[0] + 8 * c, o0), _mm256_storeu_ps(dst[1] + 8 * c, o1);
                _mm256_storeu_ps(dst[2] + 8 * c, o2), _mm256_storeu_ps(dst[3] + 8 * c, o3);
            }
        }
    }
}

__attribute__((target("avx2,fma"))) static void span_64(const float *q, const float *k, const float *v,
                                                        Py_ssize_t p0, Py_ssize_t p1, int group, float scale,
                                                        float *m, float *l, float *acc) {
    span(q, k, v, p0, p1, group, 64, scale, m, l, acc);
}

__attribute__((target("avx2,fma"))) static void span_any(const float *q, const float *k, const float *v,
                                                         Py_ssize_t p0, Py_ssize_t p1, int group, int d,
                                                         float scale, float *m, float *l, float *acc) {
    span(q, k, v, p0, p1, group, d, scale, m, l, acc);
}

/* attend(q_ptr, k_ptr, v_ptr, out_ptr, kv_heads, group, end, d, k_head_stride, v_head_stride, scale, threads):
 * the caller (attend.py) checks shapes, strides and dtypes and keeps the tensors alive; the GIL is released. */
static PyObject *attend(PyObject *self, PyObject *args) {
    uintptr_t qp, kp, vp, op;
    Py_ssize_t heads, group, end, d, ks, vs;
    float scale;
    int threads;
    if (!PyArg_ParseTuple(args, "kkkknnnnnnfi", &qp, &kp, &vp, &op, &heads, &group, &end, &d, &ks, &vs, &scale,
                          &threads))
        return NULL;
    if (heads < 1 || group < 1 || group > MAX_GROUP || end < 1 || d < 8 || d > MAX_D || d % 8 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "attend: bad shape (group ≤ 16, d a multiple of 8 up to 256)");
        return NULL;
    }
    const float *q = (const float *)qp, *k = (const float *)kp, *v = (const float *)vp;
    float *out = (float *)op;
    const Py_ssize_t spans = (end + SPAN - 1) / SPAN, tasks = heads * spans;
    float *m = malloc(sizeof(float) * tasks * group * (2 + d));
    if (m == NULL)
        return PyErr_NoMemory();
    float *l = m + tasks * group, *acc = l + tasks * group;
    if (tasks < threads)
        threads = (int)tasks;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(threads) schedule(static)
    for (Py_ssize_t t = 0; t < tasks; t++) {
        const Py_ssize_t h = t / spans, p0 = t % spans * SPAN, p1 = p0 + SPAN < end ? p0 + SPAN : end;
        float *mt = m + t * group, *lt = l + t * group, *at = acc + t * group * d;
        if (d == 64)
            span_64(q + h * group * d, k + h * ks, v + h * vs, p0, p1, (int)group, scale, mt, lt, at);
        else
            span_any(q + h * group * d, k + h * ks, v + h * vs, p0, p1, (int)group, (int)d, scale, mt, lt, at);
    }
    for (Py_ssize_t h = 0; h < heads; h++) {   /* each head's spans merged in order */
        for (Py_ssize_t g = 0; g < group; g++) {
            float mx = -INFINITY, total = 0.0f;
            for (Py_ssize_t i = 0; i < spans; i++)
                mx = fmaxf(mx, m[(h * spans + i) * group + g]);
            float *o = out + (h * group + g) * d;
            for (Py_ssize_t c = 0; c < d; c++)
                o[c] = 0.0f;
            for (Py_ssize_t i = 0; i < spans; i++) {
                const Py_ssize_t t = h * spans + i;
                const float w = expf(m[t * group + g] - mx);
                total += w * l[t * group + g];
                for (Py_ssize_t c = 0; c < d; c++)
                    o[c] += w * acc[(t * group + g) * d + c];
            }
            for (Py_ssize_t c = 0; c < d; c++)
                o[c] /= total;
        }
    }
    Py_END_ALLOW_THREADS
    free(m);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attend", attend, METH_VARARGS,
     "attend(q, k, v, out, kv_heads, group, end, d, k_head_stride, v_head_stride, scale, threads) (attend.py)"},
    AVAILABLE_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_attend", NULL, -1, methods};

PyMODINIT_FUNC PyInit__attend(void) { return PyModule_Create(&module); }
