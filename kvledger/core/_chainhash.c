/* Chained block keys in one C loop: the accelerator of kvledger.core.keys.extend_chain.
 *
 * chain(parent, data, step) -> list of n 16-byte keys, n = len(data) // step, where
 *   key_0     = SHA-256(parent || data[0 : step])[:16]
 *   key_i     = SHA-256(key_{i-1} || data[i*step : (i+1)*step])[:16]
 * exactly what the pure-Python loop computes (a test compares them). Hashing is OpenSSL's;
 * this file only removes the interpreter's per-block cost (about 1 us a call). The GIL is
 * released while hashing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <openssl/evp.h>
#include <openssl/opensslv.h>

#define KEY_BYTES 16

static const EVP_MD *sha256_md = NULL;

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer parent, data;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*y*n", &parent, &data, &step))
        return NULL;
    PyObject *out = NULL;
    if (parent.len != KEY_BYTES || step <= 0) {
        PyErr_SetString(PyExc_ValueError, "parent must be 16 bytes and step > 0");
        goto done;
    }
    Py_ssize_t n = data.len / step;
    unsigned char *keys = PyMem_Malloc(n > 0 ? n * KEY_BYTES : 1);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (keys == NULL || ctx == NULL) {
        PyErr_NoMemory();
        goto free;
    }
    const unsigned char *src = (const unsigned char *)data.buf;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int dlen = 0;
    const unsigned char *prev = (const unsigned char *)parent.buf;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        ok = EVP_DigestInit_ex(ctx, sha256_md, NULL) && EVP_DigestUpdate(ctx, prev, KEY_BYTES)
             && EVP_DigestUpdate(ctx, src + i * step, (size_t)step) && EVP_DigestFinal_ex(ctx, digest, &dlen);
        memcpy(keys + i * KEY_BYTES, digest, KEY_BYTES);
        prev = keys + i * KEY_BYTES;
    }
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
        goto free;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)keys + i * KEY_BYTES, KEY_BYTES);
        if (key == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, key);
    }
free:
    EVP_MD_CTX_free(ctx);
    PyMem_Free(keys);
done:
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "chain(parent, data, step) -> list of chained SHA-256/128 keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chainhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chainhash(void) {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL); /* fetched once: no implicit fetch per block */
#else
    sha256_md = EVP_sha256();
#endif
    if (sha256_md == NULL) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL has no SHA-256");
        return NULL;
    }
    return PyModule_Create(&module);
}
