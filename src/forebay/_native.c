/* forebay._native: the few hot loops that numpy cannot vectorize.
 *
 * gather(src, starts, lens, out, dst): copy src[starts[k] : starts[k]+lens[k]] to
 * out[dst[k] : ...] for every k.  starts, lens, dst are C-contiguous int64 buffers of
 * equal length.  Every range is bounds-checked before any byte moves (a bad index is
 * a ValueError, never a crash); the copies run without the GIL, so page faults on a
 * cold memory map do not block other Python threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int as_i64(Py_buffer *b, const char *name, Py_ssize_t *n) {
    if (b->len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: byte length %zd is not a multiple of 8", name, b->len);
        return -1;
    }
    *n = b->len / (Py_ssize_t)sizeof(int64_t);
    return 0;
}

static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer src, st, ln, out, ds;
    if (!PyArg_ParseTuple(args, "y*y*y*w*y*", &src, &st, &ln, &out, &ds))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n1, n2, n3;
    if (as_i64(&st, "starts", &n1) || as_i64(&ln, "lens", &n2) || as_i64(&ds, "dst", &n3))
        goto done;
    if (n1 != n2 || n1 != n3) {
        PyErr_Format(PyExc_ValueError, "starts, lens and dst differ in length (%zd, %zd, %zd)",
                     n1, n2, n3);
        goto done;
    }
    const int64_t *s = (const int64_t *)st.buf, *l = (const int64_t *)ln.buf,
                  *d = (const int64_t *)ds.buf;
    for (Py_ssize_t k = 0; k < n1; k++) {
        if (s[k] < 0 || l[k] < 0 || d[k] < 0 || s[k] > src.len - l[k] || d[k] > out.len - l[k]) {
            PyErr_Format(PyExc_ValueError,
                         "range %zd out of bounds: src[%lld:+%lld] of %zd, out[%lld:+%lld] of %zd",
                         k, (long long)s[k], (long long)l[k], src.len, (long long)d[k],
                         (long long)l[k], out.len);
            goto done;
        }
    }
    {
        const char *sp = (const char *)src.buf;
        char *op = (char *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < n1; k++)
            memcpy(op + d[k], sp + s[k], (size_t)l[k]);
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&st);
    PyBuffer_Release(&ln);
    PyBuffer_Release(&out);
    PyBuffer_Release(&ds);
    return result;
}

/* willneed(map, starts, ends): madvise(MADV_WILLNEED) the pages of byte ranges
 * [starts[k], ends[k]) of a page-aligned memory map, so the kernel starts reading them
 * all before the first fault.  Advice only: errors from madvise are ignored. */
static PyObject *willneed(PyObject *self, PyObject *args) {
    Py_buffer src, st, en;
    if (!PyArg_ParseTuple(args, "y*y*y*", &src, &st, &en))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n1, n2;
    long ps = sysconf(_SC_PAGESIZE);
    if (as_i64(&st, "starts", &n1) || as_i64(&en, "ends", &n2))
        goto done;
    if (n1 != n2) {
        PyErr_SetString(PyExc_ValueError, "starts and ends differ in length");
        goto done;
    }
    if (ps <= 0 || ((uintptr_t)src.buf) % (uintptr_t)ps != 0) {
        PyErr_SetString(PyExc_ValueError, "willneed: the buffer is not page-aligned");
        goto done;
    }
    {
        const int64_t *s = (const int64_t *)st.buf, *e = (const int64_t *)en.buf;
        char *base = (char *)src.buf;
        int64_t len = (int64_t)src.len;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < n1; k++) {
            int64_t a = s[k] < 0 ? 0 : s[k] - s[k] % ps;
            int64_t b = e[k] > len ? len : e[k];
            if (b > a)
                (void)madvise(base + a, (size_t)(b - a), MADV_WILLNEED);
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&st);
    PyBuffer_Release(&en);
    return result;
}

static PyObject *fence(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fence", fence, METH_NOARGS,
     "fence(): a full memory barrier (stores before it are visible to other processes "
     "sharing the memory before stores after it; loads likewise)"},
    {"willneed", willneed, METH_VARARGS,
     "willneed(map, starts, ends): madvise(MADV_WILLNEED) byte ranges of a memory map"},
    {"gather", gather, METH_VARARGS,
     "gather(src, starts, lens, out, dst): out[dst[k]:+lens[k]] = src[starts[k]:+lens[k]]"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "forebay._native",
                                    "Hot loops of forebay in C.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
