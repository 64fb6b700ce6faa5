/* Verified copies of a restore: each chunk copied into its target and checked against its
 * crc32c in one pass over its bytes, with the GIL released.
 *
 * A restore copies thousands of chunks from a snapshot's data region (a slot in shared
 * memory, a buffer read from a tier) into the tensors of a live state. Done chunk by chunk
 * from Python, the calls around each chunk cost more than its bytes at a few KiB, and the
 * checksum is a second pass over what was copied. Here one call takes a run of chunks, as
 * four columns of int64 (target address, offset in the source, bytes, crc32c expected or
 * -1 for none), and copies each one a block of 128 KiB at a time, checking the block where
 * it landed while it is still in the core's cache (the SSE4.2 crc32 instruction over three
 * interleaved streams, their crcs joined by multiplying in GF(2)): one read of memory for
 * the copy and its check. A directory tier's file is read into the targets the same way,
 * a batch of chunks per ``preadv``, each checked while still in cache.
 *
 * Built where the compiler targets x86-64; ``available()`` says whether this CPU has the
 * instruction. Elsewhere the restore copies and checks from Python (``entry_copy``).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_CRC_INSN 1
#include <immintrin.h>
#else
#define HAVE_CRC_INSN 0
#endif

#define POLY 0x82f63b78u /* Castagnoli, bit-reflected */
#define STREAM 4096      /* bytes of each of the three streams the crc interleaves */
#define BLOCK (128u << 10) /* bytes copied, then checked in cache, at a time */

/* a * b modulo the polynomial, in the reflected representation (x^0 is the top bit). */
static uint32_t gf2_mul(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t bit = 1u << 31; bit; bit >>= 1) {
        if (a & bit)
            product ^= b;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return product;
}

/* x^(8 n) modulo the polynomial: what shifting a crc register past n zero bytes multiplies by. */
static uint32_t x_pow_8n(uint64_t n) {
    uint32_t result = 1u << 31, square = 1u << 23; /* x^0 and x^8 */
    while (n) {
        if (n & 1)
            result = gf2_mul(square, result);
        square = gf2_mul(square, square);
        n >>= 1;
    }
    return result;
}

static uint32_t shift_one, shift_two; /* past one stream of a block, and past two */
static int have_insn;

#if HAVE_CRC_INSN
__attribute__((target("sse4.2"))) static uint32_t crc_only(const uint8_t *p, size_t n,
                                                         uint32_t reg) {
    uint64_t a = reg;
    while (n >= 3 * STREAM) {
        uint64_t b = 0, c = 0;
        for (size_t i = 0; i < STREAM; i += 8) {
            uint64_t x, y, z;
            memcpy(&x, p + i, 8);
            memcpy(&y, p + STREAM + i, 8);
            memcpy(&z, p + 2 * STREAM + i, 8);
            a = _mm_crc32_u64(a, x);
            b = _mm_crc32_u64(b, y);
            c = _mm_crc32_u64(c, z);
        }
        a = gf2_mul(shift_two, (uint32_t)a) ^ gf2_mul(shift_one, (uint32_t)b) ^ (uint32_t)c;
        p += 3 * STREAM;
        n -= 3 * STREAM;
    }
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t x;
        memcpy(&x, p, 8);
        a = _mm_crc32_u64(a, x);
    }
    uint32_t r = (uint32_t)a;
    for (; n; n--, p++)
        r = _mm_crc32_u8(r, *p);
    return r;
}


/* Copy n bytes from src to dst and return the crc32c register after them (no inversion):
 * a block at a time, copied by memcpy at the speed of memory, then checked where it landed
 * while it is still in the core's cache. */
static uint32_t copy_crc(uint8_t *dst, const uint8_t *src, size_t n, uint32_t reg) {
    for (size_t p = 0; p < n; p += BLOCK) {
        size_t m = n - p < BLOCK ? n - p : BLOCK;
        memcpy(dst + p, src + p, m);
        reg = crc_only(dst + p, m, reg);
    }
    return reg;
}
#endif

/* The four int64 columns of a run of chunks, checked to hold rows [first, last). */
typedef struct {
    Py_buffer to, frm, size, want;
} Columns;

static int column(PyObject *obj, Py_buffer *view, Py_ssize_t rows, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || (view->format && strcmp(view->format, "q") != 0 &&
                                strcmp(view->format, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s: a buffer of int64 is needed", name);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len / 8 < rows) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd rows, %zd are asked for", name,
                     view->len / 8, rows);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release(Columns *c, int held) {
    Py_buffer *all[] = {&c->to, &c->frm, &c->size, &c->want};
    for (int i = 0; i < held; i++)
        PyBuffer_Release(all[i]);
}

static int columns(PyObject *const *args, Columns *c, Py_ssize_t last) {
    PyObject *objs[] = {args[0], args[1], args[2], args[3]};
    Py_buffer *views[] = {&c->to, &c->frm, &c->size, &c->want};
    const char *names[] = {"to", "frm", "size", "want"};
    for (int i = 0; i < 4; i++) {
        if (column(objs[i], views[i], last, names[i]) < 0) {
            release(c, i);
            return -1;
        }
    }
    return 0;
}

/* The arguments every call over a run of chunks starts with: ``nargs`` must be ``expected``,
 * the first four are the columns and the next two the rows [first, last). 0, or -1 with an
 * exception set (nothing to release then). */
static int run_of(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected, const char *name,
                  Columns *c, Py_ssize_t *first, Py_ssize_t *last) {
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, expected);
        return -1;
    }
    *first = PyLong_AsSsize_t(args[4]);
    *last = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred())
        return -1;
    if (*first < 0 || *last < *first) {
        PyErr_SetString(PyExc_ValueError, "rows out of order");
        return -1;
    }
    if (!have_insn) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no crc32c instruction");
        return -1;
    }
    return columns(args, c, *last);
}

/* copy_checked(to, frm, size, want, first, last, src) -> (row, crc) of the first chunk
 * whose crc32c is not the one expected, or (-1, 0). ``src``: the source's address. */
static PyObject *copy_checked(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Columns c;
    Py_ssize_t first, last;
    unsigned long long src = nargs == 7 ? PyLong_AsUnsignedLongLong(args[6]) : 0;
    if (PyErr_Occurred() || run_of(args, nargs, 7, "copy_checked", &c, &first, &last) < 0)
        return NULL;
    const int64_t *to = c.to.buf, *frm = c.frm.buf, *size = c.size.buf, *want = c.want.buf;
    Py_ssize_t bad = -1;
    uint32_t found = 0;
#if HAVE_CRC_INSN
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = first; j < last; j++) {
        uint32_t r = ~copy_crc((uint8_t *)(uintptr_t)to[j],
                               (const uint8_t *)(uintptr_t)(src + (uint64_t)frm[j]),
                               (size_t)size[j], 0xffffffffu);
        if (want[j] >= 0 && r != (uint32_t)want[j]) {
            bad = j;
            found = r;
            break;
        }
    }
    Py_END_ALLOW_THREADS
#endif
    release(&c, 4);
    return Py_BuildValue("(nI)", bad, found);
}

#if HAVE_CRC_INSN
/* The first of rows [first, last) whose chunk, in place at ``to``, does not have the crc32c
 * expected (its crc in ``found``), or -1; rows expecting -1 are not checked. */
static Py_ssize_t first_bad(const int64_t *to, const int64_t *size, const int64_t *want,
                            Py_ssize_t first, Py_ssize_t last, uint32_t *found) {
    for (Py_ssize_t j = first; j < last; j++) {
        if (want[j] < 0)
            continue;
        uint32_t r = ~crc_only((const uint8_t *)(uintptr_t)to[j], (size_t)size[j], 0xffffffffu);
        if (r != (uint32_t)want[j]) {
            *found = r;
            return j;
        }
    }
    return -1;
}
#endif

/* checked_at(to, frm, size, want, first, last) -> like copy_checked, for chunks already in
 * place at their ``to`` addresses (``frm`` is not read). */
static PyObject *checked_at(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Columns c;
    Py_ssize_t first, last;
    if (run_of(args, nargs, 6, "checked_at", &c, &first, &last) < 0)
        return NULL;
    const int64_t *to = c.to.buf, *size = c.size.buf, *want = c.want.buf;
    Py_ssize_t bad = -1;
    uint32_t found = 0;
#if HAVE_CRC_INSN
    Py_BEGIN_ALLOW_THREADS
    bad = first_bad(to, size, want, first, last, &found);
    Py_END_ALLOW_THREADS
#endif
    release(&c, 4);
    return Py_BuildValue("(nI)", bad, found);
}

#define BATCH_IOV 512           /* chunks read by one preadv */
#define BATCH_BYTES (1u << 20)  /* bytes read by one preadv, then checked while in cache */
#define GAP_MAX 4096            /* bytes between two chunks read past into scratch */

/* read_checked(to, frm, size, want, first, last, fd) -> (row, crc, short): read each chunk's
 * bytes [frm, frm + size) of the file ``fd`` straight into its target, in preadv batches of
 * about a MiB, and check each one's crc32c while the batch is still in cache. ``row`` is
 * the first chunk whose crc is not the one expected (-1: none); ``short`` is 1 where the
 * file ended before a chunk did. Read errors raise OSError. */
static PyObject *read_checked(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Columns c;
    Py_ssize_t first, last;
    int fd = nargs == 7 ? (int)PyLong_AsLong(args[6]) : -1;
    if (PyErr_Occurred() || run_of(args, nargs, 7, "read_checked", &c, &first, &last) < 0)
        return NULL;
    const int64_t *to = c.to.buf, *frm = c.frm.buf, *size = c.size.buf, *want = c.want.buf;
    Py_ssize_t bad = -1;
    uint32_t found = 0;
    int short_read = 0, error = 0;
#if HAVE_CRC_INSN
    static uint8_t scratch[GAP_MAX];
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t j = first;
    while (j < last && bad < 0 && !short_read && !error) {
        /* One batch: consecutive chunks whose gaps are small, read by one preadv. */
        struct iovec iov[BATCH_IOV];
        int n = 0;
        Py_ssize_t end = j;
        int64_t start = frm[j], at = frm[j], bytes = 0;
        while (end < last && n < BATCH_IOV - 1 && bytes < BATCH_BYTES) {
            int64_t gap = frm[end] - at;
            if (gap < 0 || gap > GAP_MAX)
                break;
            if (gap > 0)
                iov[n++] = (struct iovec){scratch, (size_t)gap};
            iov[n++] = (struct iovec){(void *)(uintptr_t)to[end], (size_t)size[end]};
            at = frm[end] + size[end];
            bytes += gap + size[end];
            end++;
        }
        /* Read the batch whole, resuming after a short read. */
        int64_t done = 0;
        int k = 0;
        while (done < bytes) {
            ssize_t got = preadv(fd, iov + k, n - k, (off_t)(start + done));
            if (got < 0) {
                if (errno == EINTR)
                    continue;
                error = errno;
                break;
            }
            if (got == 0) {
                short_read = 1;
                break;
            }
            done += got;
            while (k < n && (size_t)got >= iov[k].iov_len) {
                got -= (ssize_t)iov[k].iov_len;
                k++;
            }
            if (k < n && got > 0) {
                iov[k].iov_base = (uint8_t *)iov[k].iov_base + got;
                iov[k].iov_len -= (size_t)got;
            }
        }
        if (error || short_read)
            break;
        bad = first_bad(to, size, want, j, end, &found);
        j = end;
    }
    Py_END_ALLOW_THREADS
#endif
    release(&c, 4);
    if (error) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(nIi)", bad, found, short_read);
}

/* copy_crc(dst, src, n, value) -> copy n bytes from address src to address dst and return
 * their crc32c, continuing ``value`` (a piece of a chunk staged for a device upload). */
static PyObject *copy_crc_of(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_crc takes 4 arguments");
        return NULL;
    }
    unsigned long long dst = PyLong_AsUnsignedLongLong(args[0]);
    unsigned long long src = PyLong_AsUnsignedLongLong(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    unsigned long value = PyLong_AsUnsignedLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative size");
        return NULL;
    }
    if (!have_insn) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no crc32c instruction");
        return NULL;
    }
    uint32_t r = (uint32_t)value;
#if HAVE_CRC_INSN
    Py_BEGIN_ALLOW_THREADS
    r = ~copy_crc((uint8_t *)(uintptr_t)dst, (const uint8_t *)(uintptr_t)src, (size_t)n, ~r);
    Py_END_ALLOW_THREADS
#endif
    return PyLong_FromUnsignedLong(r);
}

/* crc32c(buffer, value=0) -> the crc32c of the buffer, continuing ``value`` (for tests). */
static PyObject *crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "crc32c takes a buffer and an optional value");
        return NULL;
    }
    unsigned long value = nargs == 2 ? PyLong_AsUnsignedLong(args[1]) : 0;
    if (PyErr_Occurred())
        return NULL;
    if (!have_insn) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no crc32c instruction");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint32_t r = (uint32_t)value;
#if HAVE_CRC_INSN
    Py_BEGIN_ALLOW_THREADS
    r = ~crc_only(view.buf, (size_t)view.len, ~r);
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

static PyObject *available(PyObject *self, PyObject *unused) { return PyBool_FromLong(have_insn); }

static PyMethodDef methods[] = {
    {"copy_checked", (PyCFunction)(void (*)(void))copy_checked, METH_FASTCALL,
     "Copy a run of chunks into their targets, each checked as it is copied."},
    {"checked_at", (PyCFunction)(void (*)(void))checked_at, METH_FASTCALL,
     "Check a run of chunks where they lie."},
    {"read_checked", (PyCFunction)(void (*)(void))read_checked, METH_FASTCALL,
     "Read a run of chunks of a file into their targets, each checked."},
    {"copy_crc", (PyCFunction)(void (*)(void))copy_crc_of, METH_FASTCALL,
     "Copy bytes between addresses and return their crc32c."},
    {"crc32c", (PyCFunction)(void (*)(void))crc32c, METH_FASTCALL, "crc32c of a buffer."},
    {"available", available, METH_NOARGS, "Whether this CPU has the crc32c instruction."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_verified_copy", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__verified_copy(void) {
    shift_one = x_pow_8n(STREAM);
    shift_two = x_pow_8n(2 * STREAM);
#if HAVE_CRC_INSN
    __builtin_cpu_init();
    have_insn = __builtin_cpu_supports("sse4.2");
#else
    have_insn = 0;
#endif
    return PyModule_Create(&module);
}
