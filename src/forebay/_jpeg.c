/* forebay._jpeg: a JPEG's random-resized crop, decoding only the rows and columns it needs.
 *
 * A random-resized crop keeps about half of an image, yet Pillow decodes all of it and
 * then resizes.  crop(data, out, x0, y0, x1, y1, ow, oh, flip, order) gives the bytes of
 *     Image.open(data).convert("RGB").resize((ow, oh), BILINEAR, box=(x0, y0, x1, y1))
 * (mirrored left-right if flip) as three planes (C, H, W) in out, while libjpeg-turbo
 * decodes only the rows the resize reads (the rows above are skipped: Huffman-decoded,
 * not transformed; the rows below are not read at all) and only their columns, widened
 * to whole iMCU columns (jpeg_crop_scanline).  The work runs without the GIL.
 *
 * info(data) returns (width, height) of a JPEG this module decodes as Pillow does (8-bit
 * YCbCr, RGB or grayscale), None for any other (CMYK, YCCK, 12-bit, a header libjpeg
 * rejects).  crop returns False, writing nothing, for those, for a JPEG libjpeg fails on,
 * for data that ends before the last row it needs, for data that does not end with an
 * end-of-image marker (a file cut short below the crop would not be noticed) or holds
 * markers libjpeg rejects after the image data (Pillow reads that far; markers_ok): the
 * caller then uses Pillow, which gives the image or its own error.  Corrupt-data
 * warnings are ignored, as Pillow does.  Built only where libjpeg-turbo 2.0 or newer and
 * its headers are installed; without this module forebay decodes with Pillow alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#if !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 2000000
#error "forebay._jpeg needs libjpeg-turbo 2.0 or newer (jpeg_crop_scanline, jpeg_skip_scanlines)"
#endif

struct err {
    struct jpeg_error_mgr pub;
    jmp_buf jb;
    int eof;                     /* the data ended early (libjpeg padded it) */
    char msg[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr c) {
    struct err *e = (struct err *)c->err;
    (*c->err->format_message)(c, e->msg);
    longjmp(e->jb, 1);
}

static void on_message(j_common_ptr c, int level) {
    struct err *e = (struct err *)c->err;
    if (level < 0 && c->err->msg_code == JWRN_JPEG_EOF)
        e->eof = 1;
}

static void setup(struct jpeg_decompress_struct *c, struct err *e) {
    c->err = jpeg_std_error(&e->pub);
    e->pub.error_exit = on_error;
    e->pub.emit_message = on_message;
    e->eof = 0;
    e->msg[0] = '\0';
}

/* 1 if the bytes from the first scan's data (at p) to the end-of-image marker that ends
 * the file hold only what libjpeg accepts there: entropy-coded data (a 0xFF only as
 * stuffing, fill or a restart marker) and the segments that may stand between scans
 * (tables, restart interval, DNL, APPn, COM, another scan), each skipped by its length.
 * The region decoder stops reading at the crop's last row, where Pillow reads the whole
 * file and refuses one whose later markers libjpeg rejects (a SOF or SOI again, a
 * reserved marker, a segment running past the end, an end-of-image marker before the
 * end): such a file is left to Pillow, so that it gives its verdict. */
static int markers_ok(const unsigned char *p, const unsigned char *end) {
    end -= 2;                                   /* the final FF D9 */
    while (p < end) {
        const unsigned char *ff = memchr(p, 0xFF, (size_t)(end - p));
        if (ff == NULL)
            return 1;
        if (ff + 1 >= end)
            return 0;                           /* a lone FF just before the end */
        unsigned m = ff[1];
        if (m == 0x00 || m == 0x01 || (m >= 0xD0 && m <= 0xD7)) {
            p = ff + 2;                         /* stuffing, TEM, a restart marker */
        } else if (m == 0xFF) {
            p = ff + 1;                         /* fill before a marker */
        } else if (m == 0xC4 || m == 0xCC || m == 0xDA || m == 0xDB || m == 0xDC ||
                   m == 0xDD || (m >= 0xE0 && m <= 0xEF) || m == 0xFE) {
            if (ff + 4 > end)
                return 0;
            size_t len = ((size_t)ff[2] << 8) | ff[3];
            if (len < 2 || ff + 2 + len > end)
                return 0;
            p = ff + 2 + len;
        } else {
            return 0;                           /* SOF, SOI, EOI early, reserved */
        }
    }
    return 1;
}

/* 1 for a header this module decodes as Pillow does; 0 otherwise. */
static int supported(const struct jpeg_decompress_struct *c) {
    if (c->data_precision != 8)
        return 0;
    switch (c->jpeg_color_space) {
    case JCS_YCbCr:
    case JCS_RGB:
        return c->num_components == 3;
    case JCS_GRAYSCALE:
        return c->num_components == 1;
    default:
        return 0;
    }
}

static PyObject *info(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    struct jpeg_decompress_struct c;
    struct err e;
    volatile int ok = 0;
    JDIMENSION w = 0, h = 0;
    setup(&c, &e);
    jpeg_create_decompress(&c);
    if (setjmp(e.jb) == 0) {
        jpeg_mem_src(&c, (const unsigned char *)data.buf, (unsigned long)data.len);
        if (jpeg_read_header(&c, TRUE) == JPEG_HEADER_OK && supported(&c)) {
            w = c.image_width;
            h = c.image_height;
            ok = 1;
        }
    }
    jpeg_destroy_decompress(&c);
    PyBuffer_Release(&data);
    if (!ok)
        Py_RETURN_NONE;
    return Py_BuildValue("(II)", (unsigned)w, (unsigned)h);
}

/* ---- Resampling: Pillow's BILINEAR resize with a box, to the same bytes -------------
 *
 * Image.resize(size, BILINEAR, box) filters each axis with a triangle of half-width
 * max(scale, 1) (scale = box extent / output size, an antialiased downscale), centred
 * on each output pixel's centre mapped into the box; the weights are normalised in
 * double precision, then rounded to integers of FIXED fractional bits; one axis is
 * filtered, rounded and clipped to 8 bits, then the other (which first: Pillow 13 changed
 * it, hence crop's order argument).  Written here from that description and checked against
 * Pillow's output byte for byte (tests/test_transforms.py, and at first use in each
 * process: forebay.torch._transforms); the double arithmetic follows the same order of
 * operations and is compiled without contraction into fused multiply-adds. */
#define FIXED 22

/* larger images go to Pillow (whose own limit, PIL.Image.MAX_IMAGE_PIXELS, forebay checks
 * before calling crop, is 89 million by default) */
#define MAX_PIXELS (1ull << 28)

typedef struct {
    int ksize;                   /* weights stored per output pixel */
    int *lo, *cnt;               /* first input pixel and number of them, per output pixel */
    int32_t *k;                  /* out * ksize fixed-point weights */
} axis_t;

static void axis_free(axis_t *a) {
    free(a->lo);
    free(a->cnt);
    free(a->k);
}

static double triangle(double x) {
    if (x < 0.0)
        x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* The weights of out output pixels over input pixels [0, in) for the box [b0, b1). */
static int axis_weights(int in, int b0, int b1, int out, axis_t *a) {
    double scale = (double)((float)b1 - (float)b0) / out;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filterscale;
    a->ksize = (int)ceil(support) * 2 + 1;
    a->lo = malloc(sizeof(int) * (size_t)out);
    a->cnt = malloc(sizeof(int) * (size_t)out);
    a->k = calloc((size_t)out * a->ksize, sizeof(int32_t));
    double *w = malloc(sizeof(double) * (size_t)a->ksize);
    if (!a->lo || !a->cnt || !a->k || !w) {
        free(w);
        return -1;
    }
    for (int o = 0; o < out; o++) {
        double center = (double)(float)b0 + (o + 0.5) * scale;
        double inv = 1.0 / filterscale, total = 0.0;
        int lo = (int)(center - support + 0.5), hi = (int)(center + support + 0.5);
        if (lo < 0)
            lo = 0;
        if (hi > in)
            hi = in;
        int n = hi - lo;
        if (n > a->ksize)        /* cannot happen: the support spans at most ksize pixels */
            n = a->ksize;
        for (int j = 0; j < n; j++) {
            w[j] = triangle((j + lo - center + 0.5) * inv);
            total += w[j];
        }
        int32_t *k = a->k + (size_t)o * a->ksize;
        for (int j = 0; j < n; j++) {
            double v = total != 0.0 ? w[j] / total : w[j];
            k[j] = v < 0 ? (int32_t)(-0.5 + v * (1 << FIXED)) : (int32_t)(0.5 + v * (1 << FIXED));
        }
        a->lo[o] = lo;
        a->cnt[o] = n < 0 ? 0 : n;
    }
    free(w);
    return 0;
}

static inline uint8_t clip8(int32_t s) {
    s >>= FIXED;
    return (uint8_t)(s < 0 ? 0 : s > 255 ? 255 : s);
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* rows of RGB pixels (src, stride sstride; its first pixel is input column x_origin)
 * filtered horizontally into rows of ow pixels (dst, packed) */
VECTOR_CLONES
static void pass_h(const uint8_t *src, size_t sstride, int x_origin, int rows,
                   const axis_t *a, int ow, uint8_t *dst) {
    for (int r = 0; r < rows; r++) {
        const uint8_t *row = src + (size_t)r * sstride;
        uint8_t *o = dst + (size_t)r * ow * 3;
        for (int x = 0; x < ow; x++) {
            const int32_t *k = a->k + (size_t)x * a->ksize;
            const uint8_t *p = row + (size_t)(a->lo[x] - x_origin) * 3;
            int32_t s0 = 1 << (FIXED - 1), s1 = s0, s2 = s0;
            for (int j = 0; j < a->cnt[x]; j++) {
                s0 += p[3 * j] * k[j];
                s1 += p[3 * j + 1] * k[j];
                s2 += p[3 * j + 2] * k[j];
            }
            o[3 * x] = clip8(s0);
            o[3 * x + 1] = clip8(s1);
            o[3 * x + 2] = clip8(s2);
        }
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_ROWS8 1

/* 8 rows of n bytes (src, stride sstride) interleaved: t[i * 8 + k] = row k's byte i */
__attribute__((target("avx2"))) static void interleave8(const uint8_t *src, size_t sstride,
                                                         size_t n, uint8_t *t) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i a[8], b[8], c[8];
        for (int k = 0; k < 8; k++)
            a[k] = _mm_loadu_si128((const __m128i *)(src + k * sstride + i));
        for (int k = 0; k < 8; k += 2) {
            b[k] = _mm_unpacklo_epi8(a[k], a[k + 1]);      /* bytes 0-7 of rows k, k+1 */
            b[k + 1] = _mm_unpackhi_epi8(a[k], a[k + 1]);  /* bytes 8-15 */
        }
        for (int h = 0; h < 2; h++) {                       /* rows 0-3, then 4-7 */
            c[4 * h] = _mm_unpacklo_epi16(b[4 * h], b[4 * h + 2]);        /* bytes 0-3 */
            c[4 * h + 1] = _mm_unpackhi_epi16(b[4 * h], b[4 * h + 2]);    /* 4-7 */
            c[4 * h + 2] = _mm_unpacklo_epi16(b[4 * h + 1], b[4 * h + 3]); /* 8-11 */
            c[4 * h + 3] = _mm_unpackhi_epi16(b[4 * h + 1], b[4 * h + 3]); /* 12-15 */
        }
        uint8_t *o = t + i * 8;
        for (int q = 0; q < 4; q++) {                       /* bytes 4q .. 4q+3 */
            _mm_storeu_si128((__m128i *)(o + 32 * q), _mm_unpacklo_epi32(c[q], c[4 + q]));
            _mm_storeu_si128((__m128i *)(o + 32 * q + 16), _mm_unpackhi_epi32(c[q], c[4 + q]));
        }
    }
    for (; i < n; i++)
        for (int k = 0; k < 8; k++)
            t[i * 8 + k] = src[k * sstride + i];
}

/* pass_h on 8 rows at once: each (output pixel, channel) an 8-lane sum over its taps
 * of the interleaved rows (t, from input column x_lo), the same integer arithmetic */
__attribute__((target("avx2"))) static void pass_h8(const uint8_t *t, int x_lo,
                                                    const axis_t *a, int ow, uint8_t *dst,
                                                    size_t dstride) {
    const __m256i half = _mm256_set1_epi32(1 << (FIXED - 1)), zero = _mm256_setzero_si256(),
                  top = _mm256_set1_epi32(255);
    for (int x = 0; x < ow; x++) {
        const int32_t *k = a->k + (size_t)x * a->ksize;
        const uint8_t *p = t + (size_t)(a->lo[x] - x_lo) * 24;
        for (int c = 0; c < 3; c++) {
            __m256i acc = half;
            for (int j = 0; j < a->cnt[x]; j++) {
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                    (const __m128i *)(p + (size_t)j * 24 + c * 8)));
                acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(v, _mm256_set1_epi32(k[j])));
            }
            acc = _mm256_min_epi32(_mm256_max_epi32(_mm256_srai_epi32(acc, FIXED), zero), top);
            __m256i w = _mm256_packus_epi16(_mm256_packs_epi32(acc, acc), zero);
            uint32_t lo = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(w));
            uint32_t hi = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(w, 1));
            uint8_t *o = dst + (size_t)x * 3 + c;
            for (int r = 0; r < 4; r++) {
                o[r * dstride] = (uint8_t)(lo >> (8 * r));
                o[(r + 4) * dstride] = (uint8_t)(hi >> (8 * r));
            }
        }
    }
}
#endif

/* pass_h, 8 rows at a time where the CPU has AVX2 (t: scratch for 8 rows of the
 * columns the weights reach, 24 bytes a column); the same bytes as pass_h */
static void pass_h_rows(const uint8_t *src, size_t sstride, int x_origin, int rows,
                        const axis_t *a, int ow, uint8_t *dst, uint8_t *t) {
    int r = 0;
#ifdef HAVE_ROWS8
    if (__builtin_cpu_supports("avx2")) {
        int x_lo = a->lo[0], x_hi = a->lo[ow - 1] + a->cnt[ow - 1];
        size_t n = (size_t)(x_hi - x_lo) * 3;
        for (; r + 8 <= rows; r += 8) {
            interleave8(src + (size_t)r * sstride + (size_t)(x_lo - x_origin) * 3, sstride, n,
                        t);
            pass_h8(t, x_lo, a, ow, dst + (size_t)r * ow * 3, (size_t)ow * 3);
        }
    }
#endif
    if (r < rows)
        pass_h(src + (size_t)r * sstride, sstride, x_origin, rows - r, a, ow,
               dst + (size_t)r * ow * 3);
}

/* rows of width bytes (src, stride sstride; its first row is input row y_origin) filtered
 * vertically into oh rows (dst, packed); acc: width int32s of scratch */
VECTOR_CLONES
static void pass_v(const uint8_t *src, size_t sstride, int y_origin, const axis_t *a, int oh,
                   int width, int32_t *acc, uint8_t *dst) {
    for (int y = 0; y < oh; y++) {
        const int32_t *k = a->k + (size_t)y * a->ksize;
        for (int i = 0; i < width; i++)
            acc[i] = 1 << (FIXED - 1);
        for (int j = 0; j < a->cnt[y]; j++) {
            const uint8_t *row = src + (size_t)(a->lo[y] + j - y_origin) * sstride;
            int32_t kj = k[j];
            for (int i = 0; i < width; i++)
                acc[i] += row[i] * kj;
        }
        uint8_t *o = dst + (size_t)y * width;
        for (int i = 0; i < width; i++)
            o[i] = clip8(acc[i]);
    }
}

/* packed RGB rows (ow x oh) to three planes, each row mirrored if flip */
static void to_planes(const uint8_t *src, int ow, int oh, int flip, uint8_t *out) {
    size_t plane = (size_t)ow * oh;
    for (int y = 0; y < oh; y++) {
        const uint8_t *p = src + (size_t)y * ow * 3;
        uint8_t *r = out + (size_t)y * ow, *g = r + plane, *b = g + plane;
        for (int x = 0; x < ow; x++) {
            int xo = flip ? ow - 1 - x : x;
            r[xo] = p[3 * x];
            g[xo] = p[3 * x + 1];
            b[xo] = p[3 * x + 2];
        }
    }
}

/* ---- crop ----------------------------------------------------------------------------- */

static PyObject *crop(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    int x0, y0, x1, y1, ow, oh, flip, order;
    if (!PyArg_ParseTuple(args, "y*w*iiiiiipi", &data, &out, &x0, &y0, &x1, &y1, &ow, &oh,
                          &flip, &order))
        return NULL;
    const unsigned char *bytes = (const unsigned char *)data.buf;
    if (ow <= 0 || oh <= 0 || ow > 65536 || oh > 65536 || out.len != (Py_ssize_t)ow * oh * 3) {
        PyErr_Format(PyExc_ValueError, "crop: out has %zd bytes, not 3 x %d x %d", out.len, oh,
                     ow);
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        return NULL;
    }
    /* a file cut short below the crop would decode here without a word (its rows are never
     * read) where Pillow raises: such a file, without its end-of-image marker, goes to Pillow */
    if (data.len < 4 || bytes[data.len - 2] != 0xFF || bytes[data.len - 1] != 0xD9) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        Py_RETURN_FALSE;
    }
    struct jpeg_decompress_struct c;
    struct err e;
    axis_t ax = {0}, ay = {0};
    uint8_t *reg = NULL, *tmp = NULL, *packed = NULL, *scratch = NULL;
    int32_t *acc = NULL;
    int vfirst = 0;
    int status = 0;              /* 0 ok, 2 left to Pillow, 3 no memory, 5 box not inside */
    int w = 0, h = 0, ry0 = 0, ry1 = 0, cx0 = 0, cx1 = 0;
    size_t rcols = 0;
    volatile int xs = 0, xe = 0, got = 0;
    setup(&c, &e);
    Py_BEGIN_ALLOW_THREADS
    jpeg_create_decompress(&c);
    /* the header (libjpeg may jump back here) */
    if (setjmp(e.jb) == 0) {
        jpeg_mem_src(&c, bytes, (unsigned long)data.len);
        if (jpeg_read_header(&c, TRUE) != JPEG_HEADER_OK || !supported(&c) ||
            (uint64_t)c.image_width * c.image_height > MAX_PIXELS ||
            !markers_ok(c.src->next_input_byte, bytes + data.len))
            status = 2;
        else {
            w = (int)c.image_width;
            h = (int)c.image_height;
        }
    } else {
        status = 2;
    }
    /* the weights and the rows and columns they reach (no libjpeg call) */
    if (status == 0 && (x0 < 0 || y0 < 0 || x1 <= x0 || y1 <= y0 || x1 > w || y1 > h))
        status = 5;
    if (status == 0 && (axis_weights(w, x0, x1, ow, &ax) || axis_weights(h, y0, y1, oh, &ay)))
        status = 3;
    if (status == 0) {
        /* Pillow skips a pass whose axis is unchanged; these weights are then the identity */
        ry0 = ay.lo[0];
        ry1 = ay.lo[oh - 1] + ay.cnt[oh - 1];
        cx0 = ax.lo[0];
        cx1 = ax.lo[ow - 1] + ax.cnt[ow - 1];
        /* Pillow 13 filters vertically first where the height shrinks more than twice
         * as much as the width (order 1); Pillow 12 and older always horizontally first */
        vfirst = order == 1 && h - oh > 0 && h - oh > (w - ow) * 2;
        size_t cols = (size_t)(cx1 - cx0), rows = (size_t)(ry1 - ry0);
        /* the columns decoded: [cx0 - 16, cx1 + 16) widened by at most an iMCU (at most
         * 32 pixels) each side */
        rcols = cols + 32 + 64 < (size_t)w ? cols + 32 + 64 : (size_t)w;
        reg = malloc(rows * rcols * 3);
        scratch = malloc(cols * 24 + 16);
        tmp = malloc((vfirst ? (size_t)oh * cols : rows * ow) * 3);
        packed = malloc((size_t)oh * ow * 3);
        acc = malloc(sizeof(int32_t) * (vfirst ? cols : (size_t)ow) * 3);
        if (!reg || !tmp || !packed || !acc || !scratch)
            status = 3;
    }
    /* the rows [ry0, ry1), columns [cx0, cx1) widened: libjpeg-turbo's fancy upsampling
     * gives other values in a cropped region's first and last columns, so 16 more are
     * decoded each side and the two outermost are never used (but at the image's edge) */
    if (status == 0) {
        if (setjmp(e.jb) == 0) {
            JDIMENSION x = (JDIMENSION)(cx0 > 16 ? cx0 - 16 : 0);
            JDIMENSION n = (JDIMENSION)(cx1 + 16 < w ? cx1 + 16 : w) - x;
            c.out_color_space = JCS_RGB;
            jpeg_start_decompress(&c);
            jpeg_crop_scanline(&c, &x, &n);
            xs = (int)x;
            xe = (int)(x + n);
            if ((size_t)n > rcols)   /* cannot happen: libjpeg widens by less than an iMCU */
                ERREXIT(&c, JERR_BAD_CROP_SPEC);
            size_t stride = (size_t)n * 3;
            if (ry0 > 0)
                jpeg_skip_scanlines(&c, (JDIMENSION)ry0);
            JSAMPROW rows[16];
            while (c.output_scanline < (JDIMENSION)ry1 && !e.eof) {
                JDIMENSION y = c.output_scanline, m = (JDIMENSION)ry1 - y;
                if (m > 16)
                    m = 16;
                for (JDIMENSION k = 0; k < m; k++)
                    rows[k] = reg + (size_t)(y + k - (JDIMENSION)ry0) * stride;
                if (jpeg_read_scanlines(&c, rows, m) == 0)
                    break;
            }
            got = !e.eof && c.output_scanline >= (JDIMENSION)ry1;
        }
        if (!got || (xs > 0 && cx0 < xs + 2) || (xe < w && cx1 > xe - 2))
            status = 2;          /* libjpeg's error or the data cut short: Pillow's to say */
    }
    jpeg_destroy_decompress(&c);
    if (status == 0) {
        size_t rstride = (size_t)(xe - xs) * 3;
        if (vfirst) {           /* only the columns the horizontal pass reads */
            int cols = cx1 - cx0;
            pass_v(reg + (size_t)(cx0 - xs) * 3, rstride, ry0, &ay, oh, cols * 3, acc, tmp);
            pass_h_rows(tmp, (size_t)cols * 3, cx0, oh, &ax, ow, packed, scratch);
        } else {
            pass_h_rows(reg, rstride, xs, ry1 - ry0, &ax, ow, tmp, scratch);
            pass_v(tmp, (size_t)ow * 3, ry0, &ay, oh, ow * 3, acc, packed);
        }
        to_planes(packed, ow, oh, flip, out.buf);
    }
    free(reg);
    free(tmp);
    free(packed);
    free(scratch);
    free(acc);
    axis_free(&ax);
    axis_free(&ay);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    switch (status) {
    case 0:
        Py_RETURN_TRUE;
    case 3:
        return PyErr_NoMemory();
    case 5:
        PyErr_Format(PyExc_ValueError, "crop: box (%d, %d, %d, %d) is not inside %d x %d", x0, y0,
                     x1, y1, w, h);
        return NULL;
    default:
        Py_RETURN_FALSE;
    }
}
static PyMethodDef methods[] = {
    {"info", info, METH_VARARGS,
     "info(data) -> (width, height), or None for a JPEG left to Pillow"},
    {"crop", crop, METH_VARARGS,
     "crop(data, out, x0, y0, x1, y1, ow, oh, flip, order) -> bool: the box resized to "
     "ow x oh as Pillow's BILINEAR resize would (order 1: Pillow 13's order of the passes, "
     "0: older Pillow's), mirrored if flip, written to out as 3 planes; False for a JPEG "
     "left to Pillow"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "forebay._jpeg",
                                    "Region decode of JPEGs with libjpeg-turbo", -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
