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

/* Three int64 buffers of one length (*n), named a, b and c in errors. */
static int three_i64(Py_buffer *x, Py_buffer *y, Py_buffer *z, const char *a, const char *b,
                     const char *c, Py_ssize_t *n) {
    Py_ssize_t n1, n2, n3;
    if (as_i64(x, a, &n1) || as_i64(y, b, &n2) || as_i64(z, c, &n3))
        return -1;
    if (n1 != n2 || n1 != n3) {
        PyErr_Format(PyExc_ValueError, "%s, %s and %s differ in length (%zd, %zd, %zd)", a, b,
                     c, n1, n2, n3);
        return -1;
    }
    *n = n1;
    return 0;
}

static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer src, st, ln, out, ds;
    if (!PyArg_ParseTuple(args, "y*y*y*w*y*", &src, &st, &ln, &out, &ds))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n1;
    if (three_i64(&st, &ln, &ds, "starts", "lens", "dst", &n1))
        goto done;
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

/* pread_ranges(fd, offsets, lens, out, dst) -> ranges read
 *
 * out[dst[k]:+lens[k]] = bytes [offsets[k], +lens[k]) of file fd, for every k, with
 * pread (the kernel copies from its page cache: no map, no page faults in this
 * process), without the GIL.  Every destination range is bounds-checked first.
 * Returns how many ranges were read whole: fewer than asked when the file ended
 * inside range k (k is returned); an I/O error raises OSError. */
static PyObject *pread_ranges(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer of, ln, out, ds;
    if (!PyArg_ParseTuple(args, "iy*y*w*y*", &fd, &of, &ln, &out, &ds))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n1;
    if (three_i64(&of, &ln, &ds, "offsets", "lens", "dst", &n1))
        goto done;
    {
        const int64_t *o = (const int64_t *)of.buf, *l = (const int64_t *)ln.buf,
                      *d = (const int64_t *)ds.buf;
        for (Py_ssize_t k = 0; k < n1; k++) {
            if (o[k] < 0 || l[k] < 0 || d[k] < 0 || d[k] > out.len - l[k]) {
                PyErr_Format(PyExc_ValueError, "range %zd out of bounds: file[%lld:+%lld], "
                             "out[%lld:+%lld] of %zd", k, (long long)o[k], (long long)l[k],
                             (long long)d[k], (long long)l[k], out.len);
                goto done;
            }
        }
        char *op = (char *)out.buf;
        Py_ssize_t k = 0;
        int err = 0;
        Py_BEGIN_ALLOW_THREADS
        for (; k < n1; k++) {
            int64_t got = 0;
            while (got < l[k]) {
                ssize_t r = pread(fd, op + d[k] + got, (size_t)(l[k] - got), (off_t)(o[k] + got));
                if (r < 0) {
                    if (errno == EINTR)
                        continue;
                    err = errno;
                    break;
                }
                if (r == 0)
                    break;
                got += r;
            }
            if (err || got < l[k])
                break;
        }
        Py_END_ALLOW_THREADS
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        result = PyLong_FromSsize_t(k);
    }
done:
    PyBuffer_Release(&of);
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

/* The batch kernels: where every field of every sample of a batch goes in its output
 * (layout_into), then the copies of the selected samples' fields from one source
 * (check_part, copy_part).  Every range is checked before any byte moves. */

/* Copies above this many bytes run without the GIL (below, releasing it costs more
 * than the copy, and a waiting thread could hold the GIL for a whole switch
 * interval). */
#define NOGIL_BYTES ((int64_t)1 << 16)

/* rows: n x ncols int64 index rows; field k's byte count is column c[k], its element
 * size is[k].  meta (nf + n*nf + (n+1)*nf int64) receives base[nf] (each field's
 * region, `align`-aligned, in field order), dst[n][nf] (where sample i's field k starts
 * in the output) and elems[n+1][nf] (each field's element offsets).  *size: the
 * output's bytes. */
static int layout_into(const int64_t *r, Py_ssize_t n, Py_ssize_t ncols, const int64_t *c,
                       const int64_t *is, Py_ssize_t nf, Py_ssize_t align, int64_t *meta,
                       int64_t *size) {
    int64_t *base = meta, *dst = meta + nf, *el = dst + n * nf;
    if (align <= 0) {
        PyErr_SetString(PyExc_ValueError, "batch_layout: inconsistent shapes");
        return -1;
    }
    for (Py_ssize_t k = 0; k < nf; k++) {
        if (c[k] < 0 || c[k] >= ncols || is[k] <= 0) {
            PyErr_SetString(PyExc_ValueError, "batch_layout: bad field column");
            return -1;
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
                return -1;
            }
            dst[i * nf + k] = at + pos;
            pos += len;
            e += len / is[k];
            el[(i + 1) * nf + k] = e;
        }
        at += pos + (align - pos % align) % align;
    }
    *size = at;
    return 0;
}

/* One source's part of a batch: sample i is selected when m is NULL or m[i]; the j-th
 * selected sample's record starts at src[st[j]], its field k at st[j] + r[i][oc[k]],
 * r[i][nc[k]] bytes, going to out[d[i*nf + k]]. */
typedef struct {
    const char *src;
    Py_ssize_t srclen;
    const int64_t *st;
    Py_ssize_t nst, sst; /* how many starts, and the stride between them in int64s */
    const unsigned char *m;
} part_t;

typedef struct {
    const int64_t *r, *oc, *nc, *d;
    Py_ssize_t n, ncols, nf;
} fields_t;

/* Checks every range of a part against its source and the output; *nbytes: how many
 * bytes it moves. */
static int check_part(const fields_t *f, const part_t *p, Py_ssize_t outlen, int64_t *nbytes) {
    for (Py_ssize_t k = 0; k < f->nf; k++) {
        if (f->oc[k] < 0 || f->oc[k] >= f->ncols || f->nc[k] < 0 || f->nc[k] >= f->ncols) {
            PyErr_SetString(PyExc_ValueError, "gather_fields: bad field column");
            return -1;
        }
    }
    Py_ssize_t j = 0;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < f->n; i++) {
        if (p->m && !p->m[i])
            continue;
        if (j >= p->nst) {
            PyErr_SetString(PyExc_ValueError, "gather_fields: fewer record starts than "
                            "selected samples");
            return -1;
        }
        for (Py_ssize_t k = 0; k < f->nf; k++) {
            int64_t a = p->st[j * p->sst], o = f->r[i * f->ncols + f->oc[k]],
                    l = f->r[i * f->ncols + f->nc[k]], to = f->d[i * f->nf + k];
            if (a < 0 || o < 0 || l < 0 || to < 0 || a > p->srclen || o > p->srclen - a ||
                l > p->srclen - a - o || to > outlen || l > outlen - to) {
                PyErr_Format(PyExc_ValueError, "gather_fields: sample %zd field %zd out "
                             "of bounds (src[%lld+%lld:+%lld] of %zd, out[%lld:+%lld] of "
                             "%zd)", i, k, (long long)a, (long long)o, (long long)l,
                             p->srclen, (long long)to, (long long)l, outlen);
                return -1;
            }
            total += l;
        }
        j++;
    }
    if (j != p->nst) {
        PyErr_SetString(PyExc_ValueError, "gather_fields: more record starts than "
                        "selected samples");
        return -1;
    }
    *nbytes = total;
    return 0;
}

static void copy_part_nogil(const fields_t *f, const part_t *p, char *op) {
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < f->n; i++) {
        if (p->m && !p->m[i])
            continue;
        for (Py_ssize_t k = 0; k < f->nf; k++)
            memcpy(op + f->d[i * f->nf + k],
                   p->src + p->st[j * p->sst] + f->r[i * f->ncols + f->oc[k]],
                   (size_t)f->r[i * f->ncols + f->nc[k]]);
        j++;
    }
}

/* Checks a part (check_part), then copies it, without the GIL when it is large. */
static int copy_part(const fields_t *f, const part_t *p, char *op, Py_ssize_t outlen) {
    int64_t nbytes;
    if (check_part(f, p, outlen, &nbytes))
        return -1;
    if (nbytes >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_part_nogil(f, p, op);
        Py_END_ALLOW_THREADS
    } else {
        copy_part_nogil(f, p, op);
    }
    return 0;
}

/* batch_layout(rows, ncols, nbytes_cols, itemsizes, align, meta) -> size: layout_into
 * on buffers (meta: nf + n*nf + (n+1)*nf int64, writable). */
static PyObject *batch_layout(PyObject *self, PyObject *args) {
    Py_buffer rw, nbc, isz, meta;
    Py_ssize_t ncols, align;
    if (!PyArg_ParseTuple(args, "y*ny*y*nw*", &rw, &ncols, &nbc, &isz, &align, &meta))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t nr, nf, nf2, nm;
    int64_t size;
    if (as_i64(&rw, "rows", &nr) || as_i64(&nbc, "nbytes_cols", &nf) ||
        as_i64(&isz, "itemsizes", &nf2) || as_i64(&meta, "meta", &nm))
        goto done;
    if (ncols <= 0 || nr % ncols != 0 || nf != nf2) {
        PyErr_SetString(PyExc_ValueError, "batch_layout: inconsistent shapes");
        goto done;
    }
    if (nm != nf + (nr / ncols) * nf + (nr / ncols + 1) * nf) {
        PyErr_SetString(PyExc_ValueError, "batch_layout: meta has the wrong length");
        goto done;
    }
    if (layout_into((const int64_t *)rw.buf, nr / ncols, ncols, (const int64_t *)nbc.buf,
                    (const int64_t *)isz.buf, nf, align, (int64_t *)meta.buf, &size) == 0)
        result = PyLong_FromLongLong((long long)size);
done:
    PyBuffer_Release(&rw);
    PyBuffer_Release(&nbc);
    PyBuffer_Release(&isz);
    PyBuffer_Release(&meta);
    return result;
}

/* gather_fields(src, rows, ncols, off_cols, nbytes_cols, rec_start, mask, dst, out):
 * every field of the selected samples of a batch (mask None: all; else one byte per
 * sample), from records in src (rec_start: where each selected sample's record starts)
 * to out at dst (n*nf).  All ranges are bounds-checked before any byte moves. */
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
        fields_t f = {(const int64_t *)rw.buf, (const int64_t *)offc.buf,
                      (const int64_t *)nbc.buf, (const int64_t *)ds.buf, nr / ncols, ncols, nf};
        part_t p = {(const char *)src.buf, src.len, (const int64_t *)rs.buf, nrs, 1,
                    have_mask ? (const unsigned char *)mask.buf : NULL};
        if (nd != f.n * nf || (have_mask && mask.len != f.n)) {
            PyErr_SetString(PyExc_ValueError, "gather_fields: dst or mask has the wrong length");
            goto done;
        }
        if (copy_part(&f, &p, (char *)out.buf, out.len))
            goto done;
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

/* A part's selector: 0 and *mask NULL for a full slice (every sample), 0 and a
 * buffer for a bool array of n, 1 for anything else (not taken here). */
static int part_selector(PyObject *sel, Py_ssize_t n, Py_buffer *buf, int *have) {
    *have = 0;
    if (PySlice_Check(sel)) {
        PySliceObject *sl = (PySliceObject *)sel;
        return (sl->start == Py_None && sl->stop == Py_None && sl->step == Py_None) ? 0 : 1;
    }
    if (!PyObject_CheckBuffer(sel))
        return 1;
    if (PyObject_GetBuffer(sel, buf, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 1;
    }
    if (buf->format == NULL || strcmp(buf->format, "?") != 0 || buf->len != n ||
        buf->ndim != 1) {
        PyBuffer_Release(buf);
        return 1;
    }
    *have = 1;
    return 0;
}

/* An int64 array's buffer (C-contiguous; or_strided: also one-dimensional with any
 * stride that is a whole number of int64s): 0, or 1 (released, no error) for anything
 * else. */
static int i64_array(PyObject *obj, Py_buffer *buf, int or_strided) {
    if (!PyObject_CheckBuffer(obj))
        return 1;
    if (PyObject_GetBuffer(obj, buf, or_strided ? PyBUF_FORMAT | PyBUF_STRIDES
                                                : PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 1;
    }
    const char *f = buf->format;
    if (f != NULL && (*f == '<' || *f == '=' || *f == '@'))
        f++;
    if (buf->itemsize != 8 || f == NULL || (strcmp(f, "l") != 0 && strcmp(f, "q") != 0) ||
        (or_strided && (buf->ndim != 1 || buf->strides[0] <= 0 || buf->strides[0] % 8 != 0))) {
        PyBuffer_Release(buf);
        return 1;
    }
    return 0;
}

#define MAX_PARTS 64

/* assemble(rows, ncols, off_cols, nbytes_cols, itemsizes, align, meta, parts, alloc)
 *     -> (out, bounds) or NotImplemented
 *
 * batch_layout, then gather_fields of every part, in one call: parts is a list of
 * (src, rec_start, selector) with a full slice or a bool mask of n as selector; out =
 * alloc(size) (a writable buffer of at least size bytes); bounds: field k's bytes are
 * out[bounds[2k]:bounds[2k+1]].  NotImplemented (nothing allocated or copied) when a
 * selector is neither, rows are not a C-contiguous int64 array, a rec_start not a
 * one-dimensional int64 array (any positive stride), or there are more than MAX_PARTS
 * parts. */
static PyObject *assemble(PyObject *self, PyObject *args) {
    Py_buffer rw, offc, nbc, isz, meta;
    Py_ssize_t ncols, align;
    PyObject *rows, *parts, *alloc;
    if (!PyArg_ParseTuple(args, "Ony*y*y*nw*O!O", &rows, &ncols, &offc, &nbc, &isz, &align,
                          &meta, &PyList_Type, &parts, &alloc))
        return NULL;
    if (i64_array(rows, &rw, 0)) {
        PyBuffer_Release(&offc);
        PyBuffer_Release(&nbc);
        PyBuffer_Release(&isz);
        PyBuffer_Release(&meta);
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *result = NULL, *out = NULL;
    Py_buffer srcs[MAX_PARTS], starts[MAX_PARTS], masks[MAX_PARTS], outbuf = {0};
    int have_mask[MAX_PARTS], held = 0, have_out = 0;
    Py_ssize_t nr, nf, nf2, nf3, nm, np_ = PyList_GET_SIZE(parts);
    int64_t size;
    if (as_i64(&rw, "rows", &nr) || as_i64(&offc, "off_cols", &nf) ||
        as_i64(&nbc, "nbytes_cols", &nf2) || as_i64(&isz, "itemsizes", &nf3) ||
        as_i64(&meta, "meta", &nm))
        goto done;
    if (ncols <= 0 || nr % ncols != 0 || nf != nf2 || nf != nf3) {
        PyErr_SetString(PyExc_ValueError, "assemble: inconsistent shapes");
        goto done;
    }
    Py_ssize_t n = nr / ncols;
    if (nm != nf + n * nf + (n + 1) * nf) {
        PyErr_SetString(PyExc_ValueError, "assemble: meta has the wrong length");
        goto done;
    }
    if (np_ > MAX_PARTS) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    for (; held < np_; held++) {   /* every selector, before anything is allocated */
        PyObject *t = PyList_GET_ITEM(parts, held);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
            PyErr_SetString(PyExc_TypeError, "assemble: a part is not a (src, rec_start, "
                            "selector) tuple");
            goto done;
        }
        if (part_selector(PyTuple_GET_ITEM(t, 2), n, &masks[held], &have_mask[held])) {
            if (PyErr_Occurred())
                goto done;
            result = Py_NewRef(Py_NotImplemented);
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 0), &srcs[held], PyBUF_SIMPLE) < 0) {
            if (have_mask[held])
                PyBuffer_Release(&masks[held]);
            goto done;
        }
        if (i64_array(PyTuple_GET_ITEM(t, 1), &starts[held], 1)) {
            PyBuffer_Release(&srcs[held]);
            if (have_mask[held])
                PyBuffer_Release(&masks[held]);
            result = Py_NewRef(Py_NotImplemented);
            goto done;
        }
    }
    if (layout_into((const int64_t *)rw.buf, n, ncols, (const int64_t *)nbc.buf,
                    (const int64_t *)isz.buf, nf, align, (int64_t *)meta.buf, &size))
        goto done;
    out = PyObject_CallFunction(alloc, "L", (long long)size);
    if (out == NULL || PyObject_GetBuffer(out, &outbuf, PyBUF_WRITABLE) < 0)
        goto done;
    have_out = 1;
    if (outbuf.len < size) {
        PyErr_Format(PyExc_ValueError, "assemble: alloc(%lld) gave %zd bytes",
                     (long long)size, outbuf.len);
        goto done;
    }
    {
        const int64_t *m = (const int64_t *)meta.buf;
        fields_t f = {(const int64_t *)rw.buf, (const int64_t *)offc.buf,
                      (const int64_t *)nbc.buf, m + nf, n, ncols, nf};
        for (Py_ssize_t q = 0; q < np_; q++) {
            part_t p = {(const char *)srcs[q].buf, srcs[q].len,
                        (const int64_t *)starts[q].buf, starts[q].shape[0],
                        starts[q].strides[0] / 8,
                        have_mask[q] ? (const unsigned char *)masks[q].buf : NULL};
            if (copy_part(&f, &p, (char *)outbuf.buf, outbuf.len))
                goto done;
        }
        PyObject *bounds = PyList_New(2 * nf);
        if (bounds == NULL)
            goto done;
        const int64_t *is = (const int64_t *)isz.buf, *el_n = m + nf + n * nf + n * nf;
        for (Py_ssize_t k = 0; k < nf; k++) {
            PyList_SET_ITEM(bounds, 2 * k, PyLong_FromLongLong((long long)m[k]));
            PyList_SET_ITEM(bounds, 2 * k + 1,
                            PyLong_FromLongLong((long long)(m[k] + el_n[k] * is[k])));
        }
        result = PyTuple_Pack(2, out, bounds);
        Py_DECREF(bounds);
    }
done:
    if (have_out)
        PyBuffer_Release(&outbuf);
    Py_XDECREF(out);
    for (int q = 0; q < held; q++) {
        PyBuffer_Release(&srcs[q]);
        PyBuffer_Release(&starts[q]);
        if (have_mask[q])
            PyBuffer_Release(&masks[q]);
    }
    PyBuffer_Release(&rw);
    PyBuffer_Release(&offc);
    PyBuffer_Release(&nbc);
    PyBuffer_Release(&isz);
    PyBuffer_Release(&meta);
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
    {"assemble", assemble, METH_VARARGS,
     "assemble(rows, ncols, off_cols, nbytes_cols, itemsizes, align, meta, parts, alloc) "
     "-> (out, bounds) | NotImplemented: batch_layout and every part's gather_fields"},
    {"pread_ranges", pread_ranges, METH_VARARGS,
     "pread_ranges(fd, offsets, lens, out, dst) -> ranges read whole: pread each range "
     "of a file into out, without the GIL"},
    {"gather", gather, METH_VARARGS,
     "gather(src, starts, lens, out, dst): out[dst[k]:+lens[k]] = src[starts[k]:+lens[k]]"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "forebay._native",
                                    "Hot loops of forebay in C.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
