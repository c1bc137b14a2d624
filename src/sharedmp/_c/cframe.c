/* sharedmp._cframe: the per-message work of a small message, in C.
 *
 * Each function has a pure-Python twin that stays the reference (channels/fdpass.py,
 * reductions/ndarray.py); the wire format and the exceptions are the twin's. Anything
 * unusual (a malformed or odd array frame) is handed to the twin, which raises its own
 * error or returns its own result: the C path only runs the common case faster.
 *
 *   send_record(sock, flags, nfds, length, payload, fds, block)   fdpass._send_record
 *   send_frame(sock, payload, fds, flags, window[, flight])        fdpass.send_frame
 *   recv_frame(sock, block=True)                                   fdpass._recv_frame
 *   encode_value(a, code)                                          ndarray._encode_value
 *   decode_value(payload)                                          ndarray._decode_value
 *   dumps_plain(obj)                                               wire._dumps_plain
 *   loads(payload, fds, kind=0)                                    wire.loads
 *   setup_wire(...), setup_fdpass(...), setup_ndarray(...): the Python objects they use (no
 *   import of numpy here: `import sharedmp` must not import it)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* fdpass.py: the frame header <2sBBIQ and its bounds */
#define HEADER_SIZE 16
#define VERSION 3
#define KIND 0x1F
#define FLIGHT_TOKEN 0x20
#define PAYLOAD_IN_MEMFD 0x40
#define FDS_ON_SOCKET 0x80
#define RECORD (1 << 16)
#define MAX_FDS_PER_MSG 253
#define MAX_FDS (1ULL << 16)
#define MAX_PAYLOAD (1ULL << 40)
/* ndarray.py: _HEAD <QBB?, then the dtype string, ndim shapes and ndim strides (<q) */
#define HEAD_SIZE 11
#define MAX_NDIM 32 /* beyond, NumPy may refuse: the twin says how */

typedef struct {
    PyObject *protocol_error;  /* sharedmp.errors.ProtocolError */
    PyObject *payload_of;      /* fdpass._payload_of(fd, offset, length) */
    PyObject *fds_of_socket;   /* fdpass._fds_of_socket(fd, nfds) */
    PyObject *send_frame_twin; /* fdpass._send_frame_py */
    PyObject *dtypes;          /* ndarray._dtypes: dtype string (bytes) -> np.dtype */
    PyObject *dtype_of;        /* ndarray._dtype(code): parses, caches, raises SegmentError */
    PyObject *decode_twin;     /* ndarray._decode_value_py */
    PyObject *encode_twin;     /* ndarray._encode_value_py */
    PyObject *empty;           /* numpy.empty */
    PyObject *pickle_dumps;    /* pickle.dumps */
    PyObject *pickle_loads;    /* pickle.loads */
    PyObject *oob_class;       /* wire.OutOfBand */
    PyObject *local;           /* wire._local: .oob is the current OutOfBand */
    PyObject *loads_twin;      /* wire._loads_py */
    PyObject *oob_name;        /* "oob" */
    PyObject *protocol;        /* 5 */
    PyObject *order_c, *order_f;
} State;

static State *state_of(PyObject *module) { return (State *)PyModule_GetState(module); }

static void put_le(unsigned char *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void close_fds(const int *fds, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) close(fds[i]);
}

/* The fd of a socket object (or an int): a closed socket is EBADF, as its own methods say */
static int fd_of(PyObject *sock) {
    int fd = PyObject_AsFileDescriptor(sock);
    if (fd < 0 && PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        errno = EBADF;
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return fd;
}

/* ---------------------------------------------------------------------------------- */
/* Records                                                                             */
/* ---------------------------------------------------------------------------------- */

typedef union { /* aligned as a cmsghdr must be */
    struct cmsghdr align;
    char buf[CMSG_SPACE(MAX_FDS_PER_MSG * sizeof(int))];
} Control;

/* One record: the header (MAGIC, VERSION, flags, nfds, length), then `buf`, with the fds
 * of `fdseq` as SCM_RIGHTS; waits while the kernel refuses more fds in flight
 * (ETOOMANYREFS) when `block`, as fdpass._sendmsg. */
static int send_fds(int fd, long flags, unsigned long long nfds, unsigned long long length,
                    const void *buf, Py_ssize_t len, PyObject *fdseq, int block) {
    if (flags < 0 || flags > 255 || nfds > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "frame header field out of range");
        return -1;
    }
    PyObject *seq = PySequence_Fast(fdseq, "fds must be a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_FDS_PER_MSG) {
        Py_DECREF(seq);
        errno = EINVAL; /* what the kernel answers to more than SCM_MAX_FD */
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    Control control;
    memset(&control, 0, sizeof control);
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    if (n) {
        msg.msg_control = control.buf;
        msg.msg_controllen = CMSG_SPACE(n * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(n * sizeof(int));
        for (Py_ssize_t i = 0; i < n; i++) {
            long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
            if (v < INT_MIN || v > INT_MAX) {
                Py_DECREF(seq);
                PyErr_SetString(PyExc_OverflowError, "fd out of range");
                return -1;
            }
            int fdv = (int)v;
            memcpy(CMSG_DATA(c) + i * sizeof fdv, &fdv, sizeof fdv);
        }
    }
    Py_DECREF(seq);
    unsigned char header[HEADER_SIZE] = {'S', 'M', VERSION, (unsigned char)flags};
    put_le(header + 4, nfds, 4);
    put_le(header + 8, length, 8);
    struct iovec iov[2] = {{header, HEADER_SIZE}, {(void *)buf, (size_t)len}};
    msg.msg_iov = iov;
    msg.msg_iovlen = 2;
    long delay_ns = 500000;
    for (;;) {
        ssize_t r;
        Py_BEGIN_ALLOW_THREADS
        r = sendmsg(fd, &msg, block ? 0 : MSG_DONTWAIT);
        Py_END_ALLOW_THREADS
        if (r >= 0) return 0;
        if (errno == ETOOMANYREFS && block && n) {
            /* back-pressure: receivers take fds out of flight as they read (fdpass._sendmsg) */
            struct timespec ts = {0, delay_ns};
            Py_BEGIN_ALLOW_THREADS
            nanosleep(&ts, NULL);
            Py_END_ALLOW_THREADS
            delay_ns = delay_ns * 2 < 20000000 ? delay_ns * 2 : 20000000;
        } else if (errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0) return -1;
    }
}

/* send_record(sock, flags, nfds, length, payload, fds, block): fdpass._send_record_py */
static PyObject *send_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "send_record takes 7 arguments");
        return NULL;
    }
    int fd = fd_of(args[0]);
    if (fd < 0) return NULL;
    long flags = PyLong_AsLong(args[1]);
    unsigned long long nfds = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long length = PyLong_AsUnsignedLongLong(args[3]);
    int block = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || block < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[4], &view, PyBUF_SIMPLE) < 0) return NULL;
    int r = send_fds(fd, flags, nfds, length, view.buf, view.len, args[5], block);
    PyBuffer_Release(&view);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

/* send_frame(sock, payload, fds, flags, window[, flight]): fdpass._send_frame_py for a
 * frame that is one plain record (bytes that fit, no flight to count); any other goes to
 * the twin. */
static PyObject *send_frame(PyObject *module, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames) {
    State *st = state_of(module);
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || nargs < 5 || nargs > 6 || !PyBytes_CheckExact(args[1]) ||
        PyBytes_GET_SIZE(args[1]) > RECORD - HEADER_SIZE || !PyLong_Check(args[3]))
        goto twin;
    Py_ssize_t nfds = PyObject_Length(args[2]);
    if (nfds < 0) return NULL;
    if (nfds > MAX_FDS_PER_MSG) goto twin; /* on a socket of their own */
    PyObject *window = args[4];
    if (window != Py_None) { /* with flight to count, a flight token may go with it */
        PyObject *flight = nargs == 6 && args[5] != Py_None ? Py_NewRef(args[5])
                                                             : PyObject_GetAttrString(args[2], "flight");
        if (flight == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
            PyErr_Clear(); /* (getattr(fds, "flight", 0)) */
            flight = PyLong_FromLong(0);
            if (flight == NULL) return NULL;
        }
        long long f = PyLong_Check(flight) ? PyLong_AsLongLong(flight) : 1;
        Py_DECREF(flight);
        if (f == -1 && PyErr_Occurred()) {
            PyErr_Clear(); /* (out of range: the twin says what it makes of it) */
            f = 1;
        }
        if (f > 0) goto twin;
    }
    int fd = fd_of(args[0]);
    if (fd < 0) return NULL;
    long flags = PyLong_AsLong(args[3]);
    if (flags == -1 && PyErr_Occurred()) PyErr_Clear();
    if (flags < 0 || flags > 255) goto twin; /* (its struct.error) */
    Py_ssize_t len = PyBytes_GET_SIZE(args[1]);
    if (send_fds(fd, flags, (unsigned long long)nfds, (unsigned long long)len,
                 PyBytes_AS_STRING(args[1]), len, args[2], 1) < 0)
        return NULL;
    if (window == Py_None) Py_RETURN_NONE;
    return PyObject_CallMethod(window, "wait", NULL);
twin:
    return PyObject_Vectorcall(st->send_frame_twin, args, nargsf, kwnames);
}

static PyObject *protocol_error(State *st, const char *format, ...) {
    va_list va;
    va_start(va, format);
    PyObject *text = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (text != NULL) {
        PyErr_SetObject(st->protocol_error, text);
        Py_DECREF(text);
    }
    return NULL;
}

/* The checks of a record, in fdpass._recv_frame's order and words. Returns the payload
 * (new reference) and sets *nfds_io to the fds left as the message's, or NULL with an
 * exception set; the fds it consumed are closed either way, those left are the caller's. */
static PyObject *check_record(State *st, const unsigned char *data, ssize_t got_total,
                              int msg_flags, int *fds, Py_ssize_t *nfds_io, int *flags_out,
                              int *on_socket_fd, unsigned long *announced) {
    Py_ssize_t nfds = *nfds_io;
    if (msg_flags & MSG_CTRUNC)
        return protocol_error(st, "file descriptors were dropped in transit (MSG_CTRUNC): the "
                                  "receiver's fd limit is too low (raise it with `ulimit -n`)");
    if (got_total == 0) {
        PyErr_SetString(PyExc_EOFError, "the other end of the channel was closed");
        return NULL;
    }
    if (msg_flags & MSG_TRUNC)
        return protocol_error(st, "a record longer than %d bytes: the peer is not a sharedmp "
                                  "channel of this version", RECORD);
    if (got_total < HEADER_SIZE)
        return protocol_error(st, "a record of %zd bytes, shorter than a frame header: the "
                                  "peer is not a sharedmp channel of this version",
                              (Py_ssize_t)got_total);
    if (data[0] != 'S' || data[1] != 'M' || data[2] != VERSION) {
        PyObject *head = PyBytes_FromStringAndSize((const char *)data, HEADER_SIZE);
        if (head == NULL) return NULL;
        protocol_error(st, "not a sharedmp frame (header %R): the peer is not a sharedmp "
                           "channel of this version, or the stream is corrupt", head);
        Py_DECREF(head);
        return NULL;
    }
    int flags = data[3];
    uint64_t announced_fds = get_le(data + 4, 4), length = get_le(data + 8, 8);
    if (announced_fds > MAX_FDS || length > MAX_PAYLOAD)
        return protocol_error(st, "frame announces %llu fds and %llu bytes: over the sane "
                                  "bounds", (unsigned long long)announced_fds,
                              (unsigned long long)length);
    int in_memfd = flags & PAYLOAD_IN_MEMFD, on_socket = flags & FDS_ON_SOCKET,
        token = flags & FLIGHT_TOKEN;
    Py_ssize_t expected = (on_socket ? 1 : (Py_ssize_t)announced_fds) + (in_memfd ? 1 : 0) +
                          (token ? 1 : 0);
    if (nfds != expected)
        return protocol_error(st, "frame announces %llu fds%s%s%s but %zd arrived with it",
                              (unsigned long long)announced_fds, on_socket ? " on a socket" : "",
                              in_memfd ? " and its payload in a memfd" : "",
                              token ? " and a flight token" : "", nfds);
    Py_ssize_t got = (Py_ssize_t)got_total - HEADER_SIZE;
    PyObject *payload;
    if (in_memfd) {
        if (got != 8)
            return protocol_error(st, "a frame with its payload in a memfd carries %zd bytes "
                                      "instead of the payload's offset there", got);
        int memfd = fds[--nfds];
        *nfds_io = nfds; /* _payload_of closes it */
        payload = PyObject_CallFunction(st->payload_of, "iKK", memfd,
                                        (unsigned long long)get_le(data + HEADER_SIZE, 8),
                                        (unsigned long long)length);
        if (payload == NULL) return NULL;
    } else if ((uint64_t)got != length) {
        return protocol_error(st, "a frame's record carries %zd payload bytes, its header "
                                  "announces %llu: the peer is not a sharedmp channel, or the "
                                  "stream is corrupt", got, (unsigned long long)length);
    } else {
        payload = PyBytes_FromStringAndSize((const char *)data + HEADER_SIZE, got);
        if (payload == NULL) return NULL;
    }
    if (token) close(fds[--nfds]); /* taken: the sender's window is free of this message */
    *on_socket_fd = on_socket ? fds[--nfds] : -1;
    *nfds_io = nfds;
    *flags_out = flags;
    *announced = (unsigned long)announced_fds;
    return payload;
}

/* recv_frame(sock, block=True) -> (payload, fds, kind), as fdpass._recv_frame. */
static PyObject *recv_frame(PyObject *module, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames) {
    State *st = state_of(module);
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw < 1 || nargs + nkw > 2 || nargs < 1 ||
        (nkw && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "block") != 0)) {
        PyErr_SetString(PyExc_TypeError, "recv_frame(sock, block=True)");
        return NULL;
    }
    nargs += nkw; /* (block, by position or by name, is args[1]) */
    if (st->protocol_error == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "sharedmp._cframe: setup_fdpass() was not called");
        return NULL;
    }
    int fd = fd_of(args[0]);
    if (fd < 0) return NULL;
    int block = nargs < 2 ? 1 : PyObject_IsTrue(args[1]);
    if (block < 0) return NULL;
    unsigned char *data = PyMem_Malloc(RECORD);
    if (data == NULL) return PyErr_NoMemory();
    Control control;
    struct iovec iov = {data, RECORD};
    struct msghdr msg;
    ssize_t r;
    for (;;) {
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof control.buf;
        Py_BEGIN_ALLOW_THREADS
        r = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | (block ? 0 : MSG_DONTWAIT));
        Py_END_ALLOW_THREADS
        if (r >= 0) break;
        if (errno != EINTR) {
            PyMem_Free(data);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (PyErr_CheckSignals() < 0) {
            PyMem_Free(data);
            return NULL;
        }
    }
    /* every fd that arrived, from every SCM_RIGHTS message, before any check */
    int fds[sizeof control.buf / sizeof(int)];
    Py_ssize_t nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
            c->cmsg_len < CMSG_LEN(0))
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        memcpy(fds + nfds, CMSG_DATA(c), k * sizeof(int));
        nfds += (Py_ssize_t)k;
    }
    int flags = 0, side = -1;
    unsigned long announced = 0;
    PyObject *payload = check_record(st, data, r, msg.msg_flags, fds, &nfds, &flags, &side,
                                     &announced);
    PyMem_Free(data);
    if (payload == NULL) {
        close_fds(fds, nfds);
        return NULL;
    }
    /* (made first: once the list holds the fds, nothing can fail) */
    PyObject *result = PyTuple_New(3), *kind = PyLong_FromLong(flags & KIND);
    if (result == NULL || kind == NULL) {
        Py_XDECREF(result);
        Py_XDECREF(kind);
        Py_DECREF(payload);
        close_fds(fds, nfds);
        if (side >= 0) close(side);
        return NULL;
    }
    PyTuple_SET_ITEM(result, 0, payload);
    PyTuple_SET_ITEM(result, 2, kind);
    PyObject *list;
    if (side >= 0) /* the message's fds wait on a socket: _fds_of_socket closes it */
        list = PyObject_CallFunction(st->fds_of_socket, "ik", side, announced);
    else {
        list = PyList_New(nfds);
        for (Py_ssize_t i = 0; list != NULL && i < nfds; i++) {
            PyObject *v = PyLong_FromLong(fds[i]);
            if (v == NULL) Py_CLEAR(list);
            else PyList_SET_ITEM(list, i, v);
        }
        if (list == NULL) close_fds(fds, nfds);
    }
    if (list == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    PyTuple_SET_ITEM(result, 1, list);
    return result;
}

/* ---------------------------------------------------------------------------------- */
/* Arrays by value                                                                     */
/* ---------------------------------------------------------------------------------- */

static PyObject *call_twin(PyObject *twin, PyObject *const *args, Py_ssize_t nargs) {
    if (twin == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "sharedmp._cframe: setup_ndarray() was not called");
        return NULL;
    }
    return PyObject_Vectorcall(twin, args, (size_t)nargs, NULL);
}

/* encode_value(a, code) -> bytes, as ndarray._encode_value: the header (offset 0, the
 * strides of its C or F copy), then its bytes in that order. A read-only or empty array
 * goes to the twin (NumPy's buffer says read-only also for an array that warns on write). */
static PyObject *encode_value(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    State *st = state_of(module);
    if (nargs != 2 || !PyBytes_Check(args[1]) || PyBytes_GET_SIZE(args[1]) > 255)
        return call_twin(st->encode_twin, args, nargs);
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_STRIDES) < 0) {
        PyErr_Clear(); /* (the twin says why, if anything is wrong) */
        return call_twin(st->encode_twin, args, nargs);
    }
    if (v.readonly || v.len == 0 || v.ndim > 64 || (v.ndim && v.strides == NULL)) {
        PyBuffer_Release(&v);
        return call_twin(st->encode_twin, args, nargs);
    }
    /* F-contiguous and not C (NumPy's flags.fnc): F, as NumPy's pickle keeps it */
    char order = v.ndim > 1 && PyBuffer_IsContiguous(&v, 'F') && !PyBuffer_IsContiguous(&v, 'C')
                     ? 'F' : 'C';
    Py_ssize_t k = PyBytes_GET_SIZE(args[1]), n = v.ndim;
    PyObject *out = PyBytes_FromStringAndSize(NULL, HEAD_SIZE + k + 16 * n + v.len);
    if (out == NULL) {
        PyBuffer_Release(&v);
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    memset(p, 0, HEAD_SIZE);
    p[8] = (unsigned char)n;
    p[9] = (unsigned char)k;
    memcpy(p + HEAD_SIZE, PyBytes_AS_STRING(args[1]), k);
    unsigned char *dims = p + HEAD_SIZE + k;
    int64_t step = v.itemsize; /* ndarray._packed_strides: a dimension of 0 counts as 1 */
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = order == 'F' ? j : n - 1 - j;
        put_le(dims + 8 * i, (uint64_t)v.shape[i], 8);
        put_le(dims + 8 * (n + i), (uint64_t)step, 8);
        step *= v.shape[i] ? v.shape[i] : 1;
    }
    int r = PyBuffer_ToContiguous(dims + 16 * n, &v, v.len, order);
    PyBuffer_Release(&v);
    if (r < 0) Py_CLEAR(out);
    return out;
}

/* decode_value(payload) -> ndarray, as ndarray._decode_value: a fresh array of NumPy's own
 * (numpy.empty, C or F as the strides say) holding a copy of the bytes. Every frame that
 * is not plainly well formed, and an empty array, goes to the twin: its checks, its words. */
static PyObject *decode_value(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    State *st = state_of(module);
    if (nargs != 1 || st->empty == NULL) return call_twin(st->decode_twin, args, nargs);
    Py_buffer p;
    if (PyObject_GetBuffer(args[0], &p, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *data = p.buf;
    PyObject *code = NULL, *dtype = NULL, *shape = NULL, *a = NULL;
    Py_ssize_t n = 0, k = 0, start = 0;
    int64_t itemsize = 0, count = 1, cstride[MAX_NDIM], fstride[MAX_NDIM];
    if (p.len < HEAD_SIZE || get_le(data, 8) != 0) goto twin;
    n = data[8];
    k = data[9];
    start = HEAD_SIZE + k + 16 * n;
    if (n > MAX_NDIM || p.len < start) goto twin;
    code = PyBytes_FromStringAndSize((const char *)data + HEAD_SIZE, k);
    if (code == NULL) goto fail;
    dtype = PyDict_GetItemWithError(st->dtypes, code);
    if (dtype != NULL) Py_INCREF(dtype);
    else if (PyErr_Occurred() || (dtype = PyObject_CallOneArg(st->dtype_of, code)) == NULL)
        goto fail; /* (the twin's _dtype raised: its SegmentError) */
    PyObject *v = PyObject_GetAttrString(dtype, "itemsize");
    if (v == NULL) goto fail;
    itemsize = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (itemsize == -1 && PyErr_Occurred()) goto fail;
    v = PyObject_GetAttrString(dtype, "hasobject");
    if (v == NULL) goto fail;
    int hasobject = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (hasobject < 0) goto fail;
    if (hasobject || itemsize <= 0) goto twin;
    const unsigned char *dims = data + HEAD_SIZE + k;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t d = (int64_t)get_le(dims + 8 * i, 8);
        if (d <= 0 || __builtin_mul_overflow(count, d, &count)) goto twin;
    }
    int64_t nbytes;
    if (__builtin_mul_overflow(count, itemsize, &nbytes) || nbytes != p.len - start) goto twin;
    /* the strides must be exactly those of the C array of this shape, or of the F one
     * (no overflow: their product is nbytes) */
    int64_t cs = itemsize, fs = itemsize;
    int is_c = 1, is_f = 1;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = n - 1 - j;
        cstride[i] = cs;
        cs *= (int64_t)get_le(dims + 8 * i, 8);
        fstride[j] = fs;
        fs *= (int64_t)get_le(dims + 8 * j, 8);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = (int64_t)get_le(dims + 8 * (n + i), 8);
        is_c &= s == cstride[i];
        is_f &= s == fstride[i];
    }
    if (!is_c && !is_f) goto twin;
    shape = PyTuple_New(n);
    if (shape == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyLong_FromLongLong((long long)get_le(dims + 8 * i, 8));
        if (d == NULL) goto fail;
        PyTuple_SET_ITEM(shape, i, d);
    }
    PyObject *argv[3] = {shape, dtype, is_c ? st->order_c : st->order_f};
    a = PyObject_Vectorcall(st->empty, argv, 3, NULL);
    if (a == NULL) goto fail;
    Py_buffer out;
    if (PyObject_GetBuffer(a, &out, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS) < 0) goto fail;
    Py_ssize_t got = out.len;
    if (got == nbytes) memcpy(out.buf, data + start, (size_t)nbytes);
    PyBuffer_Release(&out);
    if (got != nbytes) {
        PyErr_SetString(PyExc_SystemError, "numpy.empty gave an array of another size");
        goto fail;
    }
    if (data[10]) { /* read-only, as the sender's was */
        PyObject *flags = PyObject_GetAttrString(a, "flags");
        if (flags == NULL) goto fail;
        int r = PyObject_SetAttrString(flags, "writeable", Py_False);
        Py_DECREF(flags);
        if (r < 0) goto fail;
    }
    goto done;
twin:
    a = call_twin(st->decode_twin, args, nargs);
    goto done;
fail:
    Py_CLEAR(a);
done:
    Py_XDECREF(code);
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    PyBuffer_Release(&p);
    return a;
}

/* ---------------------------------------------------------------------------------- */
/* Messages of builtin atoms                                                           */
/* ---------------------------------------------------------------------------------- */

static int is_atom(PyObject *o) {
    PyTypeObject *t = Py_TYPE(o);
    return t == &PyLong_Type || t == &PyFloat_Type || t == &PyUnicode_Type ||
           t == &PyBytes_Type || t == &PyBool_Type || o == Py_None;
}

/* dumps_plain(obj) -> the pickle of a builtin atom or a tuple of them, else None:
 * wire._dumps_plain_py (pickle writes these itself, no reducer or dispatch table runs) */
static PyObject *dumps_plain(PyObject *module, PyObject *obj) {
    State *st = state_of(module);
    if (st->pickle_dumps == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "sharedmp._cframe: setup_wire() was not called");
        return NULL;
    }
    if (!is_atom(obj)) {
        if (!PyTuple_CheckExact(obj)) Py_RETURN_NONE;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); i++)
            if (!is_atom(PyTuple_GET_ITEM(obj, i))) Py_RETURN_NONE;
    }
    PyObject *argv[2] = {obj, st->protocol};
    return PyObject_Vectorcall(st->pickle_dumps, argv, 2, NULL);
}

/* The exception being raised, taken (normalized, its traceback on it), and raised again
 * (stolen): one object from 3.12 on, three before */
static PyObject *take_exc(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) {
        PyException_SetTraceback(value, tb);
        Py_DECREF(tb);
    }
    Py_DECREF(type);
    return value;
#endif
}

static void put_exc(PyObject *exc) {
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    if (exc != NULL)
        PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* loads(payload, fds, kind=0): wire._loads_py for a pickle (kind 0), with OutOfBand(fds)
 * current while it is unpickled; other kinds go to the twin. */
static PyObject *loads(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    State *st = state_of(module);
    long kind = 0;
    if (nargs == 3) {
        kind = PyLong_Check(args[2]) ? PyLong_AsLong(args[2]) : -1;
        if (kind == -1 && PyErr_Occurred()) PyErr_Clear();
    }
    if (st->loads_twin == NULL || nargs < 2 || nargs > 3 || kind != 0)
        return call_twin(st->loads_twin, args, nargs);
    PyObject *oob = PyObject_CallOneArg(st->oob_class, args[1]);
    if (oob == NULL) return NULL;
    PyObject *prev = PyObject_GetAttr(st->local, st->oob_name); /* swap(oob) */
    if (prev == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            Py_DECREF(oob);
            return NULL;
        }
        PyErr_Clear();
        prev = Py_NewRef(Py_None);
    }
    int r = PyObject_SetAttr(st->local, st->oob_name, oob);
    Py_DECREF(oob);
    if (r < 0) {
        Py_DECREF(prev);
        return NULL;
    }
    PyObject *obj = PyObject_CallOneArg(st->pickle_loads, args[0]);
    if (obj == NULL && PyErr_ExceptionMatches(PyExc_EOFError)) {
        /* pickle's "Ran out of input": not the end of the channel (raise ... from it) */
        PyObject *eof = take_exc();
        Py_ssize_t n = PyObject_Length(args[0]);
        if (n < 0) {
            Py_XDECREF(eof);
        } else {
            protocol_error(st, "a frame's payload ends before its pickle does (%zd bytes; the "
                               "peer sent raw bytes to recv(), or the stream is corrupt)", n);
            PyObject *pe = take_exc();
            if (pe != NULL && eof != NULL) {
                PyException_SetContext(pe, Py_NewRef(eof));
                PyException_SetCause(pe, eof);
            } else {
                Py_XDECREF(eof);
            }
            put_exc(pe);
        }
    }
    /* finally: swap(prev), close_all(fds) */
    PyObject *raised = take_exc();
    r = PyObject_SetAttr(st->local, st->oob_name, prev);
    Py_DECREF(prev);
    PyObject *seq = r < 0 ? NULL : PySequence_Fast(args[1], "fds must be a sequence");
    for (Py_ssize_t i = 0; seq != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (fd == -1 && PyErr_Occurred()) break;
        if (fd >= 0 && fd <= INT_MAX) close((int)fd);
    }
    Py_XDECREF(seq);
    if (PyErr_Occurred()) { /* (the finally's own error wins, as in Python) */
        Py_XDECREF(raised);
        Py_XDECREF(obj);
        return NULL;
    }
    put_exc(raised);
    return obj;
}

/* ---------------------------------------------------------------------------------- */

static void set(PyObject **slot, PyObject *value) {
    Py_INCREF(value);
    Py_XSETREF(*slot, value);
}

/* Keep args[i] in slots[i] (the module's state), for the setup_* calls below. */
static PyObject *keep(PyObject *const *args, Py_ssize_t nargs, PyObject **slots[],
                      Py_ssize_t n, const char *name) {
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, n);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        set(slots[i], args[i]);
    Py_RETURN_NONE;
}

/* setup_wire(pickle.dumps, pickle.loads, OutOfBand, _local, _loads_py) */
static PyObject *setup_wire(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    State *st = state_of(module);
    PyObject **slots[] = {&st->pickle_dumps, &st->pickle_loads, &st->oob_class, &st->local,
                          &st->loads_twin};
    return keep(args, nargs, slots, 5, "setup_wire");
}

/* setup_fdpass(ProtocolError, _payload_of, _fds_of_socket, _send_frame_py) */
static PyObject *setup_fdpass(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    State *st = state_of(module);
    PyObject **slots[] = {&st->protocol_error, &st->payload_of, &st->fds_of_socket,
                          &st->send_frame_twin};
    return keep(args, nargs, slots, 4, "setup_fdpass");
}

/* setup_ndarray(_dtypes, _dtype, _encode_value_py, _decode_value_py, numpy.empty) */
static PyObject *setup_ndarray(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    State *st = state_of(module);
    if (nargs == 5 && !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "setup_ndarray takes a dict and 4 callables");
        return NULL;
    }
    PyObject **slots[] = {&st->dtypes, &st->dtype_of, &st->encode_twin, &st->decode_twin,
                          &st->empty};
    return keep(args, nargs, slots, 5, "setup_ndarray");
}

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
static PyMethodDef methods[] = {
    {"send_record", FASTCALL(send_record),
     "send_record(sock, flags, nfds, length, payload, fds, block): fdpass._send_record"},
    {"send_frame", (PyCFunction)(void (*)(void))send_frame, METH_FASTCALL | METH_KEYWORDS,
     "send_frame(sock, payload, fds, flags, window[, flight]): fdpass._send_frame_py"},
    {"recv_frame", (PyCFunction)(void (*)(void))recv_frame, METH_FASTCALL | METH_KEYWORDS,
     "recv_frame(sock, block=True) -> (payload, fds, kind): fdpass._recv_frame"},
    {"encode_value", FASTCALL(encode_value), "encode_value(a, code): ndarray._encode_value_py"},
    {"decode_value", FASTCALL(decode_value), "decode_value(payload): ndarray._decode_value_py"},
    {"dumps_plain", dumps_plain, METH_O, "dumps_plain(obj): wire._dumps_plain_py"},
    {"loads", FASTCALL(loads), "loads(payload, fds, kind=0): wire._loads_py"},
    {"setup_wire", FASTCALL(setup_wire), NULL},
    {"setup_fdpass", FASTCALL(setup_fdpass), NULL},
    {"setup_ndarray", FASTCALL(setup_ndarray), NULL},
    {NULL, NULL, 0, NULL},
};

#define STATE_OBJECTS(X)                                                                      \
    X(protocol_error) X(payload_of) X(fds_of_socket) X(send_frame_twin) X(dtypes) X(dtype_of) X(decode_twin)     \
    X(encode_twin) X(empty) X(pickle_dumps) X(protocol) X(order_c) X(order_f)              \
    X(pickle_loads) X(oob_class) X(local) X(loads_twin) X(oob_name)

static int traverse(PyObject *module, visitproc visit, void *arg) {
    State *st = state_of(module);
#define VISIT(name) Py_VISIT(st->name);
    STATE_OBJECTS(VISIT)
    return 0;
}

static int clear(PyObject *module) {
    State *st = state_of(module);
#define CLEAR(name) Py_CLEAR(st->name);
    STATE_OBJECTS(CLEAR)
    return 0;
}

static void free_module(void *module) { clear((PyObject *)module); }

static int exec_module(PyObject *module) {
    State *st = state_of(module);
    st->order_c = PyUnicode_InternFromString("C");
    st->order_f = PyUnicode_InternFromString("F");
    st->protocol = PyLong_FromLong(5);
    st->oob_name = PyUnicode_InternFromString("oob");
    if (st->order_c == NULL || st->order_f == NULL || st->protocol == NULL ||
        st->oob_name == NULL)
        return -1;
    if (PyModule_AddIntConstant(module, "VERSION", VERSION) < 0 ||
        PyModule_AddIntConstant(module, "RECORD", RECORD) < 0 ||
        PyModule_AddIntConstant(module, "MAX_FDS_PER_MSG", MAX_FDS_PER_MSG) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sharedmp._cframe", NULL, sizeof(State), methods, slots, traverse,
    clear, free_module,
};

PyMODINIT_FUNC PyInit__cframe(void) { return PyModuleDef_Init(&module); }
