/* y = x · wᵀ in a fixed order of summation: the decode step's matmuls at the speed of reading w once, and every
 * product of a model whose floats must not depend on the batch (Gemma 3's).
 *
 * x is [m × k], w is [n × k], y is [m × n], all float32 and row-major; x and y contiguous, w's rows ldw ≥ k floats apart. A decode step multiplies one
 * row a sequence by every weight of the model: 540 MB for SmolLM2 in float32, read from memory once a token, so
 * the product is bound by memory bandwidth, not arithmetic. oneDNN's inner product and MKL's sgemv reach 2/3 of
 * that bandwidth on two cores (docs/engine.md); this loop reads each row of w once with AVX2 loads, for every row
 * of x, and splits w's rows between the threads of the OpenMP runtime torch loaded (libgomp.so.1 by soname: one
 * thread pool, no second one spinning against it). For many rows of x (a prefill chunk) it works in blocks of
 * BLOCK rows of w, which stay in L2 while every row of x passes over them, in micro-tiles of 4 rows of w × 3 rows
 * of x (12 accumulators): about AVX2's peak of fused multiply-adds (80 GFLOP/s a core on the 2-core Xeon). Where
 * the CPU has AVX-512F and the caller asks (`wide`), the same in sixteen lanes, tiles of 4 × 6 (110–128 GFLOP/s).
 *
 * Each y[i][j] is the sum over k in eight lanes (k mod 8), then the lanes added pairwise, then the tail k mod 8
 * in order (sixteen lanes: the upper eight added to the lower eight first, the tail k mod 16): a fixed order for a
 * given k and width, the same for every m, tile, block, thread count and call, and on every CPU that runs it. So y[i][j] depends on row i of x and row j of w only: a row computes the same floats
 * alone, in a batch of decode steps, or in a prefill chunk. It differs from oneDNN's order, so the results agree
 * with oneDNN's to float32 rounding (about 1e-7 relative), not bit for bit.
 *
 * Built only on x86-64 with a compiler that has the AVX2 intrinsics; `available()` is false where the CPU lacks
 * AVX2 or FMA, and the caller keeps its own path there.
 */
#include "_avx2.h"
#include <omp.h>
#include <stdint.h>

#define ROWS 4   /* rows of w in a micro-tile: each w load feeds up to XROWS accumulators */
#define XROWS 3  /* rows of x in a micro-tile: 4 × 3 accumulators, 3 x lanes and 1 w lane fill the 16 ymm registers */
#define BLOCK 32 /* rows of w per cache block: every row of x passes over them while they are in L2 */

/* y[i][r + p] for p < NW (4 or 1) and i in [i0, i0 + NX), NX ≤ XROWS: one 8-lane accumulator per output, k in
 * steps of 8, the lanes added by `sum_lanes`, then the tail k mod 8 in order with fused multiply-adds. That is
 * the order of summation of every output, whatever tile computes it. */
__attribute__((target("avx2,fma"), always_inline)) static inline void tile(const float *x, const float *w, float *y,
                                                                           Py_ssize_t n, Py_ssize_t k, Py_ssize_t ldw,
                                                                           Py_ssize_t r, Py_ssize_t i0, const int NW,
                                                                           const int NX) {
    const Py_ssize_t k8 = k - k % 8;
    const float *wr = w + r * ldw, *xi = x + i0 * k;
    __m256 acc[ROWS][XROWS];
    for (int p = 0; p < NW; p++)
        for (int q = 0; q < NX; q++)
            acc[p][q] = _mm256_setzero_ps();
    for (Py_ssize_t j = 0; j < k8; j += 8) {
        __m256 xv[XROWS];
        for (int q = 0; q < NX; q++)
            xv[q] = _mm256_loadu_ps(xi + q * k + j);
        for (int p = 0; p < NW; p++) {
            const __m256 wv = _mm256_loadu_ps(wr + p * ldw + j);
            for (int q = 0; q < NX; q++)
                acc[p][q] = _mm256_fmadd_ps(wv, xv[q], acc[p][q]);
        }
    }
    for (int p = 0; p < NW; p++)
        for (int q = 0; q < NX; q++) {
            float s = sum_lanes(acc[p][q]);
            for (Py_ssize_t j = k8; j < k; j++)
                s = fmaf(wr[p * ldw + j], xi[q * k + j], s);
            y[(i0 + q) * n + r + p] = s;
        }
}

/* y[i][r] for r in [r0, r1) and every row i of x: BLOCK rows of w at a time, every row of x over them. */
__attribute__((target("avx2,fma"))) static void rows(const float *x, const float *w, float *y, Py_ssize_t m,
                                                     Py_ssize_t n, Py_ssize_t k, Py_ssize_t ldw, Py_ssize_t r0,
                                                     Py_ssize_t r1) {
    for (Py_ssize_t b0 = r0; b0 < r1; b0 += BLOCK) {
        const Py_ssize_t b1 = b0 + BLOCK < r1 ? b0 + BLOCK : r1;
        for (Py_ssize_t i = 0; i < m; i += XROWS) {
            const Py_ssize_t left = m - i;
            Py_ssize_t r = b0;
            for (; r + ROWS <= b1; r += ROWS) {
                if (left >= 3)
                    tile(x, w, y, n, k, ldw, r, i, ROWS, 3);
                else if (left == 2)
                    tile(x, w, y, n, k, ldw, r, i, ROWS, 2);
                else
                    tile(x, w, y, n, k, ldw, r, i, ROWS, 1);
            }
            for (; r < b1; r++) {   /* the last n mod ROWS rows of the last thread's share */
                if (left >= 3)
                    tile(x, w, y, n, k, ldw, r, i, 1, 3);
                else if (left == 2)
                    tile(x, w, y, n, k, ldw, r, i, 1, 2);
                else
                    tile(x, w, y, n, k, ldw, r, i, 1, 1);
            }
        }
    }
}

/* The same with sixteen lanes, on a CPU with AVX-512 (`wide`): each output sums k in sixteen lanes (k mod 16),
 * the upper eight lanes added to the lower eight, those by `sum_lanes`, then the tail k mod 16 in order. Another
 * fixed order (so other bits than the eight-lane kernel's), the same for every m, tile, thread count and call. */
#define XROWS16 6   /* 4 × 6 accumulators, 6 x lanes and 1 w lane: 31 of the 32 zmm registers */

__attribute__((target("avx512f,avx2,fma"), always_inline)) static inline void tile16(
    const float *x, const float *w, float *y, Py_ssize_t n, Py_ssize_t k, Py_ssize_t ldw, Py_ssize_t r, Py_ssize_t i0,
    const int NW, const int NX) {
    const Py_ssize_t k16 = k - k % 16;
    const float *wr = w + r * ldw, *xi = x + i0 * k;
    __m512 acc[ROWS][XROWS16];
    for (int p = 0; p < NW; p++)
        for (int q = 0; q < NX; q++)
            acc[p][q] = _mm512_setzero_ps();
    for (Py_ssize_t j = 0; j < k16; j += 16) {
        __m512 xv[XROWS16];
        for (int q = 0; q < NX; q++)
            xv[q] = _mm512_loadu_ps(xi + q * k + j);
        for (int p = 0; p < NW; p++) {
            const __m512 wv = _mm512_loadu_ps(wr + p * ldw + j);
            for (int q = 0; q < NX; q++)
                acc[p][q] = _mm512_fmadd_ps(wv, xv[q], acc[p][q]);
        }
    }
    for (int p = 0; p < NW; p++)
        for (int q = 0; q < NX; q++) {
            const __m256 lo = _mm512_castps512_ps256(acc[p][q]);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p][q]), 1));
            float s = sum_lanes(_mm256_add_ps(lo, hi));
            for (Py_ssize_t j = k16; j < k; j++)
                s = fmaf(wr[p * ldw + j], xi[q * k + j], s);
            y[(i0 + q) * n + r + p] = s;
        }
}

__attribute__((target("avx512f,avx2,fma"))) static void rows16(const float *x, const float *w, float *y, Py_ssize_t m,
                                                               Py_ssize_t n, Py_ssize_t k, Py_ssize_t ldw,
                                                               Py_ssize_t r0, Py_ssize_t r1) {
    for (Py_ssize_t b0 = r0; b0 < r1; b0 += BLOCK) {
        const Py_ssize_t b1 = b0 + BLOCK < r1 ? b0 + BLOCK : r1;
        for (Py_ssize_t i = 0; i < m; i += XROWS16) {
            const Py_ssize_t left = m - i;
            Py_ssize_t r = b0;
            const int nx = left >= XROWS16 ? XROWS16 : (int)left;
            for (; r + ROWS <= b1; r += ROWS)
                switch (nx) {   /* a constant per case: the tile's loops unroll and its accumulators stay in zmm */
                case 6: tile16(x, w, y, n, k, ldw, r, i, ROWS, 6); break;
                case 5: tile16(x, w, y, n, k, ldw, r, i, ROWS, 5); break;
                case 4: tile16(x, w, y, n, k, ldw, r, i, ROWS, 4); break;
                case 3: tile16(x, w, y, n, k, ldw, r, i, ROWS, 3); break;
                case 2: tile16(x, w, y, n, k, ldw, r, i, ROWS, 2); break;
                default: tile16(x, w, y, n, k, ldw, r, i, ROWS, 1);
                }
            for (; r < b1; r++)
                switch (nx) {
                case 6: tile16(x, w, y, n, k, ldw, r, i, 1, 6); break;
                case 5: tile16(x, w, y, n, k, ldw, r, i, 1, 5); break;
                case 4: tile16(x, w, y, n, k, ldw, r, i, 1, 4); break;
                case 3: tile16(x, w, y, n, k, ldw, r, i, 1, 3); break;
                case 2: tile16(x, w, y, n, k, ldw, r, i, 1, 2); break;
                default: tile16(x, w, y, n, k, ldw, r, i, 1, 1);
                }
        }
    }
}

/* wide_available(): whether this CPU has AVX-512F (the sixteen-lane kernel). */
static PyObject *wide_available(PyObject *self, PyObject *unused) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx512f"));
}

/* gemv(x_ptr, w_ptr, y_ptr, m, n, k, threads, wide, ldw): w's rows ldw floats apart; the caller (gemv.py) checks shapes, dtypes and contiguity and
 * keeps the three tensors alive for the call; the GIL is released while it runs. */
static PyObject *gemv(PyObject *self, PyObject *args) {
    uintptr_t xp, wp, yp;
    Py_ssize_t m, n, k, ldw;
    int threads, wide;
    if (!PyArg_ParseTuple(args, "kkknnnipn", &xp, &wp, &yp, &m, &n, &k, &threads, &wide, &ldw))
        return NULL;
    if (m < 1 || n < 1 || k < 1 || threads < 1 || ldw < k) {
        PyErr_SetString(PyExc_ValueError, "gemv: m, n, k and threads must be positive, and ldw at least k");
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
        if (wide)
            rows16(x, w, y, m, n, k, ldw, r0, r1);
        else
            rows(x, w, y, m, n, k, ldw, r0, r1);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gemv", gemv, METH_VARARGS,
     "gemv(x_ptr, w_ptr, y_ptr, m, n, k, threads, wide, ldw): y = x · wᵀ, float32, w's rows ldw apart (gemv.py)"},
    {"wide_available", wide_available, METH_NOARGS, "Whether this CPU has AVX-512F (the sixteen-lane kernel)."},
    AVAILABLE_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gemv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gemv(void) { return PyModule_Create(&module); }
