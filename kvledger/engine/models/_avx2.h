/* What kvledger's AVX2 kernels (`_gemv.c`, `_attend.c`, `_rowwise.c`) share. */
#ifndef KVLEDGER_AVX2_H
#define KVLEDGER_AVX2_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>

/* The sum of v's eight lanes: the halves added, then pairwise. */
__attribute__((target("avx2,fma"))) static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x), eight lanes: Cephes' expf (within about 1 ulp of the exact value). Below −87.34 it is 0; above 88.38 it
 * is +inf (a little early: the float range ends at 88.72). */
__attribute__((target("avx2,fma"))) static inline __m256 exp_lanes(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 hi = _mm256_set1_ps(88.3762626647949f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), huge = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), huge);
}

/* available(): whether this CPU has AVX2 and FMA, which the kernels use (the caller keeps torch's path if not). */
static PyObject *available(PyObject *self, PyObject *unused) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
}

#define AVAILABLE_METHOD {"available", available, METH_NOARGS, "Whether this CPU has AVX2 and FMA, which the kernel uses."}

#endif
