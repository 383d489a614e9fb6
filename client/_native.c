/* The native path for the one message every rendezvous round brings to the coordinator (and
 * to a host relay): a serialized RendezvousRequest in the parallel-lists form, decoded into
 * the tuple client/_wire.py's decode_rendezvous returns, without building a protobuf object
 * and reading its fields one by one (most of a small round's parsing cost in Python).
 *
 * It decides nothing: a message it does not take as it is (not well-formed, a form it does
 * not read, lists that do not fit together) gives None, and the caller parses it again with
 * protobuf, which names what is wrong. So it may refuse more than protobuf does, never less,
 * and what it accepts it decodes as protobuf would (tests/test_native.py compares the two).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* RendezvousRequest's field numbers (protos/pjrt_rendezvous/v1/coordinator.proto). */
enum {
    F_JOB = 1, F_INCARNATION = 2, F_REPLICAS = 3, F_ROUND = 4, F_CONTRIBUTIONS = 5,
    F_TIMEOUT = 6, F_GENERATION = 7, F_ORDINALS = 8, F_TAGS = 9, F_PAYLOADS = 10,
    F_INCARNATIONS = 11, F_PROCESSES = 12, F_PROCESS_INDEXES = 13,
};
#define MAX_FIELD ((1u << 29) - 1)  /* protobuf's largest field number */
enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_I32 = 5 };

typedef struct { const uint8_t *p, *end; } Reader;

/* A growable array of integers or of byte spans; the first few need no allocation. */
typedef struct { const uint8_t *data; Py_ssize_t size; } Span;
#define INLINE 16
typedef struct { int64_t *v; Py_ssize_t n, cap; int64_t inline_v[INLINE]; } Ints;
typedef struct { Span *v; Py_ssize_t n, cap; Span inline_v[INLINE]; } Spans;

static void ints_init(Ints *a) { a->v = a->inline_v; a->n = 0; a->cap = INLINE; }
static void spans_init(Spans *a) { a->v = a->inline_v; a->n = 0; a->cap = INLINE; }
static void ints_free(Ints *a) { if (a->v != a->inline_v) PyMem_Free(a->v); }
static void spans_free(Spans *a) { if (a->v != a->inline_v) PyMem_Free(a->v); }

/* Room for one more element: 0, or -1 with MemoryError set. */
static int grow(void **v, void *inline_v, Py_ssize_t *cap, size_t item) {
    Py_ssize_t cap2 = *cap * 2;
    void *v2 = PyMem_Malloc((size_t)cap2 * item);
    if (v2 == NULL) { PyErr_NoMemory(); return -1; }
    memcpy(v2, *v, (size_t)*cap * item);
    if (*v != inline_v) PyMem_Free(*v);
    *v = v2;
    *cap = cap2;
    return 0;
}
static int ints_push(Ints *a, int64_t x) {
    if (a->n == a->cap && grow((void **)&a->v, a->inline_v, &a->cap, sizeof *a->v) < 0) return -1;
    a->v[a->n++] = x;
    return 0;
}
static int spans_push(Spans *a, Span s) {
    if (a->n == a->cap && grow((void **)&a->v, a->inline_v, &a->cap, sizeof *a->v) < 0) return -1;
    a->v[a->n++] = s;
    return 0;
}

/* 0, or -1 for a varint that is cut off or longer than ten bytes. */
static int read_varint(Reader *r, uint64_t *out) {
    uint64_t x = 0;
    for (int shift = 0; shift < 70 && r->p < r->end; shift += 7) {
        uint8_t b = *r->p++;
        x |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) { *out = x; return 0; }
    }
    return -1;
}

/* A length-delimited field's bytes: 0, or -1 if they run past the end. */
static int read_span(Reader *r, Span *out) {
    uint64_t n;
    if (read_varint(r, &n) < 0 || n > (uint64_t)(r->end - r->p)) return -1;
    out->data = r->p;
    out->size = (Py_ssize_t)n;
    r->p += n;
    return 0;
}

/* Skips an unknown field: 0, or -1 for groups (never ours) and bad wire types. */
static int skip(Reader *r, int wire_type) {
    uint64_t ignored;
    Span span;
    switch (wire_type) {
    case WT_VARINT: return read_varint(r, &ignored);
    case WT_I64: if (r->end - r->p < 8) return -1; r->p += 8; return 0;
    case WT_LEN: return read_span(r, &span);
    case WT_I32: if (r->end - r->p < 4) return -1; r->p += 4; return 0;
    default: return -1;
    }
}

/* A repeated integer field, one value (WT_VARINT) or packed (WT_LEN): 0, -1 malformed,
 * -2 with an exception set. Values are kept as their 64 bits; the caller narrows them. */
static int read_ints(Reader *r, int wire_type, Ints *out) {
    uint64_t x;
    if (wire_type == WT_VARINT) {
        if (read_varint(r, &x) < 0) return -1;
        return ints_push(out, (int64_t)x) < 0 ? -2 : 0;
    }
    if (wire_type != WT_LEN) return -1;
    Span packed;
    if (read_span(r, &packed) < 0) return -1;
    Reader inner = {packed.data, packed.data + packed.size};
    while (inner.p < inner.end) {
        if (read_varint(&inner, &x) < 0) return -1;
        if (ints_push(out, (int64_t)x) < 0) return -2;
    }
    return 0;
}

static PyObject *text(Span s) {  /* a str, or NULL with an exception set (bad UTF-8 too) */
    return PyUnicode_DecodeUTF8((const char *)s.data, s.size, NULL);
}

/* A list of the spans as str (or bytes), or NULL with an exception set. */
static PyObject *objects(const Spans *spans, int as_text) {
    PyObject *list = PyList_New(spans->n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < spans->n; i++) {
        Span s = spans->v[i];
        PyObject *item = as_text ? text(s) : PyBytes_FromStringAndSize((const char *)s.data, s.size);
        if (item == NULL) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

typedef struct {
    Span job, incarnation;
    int has_timeout;
    double timeout;
    int64_t round, generation;
    Ints replicas, ordinals, process_indexes;
    Spans tags, payloads, incarnations, processes;
} Request;

/* Reads every field: 1 taken, 0 not taken (None to the caller), -1 with an exception set. */
static int scan(Reader *r, Request *q) {
    while (r->p < r->end) {
        uint64_t key, x;
        if (read_varint(r, &key) < 0 || key >> 3 == 0 || key >> 3 > MAX_FIELD) return 0;
        int field = (int)(key >> 3), wt = (int)(key & 7), rc = 0;
        Span span;
        switch (field) {
        case F_JOB: case F_INCARNATION: case F_TAGS: case F_PAYLOADS: case F_INCARNATIONS: case F_PROCESSES:
            if (wt != WT_LEN || read_span(r, &span) < 0) return 0;
            if (field == F_JOB) q->job = span;  /* a scalar given twice: the last one counts */
            else if (field == F_INCARNATION) q->incarnation = span;
            else {
                Spans *list = field == F_TAGS ? &q->tags : field == F_PAYLOADS ? &q->payloads
                            : field == F_INCARNATIONS ? &q->incarnations : &q->processes;
                if (spans_push(list, span) < 0) return -1;
            }
            break;
        case F_ROUND: case F_GENERATION:
            if (wt != WT_VARINT || read_varint(r, &x) < 0) return 0;
            *(field == F_ROUND ? &q->round : &q->generation) = (int64_t)x;
            break;
        case F_TIMEOUT:
            if (wt != WT_I64 || r->end - r->p < 8) return 0;
            x = 0;
            for (int i = 7; i >= 0; i--) x = x << 8 | r->p[i];  /* little-endian on the wire */
            memcpy(&q->timeout, &x, sizeof q->timeout);
            q->has_timeout = 1;
            r->p += 8;
            break;
        case F_REPLICAS: case F_ORDINALS: case F_PROCESS_INDEXES:
            rc = read_ints(r, wt, field == F_REPLICAS ? &q->replicas : field == F_ORDINALS ? &q->ordinals : &q->process_indexes);
            if (rc == -2) return -1;
            if (rc < 0) return 0;
            break;
        case F_CONTRIBUTIONS:
            return 0;  /* the Contribution-message form: protobuf reads it */
        default:
            if (skip(r, wt) < 0) return 0;
        }
    }
    return 1;
}

/* The contributions as (ordinal, tag, payload, incarnation) rows, as contribution_rows in
 * client/_wire.py makes them: NULL with no exception when the lists do not fit together. */
static PyObject *rows(const Request *q, PyObject *tags, PyObject *payloads, PyObject *incarnations, PyObject *processes) {
    Py_ssize_t n = q->ordinals.n;
    if (n == 0 || (PyList_GET_SIZE(tags) != n && PyList_GET_SIZE(tags) != 1)
        || (PyList_GET_SIZE(payloads) != n && PyList_GET_SIZE(payloads) != 0))
        return NULL;
    if (q->process_indexes.n) {
        if (PyList_GET_SIZE(incarnations) != 0 || q->process_indexes.n != n) return NULL;
        for (Py_ssize_t i = 0; i < n; i++)
            if ((uint32_t)q->process_indexes.v[i] >= (uint64_t)PyList_GET_SIZE(processes)) return NULL;
    } else if (PyList_GET_SIZE(incarnations) != n && PyList_GET_SIZE(incarnations) != 0) {
        return NULL;
    }
    PyObject *empty_text = PyUnicode_FromStringAndSize(NULL, 0), *empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
    PyObject *out = empty_text && empty_bytes ? PyList_New(n) : NULL;
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *ordinal = PyLong_FromLong((int32_t)(uint32_t)q->ordinals.v[i]);
        PyObject *tag = PyList_GET_ITEM(tags, PyList_GET_SIZE(tags) == 1 ? 0 : i);
        PyObject *payload = PyList_GET_SIZE(payloads) ? PyList_GET_ITEM(payloads, i) : empty_bytes;
        PyObject *named = q->process_indexes.n ? PyList_GET_ITEM(processes, (uint32_t)q->process_indexes.v[i])
                        : PyList_GET_SIZE(incarnations) ? PyList_GET_ITEM(incarnations, i) : empty_text;
        PyObject *row = ordinal ? PyTuple_Pack(4, ordinal, tag, payload, named) : NULL;
        Py_XDECREF(ordinal);
        if (row == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, row);
    }
    Py_XDECREF(empty_text);
    Py_XDECREF(empty_bytes);
    return out;
}

static PyObject *decode_rendezvous(PyObject *Py_UNUSED(module), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Request q;
    memset(&q, 0, sizeof q);
    ints_init(&q.replicas); ints_init(&q.ordinals); ints_init(&q.process_indexes);
    spans_init(&q.tags); spans_init(&q.payloads); spans_init(&q.incarnations); spans_init(&q.processes);
    Reader r = {view.buf, (const uint8_t *)view.buf + view.len};
    PyObject *result = NULL, *job = NULL, *incarnation = NULL, *replicas = NULL, *tags = NULL,
             *payloads = NULL, *incarnations = NULL, *processes = NULL, *contributions = NULL;
    int taken = scan(&r, &q);
    if (taken <= 0) goto done;
    /* the strings; a UnicodeDecodeError leaves the naming to protobuf */
    if (!(job = text(q.job)) || !(incarnation = text(q.incarnation)) || !(tags = objects(&q.tags, 1))
        || !(payloads = objects(&q.payloads, 0)) || !(incarnations = objects(&q.incarnations, 1))
        || !(processes = objects(&q.processes, 1))) {
        taken = PyErr_ExceptionMatches(PyExc_UnicodeDecodeError) ? 0 : -1;
        goto done;
    }
    if (!(replicas = PyList_New(q.replicas.n))) { taken = -1; goto done; }
    for (Py_ssize_t i = 0; i < q.replicas.n; i++) {
        PyObject *o = PyLong_FromLong((int32_t)(uint32_t)q.replicas.v[i]);
        if (o == NULL) { taken = -1; goto done; }
        PyList_SET_ITEM(replicas, i, o);
    }
    contributions = rows(&q, tags, payloads, incarnations, processes);
    if (contributions == NULL) { taken = PyErr_Occurred() ? -1 : 0; goto done; }
    result = Py_BuildValue("(NNNLNLN)", job, incarnation, replicas, (long long)q.round,
                           q.has_timeout ? PyFloat_FromDouble(q.timeout) : Py_NewRef(Py_None),
                           (long long)q.generation, contributions);
    job = incarnation = replicas = contributions = NULL;  /* "N": the tuple took them */
    if (result == NULL) taken = -1;
done:
    if (taken == 0) PyErr_Clear();  /* a UnicodeDecodeError: protobuf names it */
    if (taken < 0 && !PyErr_Occurred()) PyErr_NoMemory();
    Py_XDECREF(job); Py_XDECREF(incarnation); Py_XDECREF(replicas); Py_XDECREF(tags);
    Py_XDECREF(payloads); Py_XDECREF(incarnations); Py_XDECREF(processes); Py_XDECREF(contributions);
    ints_free(&q.replicas); ints_free(&q.ordinals); ints_free(&q.process_indexes);
    spans_free(&q.tags); spans_free(&q.payloads); spans_free(&q.incarnations); spans_free(&q.processes);
    PyBuffer_Release(&view);
    if (taken < 0) return NULL;
    return result != NULL ? result : Py_NewRef(Py_None);
}

static PyMethodDef methods[] = {
    {"decode_rendezvous", decode_rendezvous, METH_O,
     "decode_rendezvous(data) -> (job, incarnation, replicas, round, timeout, generation, rows) or None\n\n"
     "A serialized RendezvousRequest in the parallel-lists form, decoded; None when protobuf\n"
     "must read it (see client/_wire.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pjrt_rendezvous.client._native",
    "The native path of client/_wire.py (optional: built when a C compiler is at hand).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
