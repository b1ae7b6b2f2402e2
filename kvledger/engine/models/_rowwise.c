/* A decoder layer's row-wise operators, each in one pass over its rows: the RMSNorm (with the residual add before
 * it, Llama's, or after it, Gemma 3's), the rotary embedding of Q and K, and the MLP's act(gate) · up (Llama's silu,
 * Gemma 3's tanh GELU).
 *
 * torch runs each of them as a few operators, each a pass over the whole [tokens × width] tensor and an OpenMP
 * region of its own: about 12 a layer, 0.36 s of a 2,304-token SmolLM2 prefill on a 2-core Xeon (rowwise.py).
 * Here a row is read once, while it is in L1, and the rows are shared out between the threads of the OpenMP
 * runtime torch loaded (libgomp.so.1 by soname), in one region per operator.
 *
 * Every row is computed on its own, in a fixed order: a row's result does not depend on the other rows, on how
 * many there are, or on the thread count. The rotation is torch's formula operator for operator (x·cos, the
 * rolled x·signed sin, their sum: this file is built with -ffp-contract=off, so no product is fused into a sum),
 * so its bits are torch's. The RMSNorm's sum of squares runs in eight lanes, not torch's order, and the activations'
 * exponential is Cephes' (`exp_lanes`), not Sleef's: those agree with torch to float32 rounding.
 *
 * Built only on x86-64 with a compiler that has the AVX2 intrinsics; `available()` is false where the CPU lacks
 * AVX2 or FMA, and the caller keeps torch's operators there.
 */
#include "_avx2.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define MIN_SHARE 16384   /* floats a thread is given at least (chosen, not tuned): a region costs a few µs */

/* How many of `threads` to use for `rows` rows of `width` floats. */
static int team(Py_ssize_t rows, Py_ssize_t width, int threads) {
    const Py_ssize_t most = rows * width / MIN_SHARE;
    if (most < threads)
        threads = most > 1 ? (int)most : 1;
    return threads < rows ? threads : (int)rows;
}

/* x += add (when add is not NULL); then y = x · rsqrt(mean(x²) + eps) · w over the row's h floats, written to out,
 * or added into it when `accumulate` (out += y, y rounded first, as torch's two operators round). */
__attribute__((target("avx2,fma"))) static void rms_norm_row(float *x, const float *add, const float *w,
                                                             float *out, Py_ssize_t h, float eps, int accumulate) {
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
    for (j = 0; j < h8; j += 8) {
        __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), iv), _mm256_loadu_ps(w + j));
        if (accumulate)
            y = _mm256_add_ps(_mm256_loadu_ps(out + j), y);
        _mm256_storeu_ps(out + j, y);
    }
    for (; j < h; j++) {
        const float y = x[j] * inv * w[j];
        out[j] = accumulate ? out[j] + y : y;
    }
}

/* One row's heads rotated in place: x[i] · cos[i] + x[(i + d/2) mod d] · sin[i], heads of d floats, d a multiple
 * of 16 (each half a whole number of lanes); sin's first half is negated (rowwise.rotate's `signed_sin`). */
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

enum { SILU = 0, GELU_TANH = 1 };

/* out[j] = act(g[j]) · u[j] for j < n, n a multiple of 8. Both activations are g / (1 + exp(z)): silu's z = −g, and
 * the tanh GELU's 0.5 · g · (1 + tanh(y)) with y = √(2/π) · (g + 0.044715 · g³) is g / (1 + exp(−2y)), the same value
 * without the cancellation of 1 + tanh(y) where tanh(y) is near −1. */
__attribute__((target("avx2,fma"))) static void act_mul_row(int act, const float *g, const float *u, float *out,
                                                            Py_ssize_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 c = _mm256_set1_ps(-2.0f * 0.7978845608028654f), k = _mm256_set1_ps(0.044715f);
    for (Py_ssize_t j = 0; j < n; j += 8) {
        const __m256 vg = _mm256_loadu_ps(g + j);
        __m256 z;
        if (act == SILU) {
            z = _mm256_sub_ps(zero, vg);
        } else {   /* −2y = −2√(2/π) · (g + 0.044715 · g³) */
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(vg, vg), vg);
            z = _mm256_mul_ps(c, _mm256_add_ps(vg, _mm256_mul_ps(k, cube)));
        }
        const __m256 a = _mm256_div_ps(vg, _mm256_add_ps(one, exp_lanes(z)));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(a, _mm256_loadu_ps(u + j)));
    }
}

/* rms_norm(x_ptr, add_ptr, w_ptr, out_ptr, rows, h, eps, accumulate, threads): x, add and out are [rows × h]
 * contiguous (add_ptr 0: none), w [h]; x is updated in place when add is given, out is added into when accumulate is
 * 1. The caller (rowwise.py) checks shapes, dtypes and contiguity and keeps the tensors alive; the GIL is released
 * while it runs. */
static PyObject *rms_norm(PyObject *self, PyObject *args) {
    uintptr_t xp, ap, wp, op;
    Py_ssize_t rows, h;
    float eps;
    int accumulate, threads;
    if (!PyArg_ParseTuple(args, "kkkknnfpi", &xp, &ap, &wp, &op, &rows, &h, &eps, &accumulate, &threads))
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
        rms_norm_row(x + r * h, add != NULL ? add + r * h : NULL, w, out + r * h, h, eps, accumulate);
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

/* act_mul(act, g_ptr, u_ptr, out_ptr, rows, n, g_stride, u_stride, threads): out [rows × n] contiguous = act(g) · u,
 * g's and u's rows of n contiguous floats starting g_stride and u_stride floats apart (gate and up side by side in
 * one matrix, or two matrices); act 0 silu, 1 gelu_tanh; n a multiple of 8. */
static PyObject *act_mul(PyObject *self, PyObject *args) {
    uintptr_t gp, up, op;
    Py_ssize_t rows, n, gs, us;
    int act, threads;
    if (!PyArg_ParseTuple(args, "ikkknnnni", &act, &gp, &up, &op, &rows, &n, &gs, &us, &threads))
        return NULL;
    if ((act != SILU && act != GELU_TANH) || rows < 1 || n < 8 || n % 8 || gs < n || us < n || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "act_mul: bad arguments (act 0 or 1, n a multiple of 8, strides ≥ n)");
        return NULL;
    }
    const float *g = (const float *)gp, *u = (const float *)up;
    float *out = (float *)op;
    threads = team(rows, n, threads);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(threads) schedule(static)
    for (Py_ssize_t r = 0; r < rows; r++)
        act_mul_row(act, g + r * gs, u + r * us, out + r * n, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, "rms_norm(x, add, w, out, rows, h, eps, accumulate, threads) (rowwise.py)"},
    {"rotate", rotate, METH_VARARGS, "rotate(x, row_stride, rows, heads, d, cos, sin, threads) (rowwise.py)"},
    {"act_mul", act_mul, METH_VARARGS, "act_mul(act, g, u, out, rows, n, g_stride, u_stride, threads) (rowwise.py)"},
    AVAILABLE_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowwise", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowwise(void) { return PyModule_Create(&module); }
