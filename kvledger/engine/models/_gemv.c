/* y = x · wᵀ for a few rows of x: the decode step's matmuls, at the speed of reading w once.
 *
 * x is [m × k], w is [n × k], y is [m × n], all float32, row-major and contiguous. A decode step multiplies one
 * row (m = 1) by every weight of the model: 540 MB for SmolLM2 in float32, read from memory once a token, so
 * the product is bound by memory bandwidth, not arithmetic. oneDNN's inner product and MKL's sgemv reach 2/3 of
 * that bandwidth on two cores (docs/engine.md); this loop reads each row of w once with AVX2 loads, for every row
 * of x while the row is in L1, and splits w's rows between the threads of the OpenMP runtime torch loaded
 * (libgomp.so.1 by soname: one thread pool, no second one spinning against it).
 *
 * Each y[i][j] is the sum over k in eight lanes (k mod 8), then the lanes added pairwise, then the tail k mod 8
 * in order: a fixed order for a given k, the same for every m, thread count and call. It differs from oneDNN's
 * order, so the results agree with oneDNN's to float32 rounding (about 1e-7 relative), not bit for bit.
 *
 * Built only on x86-64 with a compiler that has the AVX2 intrinsics; `available()` is false where the CPU lacks
 * AVX2 or FMA, and the caller keeps oneDNN there.
 */
#include "_avx2.h"
#include <omp.h>
#include <stdint.h>

#define ROWS 4   /* rows of w per step of the inner loop: four 8-lane accumulators, x's lanes loaded once */

/* y[i][r] for r in [r0, r1) and every row i of x. */
__attribute__((target("avx2,fma"))) static void rows(const float *x, const float *w, float *y, Py_ssize_t m,
                                                     Py_ssize_t n, Py_ssize_t k, Py_ssize_t r0, Py_ssize_t r1) {
    const Py_ssize_t k8 = k - k % 8;
    Py_ssize_t r = r0;
    for (; r + ROWS <= r1; r += ROWS) {
        const float *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        for (Py_ssize_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (Py_ssize_t j = 0; j < k8; j += 8) {
                const __m256 xv = _mm256_loadu_ps(xi + j);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + j), xv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + j), xv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + j), xv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + j), xv, a3);
            }
            float s0 = sum_lanes(a0), s1 = sum_lanes(a1), s2 = sum_lanes(a2), s3 = sum_lanes(a3);
            for (Py_ssize_t j = k8; j < k; j++) {
                s0 += w0[j] * xi[j];
                s1 += w1[j] * xi[j];
                s2 += w2[j] * xi[j];
                s3 += w3[j] * xi[j];
            }
            float *yi = y + i * n + r;
            yi[0] = s0, yi[1] = s1, yi[2] = s2, yi[3] = s3;
        }
    }
    for (; r < r1; r++) {   /* the last n mod ROWS rows of the last thread's share */
        const float *wr = w + r * k;
        for (Py_ssize_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            __m256 a = _mm256_setzero_ps();
            for (Py_ssize_t j = 0; j < k8; j += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(wr + j), _mm256_loadu_ps(xi + j), a);
            float s = sum_lanes(a);
            for (Py_ssize_t j = k8; j < k; j++)
                s += wr[j] * xi[j];
            y[i * n + r] = s;
        }
    }
}

/* gemv(x_ptr, w_ptr, y_ptr, m, n, k, threads): the caller (gemv.py) checks shapes, dtypes and contiguity and
 * keeps the three tensors alive for the call; the GIL is released while it runs. */
static PyObject *gemv(PyObject *self, PyObject *args) {
    uintptr_t xp, wp, yp;
    Py_ssize_t m, n, k;
    int threads;
    if (!PyArg_ParseTuple(args, "kkknnni", &xp, &wp, &yp, &m, &n, &k, &threads))
        return NULL;
    if (m < 1 || n < 1 || k < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "gemv: m, n, k and threads must be positive");
        return NULL;
    }
    const float *x = (const float *)xp, *w = (const float *)wp;
    float *y = (float *)yp;
    /* each thread's rows: a multiple of ROWS, the remainder to the last */
    const Py_ssize_t blocks = n / ROWS;
    if (blocks < threads)
        threads = blocks > 0 ? (int)blocks : 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const Py_ssize_t r0 = blocks * t / nt * ROWS;
        const Py_ssize_t r1 = t == nt - 1 ? n : blocks * (t + 1) / nt * ROWS;
        rows(x, w, y, m, n, k, r0, r1);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gemv", gemv, METH_VARARGS, "gemv(x_ptr, w_ptr, y_ptr, m, n, k, threads): y = x · wᵀ, float32 (see gemv.py)"},
    AVAILABLE_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gemv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gemv(void) { return PyModule_Create(&module); }
