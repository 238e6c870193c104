/* The router's per-round fan-out of streamed tokens: one HTTP/1.1 chunk to each of many
 * sockets, without the GIL and without a Python frame per socket.
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
 * post(fds, bodies, wake=True) / collect() -> list[tuple[int, int]]: the same sends, pipelined
 *   with the caller's rendering. post() queues a piece of a round (the bodies are held) and, with
 *   wake, wakes one helper thread, which sends queued frames while the caller renders the next
 *   piece (a helper still sending takes later pieces without a wake-up); collect()
 *   (end of the round) sends whatever is still queued on the calling thread too, GIL released,
 *   waits until every frame posted since the last collect() has been sent, and returns the
 *   short ones as send_chunks does, i indexing all of them in posting order. Nothing is sent
 *   twice or out of order on one socket as long as a round posts at most one frame a socket
 *   (the router's rounds do) and no socket is closed between its post() and collect() (the
 *   router's event loop thread is inside the round all that time). One queue and one helper per
 *   process; if the helper cannot be started (or after a fork) collect() sends everything itself.
 *
 * Built by pd_server/fanout.py with the C compiler into the pdserve cache (a CPython module).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

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
    (void)self;
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

/* ---- the pipelined sender: a queue of frames shared by the posting thread and one helper ---- */

typedef struct {
    item_t it;
    PyObject *body; /* held until collect() */
} job_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER; /* a job was posted */
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER; /* every posted job finished */
static job_t *jobs;                                         /* [posted], grown by post() */
static Py_ssize_t cap, posted, taken, finished;             /* taken: handed to a sender */
static int helper_sleeping;                                 /* in cond_wait: a post must signal */
static pid_t helper_pid;                                    /* the process whose helper runs; 0: none */

/* Jobs a sender takes at once: one lock round trip for up to this many sends, few enough that
 * the helper and collect()'s caller still share a round's last ones. */
#define TAKE_MAX 8

/* Sends jobs until none is left to take. Called and returns with mu held; the sends run without it. */
static void take_jobs(void) {
    item_t local[TAKE_MAX]; /* copies: post() may move the array meanwhile */
    while (taken < posted) {
        Py_ssize_t first = taken, n = posted - taken;
        if (n > TAKE_MAX) n = TAKE_MAX;
        taken += n;
        for (Py_ssize_t k = 0; k < n; k++) local[k] = jobs[first + k].it;
        pthread_mutex_unlock(&mu);
        for (Py_ssize_t k = 0; k < n; k++) local[k].sent = send_one(&local[k]);
        pthread_mutex_lock(&mu);
        for (Py_ssize_t k = 0; k < n; k++) {
            jobs[first + k].it.frame = local[k].frame;
            jobs[first + k].it.sent = local[k].sent;
        }
        finished += n;
        if (finished == posted) pthread_cond_signal(&done_cv);
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        take_jobs();
        /* No polling for the next piece: on a machine with few cores a polling helper takes the
         * core the readers of its sockets need (measured: docs/results/bench-router.md). */
        helper_sleeping = 1;
        while (taken == posted) pthread_cond_wait(&work_cv, &mu);
        helper_sleeping = 0;
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* The helper thread did not survive the fork; the queue's locks may have been held by it. */
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&work_cv, NULL);
    pthread_cond_init(&done_cv, NULL);
    helper_pid = 0;
}

static void start_helper(void) {
    pthread_t t;
    pthread_attr_t attr;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* the helper inherits it: signals go to Python's threads */
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, helper_main, NULL) == 0) helper_pid = getpid();
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static PyObject *post(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fds, *bodies;
    int wake = 1;
    if (!PyArg_ParseTuple(args, "O!O!|p", &PyList_Type, &fds, &PyList_Type, &bodies, &wake)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(fds);
    if (PyList_GET_SIZE(bodies) != n) {
        PyErr_SetString(PyExc_ValueError, "fds and bodies differ in length");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) { /* check everything before queueing anything */
        if (!PyBytes_Check(PyList_GET_ITEM(bodies, k))) {
            PyErr_SetString(PyExc_TypeError, "bodies must be bytes");
            return NULL;
        }
        long fd = PyLong_AsLong(PyList_GET_ITEM(fds, k));
        if (fd == -1 && PyErr_Occurred()) return NULL;
    }
    if (wake && helper_pid != getpid()) start_helper(); /* first use, or a forked child */
    pthread_mutex_lock(&mu);
    if (posted + n > cap) {
        Py_ssize_t want = cap ? cap : 64;
        while (want < posted + n) want *= 2;
        job_t *grown = PyMem_RawRealloc(jobs, sizeof(job_t) * (size_t)want);
        if (grown == NULL) {
            pthread_mutex_unlock(&mu);
            return PyErr_NoMemory();
        }
        jobs = grown;
        cap = want;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *b = PyList_GET_ITEM(bodies, k);
        job_t *j = &jobs[posted + k];
        Py_INCREF(b);
        j->body = b;
        j->it.fd = (int)PyLong_AsLong(PyList_GET_ITEM(fds, k));
        j->it.buf = PyBytes_AS_STRING(b);
        j->it.len = PyBytes_GET_SIZE(b);
        j->it.frame = -1;
        j->it.sent = 0;
    }
    posted += n;
    int sleeping = helper_sleeping;
    pthread_mutex_unlock(&mu);
    /* A helper still sending takes them without a wake-up. */
    if (n && wake && sleeping) pthread_cond_signal(&work_cv);
    Py_RETURN_NONE;
}

static PyObject *collect(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mu);
    take_jobs(); /* what the helper has not taken yet, sent from here too */
    while (finished < posted) pthread_cond_wait(&done_cv, &mu);
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    /* The helper waits for posts now, and only this thread (holding the GIL) posts. */
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; i < posted; i++) {
        if (out != NULL && jobs[i].it.sent != jobs[i].it.frame) {
            PyObject *v = Py_BuildValue("(nn)", i, jobs[i].it.sent);
            if (v == NULL || PyList_Append(out, v) < 0) Py_CLEAR(out);
            Py_XDECREF(v);
        }
        Py_DECREF(jobs[i].body);
    }
    pthread_mutex_lock(&mu);
    posted = taken = finished = 0;
    pthread_mutex_unlock(&mu);
    return out;
}

static PyMethodDef methods[] = {
    {"send_chunks", send_chunks, METH_VARARGS, "Send one HTTP/1.1 chunk to each socket; (index, sent or -errno) of those not fully sent."},
    {"post", post, METH_VARARGS, "Queue one HTTP/1.1 chunk for each socket; with wake (default), the helper thread starts sending them."},
    {"collect", collect, METH_NOARGS, "Send what is still queued, wait for every posted chunk; (index, sent or -errno) of those not fully sent."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pdserve_sse_fanout", NULL, -1, methods};

PyMODINIT_FUNC PyInit_pdserve_sse_fanout(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
    return PyModule_Create(&module);
}
