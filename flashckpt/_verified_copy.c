/* Verified copies of a restore: each chunk copied into its target and checked against its
 * crc32c in one pass over its bytes, with the GIL released.
 *
 * A restore copies thousands of chunks from a snapshot's data region (a slot in shared
 * memory, a buffer read from a tier) into the tensors of a live state. Done chunk by chunk
 * from Python, the calls around each chunk cost more than its bytes at a few KiB, and the
 * checksum is a second pass over what was copied. Here one call takes a run of chunks, as
 * four columns of int64 (target address, offset in the source, bytes, crc32c expected or
 * -1 for none), and copies each one checked on the way (``_crc32c.h``: folded from the
 * registers the bytes pass through, or a block at a time where it landed, still in cache):
 * one read of memory for the copy and its check. A directory tier's file is read into the
 * targets the same way, a batch of chunks per ``preadv``, each checked while still in cache.
 * Given threads, a call shares its chunks out over them (torch's OpenMP team, see below).
 *
 * Built where the compiler targets x86-64; ``available()`` says whether this CPU has the
 * crc32 instruction, ``kernel()`` which kernel runs. Elsewhere the restore copies and checks
 * from Python (``entry_copy``).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#include "_crc32c.h"

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

enum { COPY, CHECK, READ }; /* what a run does to each chunk */

/* A run of chunks and what to do with them. */
typedef struct {
    int kind;
    const int64_t *to, *frm, *size, *want;
    uint64_t src; /* COPY: the source's address */
    int fd;       /* READ: the file */
} Rows;

/* What a run of rows came to: the first chunk found bad (-1: none) and its crc, or a file
 * that ended early, or a read's errno. */
typedef struct {
    Py_ssize_t bad;
    uint32_t found;
    int short_read, error;
} Outcome;

#if HAVE_CRC_INSN
/* COPY and CHECK: each chunk copied and checked in one pass, or checked where it lies. */
static Outcome copy_rows(const Rows *r, Py_ssize_t first, Py_ssize_t last) {
    Outcome out = {-1, 0, 0, 0};
    for (Py_ssize_t j = first; j < last; j++) {
        if (r->kind == CHECK && r->want[j] < 0)
            continue;
        uint8_t *at = (uint8_t *)(uintptr_t)r->to[j];
        uint32_t crc = r->kind == COPY
                           ? ~copy_crc(at, (const uint8_t *)(uintptr_t)(r->src + (uint64_t)r->frm[j]),
                                       (size_t)r->size[j], 0xffffffffu)
                           : ~crc_any(at, (size_t)r->size[j], 0xffffffffu);
        if (r->want[j] >= 0 && crc != (uint32_t)r->want[j]) {
            out.bad = j;
            out.found = crc;
            break;
        }
    }
    return out;
}

#define BATCH_IOV 512           /* chunks read by one preadv */
#define BATCH_BYTES (1u << 20)  /* bytes read by one preadv, then checked while in cache */
#define GAP_MAX 4096            /* bytes between two chunks read past into scratch */

/* READ: each chunk's bytes [frm, frm + size) of the file read straight into its target, in
 * preadv batches of about a MiB, each chunk checked while the batch is still in cache. */
static Outcome read_rows(const Rows *r, Py_ssize_t first, Py_ssize_t last) {
    static _Thread_local uint8_t scratch[GAP_MAX];
    const int64_t *to = r->to, *frm = r->frm, *size = r->size;
    Outcome out = {-1, 0, 0, 0};
    Py_ssize_t j = first;
    while (j < last) {
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
            ssize_t got = preadv(r->fd, iov + k, n - k, (off_t)(start + done));
            if (got < 0) {
                if (errno == EINTR)
                    continue;
                out.error = errno;
                return out;
            }
            if (got == 0) {
                out.short_read = 1;
                return out;
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
        Rows check = *r;
        check.kind = CHECK;
        out = copy_rows(&check, j, end);
        if (out.bad >= 0)
            return out;
        j = end;
    }
    return out;
}

static Outcome run_rows(const Rows *r, Py_ssize_t first, Py_ssize_t last) {
    return r->kind == READ ? read_rows(r, first, last) : copy_rows(r, first, last);
}
#endif

/* A run shared out over threads: the OpenMP team torch computes with, when the process has
 * one. Its threads spin for a while after each of torch's parallel ops before they sleep;
 * a pool of other threads would wait for a core meanwhile (on a few cores the restore then
 * ran a third slower right after a training step), the team's own threads take the work at
 * once. Found by name in the process (torch loads its OpenMP runtime for every library to
 * see); a process without one runs the shares on the calling thread, and Python spreads
 * them over its own workers instead (``team()`` says which). */
#define SHARES_MAX 64

typedef struct {
    const Rows *rows;
    Py_ssize_t cuts[SHARES_MAX + 1];
    Outcome out[SHARES_MAX];
    int shares;
    int next; /* the next share a thread takes */
} Team;

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn gomp_parallel;
static int team_forbidden; /* set in a forked child: its parent's team did not come along */

static gomp_parallel_fn team_entry(void) {
    if (!gomp_parallel && !team_forbidden)
        gomp_parallel = (gomp_parallel_fn)dlsym(RTLD_DEFAULT, "GOMP_parallel");
    return team_forbidden ? NULL : gomp_parallel;
}

#if HAVE_CRC_INSN
static void team_body(void *arg) {
    Team *t = arg;
    for (;;) { /* however many threads the team gives, every share is taken once */
        int s = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
        if (s >= t->shares)
            return;
        t->out[s] = run_rows(t->rows, t->cuts[s], t->cuts[s + 1]);
    }
}

/* Rows [first, last) cut into ``shares`` runs of about equal bytes, run by that many threads;
 * the outcome of the first run (in row order) that found something. */
static Outcome run_shared(const Rows *r, Py_ssize_t first, Py_ssize_t last, int threads) {
    Team *t = PyMem_RawCalloc(1, sizeof(Team));
    if (!t) { /* no memory for the bookkeeping: one thread does it all */
        return run_rows(r, first, last);
    }
    int64_t total = 0, sum = 0;
    for (Py_ssize_t j = first; j < last; j++)
        total += r->size[j];
    t->rows = r;
    t->shares = threads < SHARES_MAX ? threads : SHARES_MAX;
    t->cuts[0] = first;
    Py_ssize_t j = first;
    for (int s = 1; s < t->shares; s++) {
        int64_t goal = (int64_t)((double)total * s / t->shares);
        while (j < last && sum + r->size[j] <= goal)
            sum += r->size[j++];
        t->cuts[s] = j;
    }
    t->cuts[t->shares] = last;
    gomp_parallel_fn parallel = team_entry();
    if (parallel && t->shares > 1)
        parallel(team_body, t, (unsigned)t->shares, 0);
    else
        team_body(t);
    Outcome out = {-1, 0, 0, 0};
    for (int s = 0; s < t->shares; s++) {
        Outcome *o = &t->out[s];
        if (o->error || o->short_read || o->bad >= 0) {
            out = *o;
            break;
        }
    }
    PyMem_RawFree(t);
    return out;
}
#endif

/* rows_of: the arguments every call over a run of chunks takes: the four columns, the rows
 * [first, last), then ``extra`` more (the source's address, the file), then optionally the
 * threads to share the rows over (default 1). 0, or -1 with an exception set where they are
 * wrong (nothing to release then). */
static int rows_of(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t extra, const char *name,
                   Columns *c, Py_ssize_t *first, Py_ssize_t *last, int *threads) {
    if (nargs != 6 + extra && nargs != 7 + extra) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd or %zd arguments", name, 6 + extra,
                     7 + extra);
        return -1;
    }
    *first = PyLong_AsSsize_t(args[4]);
    *last = PyLong_AsSsize_t(args[5]);
    long n = nargs == 7 + extra ? PyLong_AsLong(args[6 + extra]) : 1;
    if (PyErr_Occurred())
        return -1;
    if (*first < 0 || *last < *first) {
        PyErr_SetString(PyExc_ValueError, "rows out of order");
        return -1;
    }
    if (n < 1) {
        PyErr_SetString(PyExc_ValueError, "threads must be at least 1");
        return -1;
    }
    *threads = n < SHARES_MAX ? (int)n : SHARES_MAX;
    if (!have_insn) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no crc32c instruction");
        return -1;
    }
    return columns(args, c, *last);
}

static PyObject *run_call(PyObject *const *args, Py_ssize_t nargs, int kind, const char *name) {
    Py_ssize_t extra = kind == CHECK ? 0 : 1;
    Columns c;
    Py_ssize_t first, last;
    int threads;
    Rows r = {.kind = kind, .fd = -1};
    if (kind == COPY && nargs >= 7)
        r.src = PyLong_AsUnsignedLongLong(args[6]);
    if (kind == READ && nargs >= 7)
        r.fd = (int)PyLong_AsLong(args[6]);
    if (PyErr_Occurred() || rows_of(args, nargs, extra, name, &c, &first, &last, &threads) < 0)
        return NULL;
    r.to = c.to.buf;
    r.frm = c.frm.buf;
    r.size = c.size.buf;
    r.want = c.want.buf;
    Outcome out = {-1, 0, 0, 0};
#if HAVE_CRC_INSN
    Py_BEGIN_ALLOW_THREADS
    out = threads > 1 ? run_shared(&r, first, last, threads) : run_rows(&r, first, last);
    Py_END_ALLOW_THREADS
#endif
    release(&c, 4);
    if (out.error) {
        errno = out.error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (kind == READ)
        return Py_BuildValue("(nIi)", out.bad, out.found, out.short_read);
    return Py_BuildValue("(nI)", out.bad, out.found);
}

/* copy_checked(to, frm, size, want, first, last, src[, threads]) -> (row, crc) of the first
 * chunk whose crc32c is not the one expected, or (-1, 0). ``src``: the source's address. */
static PyObject *copy_checked(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return run_call(args, nargs, COPY, "copy_checked");
}

/* checked_at(to, frm, size, want, first, last[, threads]) -> like copy_checked, for chunks
 * already in place at their ``to`` addresses (``frm`` is not read); rows expecting -1 are
 * not checked. */
static PyObject *checked_at(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return run_call(args, nargs, CHECK, "checked_at");
}

/* read_checked(to, frm, size, want, first, last, fd[, threads]) -> (row, crc, short): read
 * each chunk's bytes [frm, frm + size) of the file ``fd`` straight into its target, checked
 * there. ``row`` is the first chunk whose crc is not the one expected (-1: none); ``short``
 * is 1 where the file ended before a chunk did. Read errors raise OSError. */
static PyObject *read_checked(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return run_call(args, nargs, READ, "read_checked");
}

#define GIL_FREE_MIN (32 << 10) /* smaller buffers are checked holding the GIL */

/* crc32c(buffer, value=0) -> the crc32c of the buffer, continuing ``value`` (a chunk's
 * checksum where this CPU folds: ``format.checksum``). */
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
    if (view.len < GIL_FREE_MIN) { /* a thread handing the GIL back and forth per small chunk */
        r = ~crc_any(view.buf, (size_t)view.len, ~r);
    } else {
        Py_BEGIN_ALLOW_THREADS
        r = ~crc_any(view.buf, (size_t)view.len, ~r);
        Py_END_ALLOW_THREADS
    }
#endif
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

static PyObject *available(PyObject *self, PyObject *unused) { return PyBool_FromLong(have_insn); }

/* team() -> whether runs of chunks given threads share them over torch's OpenMP team. */
static PyObject *team(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(team_entry() != NULL);
}

/* forbid_team() -> None: never use the team again (a forked child: its threads stayed behind). */
static PyObject *forbid_team(PyObject *self, PyObject *unused) {
    team_forbidden = 1;
    Py_RETURN_NONE;
}

/* kernel(name=None) -> the crc32c kernel in use ("fold" or "insn"), switched to ``name``
 * first where given (tests run both on a CPU that has both). */
static PyObject *kernel(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "kernel takes an optional name");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        const char *name = PyUnicode_AsUTF8(args[0]);
        if (!name)
            return NULL;
        if (strcmp(name, "fold") == 0 && have_fold)
            use_fold = 1;
        else if (strcmp(name, "insn") == 0 && have_insn)
            use_fold = 0;
        else {
            PyErr_Format(PyExc_ValueError, "no crc32c kernel %R on this CPU", args[0]);
            return NULL;
        }
    }
    return PyUnicode_FromString(!have_insn ? "none" : use_fold ? "fold" : "insn");
}

/* kernels() -> the crc32c kernels this CPU can run, fastest first. */
static PyObject *kernels(PyObject *self, PyObject *unused) {
    if (have_fold)
        return Py_BuildValue("[ss]", "fold", "insn");
    return have_insn ? Py_BuildValue("[s]", "insn") : PyList_New(0);
}

static PyMethodDef methods[] = {
    {"copy_checked", (PyCFunction)(void (*)(void))copy_checked, METH_FASTCALL,
     "Copy a run of chunks into their targets, each checked as it is copied."},
    {"checked_at", (PyCFunction)(void (*)(void))checked_at, METH_FASTCALL,
     "Check a run of chunks where they lie."},
    {"read_checked", (PyCFunction)(void (*)(void))read_checked, METH_FASTCALL,
     "Read a run of chunks of a file into their targets, each checked."},
    {"crc32c", (PyCFunction)(void (*)(void))crc32c, METH_FASTCALL, "crc32c of a buffer."},
    {"available", available, METH_NOARGS, "Whether this CPU has the crc32c instruction."},
    {"team", team, METH_NOARGS, "Whether shared runs use torch's OpenMP team."},
    {"forbid_team", forbid_team, METH_NOARGS, "Never use the OpenMP team (a forked child)."},
    {"kernel", (PyCFunction)(void (*)(void))kernel, METH_FASTCALL,
     "The crc32c kernel in use, switched first where a name is given."},
    {"kernels", kernels, METH_NOARGS, "The crc32c kernels this CPU can run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_verified_copy", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__verified_copy(void) {
    crc_init();
    return PyModule_Create(&module);
}
