/* The `xxh3_64-rows` tensor checksum (see hashing.py) in one native call that releases the GIL.
 *
 * rows_sum(buffer, row_bytes, first_row) -> int
 *   The sum, mod 2**64, of XXH3-64(row i's bytes, seed = first_row + i) over the rows of `buffer`
 *   (a C-contiguous buffer of whole rows of `row_bytes` bytes each), as an unsigned Python int.
 *
 * The same sum as a Python loop of xxhash.xxh3_64_intdigest calls (the fallback in hashing.py),
 * but without holding the GIL: python-xxhash's one-shot digest holds it, so a training thread
 * beside an async save barely ran while the checksums were computed (bench/gil.py).
 * xxHash itself is vendored, unchanged, from third_party/xxhash (BSD 2-clause).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static PyObject *rows_sum(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t row_bytes;
    unsigned long long first_row;
    if (!PyArg_ParseTuple(args, "y*nK", &view, &row_bytes, &first_row)) {
        return NULL;
    }
    if (row_bytes <= 0 || view.len % row_bytes != 0) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError,
                            "rows_sum: a buffer of %zd bytes is not a whole number of %zd-byte rows",
                            view.len, row_bytes);
    }
    const char *data = (const char *)view.buf;
    Py_ssize_t rows = view.len / row_bytes;
    uint64_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < rows; i++) {
        total += XXH3_64bits_withSeed(data + i * row_bytes, (size_t)row_bytes,
                                      (XXH64_hash_t)(first_row + (uint64_t)i));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(total);
}

static PyMethodDef methods[] = {
    {"rows_sum", rows_sum, METH_VARARGS,
     "rows_sum(buffer, row_bytes, first_row) -> sum mod 2**64 of XXH3-64(row, seed=first_row + i)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowhash(void) { return PyModule_Create(&module); }
