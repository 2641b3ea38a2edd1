/* The `xxh3_64-rows` tensor checksum (see hashing.py) in one native call that releases the GIL,
 * and the host copies of staging (staging.py) with non-temporal stores.
 *
 * rows_sum(buffer, row_bytes, first_row) -> int
 *   The sum, mod 2**64, of XXH3-64(row i's bytes, seed = first_row + i) over the rows of `buffer`
 *   (a C-contiguous buffer of whole rows of `row_bytes` bytes each), as an unsigned Python int.
 * copy_rows_sum(out, buffer, row_bytes, first_row) -> int
 *   The same sum, copying `buffer` into the writable `out` (same size, not overlapping) in the
 *   same pass: a staging copy that checksums its state reads it from memory once, not twice.
 * stream_copy(out, buffer) -> None
 *   Copy `buffer` into the writable `out` (same size, not overlapping) with non-temporal stores
 *   and the GIL released: a blocking staging copy that the training loop waits for.
 *
 * The same sum as a Python loop of xxhash.xxh3_64_intdigest calls (the fallback in hashing.py),
 * but without holding the GIL: python-xxhash's one-shot digest holds it, so a training thread
 * beside an async save barely ran while the checksums were computed (bench/gil.py).
 * xxHash itself is vendored, unchanged, from third_party/xxhash (BSD 2-clause).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

/* A row is hashed and copied a piece of at most this many bytes at a time: the copy then reads
 * what the hash just brought into the L1 cache. */
#define PIECE_BYTES (32 * 1024)

#if defined(__SSE2__)
#include <emmintrin.h>
/* memcpy with non-temporal stores: the destination (a staging buffer nobody reads soon) is not
 * read into the cache first nor kept there, so the copy moves half the bytes a cached one does
 * and leaves the cache to the training beside it. Needs _mm_sfence() before the bytes are used. */
static void copy_streaming(char *dst, const char *src, size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}
#define COPY_PIECE copy_streaming
#define COPY_DONE() _mm_sfence()
#else
#define COPY_PIECE memcpy
#define COPY_DONE() ((void)0)
#endif

static PyObject *copy_rows_sum(PyObject *self, PyObject *args) {
    Py_buffer out, view;
    Py_ssize_t row_bytes;
    unsigned long long first_row;
    if (!PyArg_ParseTuple(args, "w*y*nK", &out, &view, &row_bytes, &first_row)) {
        return NULL;
    }
    if (row_bytes <= 0 || view.len % row_bytes != 0 || out.len != view.len) {
        PyErr_Format(PyExc_ValueError,
                     "copy_rows_sum: a %zd-byte source of %zd-byte rows into a %zd-byte destination "
                     "(whole rows, same size needed)", view.len, row_bytes, out.len);
        PyBuffer_Release(&out);
        PyBuffer_Release(&view);
        return NULL;
    }
    const char *src = (const char *)view.buf;
    char *dst = (char *)out.buf;
    Py_ssize_t rows = view.len / row_bytes;
    uint64_t total = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    XXH3_state_t *state = row_bytes > PIECE_BYTES ? XXH3_createState() : NULL;
    if (row_bytes > PIECE_BYTES && state == NULL) {
        failed = 1;
    }
    for (Py_ssize_t i = 0; i < rows && !failed; i++) {
        const char *row = src + i * row_bytes;
        XXH64_hash_t seed = (XXH64_hash_t)(first_row + (uint64_t)i);
        if (state == NULL) {
            total += XXH3_64bits_withSeed(row, (size_t)row_bytes, seed);
            COPY_PIECE(dst + i * row_bytes, row, (size_t)row_bytes);
            continue;
        }
        XXH3_64bits_reset_withSeed(state, seed);
        for (Py_ssize_t at = 0; at < row_bytes; at += PIECE_BYTES) {
            size_t n = (size_t)(row_bytes - at < PIECE_BYTES ? row_bytes - at : PIECE_BYTES);
            XXH3_64bits_update(state, row + at, n);
            COPY_PIECE(dst + i * row_bytes + at, row + at, n);
        }
        total += XXH3_64bits_digest(state);
    }
    COPY_DONE();
    if (state != NULL) {
        XXH3_freeState(state);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&view);
    if (failed) {
        return PyErr_NoMemory();
    }
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *stream_copy(PyObject *self, PyObject *args) {
    Py_buffer out, view;
    if (!PyArg_ParseTuple(args, "w*y*", &out, &view)) {
        return NULL;
    }
    if (out.len != view.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy: a %zd-byte source into a %zd-byte destination "
                     "(the same size needed)", view.len, out.len);
        PyBuffer_Release(&out);
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    COPY_PIECE((char *)out.buf, (const char *)view.buf, (size_t)view.len);
    COPY_DONE();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rows_sum", rows_sum, METH_VARARGS,
     "rows_sum(buffer, row_bytes, first_row) -> sum mod 2**64 of XXH3-64(row, seed=first_row + i)"},
    {"copy_rows_sum", copy_rows_sum, METH_VARARGS,
     "copy_rows_sum(out, buffer, row_bytes, first_row) -> rows_sum(buffer, ...), copying buffer into out "
     "in the same pass"},
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(out, buffer) -> None: copy buffer into out with non-temporal stores, the GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowhash(void) { return PyModule_Create(&module); }
