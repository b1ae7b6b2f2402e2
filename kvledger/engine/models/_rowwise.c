/* A Llama layer's row-wise operators, each in one pass over its rows: the RMSNorm (with the residual add before
 * it), the rotary embedding of Q and K, and the MLP's silu(gate) · up.
 *
 * torch runs each of them as a few operators, each a pass over the whole [tokens × width] tensor and an OpenMP
 * region of its own: about 12 a layer, 0.36 s of a 2,304-token SmolLM2 prefill on a 2-core Xeon (rowwise.py).
 * Here a row is read once, while it is in L1, and the rows are shared out between the threads of the OpenMP
 * runtime torch loaded (libgomp.so.1 by soname), in one region per operator.
 *
 * Every row is computed on its own, in a fixed order: a row's result does not depend on the other rows, on how
 * many there are, or on the thread count. The rotation is torch's formula operator for operator (x·cos, the
 * rolled x·signed sin, their sum: this file is built with -ffp-contract=off, so no product is fused into a sum),
 * so its bits are torch's. The RMSNorm's sum of squares runs in eight lanes, not torch's order, and the silu's
 * exponential is Cephes' (`exp_lanes`), not Sleef's: those two agree with torch to float32 rounding.
 *
 * Built only on x86-64 with a compiler that has the AVX2 intrinsics; `available()` is false where the CPU lacks
 * AVX2 or FMA, and the caller keeps torch's operators there.
 */
#include "_avx2.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define MIN_SHARE 16384   /* floats a thread is given at least: below it a region costs more than it saves */

/* How many of `threads` to use for `rows` rows of `width` floats. */
static int team(Py_ssize_t rows, Py_ssize_t width, int threads) {
    const Py_ssize_t most = rows * width / MIN_SHARE;
    if (most < threads)
        threads = most > 1 ? (int)most : 1;
    return threads < rows ? threads : (int)rows;
}

/* x += add (when add is not NULL), then out = x · rsqrt(mean(x²) + eps) · w over each row of h floats. */
__attribute__((target("avx2,fma"))) static void rms_norm_row(float *x, const float *add, const float *w,
                                                             float *out, Py_ssize_t h, float eps) {
    const Py_ssize_t h8 = h - h % 8;
    __m256 sq = _mm256_setzero_ps();
    Py_ssize_t j = 0;
    for (; j < h8; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        if (add != NULL) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(add + j));
            _mm256_storeu_ps(x + j, v);
        }
        sq = _mm256_fmadd_ps(v, v, sq);
    }
    float s = sum_lanes(sq);
    for (; j < h; j++) {
        if (add != NULL)
            x[j] += add[j];
        s += x[j] * x[j];
    }
    const float inv = 1.0f / sqrtf(s / (float)h + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    for (j = 0; j < h8; j += 8)
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), iv), _mm256_loadu_ps(w + j)));
    for (; j < h; j++)
        out[j] = x[j] * inv * w[j];
}

/* One row's heads rotated in place: x[i] · cos[i] + x[(i + d/2) mod d] · sin[i], heads of d floats, d a multiple
 * of 16 (each half a whole number of lanes); sin's first half is negated (llama.rotate's `signed_sin`). */
__attribute__((target("avx2,fma"))) static void rotate_row(float *x, Py_ssize_t heads, Py_ssize_t d,
                                                           const float *cos, const float *sin) {
    const Py_ssize_t half = d / 2;
    for (Py_ssize_t hd = 0; hd < heads; hd++) {
        float *a = x + hd * d, *b = a + half;
        for (Py_ssize_t j = 0; j < half; j += 8) {
            const __m256 va = _mm256_loadu_ps(a + j), vb = _mm256_loadu_ps(b + j);
            const __m256 ra = _mm256_add_ps(_mm256_mul_ps(va, _mm256_loadu_ps(cos + j)),
                                            _mm256_mul_ps(vb, _mm256_loadu_ps(sin + j)));
            const __m256 rb = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(cos + half + j)),
                                            _mm256_mul_ps(va, _mm256_loadu_ps(sin + half + j)));
            _mm256_storeu_ps(a + j, ra);
            _mm256_storeu_ps(b + j, rb);
        }
    }
}

/* out[j] = silu(g[j]) · u[j] = g[j] / (1 + exp(−g[j])) · u[j] for j < n, n a multiple of 8. */
__attribute__((target("avx2,fma"))) static void silu_mul_row(const float *g, const float *u, float *out,
                                                             Py_ssize_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (Py_ssize_t j = 0; j < n; j += 8) {
        const __m256 vg = _mm256_loadu_ps(g + j);
        const __m256 e = exp_lanes(_mm256_sub_ps(zero, vg));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
    }
}

/* rms_norm(x_ptr, add_ptr, w_ptr, out_ptr, rows, h, eps, threads): x and add are [rows × h] contiguous (add_ptr 0:
 * none), w [h], out [rows × h]; x is updated in place when add is given. The caller (rowwise.py) checks shapes,
 * dtypes and contiguity and keeps the tensors alive; the GIL is released while it runs. */
static PyObject *rms_norm(PyObject *self, PyObject *args) {
    uintptr_t xp, ap, wp, op;
    Py_ssize_t rows, h;
    float eps;
    int threads;
    if (!PyArg_ParseTuple(args, "kkkknnfi", &xp, &ap, &wp, &op, &rows, &h, &eps, &threads))
        return NULL;
    if (rows < 1 || h < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: rows, h and threads must be positive");
        return NULL;
    }
    float *x = (float *)xp, *out = (float *)op;
    const float *add = (const float *)ap, *w = (const float *)wp;
    threads = team(rows, h, threads);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(threads) schedule(static)
    for (Py_ssize_t r = 0; r < rows; r++)
        rms_norm_row(x + r * h, add != NULL ? add + r * h : NULL, w, out + r * h, h, eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rotate(x_ptr, row_stride, rows, heads, d, cos_ptr, sin_ptr, threads): x's rows start row_stride floats apart,
 * each `heads` heads of d contiguous floats, rotated in place; cos and sin are [rows × d] contiguous. */
static PyObject *rotate(PyObject *self, PyObject *args) {
    uintptr_t xp, cp, sp;
    Py_ssize_t stride, rows, heads, d;
    int threads;
    if (!PyArg_ParseTuple(args, "knnnnkki", &xp, &stride, &rows, &heads, &d, &cp, &sp, &threads))
        return NULL;
    if (rows < 1 || heads < 1 || d < 16 || d % 16 || stride < heads * d || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "rotate: bad shape (d a multiple of 16, rows no closer than heads × d)");
        return NULL;
    }
    float *x = (float *)xp;
    const float *cos = (const float *)cp, *sin = (const float *)sp;
    threads = team(rows, heads * d, threads);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(threads) schedule(static)
    for (Py_ssize_t r = 0; r < rows; r++)
        rotate_row(x + r * stride, heads, d, cos + r * d, sin + r * d);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* silu_mul(gu_ptr, out_ptr, rows, n, threads): gu is [rows × 2n] contiguous (gate, then up, in each row), out
 * [rows × n]; n a multiple of 8. */
static PyObject *silu_mul(PyObject *self, PyObject *args) {
    uintptr_t gp, op;
    Py_ssize_t rows, n;
    int threads;
    if (!PyArg_ParseTuple(args, "kknni", &gp, &op, &rows, &n, &threads))
        return NULL;
    if (rows < 1 || n < 8 || n % 8 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "silu_mul: bad shape (n a multiple of 8)");
        return NULL;
    }
    const float *gu = (const float *)gp;
    float *out = (float *)op;
    threads = team(rows, n, threads);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(threads) schedule(static)
    for (Py_ssize_t r = 0; r < rows; r++)
        silu_mul_row(gu + r * 2 * n, gu + r * 2 * n + n, out + r * n, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, "rms_norm(x, add, w, out, rows, h, eps, threads) (rowwise.py)"},
    {"rotate", rotate, METH_VARARGS, "rotate(x, row_stride, rows, heads, d, cos, sin, threads) (rowwise.py)"},
    {"silu_mul", silu_mul, METH_VARARGS, "silu_mul(gate_up, out, rows, n, threads) (rowwise.py)"},
    AVAILABLE_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowwise", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowwise(void) { return PyModule_Create(&module); }
