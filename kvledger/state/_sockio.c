/* The state pull's socket calls in C: the accelerator of kvledger.state.sockio (same names, same behaviour).
 *
 * Each call takes a non-blocking socket (anything with fileno(), or a descriptor), a deadline in
 * time.monotonic() seconds, and buffers (anything exporting a contiguous byte buffer). It tries its system
 * call at once and waits in poll() only when that would block, all without the GIL and without going back to
 * the interpreter between calls: the Python loops cost a dozen interpreter calls a pull (docs/state.md).
 *
 *   send_all(sock, buffers, deadline)             every byte of `buffers`, in order (sendmsg); None
 *   recv_some(sock, buffer, deadline, ready=True) what has arrived (>= 1 byte; 0 when the peer closed);
 *                                                 ready=False waits before the first try
 *   recvmsg_some(sock, buffers, deadline)         one scatter read into `buffers`, waiting first; as recv_some
 *   recv_fill(sock, buffer, deadline, digest=None) fill `buffer`; the count, short only when the peer closed.
 *                                                 Each piece goes to digest.update(piece) as it lands
 *
 * Past the deadline: TimeoutError. A socket error: the OSError for its errno (ConnectionResetError, ...).
 * A signal: its handler runs (KeyboardInterrupt propagates), then the call goes on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define MAX_BUFFERS 8

static PyObject *str_update = NULL;

static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);   /* time.monotonic()'s clock on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Wait until `fd` is ready for `events`, has an error or was hung up: 0; -1 with TimeoutError or the signal
 * handler's exception set. Called with the GIL held; releases it while waiting. */
static int wait_ready(int fd, short events, double deadline) {
    for (;;) {
        double remaining = deadline - monotonic_s();
        if (remaining <= 0) {
            PyErr_SetString(PyExc_TimeoutError, "timed out");
            return -1;
        }
        struct pollfd p = {.fd = fd, .events = events, .revents = 0};
        int n, err;
        Py_BEGIN_ALLOW_THREADS
        n = poll(&p, 1, (int)ceil(remaining * 1000));
        err = errno;
        Py_END_ALLOW_THREADS
        if (n > 0)
            return 0;
        if (n < 0 && err != EINTR) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (n < 0 && PyErr_CheckSignals() < 0)
            return -1;
    }
}

static int parse_fd_deadline(PyObject *sock, PyObject *deadline_obj, int *fd, double *deadline) {
    *fd = PyObject_AsFileDescriptor(sock);
    if (*fd < 0) {
        if (PyErr_ExceptionMatches(PyExc_ValueError)) {   /* a closed socket's fileno() is -1: EBADF, as Python's */
            PyErr_Clear();
            errno = EBADF;
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return -1;
    }
    *deadline = PyFloat_AsDouble(deadline_obj);
    return (*deadline == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* The buffers of a list or tuple, exported: views[0..*count). Released by release_all. */
static int export_all(PyObject *seq, Py_buffer *views, int *count, int writable) {
    *count = 0;
    PyObject *fast = PySequence_Fast(seq, "buffers must be a list or tuple");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_BUFFERS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "at most %d buffers", MAX_BUFFERS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &views[i],
                               writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
            Py_DECREF(fast);
            return -1;
        }
        *count = (int)i + 1;
    }
    Py_DECREF(fast);
    return 0;
}

static void release_all(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
}

/* --- send ----------------------------------------------------------------------------------------------- */

static PyObject *send_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send_all(sock, buffers, deadline)");
        return NULL;
    }
    int fd, count = 0;
    double deadline;
    Py_buffer views[MAX_BUFFERS];
    if (parse_fd_deadline(args[0], args[2], &fd, &deadline) < 0 || export_all(args[1], views, &count, 0) < 0) {
        release_all(views, count);
        return NULL;
    }
    struct iovec iov[MAX_BUFFERS];
    for (int i = 0; i < count; i++) {
        iov[i].iov_base = views[i].buf;
        iov[i].iov_len = (size_t)views[i].len;
    }
    struct iovec *next = iov;
    int left = count;
    while (left > 0 && next->iov_len == 0) {   /* empty buffers send nothing */
        next++;
        left--;
    }
    PyObject *result = Py_None;
    while (left > 0) {
        struct msghdr msg = {.msg_iov = next, .msg_iovlen = (size_t)left};
        ssize_t n;
        int err;
        Py_BEGIN_ALLOW_THREADS
        n = sendmsg(fd, &msg, MSG_NOSIGNAL);
        err = errno;
        Py_END_ALLOW_THREADS
        if (n < 0) {
            if (err == EINTR) {
                if (PyErr_CheckSignals() < 0) {
                    result = NULL;
                    break;
                }
                continue;
            }
            if (err != EAGAIN && err != EWOULDBLOCK) {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
                result = NULL;
                break;
            }
            if (wait_ready(fd, POLLOUT, deadline) < 0) {   /* the send buffer is full: wait for room */
                result = NULL;
                break;
            }
            continue;
        }
        size_t sent = (size_t)n;
        while (left > 0 && sent >= next->iov_len) {
            sent -= next->iov_len;
            next++;
            left--;
        }
        if (left > 0) {
            next->iov_base = (char *)next->iov_base + sent;
            next->iov_len -= sent;
        }
    }
    release_all(views, count);
    Py_XINCREF(result);
    return result;
}

/* --- receive -------------------------------------------------------------------------------------------- */

/* One recvmsg into iov[0..count) (waiting first when `wait_first`): bytes (0 at EOF), or -1 with an exception. */
static ssize_t recv_once(int fd, struct iovec *iov, int count, double deadline, int wait_first) {
    if (wait_first && wait_ready(fd, POLLIN, deadline) < 0)
        return -1;
    for (;;) {
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)count};
        ssize_t n;
        int err;
        Py_BEGIN_ALLOW_THREADS
        n = recvmsg(fd, &msg, 0);
        err = errno;
        Py_END_ALLOW_THREADS
        if (n >= 0)
            return n;
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return -1;
            continue;
        }
        if (err != EAGAIN && err != EWOULDBLOCK) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (wait_ready(fd, POLLIN, deadline) < 0)
            return -1;
    }
}

static PyObject *recv_into_buffers(PyObject *sock, PyObject *seq_or_buffer, PyObject *deadline_obj, int is_seq,
                                   int wait_first) {
    int fd, count = 0;
    double deadline;
    Py_buffer views[MAX_BUFFERS];
    if (parse_fd_deadline(sock, deadline_obj, &fd, &deadline) < 0)
        return NULL;
    if (is_seq) {
        if (export_all(seq_or_buffer, views, &count, 1) < 0) {
            release_all(views, count);
            return NULL;
        }
    } else {
        if (PyObject_GetBuffer(seq_or_buffer, &views[0], PyBUF_WRITABLE) < 0)
            return NULL;
        count = 1;
    }
    struct iovec iov[MAX_BUFFERS];
    for (int i = 0; i < count; i++) {
        iov[i].iov_base = views[i].buf;
        iov[i].iov_len = (size_t)views[i].len;
    }
    ssize_t n = recv_once(fd, iov, count, deadline, wait_first);
    release_all(views, count);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

static PyObject *recv_some(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "recv_some(sock, buffer, deadline, ready=True)");
        return NULL;
    }
    int ready = nargs == 4 ? PyObject_IsTrue(args[3]) : 1;
    if (ready < 0)
        return NULL;
    return recv_into_buffers(args[0], args[1], args[2], 0, !ready);
}

static PyObject *recvmsg_some(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "recvmsg_some(sock, buffers, deadline)");
        return NULL;
    }
    return recv_into_buffers(args[0], args[1], args[2], 1, 1);
}

static PyObject *recv_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "recv_fill(sock, buffer, deadline, digest=None)");
        return NULL;
    }
    PyObject *digest = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    int fd;
    double deadline;
    Py_buffer view;
    if (parse_fd_deadline(args[0], args[2], &fd, &deadline) < 0 || PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    char *base = (char *)view.buf;
    Py_ssize_t got = 0;
    while (got < view.len) {
        struct iovec iov = {.iov_base = base + got, .iov_len = (size_t)(view.len - got)};
        ssize_t n = recv_once(fd, &iov, 1, deadline, 0);
        if (n < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        if (n == 0)
            break;   /* the peer closed */
        if (digest != NULL) {
            PyObject *piece = PyMemoryView_FromMemory(base + got, n, PyBUF_READ);
            PyObject *r = piece == NULL ? NULL : PyObject_CallMethodOneArg(digest, str_update, piece);
            Py_XDECREF(piece);
            if (r == NULL) {
                PyBuffer_Release(&view);
                return NULL;
            }
            Py_DECREF(r);
        }
        got += n;
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(got);
}

static PyMethodDef methods[] = {
    {"send_all", (PyCFunction)(void (*)(void))send_all, METH_FASTCALL,
     "send_all(sock, buffers, deadline): every byte of buffers, in order, before deadline."},
    {"recv_some", (PyCFunction)(void (*)(void))recv_some, METH_FASTCALL,
     "recv_some(sock, buffer, deadline, ready=True) -> bytes received (0: the peer closed)."},
    {"recvmsg_some", (PyCFunction)(void (*)(void))recvmsg_some, METH_FASTCALL,
     "recvmsg_some(sock, buffers, deadline) -> bytes received by one scatter read, waiting first."},
    {"recv_fill", (PyCFunction)(void (*)(void))recv_fill, METH_FASTCALL,
     "recv_fill(sock, buffer, deadline, digest=None) -> bytes received (short only when the peer closed)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sockio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sockio(void) {
    str_update = PyUnicode_InternFromString("update");
    if (str_update == NULL)
        return NULL;
    return PyModule_Create(&module);
}
