/* The router's per-round fan-out of streamed tokens: one call writes one HTTP/1.1 chunk to each
 * of many sockets, without the GIL and without a Python frame per socket.
 *
 * send_chunks(fds, bodies) -> list[tuple[int, int]]
 *   fds: list of int (non-blocking connected sockets), bodies: list of bytes, same length.
 *   For each i, sends "<hex len>\r\n" + bodies[i] + "\r\n" with one sendmsg(MSG_DONTWAIT |
 *   MSG_NOSIGNAL) (the framing uvicorn's chunked responses use). Returns (i, sent) for each
 *   socket that did not take its whole frame: sent is the bytes it took, or -errno (EAGAIN:
 *   none); usually the list is empty. The caller hands each unsent rest to the asyncio
 *   transport, which buffers it or fails the connection as its own write would have: this call
 *   is exactly the transport's "try to send now" step, batched.
 *
 * Built by pd_server/fanout.py with the C compiler into the pdserve cache (a CPython module).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/uio.h>

typedef struct {
    int fd;
    const char *buf;
    Py_ssize_t len;
    Py_ssize_t frame;  /* head + body + CRLF */
    Py_ssize_t sent;   /* or -errno */
} item_t;

static Py_ssize_t send_one(item_t *it) {
    char head[24];
    int hl = snprintf(head, sizeof head, "%zx\r\n", (size_t)it->len);
    it->frame = hl + it->len + 2;
    struct iovec iov[3] = {{head, (size_t)hl}, {(void *)it->buf, (size_t)it->len}, {(void *)"\r\n", 2}};
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = 3;
    for (;;) {
        ssize_t r = sendmsg(it->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r >= 0) return (Py_ssize_t)r;
        if (errno != EINTR) return -(Py_ssize_t)errno;
    }
}

static PyObject *send_chunks(PyObject *self, PyObject *args) {
    PyObject *fds, *bodies;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &fds, &PyList_Type, &bodies)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(fds);
    if (PyList_GET_SIZE(bodies) != n) {
        PyErr_SetString(PyExc_ValueError, "fds and bodies differ in length");
        return NULL;
    }
    item_t *items = PyMem_Malloc(sizeof(item_t) * (size_t)(n ? n : 1));
    PyObject **held = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n ? n : 1));
    if (items == NULL || held == NULL) {
        PyMem_Free(items);
        PyMem_Free(held);
        return PyErr_NoMemory();
    }
    Py_ssize_t k = 0;
    PyObject *out = NULL;
    for (; k < n; k++) {
        PyObject *b = PyList_GET_ITEM(bodies, k);
        long fd = PyLong_AsLong(PyList_GET_ITEM(fds, k));
        if (fd == -1 && PyErr_Occurred()) goto done;
        if (!PyBytes_Check(b)) {
            PyErr_SetString(PyExc_TypeError, "bodies must be bytes");
            goto done;
        }
        Py_INCREF(b); /* the lists may change while the GIL is released; the bytes may not go */
        held[k] = b;
        items[k].fd = (int)fd;
        items[k].buf = PyBytes_AS_STRING(b);
        items[k].len = PyBytes_GET_SIZE(b);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) items[i].sent = send_one(&items[i]);
    Py_END_ALLOW_THREADS
    out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        if (items[i].sent == items[i].frame) continue;
        PyObject *v = Py_BuildValue("(nn)", i, items[i].sent);
        if (v == NULL || PyList_Append(out, v) < 0) Py_CLEAR(out);
        Py_XDECREF(v);
    }
done:
    for (Py_ssize_t i = 0; i < k; i++) Py_DECREF(held[i]);
    PyMem_Free(items);
    PyMem_Free(held);
    return out;
}

static PyMethodDef methods[] = {
    {"send_chunks", send_chunks, METH_VARARGS, "Send one HTTP/1.1 chunk to each socket; (index, sent or -errno) of those not fully sent."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pdserve_sse_fanout", NULL, -1, methods};

PyMODINIT_FUNC PyInit_pdserve_sse_fanout(void) { return PyModule_Create(&module); }
