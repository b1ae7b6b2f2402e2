/* What the decode step's two AVX2 kernels (`_gemv.c`, `_attend.c`) share. */
#ifndef KVLEDGER_AVX2_H
#define KVLEDGER_AVX2_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>

/* The sum of v's eight lanes: the halves added, then pairwise. */
__attribute__((target("avx2,fma"))) static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* available(): whether this CPU has AVX2 and FMA, which the kernels use (the caller keeps torch's path if not). */
static PyObject *available(PyObject *self, PyObject *unused) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
}

#define AVAILABLE_METHOD {"available", available, METH_NOARGS, "Whether this CPU has AVX2 and FMA, which the kernel uses."}

#endif
