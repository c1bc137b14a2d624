/* sharedmp._cring: a single-producer/single-consumer byte ring in shared memory.

The protocol, the header's layout and the Python API are in channels/ring.py (the
pure-Python twin, the reference); this file is the same protocol in C. ring.py makes and
checks the mapping and the eventfds and hands them to Ring(...), which then owns the two
eventfds (closed by close(), by _forked() or at deallocation) and holds a buffer of the
mapping. Everything read from the mapping is checked before use: the peer is not trusted.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <unistd.h>

/* Offsets in the header (ring.py: HEADER and the O_* names; the same numbers) */
#define HEADER 512
#define O_WCLOSED 16
#define O_RCLOSED 20
#define O_HEAD 128
#define O_TAIL 256
#define O_RWAIT 384
#define O_WWAIT 448
#define MARKER 0xFFFFFFFFu
#define PAUSE_NS 3000           /* of the spin: pure loads first, then sched_yield */

typedef _Atomic uint64_t a64;
typedef _Atomic uint32_t a32;

static struct PyModuleDef ring_module;

typedef struct {
    PyObject *protocol_error;   /* sharedmp.errors.ProtocolError */
    PyObject *ring_type;
} state;

typedef struct {
    PyObject_HEAD
    Py_buffer buf;
    int have_buf;
    unsigned char *data;        /* the records: buf.buf + HEADER */
    a64 *head, *tail;
    a32 *rwait, *wwait, *wclosed, *rclosed;
    uint64_t cap, limit;        /* capacity (a power of two); the largest payload */
    uint64_t pos;               /* the reader's head, the writer's tail: this side's truth */
    uint64_t seen;              /* the other counter as last read (checked) */
    long spin_ns;
    int writer;
    int efd_data, efd_space, watch;
    int closed, forked, inflight;
    PyObject *protocol_error;
    PyObject *dict;             /* (a subclass's attributes) */
    PyObject *weaklist;
} Ring;

static inline a64 *word64(unsigned char *base, size_t off) { return (a64 *)(void *)(base + off); }
static inline a32 *word32(unsigned char *base, size_t off) { return (a32 *)(void *)(base + off); }
static inline uint64_t align8(uint64_t n) { return (n + 7) & ~(uint64_t)7; }

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int protocol(Ring *self, const char *what)
{
    PyErr_Format(self->protocol_error, "ring: the peer wrote an impossible %s into the shared "
                 "header or records (a hostile or corrupt peer); the ring is unusable", what);
    return -1;
}

/* -- the two counters, read and checked ------------------------------------------- */

/* (reader) The tail, checked against this side's head: 1 if records are there, 0 if none,
   -1 on a lie (exception set). */
static int load_tail(Ring *self)
{
    uint64_t t = atomic_load_explicit(self->tail, memory_order_acquire);
    if ((t & 7) || t - self->pos > self->cap)
        return protocol(self, "tail");
    self->seen = t;
    return t != self->pos;
}

/* (writer) The head, checked: it lies between the last head seen and this side's tail. */
static int load_head(Ring *self)
{
    uint64_t h = atomic_load_explicit(self->head, memory_order_acquire);
    if ((h & 7) || h - self->seen > self->pos - self->seen)
        return protocol(self, "head");
    self->seen = h;
    return 0;
}

/* Bytes a record of n bytes takes at the writer's position: with the wrap marker's skip. */
static uint64_t needed(Ring *self, uint64_t n)
{
    uint64_t p = self->pos & (self->cap - 1), rec = align8(4 + n);
    return p + rec <= self->cap ? rec : self->cap - p + rec;
}

/* Without the GIL and for the spin only: whether waiting may stop (shared memory alone). */
static int ready_shared(Ring *self, uint64_t need)
{
    if (self->writer) {
        uint64_t h = atomic_load_explicit(self->head, memory_order_acquire);
        return atomic_load_explicit(self->rclosed, memory_order_acquire) ||
               self->cap - (self->pos - h) >= need;
    }
    return atomic_load_explicit(self->tail, memory_order_acquire) != self->pos ||
           atomic_load_explicit(self->wclosed, memory_order_acquire);
}

/* (GIL held) 1: go on (space for `need`, or a record, or the peer closed); 0: wait; -1. */
static int ready(Ring *self, uint64_t need)
{
    if (self->writer) {
        if (atomic_load_explicit(self->rclosed, memory_order_acquire))
            return 1;
        if (self->cap - (self->pos - self->seen) >= need)
            return 1;
        if (load_head(self) < 0)
            return -1;
        return self->cap - (self->pos - self->seen) >= need;
    }
    int r = load_tail(self);
    if (r != 0)
        return r;
    if (atomic_load_explicit(self->wclosed, memory_order_acquire))
        return load_tail(self) < 0 ? -1 : 1;    /* (records published before the close) */
    return 0;
}

static void drain(int fd)
{
    uint64_t v;
    ssize_t r = read(fd, &v, sizeof v);         /* non-blocking: EAGAIN when zero */
    (void)r;
}

static int wake(int fd)
{
    uint64_t one = 1;
    if (fd < 0)
        return 0;
    if (write(fd, &one, sizeof one) < 0 && errno != EAGAIN) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

/* Wait until ready() (1), the deadline (ns, <0: none) or the watched fd (0), or -1. The
   announce-then-recheck: this side sets its `waiting` flag, a full fence, then looks once
   more; the peer publishes, a full fence, then reads the flag: one of the two sees the
   other, so no wake is lost and a busy stream makes no syscall. */
static int await_ready(Ring *self, uint64_t need, long long deadline)
{
    int fd = self->writer ? self->efd_space : self->efd_data;
    a32 *flag = self->writer ? self->wwait : self->rwait;
    long long spin_end = now_ns() + self->spin_ns;
    int spun = 0;
    for (;;) {
        int r = ready(self, need);
        if (r != 0)
            return r;
        if (self->closed)
            return 0;
        long long t = now_ns();
        if (deadline >= 0 && t >= deadline)
            return 0;
        if (!spun && self->spin_ns > 0) {
            spun = 1;
            long long start = t, end = deadline >= 0 && deadline < spin_end ? deadline : spin_end;
            /* The clock is read every 64 pauses, and after every sched_yield: on a loaded
               machine one yield can last a whole turn of the run queue (milliseconds). */
            Py_BEGIN_ALLOW_THREADS
            for (unsigned i = 1; !ready_shared(self, need); i++) {
                if (t - start < PAUSE_NS) {
                    relax();
                    if ((i & 63) == 0)
                        t = now_ns();
                } else {
                    sched_yield();
                    t = now_ns();
                }
                if (t >= end)
                    break;
            }
            Py_END_ALLOW_THREADS
            continue;
        }
        if (fd < 0)             /* (no eventfds: a ring that never sleeps, channels/board.py) */
            return 0;
        drain(fd);
        atomic_store(flag, 1);
        atomic_thread_fence(memory_order_seq_cst);
        r = ready(self, need);
        if (r != 0) {
            atomic_store(flag, 0);
            return r;
        }
        struct pollfd pfd[2] = {{fd, POLLIN, 0}, {self->watch, POLLIN, 0}};
        int ms = -1;
        if (deadline >= 0) {
            long long left = (deadline - now_ns() + 999999) / 1000000;
            ms = left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
        }
        int n, err;
        Py_BEGIN_ALLOW_THREADS
        n = poll(pfd, self->watch >= 0 ? 2 : 1, ms);
        err = errno;
        Py_END_ALLOW_THREADS
        atomic_store(flag, 0);
        if (n < 0) {
            if (err != EINTR) {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
            if (PyErr_CheckSignals() < 0)
                return -1;
            continue;
        }
        if (n > 0 && self->watch >= 0 && pfd[1].revents) {
            r = ready(self, need);
            return r != 0 ? r : 0;
        }
    }
}

/* -- operations -------------------------------------------------------------------- */

static int enter(Ring *self, int writer)
{
    if (self->forked) {
        PyErr_SetString(PyExc_RuntimeError, "this ring was inherited by fork: a forked child "
                        "cannot use its parent's ring (give the child a ring of its own)");
        return -1;
    }
    if (self->closed || !self->have_buf) {      /* (or never initialised) */
        PyErr_SetString(PyExc_OSError, "ring is closed");
        return -1;
    }
    if (writer >= 0 && self->writer != writer) {
        PyErr_SetString(PyExc_OSError, writer ? "this end of the ring is the reader's"
                                              : "this end of the ring is the writer's");
        return -1;
    }
    if (self->inflight) {
        PyErr_SetString(PyExc_RuntimeError, "ring: another thread is using this end (one "
                        "thread at a time on each side: lock around it)");
        return -1;
    }
    self->inflight = 1;
    return 0;
}

static void release_resources(Ring *self)
{
    if (self->have_buf) {
        self->have_buf = 0;
        PyBuffer_Release(&self->buf);
    }
    if (self->efd_data >= 0)
        close(self->efd_data);
    if (self->efd_space >= 0)
        close(self->efd_space);
    self->efd_data = self->efd_space = -1;
}

static void leave(Ring *self)
{
    self->inflight = 0;
    if (self->closed)           /* closed by another thread meanwhile: the last one out frees */
        release_resources(self);
}

/* The deadline (CLOCK_MONOTONIC ns) of a timeout in seconds; -1 for None (no deadline). */
static int deadline_of(PyObject *timeout, long long *deadline)
{
    if (timeout == NULL || timeout == Py_None) {
        *deadline = -1;
        return 0;
    }
    double t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred())
        return -1;
    if (t != t) {
        PyErr_SetString(PyExc_ValueError, "timeout must not be NaN");
        return -1;
    }
    if (t < 0)
        t = 0;
    if (t > 1e9)
        t = 1e9;
    *deadline = now_ns() + (long long)(t * 1e9);
    return 0;
}

/* (put, get, poll) one optional positional argument `first`, then `timeout` */
static int parse(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int want_first,
                 PyObject **first, PyObject **timeout, const char *name)
{
    *timeout = NULL;
    Py_ssize_t max = want_first + 1;
    if (nargs > max || nargs < want_first) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd or %zd arguments (%zd given)", name,
                     (Py_ssize_t)want_first, max, nargs);
        return -1;
    }
    if (want_first)
        *first = args[0];
    if (nargs == max)
        *timeout = args[want_first];
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(key, "timeout") != 0 || *timeout != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", name, key);
            return -1;
        }
        *timeout = args[nargs + i];
    }
    return 0;
}

/* (writer) write one record of `n` bytes now: space was checked */
static int publish(Ring *self, const void *src, uint64_t n)
{
    uint64_t p = self->pos & (self->cap - 1), rec = align8(4 + n), t = self->pos;
    if (p + rec > self->cap) {
        atomic_store_explicit(word32(self->data, p), MARKER, memory_order_relaxed);
        t += self->cap - p;
        p = 0;
    }
    atomic_store_explicit(word32(self->data, p), (uint32_t)n, memory_order_relaxed);
    if (n)
        memcpy(self->data + p + 4, src, n);
    self->pos = t + rec;
    atomic_store_explicit(self->tail, self->pos, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(self->rwait, memory_order_relaxed) &&
            atomic_exchange(self->rwait, 0))
        return wake(self->efd_data);
    return 0;
}

/* put: 1 written, 0 not (timeout or watched fd), -1 */
static int do_put(Ring *self, PyObject *data, PyObject *timeout, int nowait)
{
    Py_buffer view;
    long long deadline = 0;
    if (!nowait && deadline_of(timeout, &deadline) < 0)
        return -1;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return -1;
    int r = -1;
    if (enter(self, 1) < 0)
        goto done;
    if ((uint64_t)view.len > self->limit) {
        PyErr_Format(PyExc_ValueError, "ring: a record of %zd bytes is larger than this ring "
                     "takes (%llu bytes: a quarter of its capacity); send it another way",
                     view.len, (unsigned long long)self->limit);
        leave(self);
        goto done;
    }
    uint64_t need = needed(self, (uint64_t)view.len);
    r = nowait ? ready(self, need) : await_ready(self, need, deadline);
    if (r == 1 && self->closed)
        r = 0;
    if (r == 1 && atomic_load_explicit(self->rclosed, memory_order_acquire)) {
        PyErr_SetString(PyExc_BrokenPipeError, "ring: the reader closed its end");
        r = -1;
    }
    if (r == 1 && publish(self, view.buf, (uint64_t)view.len) < 0)
        r = -1;
    if (r == 0 && self->closed) {
        PyErr_SetString(PyExc_OSError, "ring is closed");
        r = -1;
    }
    leave(self);
done:
    PyBuffer_Release(&view);
    return r;
}

static PyObject *Ring_put(Ring *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw)
{
    PyObject *data, *timeout;
    if (parse(args, nargs, kw, 1, &data, &timeout, "put") < 0)
        return NULL;
    int r = do_put(self, data, timeout, 0);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *Ring_try_put(Ring *self, PyObject *data)
{
    int r = do_put(self, data, NULL, 1);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

/* (reader) the next record as bytes; records are there (load_tail said so) */
static PyObject *take(Ring *self)
{
    for (;;) {
        if (self->pos == self->seen) {
            int wclosed = atomic_load_explicit(self->wclosed, memory_order_acquire);
            int r = load_tail(self);
            if (r < 0)
                return NULL;
            if (r > 0)
                continue;
            if (wclosed)
                PyErr_SetString(PyExc_EOFError, "ring: the writer closed its end");
            else
                protocol(self, "record (a wrap marker with nothing after it)");
            return NULL;
        }
        uint64_t p = self->pos & (self->cap - 1);
        uint32_t n = atomic_load_explicit(word32(self->data, p), memory_order_relaxed);
        if (n == MARKER) {
            if (p == 0 || self->seen - self->pos < self->cap - p) {
                protocol(self, "wrap marker");
                return NULL;
            }
            self->pos += self->cap - p;
            continue;
        }
        uint64_t rec = align8(4 + (uint64_t)n);
        if (n > self->limit || p + rec > self->cap || self->seen - self->pos < rec) {
            protocol(self, "record length");
            return NULL;
        }
        PyObject *out = PyBytes_FromStringAndSize((const char *)self->data + p + 4, n);
        if (out == NULL)
            return NULL;
        self->pos += rec;
        atomic_store_explicit(self->head, self->pos, memory_order_release);
        atomic_thread_fence(memory_order_seq_cst);
        if (atomic_load_explicit(self->wwait, memory_order_relaxed) &&
                atomic_exchange(self->wwait, 0) && wake(self->efd_space) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        return out;
    }
}

static PyObject *Ring_get(Ring *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw)
{
    PyObject *timeout, *out = NULL;
    long long deadline;
    if (parse(args, nargs, kw, 0, NULL, &timeout, "get") < 0 || deadline_of(timeout, &deadline) < 0)
        return NULL;
    if (enter(self, 0) < 0)
        return NULL;
    int r = self->pos != self->seen ? 1 : await_ready(self, 0, deadline);
    if (r == 1)
        out = take(self);
    else if (r == 0 && self->closed)
        PyErr_SetString(PyExc_OSError, "ring is closed");
    else if (r == 0)
        out = Py_NewRef(Py_None);
    leave(self);
    return out;
}

static PyObject *Ring_poll(Ring *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw)
{
    PyObject *timeout;
    long long deadline;
    if (parse(args, nargs, kw, 0, NULL, &timeout, "poll") < 0)
        return NULL;
    if (timeout == NULL)
        deadline = now_ns();                    /* poll() is poll(0), as a Connection's */
    else if (deadline_of(timeout, &deadline) < 0)
        return NULL;
    if (enter(self, 0) < 0)
        return NULL;
    int r = self->pos != self->seen ? 1 : await_ready(self, 0, deadline);
    if (r == 0 && self->closed) {
        PyErr_SetString(PyExc_OSError, "ring is closed");
        r = -1;
    }
    leave(self);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *Ring_arm(Ring *self, PyObject *Py_UNUSED(ignored))
{
    if (enter(self, 0) < 0)
        return NULL;
    int r = self->pos != self->seen ? 1 : ready(self, 0);
    if (r == 0) {
        drain(self->efd_data);
        atomic_store(self->rwait, 1);
        atomic_thread_fence(memory_order_seq_cst);
        r = ready(self, 0);
        if (r != 0)
            atomic_store(self->rwait, 0);
    }
    leave(self);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *Ring_close(Ring *self, PyObject *Py_UNUSED(ignored))
{
    if (self->closed || self->forked || !self->have_buf)
        Py_RETURN_NONE;
    self->closed = 1;
    atomic_store(self->writer ? self->wclosed : self->rclosed, 1);
    atomic_thread_fence(memory_order_seq_cst);
    int r = wake(self->writer ? self->efd_data : self->efd_space);
    if (self->inflight)         /* another thread waits on this end: wake it, it frees */
        r |= wake(self->writer ? self->efd_space : self->efd_data);
    else
        release_resources(self);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Ring_forked(Ring *self, PyObject *Py_UNUSED(ignored))
{
    /* (a forked child, one thread) the parent's eventfds and buffer: the child's copies go */
    self->forked = 1;
    self->closed = 1;
    self->inflight = 0;
    release_resources(self);
    Py_RETURN_NONE;
}

static PyObject *Ring_fileno(Ring *self, PyObject *Py_UNUSED(ignored))
{
    if (self->closed || self->forked || !self->have_buf) {
        enter(self, -1);        /* (raises the error that says which) */
        return NULL;
    }
    return PyLong_FromLong(self->writer ? self->efd_space : self->efd_data);
}

static PyObject *Ring_eventfds(Ring *self, PyObject *Py_UNUSED(ignored))
{
    if (self->closed || self->forked || !self->have_buf)
        return PyErr_Format(PyExc_OSError, "ring is closed");
    return Py_BuildValue("(ii)", self->efd_data, self->efd_space);
}

static PyObject *Ring_set_watch(Ring *self, PyObject *arg)
{
    int fd = -1;
    if (arg != Py_None) {
        fd = PyObject_AsFileDescriptor(arg);
        if (fd < 0)
            return NULL;
    }
    self->watch = fd;
    Py_RETURN_NONE;
}

static PyObject *Ring_counters(Ring *self, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(KK)", (unsigned long long)self->pos, (unsigned long long)self->seen);
}

/* -- the type ------------------------------------------------------------------------ */

static int Ring_init(Ring *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"mapping", "writer", "capacity", "efd_data", "efd_space",
                             "spin_us", NULL};
    PyObject *mapping;
    int writer, efd_data, efd_space;
    unsigned long long cap;
    double spin_us;
    if (self->have_buf || self->efd_data >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "Ring.__init__ called twice");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OpKiid:Ring", kwlist, &mapping, &writer, &cap,
                                     &efd_data, &efd_space, &spin_us))
        return -1;
    if (cap < 64 || (cap & (cap - 1)) || cap > ((unsigned long long)1 << 40) ||
            efd_data < -1 || efd_space < -1 || (efd_data < 0) != (efd_space < 0) ||
            !(spin_us >= 0 && spin_us <= 1e6)) {
        PyErr_SetString(PyExc_ValueError, "Ring: bad capacity, eventfd or spin");
        return -1;
    }
    PyObject *module = PyType_GetModuleByDef(Py_TYPE(self), &ring_module);
    if (module == NULL)
        return -1;
    state *st = PyModule_GetState(module);
    Py_XSETREF(self->protocol_error, Py_NewRef(st->protocol_error));
    if (PyObject_GetBuffer(mapping, &self->buf, PyBUF_WRITABLE) < 0)
        return -1;
    self->have_buf = 1;
    if ((uint64_t)self->buf.len < HEADER + cap || ((uintptr_t)self->buf.buf & 63)) {
        PyBuffer_Release(&self->buf);
        self->have_buf = 0;
        PyErr_SetString(PyExc_ValueError, "Ring: the mapping is smaller than its capacity says, "
                        "or not aligned");
        return -1;
    }
    unsigned char *base = self->buf.buf;
    self->data = base + HEADER;
    self->head = word64(base, O_HEAD);
    self->tail = word64(base, O_TAIL);
    self->rwait = word32(base, O_RWAIT);
    self->wwait = word32(base, O_WWAIT);
    self->wclosed = word32(base, O_WCLOSED);
    self->rclosed = word32(base, O_RCLOSED);
    self->cap = cap;
    self->limit = cap / 4;
    self->writer = writer;
    /* (ring.py checked the header: these are where this side starts) */
    uint64_t h = atomic_load(self->head), t = atomic_load(self->tail);
    self->pos = writer ? t : h;
    self->seen = writer ? h : t;
    if ((h & 7) || (t & 7) || t - h > cap || (h >> 63)) {   /* (2^63: 29 years at 10 GB/s) */
        PyBuffer_Release(&self->buf);
        self->have_buf = 0;
        PyErr_SetString(self->protocol_error, "ring: the peer wrote impossible counters");
        return -1;
    }
    self->spin_ns = (long)(spin_us * 1000);
    self->efd_data = efd_data;
    self->efd_space = efd_space;
    return 0;
}

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)args;
    (void)kwds;
    Ring *self = (Ring *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->efd_data = self->efd_space = self->watch = -1;
    return (PyObject *)self;
}

static int Ring_traverse(Ring *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->dict);
    Py_VISIT(self->protocol_error);
    return 0;
}

static int Ring_clear(Ring *self)
{
    Py_CLEAR(self->dict);
    Py_CLEAR(self->protocol_error);
    return 0;
}

static void Ring_dealloc(Ring *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weaklist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    if (!self->forked)
        release_resources(self);
    Ring_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef Ring_methods[] = {
    {"put", (PyCFunction)(void (*)(void))Ring_put, METH_FASTCALL | METH_KEYWORDS,
     "put(data, timeout=None) -> bool: False if no room came within timeout s"},
    {"try_put", (PyCFunction)Ring_try_put, METH_O, "try_put(data) -> bool: put without waiting"},
    {"get", (PyCFunction)(void (*)(void))Ring_get, METH_FASTCALL | METH_KEYWORDS,
     "get(timeout=None) -> bytes | None: None if nothing came within timeout s"},
    {"poll", (PyCFunction)(void (*)(void))Ring_poll, METH_FASTCALL | METH_KEYWORDS,
     "poll(timeout=0) -> bool: whether get() would return at once"},
    {"arm", (PyCFunction)Ring_arm, METH_NOARGS, "arm() -> bool (see ring.py)"},
    {"_close", (PyCFunction)Ring_close, METH_NOARGS, "mark this side closed, wake the peer"},
    {"_forked", (PyCFunction)Ring_forked, METH_NOARGS, "(fork hook) drop the parent's ring"},
    {"fileno", (PyCFunction)Ring_fileno, METH_NOARGS, "the eventfd this side waits on"},
    {"_eventfds", (PyCFunction)Ring_eventfds, METH_NOARGS, "(data, space) eventfds"},
    {"watch", (PyCFunction)Ring_set_watch, METH_O, "watch(fd or None) (see ring.py)"},
    {"_counters", (PyCFunction)Ring_counters, METH_NOARGS, "(this side's, the other's as seen)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Ring_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(Ring, dict), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(Ring, weaklist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Ring_slots[] = {
    {Py_tp_new, Ring_new},
    {Py_tp_init, Ring_init},
    {Py_tp_dealloc, Ring_dealloc},
    {Py_tp_traverse, Ring_traverse},
    {Py_tp_clear, Ring_clear},
    {Py_tp_methods, Ring_methods},
    {Py_tp_members, Ring_members},
    {Py_tp_doc, "The compiled core of channels.ring.Ring (use that)."},
    {0, NULL},
};

/* -- a queue's board (channels/board.py: the layout, the protocol, the twins) ----------- */
#define B_RINGS 4096
#define B_USED 64
#define B_TAKEN 72              /* u32: tagged frames the consumers took */
#define B_XSENT 76              /* u32: frames sent by producers without a slot */
#define B_TABLE 256             /* per slot 16 bytes: u32 frames sent by its owners */
#define B_REC 9                 /* a record's kind u8, stamp u64 */
#define B_TAGGED 0x10

static inline uint64_t le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

typedef struct {
    unsigned char *base;
    uint64_t slots, cap;
    uint32_t used;
    PyObject *protocol_error;
} board;

/* The mapping of a board, checked; -1 with an exception set. */
static int board_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                    Py_buffer *b, board *bd)
{
    state *st = PyModule_GetState(module);
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, "board function: wrong number of arguments");
        return -1;
    }
    bd->slots = PyLong_AsUnsignedLongLong(args[1]);
    bd->cap = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return -1;
    if (bd->slots == 0 || bd->slots > 64 || bd->cap < 1024 || bd->cap > (1u << 30) ||
            (bd->cap & (bd->cap - 1))) {
        PyErr_SetString(PyExc_ValueError, "board: bad slots or capacity");
        return -1;
    }
    if (PyObject_GetBuffer(args[0], b, PyBUF_WRITABLE) < 0)
        return -1;
    bd->base = b->buf;
    bd->protocol_error = st->protocol_error;
    if ((uint64_t)b->len < B_RINGS + bd->slots * (HEADER + bd->cap) || ((uintptr_t)bd->base & 63)) {
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_ValueError, "board: the mapping is smaller than a board");
        return -1;
    }
    bd->used = atomic_load_explicit(word32(bd->base, B_USED), memory_order_acquire);
    if (bd->used > bd->slots) {
        PyBuffer_Release(b);
        PyErr_Format(st->protocol_error, "a queue's board says %u of its %llu slots are used",
                     bd->used, (unsigned long long)bd->slots);
        return -1;
    }
    return 0;
}

static int lie(board *bd)
{
    PyErr_SetString(bd->protocol_error, "a queue's board: a ring's counters or records are "
                    "impossible (a hostile or corrupt peer); the queue is unusable");
    return -1;
}

/* Slot s's front record: 1 and where it is (*at: its length word, *skip: a wrap's bytes
   first, *len), 0 if its ring is empty, -1 on a lie. */
static int front(board *bd, uint64_t s, uint64_t *h_out, uint64_t *skip, uint64_t *p_out,
                 uint32_t *len_out)
{
    uint64_t cap = bd->cap;
    unsigned char *r = bd->base + B_RINGS + s * (HEADER + cap), *data = r + HEADER;
    uint64_t h = atomic_load_explicit(word64(r, O_HEAD), memory_order_acquire);
    uint64_t t = atomic_load_explicit(word64(r, O_TAIL), memory_order_acquire);
    if (h == t)
        return 0;
    if ((h & 7) || (t & 7) || t - h > cap)
        return lie(bd);
    uint64_t p = h & (cap - 1);
    *skip = 0;
    uint32_t len = atomic_load_explicit(word32(data, p), memory_order_relaxed);
    if (len == MARKER) {
        *skip = cap - p;
        if (p == 0 || t - h <= *skip)
            return lie(bd);
        p = 0;
        len = atomic_load_explicit(word32(data, 0), memory_order_relaxed);
    }
    uint64_t rec = align8(4 + (uint64_t)len);
    if (len < B_REC || len > cap / 4 || p + rec > cap || t - h - *skip < rec || data[p + 4] >= B_TAGGED)
        return lie(bd);
    *h_out = h;
    *p_out = p;
    *len_out = len;
    return 1;
}

/* The ring record with the smallest stamp (*best -1: none), looked for until a look finds
   no smaller one (a record published before it is then seen), and whether tagged frames
   wait in the socket (counted after); -1 on a lie. */
static int first(board *bd, long long *best_out, uint64_t *stamp_out, int *waiting)
{
    /* (read again at each look: a slot claimed since the last one is looked at too) */
    uint32_t used = atomic_load_explicit(word32(bd->base, B_USED), memory_order_acquire);
    if (used > bd->slots) {
        PyErr_Format(bd->protocol_error, "a queue's board says %u of its %llu slots are used",
                     used, (unsigned long long)bd->slots);
        return -1;
    }
    bd->used = used;
    long long best = -1;
    uint64_t best_stamp = 0;
    for (int pass = 0; pass < 64; pass++) {
        long long was = best;
        uint64_t was_stamp = best_stamp;
        best = -1;
        for (uint64_t s = 0; s < bd->used; s++) {
            uint64_t h, skip, p;
            uint32_t len;
            int r = front(bd, s, &h, &skip, &p, &len);
            if (r < 0)
                return -1;
            if (r == 0)
                continue;
            unsigned char *data = bd->base + B_RINGS + s * (HEADER + bd->cap) + HEADER;
            uint64_t stamp = le64(data + p + 5);
            if (best < 0 || stamp < best_stamp) {
                best = (long long)s;
                best_stamp = stamp;
            }
        }
        if (best == was && best_stamp == was_stamp)
            break;
    }
    uint32_t sent = atomic_load_explicit(word32(bd->base, B_XSENT), memory_order_acquire);
    for (uint64_t s = 0; s < bd->used; s++)
        sent += atomic_load_explicit(word32(bd->base, B_TABLE + 16 * s), memory_order_acquire);
    uint32_t taken = atomic_load_explicit(word32(bd->base, B_TAKEN), memory_order_relaxed);
    *best_out = best;
    *stamp_out = best_stamp;
    *waiting = sent != taken;
    return 0;
}

/* Slot s's front record, taken: its payload (*kind its kind); NULL with an exception set. */
static PyObject *pop(board *bd, uint64_t s, unsigned *kind)
{
    uint64_t h, skip, p;
    uint32_t len;
    int r = front(bd, s, &h, &skip, &p, &len);
    if (r <= 0) {
        if (r == 0)
            PyErr_SetString(PyExc_RuntimeError, "board_pop: the ring is empty");
        return NULL;
    }
    unsigned char *ring = bd->base + B_RINGS + s * (HEADER + bd->cap), *q = ring + HEADER + p + 4;
    PyObject *payload = PyBytes_FromStringAndSize((const char *)q + B_REC, len - B_REC);
    if (payload == NULL)
        return NULL;
    *kind = q[0];
    atomic_store_explicit(word64(ring, O_HEAD), h + skip + align8(4 + (uint64_t)len),
                          memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    return payload;
}

/* board_first(mapping, slots, capacity) -> (slot, stamp, frames waiting): see first(). The
   consumers' lock held. board.py's _first_py is its twin. */
static PyObject *board_first(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer b;
    board bd;
    if (board_of(module, args, nargs, 3, &b, &bd) < 0)
        return NULL;
    long long best;
    uint64_t stamp;
    int waiting;
    int r = first(&bd, &best, &stamp, &waiting);
    PyBuffer_Release(&b);
    if (r < 0)
        return NULL;
    return Py_BuildValue("(LKO)", best, (unsigned long long)stamp, waiting ? Py_True : Py_False);
}

/* board_pop(mapping, slots, capacity, slot) -> (kind, payload): slot's front record, taken
   (board_first found it; the consumers' lock held). Twin: board.py's _pop_py. */
static PyObject *board_pop(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer b;
    board bd;
    if (board_of(module, args, nargs, 4, &b, &bd) < 0)
        return NULL;
    PyObject *out = NULL;
    unsigned long long s = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        goto done;
    if (s >= bd.used) {
        PyErr_SetString(PyExc_ValueError, "board_pop: no such slot");
        goto done;
    }
    unsigned kind;
    PyObject *payload = pop(&bd, s, &kind);
    if (payload != NULL)
        out = Py_BuildValue("(IN)", kind, payload);
done:
    PyBuffer_Release(&b);
    return out;
}

/* The socket's head frame (MSG_PEEK: it stays there): 0 none, 1 one stamped *stamp, 2 one
   that goes before any record (untagged, or what recv_frame refuses), 3 the socket's end
   (after every record), 4 a tagged frame whose tag lies in its memfd; -1 on an error. */
#define F_HEADER 16
#define F_MEMFD 0x40
static int head(int fd, uint64_t *stamp)
{
    unsigned char buf[F_HEADER + 16];
    ssize_t n;
    do {
        n = recv(fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return 0;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (n == 0)
        return 3;
    if (n < F_HEADER || !(buf[3] & B_TAGGED))
        return 2;
    if (buf[3] & F_MEMFD)
        return 4;
    if (n < (ssize_t)sizeof buf)
        return 2;
    *stamp = le64(buf + F_HEADER + 8);
    return 1;
}

/* The socket's head frame, read with recv_frame(sock, False): (payload without its tag,
   fds, kind), counted as taken if tagged; None if none is there. */
static PyObject *take_frame(board *bd, PyObject *sock, PyObject *recv)
{
    PyObject *frame = PyObject_CallFunctionObjArgs(recv, sock, Py_False, NULL);
    if (frame == NULL) {
        if (PyErr_ExceptionMatches(PyExc_BlockingIOError)) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        return NULL;
    }
    PyObject *payload, *fds, *kind_obj;
    if (!PyArg_ParseTuple(frame, "OOO", &payload, &fds, &kind_obj)) {
        Py_DECREF(frame);
        return NULL;
    }
    long kind = PyLong_AsLong(kind_obj);
    if (kind == -1 && PyErr_Occurred()) {
        Py_DECREF(frame);
        return NULL;
    }
    if (!(kind & B_TAGGED))
        return frame; /* (a producer that could not lock: no /proc) */
    Py_ssize_t n = PyObject_Length(payload);
    if (n < 0) {
        Py_DECREF(frame);
        return NULL;
    }
    if (n < 16) {
        for (Py_ssize_t i = 0; PyList_Check(fds) && i < PyList_GET_SIZE(fds); i++) {
            long v = PyLong_AsLong(PyList_GET_ITEM(fds, i));
            if (v >= 0 && v <= INT_MAX)
                close((int)v);
        }
        PyErr_Clear();
        Py_DECREF(frame);
        PyErr_SetString(bd->protocol_error, "a queue's tagged frame is shorter than its tag");
        return NULL;
    }
    PyObject *rest;
    if (PyByteArray_CheckExact(payload)) { /* (read from a memfd: large; no copy) */
        if (PySequence_DelSlice(payload, 0, 16) < 0) {
            Py_DECREF(frame);
            return NULL;
        }
        rest = Py_NewRef(payload);
    } else {
        rest = PySequence_GetSlice(payload, 16, n);
        if (rest == NULL) {
            Py_DECREF(frame);
            return NULL;
        }
    }
    a32 *taken = word32(bd->base, B_TAKEN);
    atomic_store_explicit(taken, atomic_load_explicit(taken, memory_order_relaxed) + 1,
                          memory_order_release);
    PyObject *out = Py_BuildValue("(NOl)", rest, fds, kind & ~(long)B_TAGGED);
    Py_DECREF(frame);
    return out;
}

/* board_take(mapping, slots, capacity, sock, recv_frame) -> the next message, the
   consumers' lock held: (payload, fds, kind) (a ring record or the socket's head frame,
   taken), None (nothing now) or 2 (the head frame's stamp lies in its memfd: the caller
   looks). The oldest goes first; the socket's head is looked at, not taken, until it is
   known to go first (a frame read before would be this consumer's alone to deliver), and
   the rings looked at again after it (a record published before the frame was sent is
   then seen; a tie goes to the frame: a record stamped in the same tick by its producer
   was put after it). Twin: board.py's _take_py. */
static PyObject *board_take(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "board_take takes 5 arguments");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[3]);
    if (fd < 0)
        return NULL;
    Py_buffer b;
    board bd;
    if (board_of(module, args, 3, 3, &b, &bd) < 0)
        return NULL;
    PyObject *out = NULL;
    long long s;
    uint64_t stamp, frame_stamp = 0;
    int waiting;
    if (first(&bd, &s, &stamp, &waiting) < 0)
        goto done;
    if (waiting || s < 0) {
        int h = head(fd, &frame_stamp);
        if (h < 0)
            goto done;
        if (h == 4) {
            out = PyLong_FromLong(2);
            goto done;
        }
        int goes = h == 2 || (h == 3 && s < 0) || (h == 1 && (s < 0 || frame_stamp <= stamp));
        if (goes && h != 2) { /* (what was published before it) */
            if (first(&bd, &s, &stamp, &waiting) < 0)
                goto done;
            goes = s < 0 || (h == 1 && frame_stamp <= stamp);
        }
        if (goes) {
            out = take_frame(&bd, args[3], args[4]);
            goto done;
        }
    }
    if (s < 0) {
        out = Py_NewRef(Py_None);
    } else {
        unsigned kind;
        PyObject *payload = pop(&bd, (uint64_t)s, &kind);
        if (payload != NULL)
            out = Py_BuildValue("(N[]I)", payload, kind);
    }
done:
    PyBuffer_Release(&b);
    return out;
}

static PyMethodDef module_functions[] = {
    {"board_first", (PyCFunction)(void (*)(void))board_first, METH_FASTCALL,
     "board_first(mapping, slots, capacity) -> (slot, stamp, frames waiting) (board.py)"},
    {"board_pop", (PyCFunction)(void (*)(void))board_pop, METH_FASTCALL,
     "board_pop(mapping, slots, capacity, slot) -> (kind, payload) (board.py)"},
    {"board_take", (PyCFunction)(void (*)(void))board_take, METH_FASTCALL,
     "board_take(mapping, slots, capacity, sock, recv_frame) -> (payload, fds, kind), None or 2 (board.py)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Spec Ring_spec = {
    "sharedmp._cring.Ring", sizeof(Ring), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, Ring_slots,
};

static int exec_module(PyObject *m)
{
    state *st = PyModule_GetState(m);
    PyObject *errors = PyImport_ImportModule("sharedmp.errors");
    if (errors == NULL)
        return -1;
    st->protocol_error = PyObject_GetAttrString(errors, "ProtocolError");
    Py_DECREF(errors);
    if (st->protocol_error == NULL)
        return -1;
    st->ring_type = PyType_FromModuleAndSpec(m, &Ring_spec, NULL);
    if (st->ring_type == NULL)
        return -1;
    if (PyModule_AddObjectRef(m, "Ring", st->ring_type) < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "HEADER", HEADER) < 0)
        return -1;
    return 0;
}

static int m_traverse(PyObject *m, visitproc visit, void *arg)
{
    state *st = PyModule_GetState(m);
    if (st) {
        Py_VISIT(st->protocol_error);
        Py_VISIT(st->ring_type);
    }
    return 0;
}

static int m_clear(PyObject *m)
{
    state *st = PyModule_GetState(m);
    if (st) {
        Py_CLEAR(st->protocol_error);
        Py_CLEAR(st->ring_type);
    }
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    /* the ring's local state (position, in-flight flag) is guarded by the GIL */
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef ring_module = {
    PyModuleDef_HEAD_INIT, "sharedmp._cring", "SPSC byte ring in shared memory (see ring.py)",
    sizeof(state), module_functions, slots, m_traverse, m_clear, NULL,
};

PyMODINIT_FUNC PyInit__cring(void) { return PyModuleDef_Init(&ring_module); }
