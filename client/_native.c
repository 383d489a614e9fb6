/* The native path of the messages every rendezvous round brings (client/_wire.py and
 * client/_session.py use it when it was built):
 *   decode_rendezvous     a serialized RendezvousRequest in the parallel-lists form, as the
 *                         tuple client/_wire.py's decode_rendezvous returns;
 *   decode_session_calls  a serialized SessionRequest's calls as (id, method, request, cancel);
 *   encode_answers        session answers as a SessionResponse (_session.py's encode_answers);
 *   decode_answers        a serialized SessionResponse's answers as (id, code, message, response);
 *   encode_call           one call as a serialized SessionRequest (_session.py's session_request);
 *   encode_rendezvous     a RendezvousRequest of rows, serialized (_wire.py's encode_rendezvous);
 *   decode_payloads / encode_payloads   a RendezvousResponse's payloads.
 * Each spares the Python of building a protobuf object and reading its fields one by one
 * (most of a small round's parsing cost), or of joining an answer's pieces.
 *
 * The decoders decide nothing: a message they do not take as it is (not well-formed, a form
 * they do not read, lists that do not fit together) gives None, and the caller parses it
 * again with protobuf, which names what is wrong. So they may refuse more than protobuf
 * does, never less, and what they accept they decode as protobuf would (tests/test_native.py
 * compares the two).
 *
 * INTERFACE counts the changes of these functions' arguments and results: client/_session.py
 * takes the module only if its count is the one it was written for (an editable install
 * keeps the module built before a checkout changed this file).
 */
#define INTERFACE 2
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

/* A field's key: 0, or -1 when it is cut off, longer than five bytes (protobuf refuses
 * those), or names field 0 or one past MAX_FIELD (all left to protobuf). */
static int read_key(Reader *r, uint64_t *key) {
    const uint8_t *start = r->p;
    if (read_varint(r, key) < 0 || r->p - start > 5 || *key >> 3 == 0 || *key >> 3 > MAX_FIELD) return -1;
    return 0;
}

/* A length-delimited field's bytes: 0, or -1 if they run past the end or their length
 * takes more than five bytes or 31 bits (protobuf refuses those; a fuzzer's find). */
static int read_span(Reader *r, Span *out) {
    const uint8_t *start = r->p;
    uint64_t n;
    if (read_varint(r, &n) < 0 || r->p - start > 5 || n > INT32_MAX || n > (uint64_t)(r->end - r->p)) return -1;
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
        if (read_key(r, &key) < 0) return 0;
        int field = (int)(key >> 3), wt = (int)(key & 7), rc = 0;
        Span span;
        switch (field) {
        case F_JOB: case F_INCARNATION: case F_TAGS: case F_PAYLOADS: case F_INCARNATIONS: case F_PROCESSES:
            if (wt != WT_LEN || read_span(r, &span) < 0) return 0;
            /* A string given twice: protobuf checks every copy's UTF-8, so it reads those. */
            if (field == F_JOB) { if (q->job.data) return 0; q->job = span; }
            else if (field == F_INCARNATION) { if (q->incarnation.data) return 0; q->incarnation = span; }
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

/* A varint into out (room for ten bytes); returns its length. */
static Py_ssize_t put_varint(uint8_t *out, uint64_t x) {
    Py_ssize_t n = 0;
    for (; x > 0x7F; x >>= 7) out[n++] = (uint8_t)((x & 0x7F) | 0x80);
    out[n++] = (uint8_t)x;
    return n;
}

/* A small message of fields 1 to 4, each a varint or length-delimited as wire_types says
 * (others skipped): 1 read, 0 not taken. A varint given twice: the last one counts; a
 * length-delimited field given twice is left to protobuf (it checks each copy of a string's
 * UTF-8). */
static int four_fields(Span body, const int wire_types[5], uint64_t values[5], Span spans[5]) {
    Reader r = {body.data, body.data + body.size};
    unsigned seen = 0;  /* the length-delimited fields read */
    for (int f = 1; f <= 4; f++) { values[f] = 0; spans[f].data = r.p; spans[f].size = 0; }
    while (r.p < r.end) {
        uint64_t key;
        if (read_key(&r, &key) < 0) return 0;
        int field = (int)(key >> 3), wt = (int)(key & 7);
        if (field > 4) {
            if (skip(&r, wt) < 0) return 0;
        } else if (wt != wire_types[field] || (wt == WT_LEN && seen & 1u << field)
                   || (wt == WT_VARINT ? read_varint(&r, &values[field]) : read_span(&r, &spans[field])) < 0) {
            return 0;
        }
        if (wt == WT_LEN && field <= 4) seen |= 1u << field;  /* (not an unknown field's: 1u << 32 is undefined) */
    }
    return 1;
}

/* 1 when *out is made, 0 for text that is not UTF-8 (protobuf names it), -1 on an error. */
static int made(PyObject *out) {
    if (out != NULL) return 1;
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return -1;
    PyErr_Clear();
    return 0;
}

/* A SessionCall (id = 1, method = 2, request = 3, cancel = 4) as (id, method, request, cancel). */
static int session_call(Span body, PyObject **out) {
    static const int wire_types[5] = {-1, WT_VARINT, WT_LEN, WT_LEN, WT_VARINT};
    uint64_t v[5];
    Span s[5];
    if (!four_fields(body, wire_types, v, s)) return 0;
    PyObject *method = text(s[2]);
    *out = method ? Py_BuildValue("(KNy#O)", (unsigned long long)v[1], method, (const char *)s[3].data, s[3].size,
                                  v[4] ? Py_True : Py_False) : NULL;
    return made(*out);
}

/* A SessionAnswer (id = 1, code = 2, message = 3, response = 4) as (id, code, message, response). */
static int session_answer(Span body, PyObject **out) {
    static const int wire_types[5] = {-1, WT_VARINT, WT_VARINT, WT_LEN, WT_LEN};
    uint64_t v[5];
    Span s[5];
    if (!four_fields(body, wire_types, v, s)) return 0;
    PyObject *message = text(s[3]);
    *out = message ? Py_BuildValue("(KiNy#)", (unsigned long long)v[1], (int)(int32_t)(uint32_t)v[2], message,
                                   (const char *)s[4].data, s[4].size) : NULL;
    return made(*out);
}

/* encode_answers_in_python in client/_session.py: (answer without response, response) pairs as a
 * serialized SessionResponse, with framed behind its four-byte big-endian length. */
static PyObject *encode_answers(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *answers;
    int framed;
    if (!PyArg_ParseTuple(args, "O!p", &PyList_Type, &answers, &framed)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(answers), size = framed ? 4 : 0;
    uint8_t scratch[10];
    for (Py_ssize_t i = 0; i < count; i++) {  /* the size first, then one copy */
        PyObject *pair = PyList_GET_ITEM(answers, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(pair, 0))
            || !PyBytes_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_SetString(PyExc_TypeError, "answers must be (bytes, bytes) pairs");
            return NULL;
        }
        Py_ssize_t head = PyBytes_GET_SIZE(PyTuple_GET_ITEM(pair, 0)), body = PyBytes_GET_SIZE(PyTuple_GET_ITEM(pair, 1));
        Py_ssize_t answer = head + (body ? 1 + put_varint(scratch, (uint64_t)body) + body : 0);
        size += 1 + put_varint(scratch, (uint64_t)answer) + answer;
    }
    if (framed && (uint64_t)size - 4 > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a session message over 4 GiB");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL) return NULL;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    if (framed) {
        uint32_t length = (uint32_t)(size - 4);
        *p++ = (uint8_t)(length >> 24); *p++ = (uint8_t)(length >> 16); *p++ = (uint8_t)(length >> 8); *p++ = (uint8_t)length;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyList_GET_ITEM(answers, i), *head = PyTuple_GET_ITEM(pair, 0), *body = PyTuple_GET_ITEM(pair, 1);
        Py_ssize_t h = PyBytes_GET_SIZE(head), b = PyBytes_GET_SIZE(body);
        Py_ssize_t answer = h + (b ? 1 + put_varint(scratch, (uint64_t)b) + b : 0);
        *p++ = 0x0A;  /* SessionResponse.answers: field 1, length-delimited */
        p += put_varint(p, (uint64_t)answer);
        memcpy(p, PyBytes_AS_STRING(head), (size_t)h);
        p += h;
        if (b) {
            *p++ = 0x22;  /* SessionAnswer.response: field 4, length-delimited */
            p += put_varint(p, (uint64_t)b);
            memcpy(p, PyBytes_AS_STRING(body), (size_t)b);
            p += b;
        }
    }
    return out;
}

/* The bodies of a message's field 1 (a repeated message or bytes field) as a list, each
 * made by one(): a list, None (not taken), or NULL with an exception set. */
static PyObject *repeated_field_1(PyObject *arg, int (*one)(Span, PyObject **)) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Reader r = {view.buf, (const uint8_t *)view.buf + view.len};
    PyObject *items = PyList_New(0);
    int taken = items != NULL ? 1 : -1;
    while (taken > 0 && r.p < r.end) {
        uint64_t key;
        Span body;
        PyObject *item = NULL;
        if (read_key(&r, &key) < 0) taken = 0;
        else if (key >> 3 != 1) taken = skip(&r, (int)(key & 7)) < 0 ? 0 : 1;
        else if ((key & 7) != WT_LEN || read_span(&r, &body) < 0) taken = 0;
        else if ((taken = one(body, &item)) > 0) {
            taken = PyList_Append(items, item) < 0 ? -1 : 1;
            Py_DECREF(item);
        }
    }
    PyBuffer_Release(&view);
    if (taken > 0) return items;
    Py_XDECREF(items);
    return taken < 0 ? NULL : Py_NewRef(Py_None);
}

static int bytes_item(Span body, PyObject **out) {
    *out = PyBytes_FromStringAndSize((const char *)body.data, body.size);
    return *out != NULL ? 1 : -1;
}

static PyObject *decode_session_calls(PyObject *Py_UNUSED(module), PyObject *arg) {
    return repeated_field_1(arg, session_call);
}

static PyObject *decode_answers(PyObject *Py_UNUSED(module), PyObject *arg) {
    return repeated_field_1(arg, session_answer);
}

static PyObject *decode_payloads(PyObject *Py_UNUSED(module), PyObject *arg) {
    return repeated_field_1(arg, bytes_item);
}

/* session_request in client/_session.py: one SessionCall as a serialized SessionRequest,
 * with framed behind its four-byte big-endian length. */
static PyObject *encode_call(PyObject *Py_UNUSED(module), PyObject *args) {
    unsigned long long id;
    const char *method, *request;
    Py_ssize_t method_size, request_size;
    int cancel, framed;
    if (!PyArg_ParseTuple(args, "Ks#y#pp", &id, &method, &method_size, &request, &request_size, &cancel, &framed))
        return NULL;
    uint8_t scratch[10];
    Py_ssize_t call = (id ? 1 + put_varint(scratch, id) : 0)
                    + (method_size ? 1 + put_varint(scratch, (uint64_t)method_size) + method_size : 0)
                    + (request_size ? 1 + put_varint(scratch, (uint64_t)request_size) + request_size : 0)
                    + (cancel ? 2 : 0);
    Py_ssize_t message = 1 + put_varint(scratch, (uint64_t)call) + call;
    if (framed && (uint64_t)message > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a session message over 4 GiB");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, message + (framed ? 4 : 0));
    if (out == NULL) return NULL;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    if (framed) {
        *p++ = (uint8_t)(message >> 24); *p++ = (uint8_t)(message >> 16); *p++ = (uint8_t)(message >> 8); *p++ = (uint8_t)message;
    }
    *p++ = 0x0A;  /* SessionRequest.calls: field 1, length-delimited */
    p += put_varint(p, (uint64_t)call);
    if (id) { *p++ = 0x08; p += put_varint(p, id); }  /* id: field 1, varint */
    if (method_size) {  /* method: field 2, length-delimited */
        *p++ = 0x12; p += put_varint(p, (uint64_t)method_size); memcpy(p, method, (size_t)method_size); p += method_size;
    }
    if (request_size) {  /* request: field 3, length-delimited */
        *p++ = 0x1A; p += put_varint(p, (uint64_t)request_size); memcpy(p, request, (size_t)request_size); p += request_size;
    }
    if (cancel) { *p++ = 0x20; *p++ = 0x01; }  /* cancel: field 4, varint, true */
    return out;
}

/* A RendezvousResponse of the payloads (a sequence of bytes): field 1, each length-delimited. */
static PyObject *encode_payloads(PyObject *Py_UNUSED(module), PyObject *arg) {
    PyObject *payloads = PySequence_Fast(arg, "payloads must be a sequence of bytes");
    if (payloads == NULL) return NULL;
    uint8_t scratch[10];
    Py_ssize_t count = PySequence_Fast_GET_SIZE(payloads), size = 0;
    PyObject **items = PySequence_Fast_ITEMS(payloads), *out = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyBytes_Check(items[i])) {
            PyErr_SetString(PyExc_TypeError, "payloads must be a sequence of bytes");
            goto done;
        }
        size += 1 + put_varint(scratch, (uint64_t)PyBytes_GET_SIZE(items[i])) + PyBytes_GET_SIZE(items[i]);
    }
    if ((out = PyBytes_FromStringAndSize(NULL, size)) == NULL) goto done;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        *p++ = 0x0A;  /* RendezvousResponse.payloads: field 1, length-delimited */
        p += put_varint(p, (uint64_t)PyBytes_GET_SIZE(items[i]));
        memcpy(p, PyBytes_AS_STRING(items[i]), (size_t)PyBytes_GET_SIZE(items[i]));
        p += PyBytes_GET_SIZE(items[i]);
    }
done:
    Py_DECREF(payloads);
    return out;
}

/* An output buffer that grows; NULL data after a failed allocation (MemoryError set). */
typedef struct { uint8_t *data; Py_ssize_t size, cap; } Out;

static int out_room(Out *o, Py_ssize_t more) {
    if (o->size + more <= o->cap) return 0;
    Py_ssize_t cap = (o->cap + more) * 2;
    uint8_t *data = PyMem_Realloc(o->data, (size_t)cap);
    if (data == NULL) { PyErr_NoMemory(); return -1; }
    o->data = data;
    o->cap = cap;
    return 0;
}
static int out_varint(Out *o, uint64_t x) {
    if (out_room(o, 10) < 0) return -1;
    o->size += put_varint(o->data + o->size, x);
    return 0;
}
static int out_bytes(Out *o, int field, const char *data, Py_ssize_t size) {  /* length-delimited */
    if (out_varint(o, (uint64_t)field << 3 | WT_LEN) < 0 || out_varint(o, (uint64_t)size) < 0 || out_room(o, size) < 0) return -1;
    memcpy(o->data + o->size, data, (size_t)size);
    o->size += size;
    return 0;
}
static int out_text(Out *o, int field, PyObject *text) {
    Py_ssize_t size;
    const char *data = PyUnicode_AsUTF8AndSize(text, &size);
    return data == NULL ? -1 : out_bytes(o, field, data, size);
}
/* A packed repeated int32 field of the items' values (as protobuf encodes them: a negative
 * one as ten bytes). */
static int out_packed(Out *o, int field, PyObject *const *items, Py_ssize_t count) {
    if (count == 0) return 0;
    Out body = {NULL, 0, 0};
    for (Py_ssize_t i = 0; i < count; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if ((v == -1 && PyErr_Occurred()) || v < INT32_MIN || v > INT32_MAX) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a value out of its field's range");
            PyMem_Free(body.data);
            return -1;
        }
        if (out_varint(&body, (uint64_t)(int64_t)v) < 0) { PyMem_Free(body.data); return -1; }
    }
    int rc = out_bytes(o, field, (const char *)body.data, body.size);
    PyMem_Free(body.data);
    return rc;
}

/* set_contribution_rows in client/_wire.py (incarnations unindexed: a client's rows carry
 * none, a relay's go through protobuf) and protobuf's serialization in one: a
 * RendezvousRequest of the rows (ordinal, tag, payload, incarnation), each list as short as
 * the form allows, its fields in number order as protobuf writes them. */
static PyObject *encode_rendezvous(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *job, *incarnation, *replicas_arg, *timeout, *rows_arg;
    long long round, generation;
    if (!PyArg_ParseTuple(args, "UUOLOLO", &job, &incarnation, &replicas_arg, &round, &timeout, &generation, &rows_arg))
        return NULL;
    /* A tuple of our own: PySequence_Fast would hand back the caller's list, which an item's
     * __index__ (called by out_packed) could change under us. */
    PyObject *replicas = PySequence_Tuple(replicas_arg);
    PyObject *rows = replicas ? PySequence_Fast(rows_arg, "rows must be a sequence") : NULL;
    PyObject *columns[4] = {NULL, NULL, NULL, NULL}, *out = NULL;
    Out o = {NULL, 0, 0};
    if (rows == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(rows);
    if (n == 0) { PyErr_SetString(PyExc_ValueError, "at least one row"); goto done; }
    for (int c = 0; c < 4; c++) if ((columns[c] = PyList_New(n)) == NULL) goto done;
    int same_tag = 1, any_payload = 0, any_incarnation = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PySequence_Fast_GET_ITEM(rows, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 4 || !PyLong_Check(PyTuple_GET_ITEM(row, 0))
            || !PyUnicode_Check(PyTuple_GET_ITEM(row, 1)) || !PyBytes_Check(PyTuple_GET_ITEM(row, 2))
            || !PyUnicode_Check(PyTuple_GET_ITEM(row, 3))) {
            PyErr_SetString(PyExc_TypeError, "rows must be (int, str, bytes, str) tuples");
            goto done;
        }
        for (int c = 0; c < 4; c++) PyList_SET_ITEM(columns[c], i, Py_NewRef(PyTuple_GET_ITEM(row, c)));
        if (i && same_tag) {
            int eq = PyUnicode_Compare(PyTuple_GET_ITEM(row, 1), PyList_GET_ITEM(columns[1], 0));
            if (eq == -1 && PyErr_Occurred()) goto done;
            same_tag = eq == 0;
        }
        any_payload |= PyBytes_GET_SIZE(PyTuple_GET_ITEM(row, 2)) > 0;
        any_incarnation |= PyUnicode_GET_LENGTH(PyTuple_GET_ITEM(row, 3)) > 0;
    }
    PyObject *const *ordinals = PySequence_Fast_ITEMS(columns[0]), *const *tags = PySequence_Fast_ITEMS(columns[1]);
    PyObject *const *payloads = PySequence_Fast_ITEMS(columns[2]), *const *incarnations = PySequence_Fast_ITEMS(columns[3]);
    if ((PyUnicode_GET_LENGTH(job) && out_text(&o, F_JOB, job) < 0)
        || (PyUnicode_GET_LENGTH(incarnation) && out_text(&o, F_INCARNATION, incarnation) < 0)
        || out_packed(&o, F_REPLICAS, PySequence_Fast_ITEMS(replicas), PySequence_Fast_GET_SIZE(replicas)) < 0
        || (round && (out_varint(&o, F_ROUND << 3 | WT_VARINT) < 0 || out_varint(&o, (uint64_t)round) < 0)))
        goto done;
    if (timeout != Py_None) {
        double t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred()) goto done;
        uint64_t bits;
        memcpy(&bits, &t, sizeof bits);
        if (out_varint(&o, F_TIMEOUT << 3 | WT_I64) < 0 || out_room(&o, 8) < 0) goto done;
        for (int i = 0; i < 8; i++) o.data[o.size++] = (uint8_t)(bits >> (8 * i));  /* little-endian */
    }
    if ((generation && (out_varint(&o, F_GENERATION << 3 | WT_VARINT) < 0 || out_varint(&o, (uint64_t)generation) < 0))
        || out_packed(&o, F_ORDINALS, ordinals, n) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < (same_tag ? 1 : n); i++)
        if (out_text(&o, F_TAGS, tags[i]) < 0) goto done;
    for (Py_ssize_t i = 0; any_payload && i < n; i++)
        if (out_bytes(&o, F_PAYLOADS, PyBytes_AS_STRING(payloads[i]), PyBytes_GET_SIZE(payloads[i])) < 0) goto done;
    for (Py_ssize_t i = 0; any_incarnation && i < n; i++)
        if (out_text(&o, F_INCARNATIONS, incarnations[i]) < 0) goto done;
    out = PyBytes_FromStringAndSize((const char *)o.data, o.size);
done:
    PyMem_Free(o.data);
    Py_XDECREF(replicas); Py_XDECREF(rows);
    for (int c = 0; c < 4; c++) Py_XDECREF(columns[c]);
    return out;
}

static PyMethodDef methods[] = {
    {"decode_rendezvous", decode_rendezvous, METH_O,
     "decode_rendezvous(data) -> (job, incarnation, replicas, round, timeout, generation, rows) or None\n\n"
     "A serialized RendezvousRequest in the parallel-lists form, decoded; None when protobuf\n"
     "must read it (see client/_wire.py)."},
    {"decode_session_calls", decode_session_calls, METH_O,
     "decode_session_calls(data) -> [(id, method, request, cancel), ...] or None\n\n"
     "A serialized SessionRequest's calls; None when protobuf must read it."},
    {"decode_answers", decode_answers, METH_O,
     "decode_answers(data) -> [(id, code, message, response), ...] or None\n\n"
     "A serialized SessionResponse's answers; None when protobuf must read it."},
    {"decode_payloads", decode_payloads, METH_O,
     "decode_payloads(data) -> [bytes, ...] or None: a serialized RendezvousResponse's payloads."},
    {"encode_payloads", encode_payloads, METH_O,
     "encode_payloads(payloads) -> bytes: a RendezvousResponse of the payloads, serialized."},
    {"encode_rendezvous", encode_rendezvous, METH_VARARGS,
     "encode_rendezvous(job, incarnation, replicas, round, timeout, generation, rows) -> bytes\n\n"
     "A serialized RendezvousRequest of the rows, as set_contribution_rows and protobuf make it."},
    {"encode_call", encode_call, METH_VARARGS,
     "encode_call(id, method, request, cancel, framed) -> bytes: session_request in client/_session.py."},
    {"encode_answers", encode_answers, METH_VARARGS,
     "encode_answers(answers, framed) -> bytes: encode_answers_in_python in client/_session.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pjrt_rendezvous.client._native",
    "The native path of client/_wire.py and client/_session.py (built when a C compiler is at hand).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "INTERFACE", INTERFACE) < 0) Py_CLEAR(m);
    return m;
}
