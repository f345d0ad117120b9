/* forebay._native: the few hot loops that numpy cannot vectorize.
 *
 * gather(src, starts, lens, out, dst): copy src[starts[k] : starts[k]+lens[k]] to
 * out[dst[k] : ...] for every k.  starts, lens, dst are C-contiguous int64 buffers of
 * equal length.  Every range is bounds-checked before any byte moves (a bad index is
 * a ValueError, never a crash); the copies run without the GIL, so page faults on a
 * cold memory map do not block other Python threads.
 *
 * batch_layout and gather_fields do all of assemble_batch's arithmetic and copies for
 * a batch in two calls (its fixed cost per batch was ~30 numpy calls).
 *
 * willneed and populate advise the kernel on a batch's byte ranges of a memory map:
 * read them ahead, or map them in now (views lent to a reader).  lock_on_fault locks
 * a whole map's pages as they are mapped in (the clairvoyant store's RAM tier held in
 * the page cache: populate then locks what it maps).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
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

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif

/* Advice on byte ranges [starts[k], ends[k]) of a page-aligned memory map, without the
 * GIL.  populate == 0: madvise(MADV_WILLNEED), so the kernel starts reading them all
 * before the first fault (advice only: errors are ignored; returns None).
 * populate == 1: map them into this process now, reading what is not cached
 * (MADV_POPULATE_READ; a kernel without it: a read of one byte per page), so that a
 * batch's views are read by the thread that fetches it, not by their first reader;
 * returns how many ranges failed (an I/O error, or a file shorter than its map: a read
 * of those pages would raise SIGBUS). */
static PyObject *advise_ranges(PyObject *args, int populate) {
    Py_buffer src, st, en;
    if (!PyArg_ParseTuple(args, "y*y*y*", &src, &st, &en))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n1, n2;
    long ps = sysconf(_SC_PAGESIZE);
    long long failed = 0;
    if (as_i64(&st, "starts", &n1) || as_i64(&en, "ends", &n2))
        goto done;
    if (n1 != n2) {
        PyErr_SetString(PyExc_ValueError, "starts and ends differ in length");
        goto done;
    }
    if (ps <= 0 || ((uintptr_t)src.buf) % (uintptr_t)ps != 0) {
        PyErr_SetString(PyExc_ValueError, "advise: the buffer is not page-aligned");
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
            if (b <= a)
                continue;
            if (!populate) {
                (void)madvise(base + a, (size_t)(b - a), MADV_WILLNEED);
            } else if (madvise(base + a, (size_t)(b - a), MADV_POPULATE_READ) != 0) {
                if (errno == EINVAL) {
                    volatile const char *p = (volatile const char *)base;
                    char sink = 0;
                    for (int64_t q = a; q < b; q += ps)
                        sink ^= p[q];
                    (void)sink;
                } else {
                    failed++;
                }
            }
        }
        Py_END_ALLOW_THREADS
    }
    result = populate ? PyLong_FromLongLong(failed) : Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&st);
    PyBuffer_Release(&en);
    return result;
}

static PyObject *willneed(PyObject *self, PyObject *args) { return advise_ranges(args, 0); }

static PyObject *populate(PyObject *self, PyObject *args) { return advise_ranges(args, 1); }

/* lock_on_fault(map) -> errno: mlock2(MLOCK_ONFAULT) over the whole map, one call:
 * its pages mapped in now are locked, the others as they are mapped in (a read,
 * populate), never read ahead of that; one call per map, where an mlock per sample
 * would split the mapping into a VMA per range (vm.max_map_count, and the write lock
 * on the address space each time).  Unmapping unlocks.  Returns 0 or the errno
 * (ENOMEM/EPERM: RLIMIT_MEMLOCK; ENOSYS/EINVAL: a kernel before 4.4). */
static PyObject *lock_on_fault(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src))
        return NULL;
    int err = 0;
#ifdef SYS_mlock2
    if (src.len > 0 && syscall(SYS_mlock2, src.buf, (size_t)src.len, 1 /* MLOCK_ONFAULT */) != 0)
        err = errno;
#else
    err = ENOSYS;
#endif
    PyBuffer_Release(&src);
    return PyLong_FromLong(err);
}

/* batch_layout(rows, ncols, nbytes_cols, itemsizes, align, meta) -> size
 *
 * Where every field of every sample of a batch goes in its output buffer.  rows: the
 * batch's index rows (n x ncols int64); field k's byte count is column nbytes_cols[k]
 * and its element size itemsizes[k].  meta (int64, writable, nf + n*nf + (n+1)*nf
 * long) receives: base[nf] (each field's region, `align`-aligned, in field order),
 * dst[n][nf] (where sample i's field k starts in the output), elems[n+1][nf] (each
 * field's element offsets, as FieldBatch.offsets).  Returns the output's byte size. */
static PyObject *batch_layout(PyObject *self, PyObject *args) {
    Py_buffer rw, nbc, isz, meta;
    Py_ssize_t ncols, align;
    if (!PyArg_ParseTuple(args, "y*ny*y*nw*", &rw, &ncols, &nbc, &isz, &align, &meta))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t nr, nf, nf2, nm;
    if (as_i64(&rw, "rows", &nr) || as_i64(&nbc, "nbytes_cols", &nf) ||
        as_i64(&isz, "itemsizes", &nf2) || as_i64(&meta, "meta", &nm))
        goto done;
    if (ncols <= 0 || nr % ncols != 0 || nf != nf2 || align <= 0) {
        PyErr_SetString(PyExc_ValueError, "batch_layout: inconsistent shapes");
        goto done;
    }
    {
        Py_ssize_t n = nr / ncols;
        if (nm != nf + n * nf + (n + 1) * nf) {
            PyErr_SetString(PyExc_ValueError, "batch_layout: meta has the wrong length");
            goto done;
        }
        const int64_t *r = (const int64_t *)rw.buf, *c = (const int64_t *)nbc.buf,
                      *is = (const int64_t *)isz.buf;
        int64_t *base = (int64_t *)meta.buf, *dst = base + nf, *el = dst + n * nf;
        for (Py_ssize_t k = 0; k < nf; k++) {
            if (c[k] < 0 || c[k] >= ncols || is[k] <= 0) {
                PyErr_SetString(PyExc_ValueError, "batch_layout: bad field column");
                goto done;
            }
        }
        int64_t at = 0;
        for (Py_ssize_t k = 0; k < nf; k++) {
            int64_t pos = 0, e = 0;
            base[k] = at;
            el[k] = 0;
            for (Py_ssize_t i = 0; i < n; i++) {
                int64_t len = r[i * ncols + c[k]];
                if (len < 0 || len > ((int64_t)1 << 50) || len % is[k] != 0) {
                    PyErr_Format(PyExc_ValueError, "batch_layout: sample %zd field %zd has "
                                 "%lld bytes", i, k, (long long)len);
                    goto done;
                }
                dst[i * nf + k] = at + pos;
                pos += len;
                e += len / is[k];
                el[(i + 1) * nf + k] = e;
            }
            at += pos + (align - pos % align) % align;
        }
        result = PyLong_FromLongLong((long long)at);
    }
done:
    PyBuffer_Release(&rw);
    PyBuffer_Release(&nbc);
    PyBuffer_Release(&isz);
    PyBuffer_Release(&meta);
    return result;
}

/* gather_fields(src, rows, ncols, off_cols, nbytes_cols, rec_start, mask, dst, out):
 * every field of the selected samples of a batch, from records in src to out.
 * Sample i is selected when mask is None or mask[i] (one byte per sample); the j-th
 * selected sample's record starts at src[rec_start[j]], its field k at
 * rec_start[j] + rows[i][off_cols[k]], rows[i][nbytes_cols[k]] bytes, going to
 * out[dst[i*nf + k]].  All ranges are bounds-checked before any byte moves; the
 * copies run without the GIL. */
static PyObject *gather_fields(PyObject *self, PyObject *args) {
    Py_buffer src, rw, offc, nbc, rs, ds, out;
    Py_ssize_t ncols;
    PyObject *maskobj;
    Py_buffer mask = {0};
    int have_mask = 0;
    if (!PyArg_ParseTuple(args, "y*y*ny*y*y*Oy*w*", &src, &rw, &ncols, &offc, &nbc, &rs,
                          &maskobj, &ds, &out))
        return NULL;
    PyObject *result = NULL;
    if (maskobj != Py_None) {
        if (PyObject_GetBuffer(maskobj, &mask, PyBUF_SIMPLE) < 0)
            goto done;
        have_mask = 1;
    }
    Py_ssize_t nr, nf, nf2, nrs, nd;
    if (as_i64(&rw, "rows", &nr) || as_i64(&offc, "off_cols", &nf) ||
        as_i64(&nbc, "nbytes_cols", &nf2) || as_i64(&rs, "rec_start", &nrs) ||
        as_i64(&ds, "dst", &nd))
        goto done;
    if (ncols <= 0 || nr % ncols != 0 || nf != nf2) {
        PyErr_SetString(PyExc_ValueError, "gather_fields: inconsistent shapes");
        goto done;
    }
    {
        Py_ssize_t n = nr / ncols;
        const int64_t *r = (const int64_t *)rw.buf, *oc = (const int64_t *)offc.buf,
                      *nc = (const int64_t *)nbc.buf, *st = (const int64_t *)rs.buf,
                      *d = (const int64_t *)ds.buf;
        const unsigned char *m = have_mask ? (const unsigned char *)mask.buf : NULL;
        if (nd != n * nf || (have_mask && mask.len != n)) {
            PyErr_SetString(PyExc_ValueError, "gather_fields: dst or mask has the wrong length");
            goto done;
        }
        for (Py_ssize_t k = 0; k < nf; k++) {
            if (oc[k] < 0 || oc[k] >= ncols || nc[k] < 0 || nc[k] >= ncols) {
                PyErr_SetString(PyExc_ValueError, "gather_fields: bad field column");
                goto done;
            }
        }
        Py_ssize_t j = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (m && !m[i])
                continue;
            if (j >= nrs) {
                PyErr_SetString(PyExc_ValueError, "gather_fields: fewer record starts than "
                                "selected samples");
                goto done;
            }
            for (Py_ssize_t k = 0; k < nf; k++) {
                int64_t a = st[j], o = r[i * ncols + oc[k]], l = r[i * ncols + nc[k]],
                        to = d[i * nf + k];
                if (a < 0 || o < 0 || l < 0 || to < 0 || a > src.len || o > src.len - a ||
                    l > src.len - a - o || to > out.len || l > out.len - to) {
                    PyErr_Format(PyExc_ValueError, "gather_fields: sample %zd field %zd out "
                                 "of bounds (src[%lld+%lld:+%lld] of %zd, out[%lld:+%lld] of "
                                 "%zd)", i, k, (long long)a, (long long)o, (long long)l,
                                 src.len, (long long)to, (long long)l, out.len);
                    goto done;
                }
            }
            j++;
        }
        if (j != nrs) {
            PyErr_SetString(PyExc_ValueError, "gather_fields: more record starts than "
                            "selected samples");
            goto done;
        }
        const char *sp = (const char *)src.buf;
        char *op = (char *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        j = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (m && !m[i])
                continue;
            for (Py_ssize_t k = 0; k < nf; k++)
                memcpy(op + d[i * nf + k], sp + st[j] + r[i * ncols + oc[k]],
                       (size_t)r[i * ncols + nc[k]]);
            j++;
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (have_mask)
        PyBuffer_Release(&mask);
    PyBuffer_Release(&src);
    PyBuffer_Release(&rw);
    PyBuffer_Release(&offc);
    PyBuffer_Release(&nbc);
    PyBuffer_Release(&rs);
    PyBuffer_Release(&ds);
    PyBuffer_Release(&out);
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
    {"populate", populate, METH_VARARGS,
     "populate(map, starts, ends) -> failed ranges: map byte ranges in now (MADV_POPULATE_READ)"},
    {"lock_on_fault", lock_on_fault, METH_VARARGS,
     "lock_on_fault(map) -> errno: mlock2(MLOCK_ONFAULT) a whole memory map"},
    {"batch_layout", batch_layout, METH_VARARGS,
     "batch_layout(rows, ncols, nbytes_cols, itemsizes, align, meta) -> output bytes"},
    {"gather_fields", gather_fields, METH_VARARGS,
     "gather_fields(src, rows, ncols, off_cols, nbytes_cols, rec_start, mask, dst, out)"},
    {"gather", gather, METH_VARARGS,
     "gather(src, starts, lens, out, dst): out[dst[k]:+lens[k]] = src[starts[k]:+lens[k]]"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "forebay._native",
                                    "Hot loops of forebay in C.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
