/* attnd._fast: the native transport's decode step in C, so that a Step of numpy arrays costs a
 * Python caller one call instead of the ~25 us of Python (in a decode loop, caches cold) that
 * attnd/_native.py spends on its arguments and answers; and the asyncio client's BatchSteps of
 * numpy arrays, started on the library's completion queue and read back in one call each.
 *
 * It calls attn_c_step, attn_c_batch_step_start and attn_c_step_start of libattn_client_c.so
 * through the pointers _native.py hands it (bind), so it links nothing but the interpreter. Built
 * against the stable ABI of Python 3.11 (the buffer protocol joined it then): one binary for every
 * CPython from 3.11 on; where it is missing or does not load, _native.py does the same work in
 * Python. */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "attn/client/c_api.h"

/* The library's functions are called through the pointers bind() is given: the header gives their
 * types and attn_c_step_item's layout, and nothing is linked. */
typedef __typeof__(attn_c_step)* StepFn;
typedef __typeof__(attn_c_batch_step_start)* BatchStartFn;
typedef __typeof__(attn_c_step_start)* StepStartFn;
typedef attn_c_step_item StepItem;

static StepFn step_fn = NULL;
static BatchStartFn batch_start_fn = NULL;
static StepStartFn step_start_fn = NULL;

enum { kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3, kFloat8 = 4 };

/* attn.v1's DType of a buffer's format as numpy exports it: float32, float16, uint16 (bfloat16
 * bits), uint8 (FP8 codes); 0 for anything else. */
static int32_t DTypeOfFormat(const char* f) {
  if (f == NULL) return 0;
  if (f[0] == '<' || f[0] == '=' || f[0] == '@') ++f;
  if (f[1] != '\0') return 0;
  switch (f[0]) {
    case 'f': return kFloat32;
    case 'e': return kFloat16;
    case 'H': return kBFloat16;
    case 'B': return kFloat8;
    default: return 0;
  }
}

static PyObject* Bind(PyObject* self, PyObject* args) {
  (void)self;
  unsigned long long step = 0, batch_start = 0, step_start = 0;
  if (!PyArg_ParseTuple(args, "K|KK", &step, &batch_start, &step_start)) return NULL;
  step_fn = (StepFn)(uintptr_t)step;
  batch_start_fn = (BatchStartFn)(uintptr_t)batch_start;
  step_start_fn = (StepStartFn)(uintptr_t)step_start;
  Py_RETURN_NONE;
}

/* step(handle, session_id, layer, q, k_new, v_new, scale, return_lse, window_left, window_right,
 *      timeout_ms)
 * -> (0, o bytes, lse bytes or None, cached_tokens, timing bytes) on success,
 *    (code, message) when the call failed,
 *    None when a tensor is not a C-contiguous buffer of 3 dimensions and a known dtype. */
static PyObject* Step(PyObject* self, PyObject* args) {
  (void)self;
  unsigned long long handle = 0;
  const char* session_id = NULL;
  int layer = 0, return_lse = 0, window_left = -1, window_right = -1;
  PyObject* arrays[3];
  float scale = 0.0f;
  long long timeout_ms = -1;
  if (!PyArg_ParseTuple(args, "KyiOOOfpiiL", &handle, &session_id, &layer, &arrays[0],
                        &arrays[1], &arrays[2], &scale, &return_lse, &window_left,
                        &window_right, &timeout_ms)) {
    return NULL;
  }
  if (step_fn == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "attnd._fast: bind() was not called");
    return NULL;
  }
  Py_buffer views[3];
  int32_t dtypes[3];
  int held = 0;
  PyObject* result = NULL;
  for (; held < 3; ++held) {
    if (PyObject_GetBuffer(arrays[held], &views[held], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();  /* not a buffer of this kind: the Python path takes it */
      result = Py_NewRef(Py_None);
      goto release;
    }
    dtypes[held] = DTypeOfFormat(views[held].format);
    if (views[held].ndim != 3 || dtypes[held] == 0) {
      ++held;
      result = Py_NewRef(Py_None);
      goto release;
    }
  }
  {
    const Py_ssize_t o_size = views[0].len;
    const Py_ssize_t lse_size = return_lse ? 4 * views[0].shape[0] * views[0].shape[1] : 0;
    PyObject* o = PyBytes_FromStringAndSize(NULL, o_size);
    PyObject* lse = return_lse ? PyBytes_FromStringAndSize(NULL, lse_size) : Py_NewRef(Py_None);
    if (o == NULL || lse == NULL) {
      Py_XDECREF(o);
      Py_XDECREF(lse);
      goto release;
    }
    char message[4096];
    char timing[512];
    size_t timing_size = 0;
    int64_t cached = 0;
    int code;
    const Py_ssize_t* s[3] = {views[0].shape, views[1].shape, views[2].shape};
    Py_BEGIN_ALLOW_THREADS
    code = step_fn((void*)(uintptr_t)handle, session_id, layer,
                   dtypes[0], s[0][0], s[0][1], s[0][2], views[0].buf, (size_t)views[0].len,
                   dtypes[1], s[1][0], s[1][1], s[1][2], views[1].buf, (size_t)views[1].len,
                   dtypes[2], s[2][0], s[2][1], s[2][2], views[2].buf, (size_t)views[2].len,
                   scale, return_lse, window_left, window_right, timeout_ms,
                   PyBytes_AsString(o), (size_t)o_size,
                   return_lse ? PyBytes_AsString(lse) : NULL, (size_t)lse_size, &cached, timing,
                   sizeof timing, &timing_size, message, sizeof message);
    Py_END_ALLOW_THREADS
    if (code != 0) {
      Py_DECREF(o);
      Py_DECREF(lse);
      result = Py_BuildValue("(is)", code, message);
    } else {
      result = Py_BuildValue("(iNNLy#)", 0, o, lse, (long long)cached, timing,
                             (Py_ssize_t)timing_size);
    }
  }
release:
  for (int i = 0; i < held; ++i) PyBuffer_Release(&views[i]);
  return result;
}

/* ---- BatchSteps on a completion queue ----------------------------------------------------- */

enum { kMessageBytes = 1024, kTimingBytes = 256 };

/* What one started BatchStep holds until its completion has been read: the items the library
 * writes into, the tensors' buffer views (each keeps its array alive), the outputs, and each
 * item's message and timing space. Freed by its capsule's destructor, which the caller runs only
 * after the completion (attnd/_native.py keeps the capsule until then). */
typedef struct {
  size_t n;
  StepItem* items;
  Py_buffer* views; /* 3 per item */
  size_t views_held;
  PyObject** outputs; /* o and lse (or None) per item */
  char* space;        /* n * (kMessageBytes + kTimingBytes) */
} Batch;

static void FreeBatch(Batch* b) {
  if (b == NULL) return;
  for (size_t i = 0; i < b->views_held; ++i) PyBuffer_Release(&b->views[i]);
  if (b->outputs != NULL) {
    for (size_t i = 0; i < 2 * b->n; ++i) Py_XDECREF(b->outputs[i]);
  }
  PyMem_Free(b->items);
  PyMem_Free(b->views);
  PyMem_Free(b->outputs);
  PyMem_Free(b->space);
  PyMem_Free(b);
}

static void BatchCapsuleDestructor(PyObject* capsule) {
  FreeBatch((Batch*)PyCapsule_GetPointer(capsule, "attnd._fast.Batch"));
}

/* Fills item i of b from (session_id bytes, layer, q, k_new, v_new, scale, return_lse,
 * window_left, window_right). 1: done; 0: a tensor this path does not take; -1: a Python error. */
static int FillItem(Batch* b, size_t i, PyObject* spec) {
  StepItem* it = &b->items[i];
  PyObject* arrays[3];
  const char* session_id = NULL;
  int layer = 0, return_lse = 0, left = -1, right = -1;
  float scale = 0.0f;
  if (!PyArg_ParseTuple(spec, "yiOOOfpii", &session_id, &layer, &arrays[0], &arrays[1],
                        &arrays[2], &scale, &return_lse, &left, &right)) {
    return -1;
  }
  int32_t dtypes[3];
  for (int t = 0; t < 3; ++t) {
    Py_buffer* v = &b->views[b->views_held];
    if (PyObject_GetBuffer(arrays[t], v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      return 0;
    }
    ++b->views_held;
    dtypes[t] = DTypeOfFormat(v->format);
    if (v->ndim != 3 || dtypes[t] == 0) return 0;
  }
  const Py_buffer* v = &b->views[b->views_held - 3];
  it->session_id = session_id; /* the spec's bytes object lives in the caller's list */
  it->layer = layer;
  it->q_dtype = dtypes[0];
  it->k_dtype = dtypes[1];
  it->v_dtype = dtypes[2];
  int64_t* shapes[3] = {it->q_shape, it->k_shape, it->v_shape};
  const void** data[3] = {&it->q, &it->k_new, &it->v_new};
  size_t* sizes[3] = {&it->q_size, &it->k_size, &it->v_size};
  for (int t = 0; t < 3; ++t) {
    for (int d = 0; d < 3; ++d) shapes[t][d] = v[t].shape[d];
    *data[t] = v[t].buf;
    *sizes[t] = (size_t)v[t].len;
  }
  it->softmax_scale = scale;
  it->return_lse = return_lse;
  it->window_left = left;
  it->window_right = right;
  const Py_ssize_t lse_size = return_lse ? 4 * v[0].shape[0] * v[0].shape[1] : 0;
  PyObject* o = PyBytes_FromStringAndSize(NULL, v[0].len);
  PyObject* lse = return_lse ? PyBytes_FromStringAndSize(NULL, lse_size) : Py_NewRef(Py_None);
  b->outputs[2 * i] = o;
  b->outputs[2 * i + 1] = lse;
  if (o == NULL || lse == NULL) return -1;
  it->o = PyBytes_AsString(o);
  it->o_size = (size_t)v[0].len;
  it->lse = return_lse ? PyBytes_AsString(lse) : NULL;
  it->lse_size = (size_t)lse_size;
  it->message = b->space + i * (kMessageBytes + kTimingBytes);
  it->message_size = kMessageBytes;
  it->message[0] = '\0';
  it->timing = it->message + kMessageBytes;
  it->timing_capacity = kTimingBytes;
  it->code = -1;
  return 1;
}

/* batch_step_start(handle, queue, tag, specs, timeout_ms[, single]), specs a list of
 * (session_id bytes, layer, q, k_new, v_new, scale, return_lse, window_left, window_right)
 * -> (0, batch capsule) once started (keep the capsule, and specs, until the completion;
 *    then batch_step_read(capsule)),
 *    (code, message) when the library refused it,
 *    None when a tensor is not a C-contiguous buffer of 3 dimensions and a known dtype.
 * single (specs of one step): a Step call (attn_c_step_start) instead of a BatchStep. */
static PyObject* BatchStepStart(PyObject* self, PyObject* args) {
  (void)self;
  unsigned long long handle = 0, queue = 0, tag = 0;
  PyObject* specs = NULL;
  long long timeout_ms = -1;
  int single = 0;
  if (!PyArg_ParseTuple(args, "KKKO!L|p", &handle, &queue, &tag, &PyList_Type, &specs,
                        &timeout_ms, &single)) {
    return NULL;
  }
  if ((single ? (void*)step_start_fn : (void*)batch_start_fn) == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "attnd._fast: bind() was given no start of this call");
    return NULL;
  }
  const Py_ssize_t n = PyList_Size(specs);
  if (single && n != 1) {
    PyErr_SetString(PyExc_ValueError, "attnd._fast: a single Step takes one spec");
    return NULL;
  }
  Batch* b = PyMem_Calloc(1, sizeof(Batch));
  if (b == NULL) return PyErr_NoMemory();
  b->n = (size_t)n;
  b->items = PyMem_Calloc(n > 0 ? n : 1, sizeof(StepItem));
  b->views = PyMem_Calloc(3 * (n > 0 ? n : 1), sizeof(Py_buffer));
  b->outputs = PyMem_Calloc(2 * (n > 0 ? n : 1), sizeof(PyObject*));
  b->space = PyMem_Malloc((n > 0 ? n : 1) * (kMessageBytes + kTimingBytes));
  if (b->items == NULL || b->views == NULL || b->outputs == NULL || b->space == NULL) {
    FreeBatch(b);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int got = FillItem(b, (size_t)i, PyList_GetItem(specs, i));
    if (got <= 0) {
      FreeBatch(b);
      return got < 0 ? NULL : Py_NewRef(Py_None);
    }
  }
  char message[kMessageBytes];
  void* client = (void*)(uintptr_t)handle;
  void* q = (void*)(uintptr_t)queue;
  const int code = single ? step_start_fn(client, q, b->items, timeout_ms, (uint64_t)tag, message,
                                          sizeof message)
                          : batch_start_fn(client, q, b->items, b->n, timeout_ms, (uint64_t)tag,
                                           message, sizeof message);
  if (code != 0) {
    FreeBatch(b);
    return Py_BuildValue("(is)", code, message);
  }
  PyObject* capsule = PyCapsule_New(b, "attnd._fast.Batch", BatchCapsuleDestructor);
  if (capsule == NULL) {
    /* Started: the library writes into b until the completion, so it cannot be freed here. */
    return NULL;
  }
  return Py_BuildValue("(iN)", 0, capsule);
}

/* batch_step_read(capsule) -> a list with, per item, (0, o bytes, lse bytes or None,
 * cached_tokens, timing bytes) or (code, message). Only after the call's completion came with
 * code 0. */
static PyObject* BatchStepRead(PyObject* self, PyObject* capsule) {
  (void)self;
  Batch* b = PyCapsule_GetPointer(capsule, "attnd._fast.Batch");
  if (b == NULL) return NULL;
  PyObject* out = PyList_New((Py_ssize_t)b->n);
  if (out == NULL) return NULL;
  for (size_t i = 0; i < b->n; ++i) {
    const StepItem* it = &b->items[i];
    PyObject* r;
    if (it->code != 0) {
      r = Py_BuildValue("(is)", it->code, it->message);
    } else {
      r = Py_BuildValue("(iOOLy#)", 0, b->outputs[2 * i], b->outputs[2 * i + 1],
                        (long long)it->cached_tokens, (const char*)it->timing,
                        (Py_ssize_t)it->timing_size);
    }
    if (r == NULL) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SetItem(out, (Py_ssize_t)i, r);
  }
  return out;
}

static PyMethodDef kMethods[] = {
    {"bind", Bind, METH_VARARGS,
     "bind(address of attn_c_step[, of attn_c_batch_step_start[, of attn_c_step_start]])"},
    {"step", Step, METH_VARARGS, "One Step of numpy arrays through attn_c_step."},
    {"batch_step_start", BatchStepStart, METH_VARARGS,
     "A BatchStep (or with single, a Step) of numpy arrays started on a completion queue."},
    {"batch_step_read", BatchStepRead, METH_O, "The items of a completed batch_step_start."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_fast", NULL, -1, kMethods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&kModule); }
