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

#include <math.h>
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

/* ---- the ordinary BatchStep: coded and read here ------------------------------------------ */

/* Client.batch_step's items (attnd._core.StepItem) as one BatchStep message, in the bytes
 * attnd/_wire.py writes for them, and the reading of its answer where every output lies in a
 * region. Each tensor is a C-contiguous numpy array of a wire dtype or a contiguous torch tensor
 * on the CPU (or on a CUDA device, when it lies in a registered region): those in a region go as
 * region slices, the others' bytes are copied into the message. Anything else (FP8 scales, a
 * CUDA tensor to copy, a tensor to make contiguous, a dtype or an answer this code does not
 * know) is left to attnd/_core.py: the functions then return None, having changed nothing. */

enum { kMaxDims = 16, kMaxRegions = 256 };

typedef struct {
  uint64_t start, end;
  long long device;
  const char* name;
  Py_ssize_t name_len;
} Region;

typedef struct {
  int32_t dtype;
  int ndim;
  uint64_t shape[kMaxDims];
  uint64_t nbytes;
  uintptr_t ptr;
  long long device; /* -1: host memory */
  int region;       /* index into the regions, or -1: the bytes go in the message */
  uint64_t offset;
  int readonly;     /* a numpy array that may not be written (torch tensors: 0) */
} Tensor;

/* Where an answer's output held in the message is copied to: the host memory of an out (or
 * lse_out) outside the regions. ptr 0: none (the output is made over the answer instead, or the
 * Python reading copies it). Kept, per item, as the bytes of the plan's last element. */
typedef struct {
  uintptr_t ptr;
  uint64_t nbytes;
  int32_t dtype;
  int32_t ndim;
  uint64_t shape[kMaxDims];
} Dest;

typedef struct {
  PyObject* sid; /* owned: the session id (str) */
  const char* sid_p;
  Py_ssize_t sid_n;
  long long layer;
  Tensor t[3];
  uint32_t scale_bits;
  int return_lse;
  int has_window;
  long long left, right;
  int o_region, lse_region; /* region index or -1 */
  uint64_t o_offset, o_bytes, lse_offset, lse_bytes;
  int q_is_ndarray;
  Dest dest[2]; /* o and lse: copied into out and lse_out when the answer holds them */
  size_t body;
} CodedStep;

/* What coding needs from Python: the types and names it looks for. */
typedef struct {
  PyObject* step_item_type;
  PyObject* ndarray_type;
  PyObject* tensor_type;  /* torch.Tensor, or None before torch has been seen */
  PyObject* torch_codes;  /* {torch dtype: wire dtype} */
  PyObject* as_step_item; /* an item given otherwise (a tuple, a dict) as a StepItem */
} Types;

static PyObject* s_session;
static PyObject* s_id;
static PyObject* s_layer;
static PyObject* s_q;
static PyObject* s_k_new;
static PyObject* s_v_new;
static PyObject* s_scale;
static PyObject* s_return_lse;
static PyObject* s_window;
static PyObject* s_out;
static PyObject* s_lse_out;
static PyObject* s_k_new_scales;
static PyObject* s_v_new_scales;
static PyObject* s_dtype;
static PyObject* s_shape;
static PyObject* s_is_contiguous;
static PyObject* s_data_ptr;
static PyObject* s_is_cpu;
static PyObject* s_is_cuda;
static PyObject* s_get_device;
static PyObject* s_buf;
static PyObject* s_start;
static PyObject* s_end;
static PyObject* s_values;
static PyObject* s_done;
static PyObject* s_set_result;
static PyObject* s_set_exception;

static int InternNames(void) {
  struct { PyObject** slot; const char* text; } names[] = {
      {&s_session, "session"}, {&s_id, "id"}, {&s_layer, "layer"}, {&s_q, "q"},
      {&s_k_new, "k_new"}, {&s_v_new, "v_new"}, {&s_scale, "scale"},
      {&s_return_lse, "return_lse"}, {&s_window, "window"}, {&s_out, "out"},
      {&s_lse_out, "lse_out"}, {&s_k_new_scales, "k_new_scales"},
      {&s_v_new_scales, "v_new_scales"}, {&s_dtype, "dtype"}, {&s_shape, "shape"},
      {&s_is_contiguous, "is_contiguous"}, {&s_data_ptr, "data_ptr"}, {&s_is_cpu, "is_cpu"},
      {&s_is_cuda, "is_cuda"}, {&s_get_device, "get_device"}, {&s_buf, "_buf"},
      {&s_start, "_start"}, {&s_end, "_end"}, {&s_values, "_values"},
      {&s_done, "done"}, {&s_set_result, "set_result"}, {&s_set_exception, "set_exception"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i) {
    *names[i].slot = PyUnicode_InternFromString(names[i].text);
    if (*names[i].slot == NULL) return -1;
  }
  return 0;
}

static int ElementBytes(int32_t dtype) {
  switch (dtype) {
    case kFloat32: return 4;
    case kFloat16: case kBFloat16: return 2;
    case kFloat8: return 1;
    default: return 0;
  }
}

/* ---- writing: count (p NULL) or write ---- */

typedef struct {
  uint8_t* p;
  size_t n;
} Writer;

static inline void PutByte(Writer* w, uint8_t b) {
  if (w->p != NULL) w->p[w->n] = b;
  ++w->n;
}

static inline void PutVarint(Writer* w, uint64_t v) {
  while (v >= 0x80) {
    PutByte(w, (uint8_t)(v | 0x80));
    v >>= 7;
  }
  PutByte(w, (uint8_t)v);
}

static inline void PutBytes(Writer* w, const void* s, size_t n) {
  if (w->p != NULL && n != 0) memcpy(w->p + w->n, s, n);
  w->n += n;
}

static inline size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

static inline void PutLenTag(Writer* w, unsigned number, size_t len) {
  PutVarint(w, ((uint64_t)number << 3) | 2);
  PutVarint(w, len);
}

/* Tensor's dtype and shape fields. */
static void PutTensorHead(Writer* w, const Tensor* t) {
  PutByte(w, 0x08);
  PutVarint(w, (uint64_t)t->dtype);
  if (t->ndim > 0) {
    size_t len = 0;
    for (int i = 0; i < t->ndim; ++i) len += VarintSize(t->shape[i]);
    PutLenTag(w, 2, len);
    for (int i = 0; i < t->ndim; ++i) PutVarint(w, t->shape[i]);
  }
}

/* A RegionSlice's fields. */
static void PutSlice(Writer* w, const Region* r, uint64_t offset, uint64_t nbytes) {
  PutLenTag(w, 1, (size_t)r->name_len);
  PutBytes(w, r->name, (size_t)r->name_len);
  if (offset != 0) {
    PutByte(w, 0x10);
    PutVarint(w, offset);
  }
  if (nbytes != 0) {
    PutByte(w, 0x18);
    PutVarint(w, nbytes);
  }
}

static size_t SliceSize(const Region* r, uint64_t offset, uint64_t nbytes) {
  Writer c = {NULL, 0};
  PutSlice(&c, r, offset, nbytes);
  return c.n;
}

static void PutTensor(Writer* w, unsigned number, const Tensor* t, const Region* regions) {
  Writer c = {NULL, 0};
  PutTensorHead(&c, t);
  if (t->region >= 0) {
    const Region* r = &regions[t->region];
    const size_t slice = SliceSize(r, t->offset, t->nbytes);
    PutLenTag(w, number, c.n + 1 + VarintSize(slice) + slice);
    PutTensorHead(w, t);
    PutLenTag(w, 4, slice);
    PutSlice(w, r, t->offset, t->nbytes);
    return;
  }
  const size_t data = t->nbytes != 0 ? 1 + VarintSize(t->nbytes) + t->nbytes : 0;
  PutLenTag(w, number, c.n + data);
  PutTensorHead(w, t);
  if (t->nbytes != 0) {
    PutLenTag(w, 3, t->nbytes);
    PutBytes(w, (const void*)t->ptr, t->nbytes);
  }
}

/* A StepRequest's fields, as attnd/_wire.py step_request writes them. */
static void PutStep(Writer* w, const CodedStep* s, const Region* regions) {
  if (s->sid_n > 0) {
    PutLenTag(w, 1, (size_t)s->sid_n);
    PutBytes(w, s->sid_p, (size_t)s->sid_n);
  }
  if (s->layer != 0) {
    PutByte(w, 0x10);
    PutVarint(w, (uint64_t)s->layer);
  }
  for (int i = 0; i < 3; ++i) PutTensor(w, 3 + (unsigned)i, &s->t[i], regions);
  if (s->scale_bits != 0) {
    PutByte(w, 0x35);
    for (int i = 0; i < 4; ++i) PutByte(w, (uint8_t)(s->scale_bits >> (8 * i)));
  }
  if (s->return_lse) {
    PutByte(w, 0x38);
    PutByte(w, 1);
  }
  if (s->has_window && !(s->left < 0 && s->right < 0)) {
    size_t len = (s->left != 0 ? 1 + VarintSize((uint64_t)s->left) : 0) +
                 (s->right != 0 ? 1 + VarintSize((uint64_t)s->right) : 0);
    PutLenTag(w, 8, len);
    if (s->left != 0) {
      PutByte(w, 0x08);
      PutVarint(w, (uint64_t)s->left);
    }
    if (s->right != 0) {
      PutByte(w, 0x10);
      PutVarint(w, (uint64_t)s->right);
    }
  }
  if (s->o_region >= 0) {
    const Region* r = &regions[s->o_region];
    PutLenTag(w, 20, SliceSize(r, s->o_offset, s->o_bytes));
    PutSlice(w, r, s->o_offset, s->o_bytes);
  }
  if (s->lse_region >= 0) {
    const Region* r = &regions[s->lse_region];
    PutLenTag(w, 21, SliceSize(r, s->lse_offset, s->lse_bytes));
    PutSlice(w, r, s->lse_offset, s->lse_bytes);
  }
}

/* ---- the items' tensors ---- */

/* A call's Python objects, released at its end. */
typedef struct {
  Py_buffer* views;
  size_t views_held;
  CodedStep* steps;
  size_t steps_held;
} Held;

static void ReleaseHeld(Held* h) {
  for (size_t i = 0; i < h->views_held; ++i) PyBuffer_Release(&h->views[i]);
  for (size_t i = 0; i < h->steps_held; ++i) Py_XDECREF(h->steps[i].sid);
  PyMem_Free(h->views);
  PyMem_Free(h->steps);
}

static int FindRegion(const Region* regions, int count, const Tensor* t, uint64_t* offset) {
  if (t->nbytes == 0) return -1;
  for (int i = 0; i < count; ++i) {
    const Region* r = &regions[i];
    if (r->device == t->device && r->start <= t->ptr && t->ptr + t->nbytes <= r->end) {
      *offset = t->ptr - r->start;
      return i;
    }
  }
  return -1;
}

/* A method's result, or NULL with a Python error. */
static PyObject* CallNoArgs(PyObject* x, PyObject* name) {
  return PyObject_CallMethodObjArgs(x, name, NULL);
}

/* Tensor x's facts. 1: taken; 0: not a tensor this code takes (none held); -1: a Python error. */
static int ReadTensor(const Types* ty, Held* h, PyObject* x, Tensor* t) {
  if ((PyObject*)Py_TYPE(x) == ty->ndarray_type) {
    Py_buffer* v = &h->views[h->views_held];
    if (PyObject_GetBuffer(x, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      return 0;
    }
    ++h->views_held;
    t->readonly = v->readonly;
    t->dtype = DTypeOfFormat(v->format);
    if (t->dtype == 0 || v->ndim > kMaxDims || v->ndim < 0) return 0;
    t->ndim = v->ndim;
    for (int i = 0; i < v->ndim; ++i) t->shape[i] = (uint64_t)v->shape[i];
    t->nbytes = (uint64_t)v->len;
    t->ptr = (uintptr_t)v->buf;
    t->device = -1;
    return 1;
  }
  if (ty->tensor_type == Py_None || !PyObject_TypeCheck(x, (PyTypeObject*)ty->tensor_type)) {
    return 0;
  }
  int taken = -1;
  PyObject* dtype = NULL;
  PyObject* shape = NULL;
  PyObject* r = NULL;
  t->readonly = 0;
  dtype = PyObject_GetAttr(x, s_dtype);
  if (dtype == NULL) goto done;
  PyObject* code = PyDict_GetItemWithError(ty->torch_codes, dtype); /* borrowed */
  if (code == NULL) {
    taken = PyErr_Occurred() ? -1 : 0;
    goto done;
  }
  t->dtype = (int32_t)PyLong_AsLong(code);
  const int element = ElementBytes(t->dtype);
  if (element == 0) {
    taken = PyErr_Occurred() ? -1 : 0;
    goto done;
  }
  shape = PyObject_GetAttr(x, s_shape);
  if (shape == NULL) goto done;
  if (!PyTuple_Check(shape) || PyTuple_Size(shape) > kMaxDims) {
    taken = 0;
    goto done;
  }
  t->ndim = (int)PyTuple_Size(shape);
  uint64_t count = 1;
  for (int i = 0; i < t->ndim; ++i) {
    const long long d = PyLong_AsLongLong(PyTuple_GetItem(shape, i));
    if (d < 0) {
      taken = PyErr_Occurred() ? -1 : 0;
      goto done;
    }
    t->shape[i] = (uint64_t)d;
    count *= (uint64_t)d;
  }
  t->nbytes = count * (uint64_t)element;
  r = CallNoArgs(x, s_is_contiguous);
  if (r == NULL) goto done;
  if (r != Py_True) {
    taken = 0;
    goto done;
  }
  Py_DECREF(r);
  r = PyObject_GetAttr(x, s_is_cpu);
  if (r == NULL) {
    PyErr_Clear();
    taken = 0;
    goto done;
  }
  if (r == Py_True) {
    t->device = -1;
  } else {
    Py_DECREF(r);
    r = PyObject_GetAttr(x, s_is_cuda);
    if (r == NULL) goto done;
    if (r != Py_True) { /* another device: attnd/_core.py says what it makes of it */
      taken = 0;
      goto done;
    }
    Py_DECREF(r);
    r = CallNoArgs(x, s_get_device);
    if (r == NULL) goto done;
    t->device = PyLong_AsLongLong(r);
    if (t->device < 0) {
      taken = PyErr_Occurred() ? -1 : 0;
      goto done;
    }
  }
  Py_DECREF(r);
  r = CallNoArgs(x, s_data_ptr);
  if (r == NULL) goto done;
  t->ptr = (uintptr_t)PyLong_AsUnsignedLongLong(r);
  if (PyErr_Occurred()) goto done;
  taken = 1;
done:
  Py_XDECREF(r);
  Py_XDECREF(shape);
  Py_XDECREF(dtype);
  return taken;
}

/* An attribute of a StepItem (new reference) or NULL with a Python error. */
static PyObject* Field(PyObject* item, PyObject* name) { return PyObject_GetAttr(item, name); }

/* A Python int as long long: 1, or 0 when it is not one that fits (no error left), -1 error. */
static int AsLongLong(PyObject* x, long long* out) {
  PyObject* n = PyNumber_Long(x);
  if (n == NULL) {
    PyErr_Clear(); /* attnd/_core.py raises what int() does */
    return 0;
  }
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(n, &overflow);
  Py_DECREF(n);
  if (overflow != 0) return 0;
  if (*out == -1 && PyErr_Occurred()) return -1;
  return 1;
}

/* Item `item` as step s. 1: taken; 0: left to Python; -1: a Python error. */
static int ReadItem(const Types* ty, Held* h, const Region* regions, int nregions, PyObject* item,
                    CodedStep* s, long long* sync_device) {
  int taken = -1;
  PyObject* f = NULL;
  if (!PyObject_TypeCheck(item, (PyTypeObject*)ty->step_item_type)) return 0;
  /* the FP8 scales: left to Python */
  for (int i = 0; i < 2; ++i) {
    f = Field(item, i == 0 ? s_k_new_scales : s_v_new_scales);
    if (f == NULL) return -1;
    if (f != Py_None) {
      Py_DECREF(f);
      return 0;
    }
    Py_DECREF(f);
  }
  /* session id: a str, or the session's id */
  f = Field(item, s_session);
  if (f == NULL) return -1;
  if (PyUnicode_Check(f)) {
    s->sid = f;
  } else {
    s->sid = PyObject_GetAttr(f, s_id);
    Py_DECREF(f);
    if (s->sid == NULL) {
      PyErr_Clear();
      return 0;
    }
    if (!PyUnicode_Check(s->sid)) return 0;
  }
  f = NULL;
  s->sid_p = PyUnicode_AsUTF8AndSize(s->sid, &s->sid_n);
  if (s->sid_p == NULL) {
    PyErr_Clear();
    return 0;
  }
  /* layer */
  f = Field(item, s_layer);
  if (f == NULL) return -1;
  taken = AsLongLong(f, &s->layer);
  Py_CLEAR(f);
  if (taken <= 0) return taken;
  taken = -1;
  /* q, k_new, v_new */
  PyObject* const names[3] = {s_q, s_k_new, s_v_new};
  for (int i = 0; i < 3; ++i) {
    f = Field(item, names[i]);
    if (f == NULL) return -1;
    if (i == 0) s->q_is_ndarray = (PyObject*)Py_TYPE(f) == ty->ndarray_type;
    const int got = ReadTensor(ty, h, f, &s->t[i]);
    Py_CLEAR(f);
    if (got <= 0) return got;
    Tensor* t = &s->t[i];
    t->region = nregions > 0 ? FindRegion(regions, nregions, t, &t->offset) : -1;
    if (t->region < 0 && t->device >= 0) return 0; /* a CUDA tensor's bytes: Python copies them */
    if (t->region >= 0 && t->device >= 0 && *sync_device == -2) *sync_device = t->device;
  }
  /* scale: as float(scale or 0.0), written when nonzero (struct.pack's overflow left to it) */
  f = Field(item, s_scale);
  if (f == NULL) return -1;
  {
    const int truth = PyObject_IsTrue(f);
    if (truth < 0) goto error;
    double x = 0.0;
    if (truth) {
      x = PyFloat_AsDouble(f);
      if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_DECREF(f);
        return 0;
      }
    }
    Py_CLEAR(f);
    s->scale_bits = 0;
    if (x != 0.0) { /* NaN too, as Python's `if scale:` */
      const float y = (float)x;
      if (isinf(y) && !isinf(x)) return 0; /* struct.pack's OverflowError, raised by Python */
      memcpy(&s->scale_bits, &y, 4);
    }
  }
  f = Field(item, s_return_lse);
  if (f == NULL) return -1;
  s->return_lse = PyObject_IsTrue(f);
  Py_CLEAR(f);
  if (s->return_lse < 0) return -1;
  /* window: None or a pair */
  f = Field(item, s_window);
  if (f == NULL) return -1;
  s->has_window = f != Py_None;
  if (s->has_window) {
    if (!(PyTuple_Check(f) && PyTuple_Size(f) == 2)) {
      Py_DECREF(f);
      return 0;
    }
    int got = AsLongLong(PyTuple_GetItem(f, 0), &s->left);
    if (got > 0) got = AsLongLong(PyTuple_GetItem(f, 1), &s->right);
    Py_CLEAR(f);
    if (got <= 0) return got;
  }
  Py_CLEAR(f);
  /* out and lse_out: region slices where they lie in one */
  s->o_region = s->lse_region = -1;
  for (int i = 0; i < 2; ++i) {
    f = Field(item, i == 0 ? s_out : s_lse_out);
    if (f == NULL) return -1;
    if (f != Py_None) {
      Tensor t;
      const int got = ReadTensor(ty, h, f, &t);
      const int out_is_ndarray = (PyObject*)Py_TYPE(f) == ty->ndarray_type;
      Py_CLEAR(f);
      if (got <= 0) return got;
      uint64_t offset = 0;
      const int at = nregions > 0 ? FindRegion(regions, nregions, &t, &offset) : -1;
      if (at < 0 && t.device >= 0) return 0; /* Python copies into a CUDA out */
      /* An out in host memory, written as attnd/_core.py's copy would write it: bytes for
       * bytes when it is writable and of q's kind (numpy or torch) and the answer's dtype and
       * shape; otherwise Python copies (converting, or saying what is wrong). */
      if (at < 0 && !t.readonly && out_is_ndarray == s->q_is_ndarray) {
        Dest* d = &s->dest[i];
        d->ptr = t.ptr;
        d->nbytes = t.nbytes;
        d->dtype = t.dtype;
        d->ndim = t.ndim;
        memcpy(d->shape, t.shape, sizeof t.shape);
      }
      if (i == 0) {
        s->o_region = at;
        s->o_offset = offset;
        s->o_bytes = t.nbytes;
      } else {
        s->lse_region = at;
        s->lse_offset = offset;
        s->lse_bytes = t.nbytes;
      }
    }
    Py_CLEAR(f);
  }
  {
    Writer c = {NULL, 0};
    PutStep(&c, s, regions);
    s->body = c.n;
  }
  return 1;
error:
  Py_XDECREF(f);
  return -1;
}

/* code_batch_step(items, regions, types, max_bytes)
 * items: a list of StepItem (others go through as_step_item); regions: a tuple of (start, end,
 * cuda device, name bytes), those of the client's RegionTable in order; types: (StepItem,
 * numpy.ndarray, torch.Tensor or None, {torch dtype: wire dtype}, as_step_item); max_bytes: the most bytes of steps one message may carry (-1: no
 * bound).
 * -> (message bytes, plan, devices): plan a list with, per item, (q, out, lse_out, o in a region,
 *    lse in a region, CUDA device of its GPU-region inputs or None, where read_batch_step may
 *    copy an o or lse held in the answer: the bytes of Dest[2], or None); devices a tuple of
 *    those devices, each once;
 *    None where attnd/_core.py codes these items (see above), or they pass max_bytes. */
static PyObject* CodeBatchStep(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* items = NULL;
  PyObject* region_specs = NULL;
  Types ty = {0};
  long long max_bytes = -1;
  if (!PyArg_ParseTuple(args, "O!O!(OOOO!O)L", &PyList_Type, &items, &PyTuple_Type,
                        &region_specs, &ty.step_item_type, &ty.ndarray_type, &ty.tensor_type,
                        &PyDict_Type, &ty.torch_codes, &ty.as_step_item, &max_bytes)) {
    return NULL;
  }
  const Py_ssize_t n = PyList_Size(items);
  const Py_ssize_t nregions = PyTuple_Size(region_specs);
  if (n <= 0 || nregions > kMaxRegions) Py_RETURN_NONE;
  Region regions[kMaxRegions];
  for (Py_ssize_t i = 0; i < nregions; ++i) {
    PyObject* spec = PyTuple_GetItem(region_specs, i);
    unsigned long long start = 0, end = 0;
    long long device = 0;
    const char* name = NULL;
    Py_ssize_t name_len = 0;
    if (!PyArg_ParseTuple(spec, "KKLy#", &start, &end, &device, &name, &name_len)) return NULL;
    regions[i] = (Region){start, end, device, name, name_len};
  }
  Held h = {0};
  h.views = PyMem_Calloc(5 * (size_t)n, sizeof(Py_buffer));
  h.steps = PyMem_Calloc((size_t)n, sizeof(CodedStep));
  if (h.views == NULL || h.steps == NULL) {
    ReleaseHeld(&h);
    return PyErr_NoMemory();
  }
  PyObject* result = NULL;
  PyObject* plan = NULL;
  PyObject* devices = NULL;
  PyObject* message = NULL;
  long long seen_devices[8];
  int nseen = 0;
  size_t steps_bytes = 0, total = 0;
  plan = PyList_New(n);
  if (plan == NULL) goto done;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GetItem(items, i);
    if (PyObject_TypeCheck(item, (PyTypeObject*)ty.step_item_type)) {
      Py_INCREF(item);
    } else {
      item = PyObject_CallFunctionObjArgs(ty.as_step_item, item, NULL);
      if (item == NULL) goto done;
    }
    CodedStep* s = &h.steps[i];
    ++h.steps_held;
    long long sync = -2;
    const int got = ReadItem(&ty, &h, regions, (int)nregions, item, s, &sync);
    if (got <= 0) {
      Py_DECREF(item);
      if (got == 0) result = Py_NewRef(Py_None);
      goto done;
    }
    steps_bytes += s->body;
    total += 1 + VarintSize(s->body) + s->body;
    PyObject* q = PyObject_GetAttr(item, s_q);
    PyObject* out = q == NULL ? NULL : PyObject_GetAttr(item, s_out);
    PyObject* lse_out = out == NULL ? NULL : PyObject_GetAttr(item, s_lse_out);
    Py_DECREF(item); /* the tensors it holds: held by the plan, or by the caller's item */
    if (lse_out == NULL) {
      Py_XDECREF(q);
      Py_XDECREF(out);
      goto done;
    }
    PyObject* dest = s->dest[0].ptr == 0 && s->dest[1].ptr == 0
                         ? Py_NewRef(Py_None)
                         : PyBytes_FromStringAndSize((const char*)s->dest, sizeof s->dest);
    PyObject* entry = Py_BuildValue("(NNNOONN)", q, out, lse_out,
                                    s->o_region >= 0 ? Py_True : Py_False,
                                    s->lse_region >= 0 ? Py_True : Py_False,
                                    sync >= 0 ? PyLong_FromLongLong(sync) : Py_NewRef(Py_None),
                                    dest);
    if (entry == NULL) goto done;
    PyList_SetItem(plan, i, entry);
    if (sync >= 0) {
      int known = 0;
      for (int j = 0; j < nseen; ++j) known |= seen_devices[j] == sync;
      if (!known) {
        if (nseen == (int)(sizeof seen_devices / sizeof seen_devices[0])) {
          result = Py_NewRef(Py_None);
          goto done;
        }
        seen_devices[nseen++] = sync;
      }
    }
  }
  if (max_bytes >= 0 && n > 1 && steps_bytes > (unsigned long long)max_bytes) {
    result = Py_NewRef(Py_None); /* cut in several calls by attnd/_core.py */
    goto done;
  }
  message = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
  if (message == NULL) goto done;
  {
    Writer w = {(uint8_t*)PyBytes_AsString(message), 0};
    for (Py_ssize_t i = 0; i < n; ++i) {
      PutLenTag(&w, 1, h.steps[i].body);
      PutStep(&w, &h.steps[i], regions);
    }
    if (w.n != total) {
      PyErr_Format(PyExc_AssertionError, "attnd._fast: BatchStep coded to %zu bytes, not %zu",
                   w.n, total);
      goto done;
    }
  }
  devices = PyTuple_New(nseen);
  if (devices == NULL) goto done;
  for (int j = 0; j < nseen; ++j) {
    PyObject* d = PyLong_FromLongLong(seen_devices[j]);
    if (d == NULL) goto done;
    PyTuple_SetItem(devices, j, d);
  }
  result = Py_BuildValue("(OOO)", message, plan, devices);
done:
  Py_XDECREF(message);
  Py_XDECREF(plan);
  Py_XDECREF(devices);
  ReleaseHeld(&h);
  return result;
}

/* ---- reading: a BatchStepResponse whose outputs went to regions ---- */

/* A varint at b[*at]: 1, or 0 when truncated or past 64 bits. */
static int GetVarint(const uint8_t* b, size_t* at, size_t end, uint64_t* v) {
  uint64_t r = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (*at >= end) return 0;
    const uint8_t c = b[(*at)++];
    if (shift == 63 && c > 1) return 0;
    r |= (uint64_t)(c & 0x7F) << shift;
    if (c < 0x80) {
      *v = r;
      return 1;
    }
  }
  return 0;
}

/* Past a field's value (its key read already): 1, or 0 for an unknown wire type or a value past
 * the end. LEN values' spans in *start, *stop. */
static int SkipValue(const uint8_t* b, size_t* at, size_t end, int wt, uint64_t* varint,
                     size_t* start, size_t* stop) {
  uint64_t n = 0;
  switch (wt) {
    case 0: return GetVarint(b, at, end, varint);
    case 1: n = 8; break;
    case 5: n = 4; break;
    case 2:
      if (!GetVarint(b, at, end, &n)) return 0;
      if (n > end - *at) return 0;
      *start = *at;
      *stop = *at + n;
      break;
    default: return 0;
  }
  if (n > end - *at) return 0;
  *at += n;
  return 1;
}

/* An answer's Tensor message, walked once: its dtype, shape, data span and region. */
typedef struct {
  uint64_t dtype;
  int ndim;
  int too_many_dims; /* more dimensions than shape holds (kept once seen) */
  uint64_t shape[kMaxDims];
  size_t start, end; /* the data field's bytes (none: start == end) */
  int has_region;    /* a field 4 of any wire type */
  int region_named;  /* the last region message names a region, all of its bytes ASCII */
} WireTensor;

/* 1 when the Tensor in b[at, end) is well formed (varints in bounds, no negative dimension, a
 * region message that parses), filling t; else 0. */
static int ReadWireTensor(const uint8_t* b, size_t at, size_t end, WireTensor* t) {
  memset(t, 0, sizeof *t);
  while (at < end) {
    uint64_t key = 0, v = 0;
    size_t s = 0, e = 0;
    if (!GetVarint(b, &at, end, &key)) return 0;
    const uint64_t number = key >> 3;
    const int wt = (int)(key & 7);
    if (!SkipValue(b, &at, end, wt, &v, &s, &e)) return 0;
    if (number == 4) t->has_region = 1;
    if (wt == 0 && number == 1) {
      t->dtype = v;
    } else if (wt == 0 && number == 2) { /* unpacked: one more dimension */
      if (v >= (1ull << 63)) return 0;
      if (t->ndim == kMaxDims) t->too_many_dims = 1;
      else t->shape[t->ndim++] = v;
    } else if (wt == 2 && number == 2) { /* packed: the whole shape */
      t->ndim = 0; /* a dimension too many stays so: the shape is refused */
      while (s < e) {
        if (!GetVarint(b, &s, e, &v) || v >= (1ull << 63)) return 0;
        if (t->ndim == kMaxDims) t->too_many_dims = 1;
        else t->shape[t->ndim++] = v;
      }
    } else if (wt == 2 && number == 3) {
      t->start = s;
      t->end = e;
    } else if (wt == 2 && number == 4) {
      t->region_named = 0;
      while (s < e) {
        uint64_t k2 = 0, v2 = 0;
        size_t s2 = 0, e2 = 0;
        if (!GetVarint(b, &s, e, &k2)) return 0;
        if (!SkipValue(b, &s, e, (int)(k2 & 7), &v2, &s2, &e2)) return 0;
        if ((k2 >> 3) == 1 && (k2 & 7) == 2) {
          for (size_t i = s2; i < e2; ++i) {
            if (b[i] >= 0x80) return 0;
          }
          t->region_named = 1;
        }
      }
    }
  }
  return 1;
}

/* A Tensor of an answer that should lie in a region: 1 when it is well formed and names a
 * region, else 0. */
static int TensorInRegion(const uint8_t* b, size_t at, size_t end) {
  WireTensor t;
  return ReadWireTensor(b, at, end, &t) && t.region_named && t.dtype >= kFloat32 &&
         t.dtype <= kFloat8;
}

/* A Tensor held in the answer (no region): 1 when it is well formed as attnd/_wire.py's
 * read_tensor takes it (its data as many bytes as dtype and shape say), else 0 (Python reads it,
 * or says what is wrong). */
static int InlineTensor(const uint8_t* b, size_t at, size_t end, WireTensor* t) {
  if (!ReadWireTensor(b, at, end, t) || t->has_region || t->too_many_dims) return 0;
  const int element = t->dtype <= kFloat8 ? ElementBytes((int32_t)t->dtype) : 0;
  if (element == 0) return 0;
  uint64_t need = (uint64_t)element;
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] != 0 && need > UINT64_MAX / t->shape[i]) return 0;
    need *= t->shape[i];
  }
  return t->end - t->start == need;
}

/* q's wire dtype where q is a numpy array (ndarray_type) whose outputs of that dtype come back
 * in q's own dtype (attnd/_tensors.py's OutputMaker: float32, float16, and bfloat16 as uint16
 * bits), else 0. */
static int32_t SameAsNumpyQ(PyObject* q, PyObject* ndarray_type) {
  if ((PyObject*)Py_TYPE(q) != ndarray_type) return 0;
  Py_buffer v;
  if (PyObject_GetBuffer(q, &v, PyBUF_FORMAT | PyBUF_ND) != 0) {
    PyErr_Clear();
    return 0;
  }
  const int32_t code = DTypeOfFormat(v.format);
  PyBuffer_Release(&v);
  return code == kFloat8 ? 0 : code;
}

/* An output held in the answer, as read_batch_step gives it: copied into dst (the caller's out
 * or lse_out, returned) where its Dest takes it; else, when dst is None, an array over the answer
 * (numpy.ndarray(shape, q.dtype, buf, start), what make would make, where q is a numpy array of
 * the output's dtype) or make(q, dtype, shape, buf, start); NULL with no error: Python reads
 * it. */
static PyObject* InlineOutput(const uint8_t* b, const WireTensor* t, const Dest* d, PyObject* dst,
                              PyObject* make, PyObject* ndarray_type, PyObject* q,
                              PyObject* buf) {
  if (dst != Py_None) {
    if (d == NULL || d->ptr == 0 || d->dtype != (int32_t)t->dtype || d->ndim != t->ndim ||
        d->nbytes != t->end - t->start) {
      return NULL;
    }
    for (int i = 0; i < t->ndim; ++i) {
      if (d->shape[i] != t->shape[i]) return NULL;
    }
    memcpy((void*)d->ptr, b + t->start, t->end - t->start);
    return Py_NewRef(dst);
  }
  PyObject* shape = PyTuple_New(t->ndim);
  if (shape == NULL) return NULL;
  for (int i = 0; i < t->ndim; ++i) {
    PyObject* x = PyLong_FromUnsignedLongLong(t->shape[i]);
    if (x == NULL) {
      Py_DECREF(shape);
      return NULL;
    }
    PyTuple_SetItem(shape, i, x);
  }
  if (t->end > t->start && SameAsNumpyQ(q, ndarray_type) == (int32_t)t->dtype) {
    PyObject* dtype = PyObject_GetAttr(q, s_dtype);
    if (dtype == NULL) {
      Py_DECREF(shape);
      return NULL;
    }
    return PyObject_CallFunction(ndarray_type, "NNOn", shape, dtype, buf, (Py_ssize_t)t->start);
  }
  return PyObject_CallFunction(make, "OiNOn", q, (int)t->dtype, shape, buf,
                               (Py_ssize_t)t->start);
}

static PyObject* NewTiming(PyObject* timing_type, PyObject* buf, size_t start, size_t end) {
  PyObject* t = PyType_GenericNew((PyTypeObject*)timing_type, NULL, NULL);
  if (t == NULL) return NULL;
  PyObject* a = PyLong_FromSize_t(start);
  PyObject* z = PyLong_FromSize_t(end);
  if (a == NULL || z == NULL || PyObject_SetAttr(t, s_buf, buf) != 0 ||
      PyObject_SetAttr(t, s_start, a) != 0 || PyObject_SetAttr(t, s_end, z) != 0 ||
      PyObject_SetAttr(t, s_values, Py_None) != 0) {
    Py_XDECREF(a);
    Py_XDECREF(z);
    Py_DECREF(t);
    return NULL;
  }
  Py_DECREF(a);
  Py_DECREF(z);
  return t;
}

/* read_batch_step(buf, plan, StepResult, ServerTiming, empty timing, make, numpy.ndarray)
 * -> (results, failed): per item a StepResult or (code, message) of a failed item, and whether
 *    any failed. o and lse are the item's out and lse_out where they were asked in a region (the
 *    server wrote them there) or where the answer holds them and they can be copied bytes for
 *    bytes (see ReadItem); an output held in the answer without an out is
 *    make(q, dtype, shape, buf, start) (attnd._core makes it over the answer, as its reading
 *    does);
 *    None where attnd/_core.py reads the answer: an output it must convert or check, or an
 *    answer laid out otherwise than this code expects (a malformed one among them: Python says
 *    what is wrong). */
static PyObject* ReadBatchStep(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* buf_obj = NULL;
  PyObject* plan = NULL;
  PyObject* result_type = NULL;
  PyObject* timing_type = NULL;
  PyObject* empty_timing = NULL;
  PyObject* make = NULL;
  PyObject* ndarray_type = NULL;
  if (!PyArg_ParseTuple(args, "SO!OOOOO", &buf_obj, &PyList_Type, &plan, &result_type,
                        &timing_type, &empty_timing, &make, &ndarray_type)) {
    return NULL;
  }
  static newfunc tuple_new = NULL;
  if (tuple_new == NULL) tuple_new = (newfunc)PyType_GetSlot(&PyTuple_Type, Py_tp_new);
  const uint8_t* b = (const uint8_t*)PyBytes_AsString(buf_obj);
  const size_t end = (size_t)PyBytes_Size(buf_obj);
  const Py_ssize_t n = PyList_Size(plan);
  PyObject* out = PyList_New(n);
  if (out == NULL) return NULL;
  Py_ssize_t seen = 0;
  int failed = 0;
  size_t at = 0;
  while (at < end) {
    uint64_t key = 0, v = 0;
    size_t s = 0, e = 0;
    if (!GetVarint(b, &at, end, &key)) goto fallback;
    const int wt = (int)(key & 7);
    if (!SkipValue(b, &at, end, wt, &v, &s, &e)) goto fallback;
    if (key != ((1u << 3) | 2)) continue;
    if (seen >= n) goto fallback;
    /* a BatchStepResult */
    int64_t code = 0;
    size_t msg_s = 0, msg_e = 0, resp_s = 0, resp_e = 0;
    int has_response = 0;
    while (s < e) {
      uint64_t k2 = 0, v2 = 0;
      size_t s2 = 0, e2 = 0;
      if (!GetVarint(b, &s, e, &k2)) goto fallback;
      if (!SkipValue(b, &s, e, (int)(k2 & 7), &v2, &s2, &e2)) goto fallback;
      if (k2 == ((1u << 3) | 0)) code = (int64_t)v2;
      else if (k2 == ((2u << 3) | 2)) { msg_s = s2; msg_e = e2; }
      else if (k2 == ((3u << 3) | 2)) { resp_s = s2; resp_e = e2; has_response = 1; }
    }
    PyObject* r = NULL;
    if (code != 0) {
      if (has_response) goto fallback;
      PyObject* text = PyUnicode_DecodeUTF8((const char*)b + msg_s, (Py_ssize_t)(msg_e - msg_s),
                                            "replace");
      if (text == NULL) goto error;
      r = Py_BuildValue("(LN)", (long long)code, text);
      failed = 1;
    } else {
      if (!has_response) goto fallback;
      /* (q, out, lse_out, o_in, lse_in, device, dest) */
      PyObject* entry = PyList_GetItem(plan, seen);
      if (entry == NULL || !PyTuple_Check(entry) || PyTuple_Size(entry) != 7) goto fallback;
      const int o_in = PyTuple_GetItem(entry, 3) == Py_True;
      const int lse_in = PyTuple_GetItem(entry, 4) == Py_True;
      PyObject* dest = PyTuple_GetItem(entry, 6);
      const Dest* dests = PyBytes_Check(dest) && PyBytes_Size(dest) == 2 * sizeof(Dest)
                              ? (const Dest*)PyBytes_AsString(dest)
                              : NULL;
      int has_o = 0, has_lse = 0, has_timing = 0;
      WireTensor held[2]; /* o and lse when the answer holds them */
      int inline_at[2] = {0, 0};
      int64_t cached = 0;
      size_t t_s = 0, t_e = 0;
      size_t ra = resp_s;
      while (ra < resp_e) {
        uint64_t k3 = 0, v3 = 0;
        size_t s3 = 0, e3 = 0;
        if (!GetVarint(b, &ra, resp_e, &k3)) goto fallback;
        const int wt3 = (int)(k3 & 7);
        if (!SkipValue(b, &ra, resp_e, wt3, &v3, &s3, &e3)) goto fallback;
        const uint64_t num = k3 >> 3;
        if (wt3 == 2 && (num == 1 || num == 2)) {
          const int i = (int)num - 1;
          if (i == 0 ? o_in : lse_in) {
            if (!TensorInRegion(b, s3, e3)) goto fallback;
            inline_at[i] = 0;
          } else {
            if (!InlineTensor(b, s3, e3, &held[i])) goto fallback;
            inline_at[i] = 1;
          }
          if (i == 0) has_o = 1;
          else has_lse = 1;
        } else if (wt3 == 2 && num == 4) {
          t_s = s3;
          t_e = e3;
          has_timing = 1;
        } else if (wt3 == 0 && num == 3) {
          cached = (int64_t)v3;
        }
      }
      if (!has_o) goto fallback;
      PyObject* outputs[2] = {NULL, NULL};
      for (int i = 0; i < 1 + has_lse; ++i) {
        PyObject* dst = PyTuple_GetItem(entry, 1 + i);
        outputs[i] = inline_at[i] ? InlineOutput(b, &held[i], dests ? &dests[i] : NULL, dst,
                                                 make, ndarray_type, PyTuple_GetItem(entry, 0),
                                                 buf_obj)
                                  : Py_NewRef(dst);
        if (outputs[i] == NULL) {
          Py_XDECREF(outputs[0]);
          if (PyErr_Occurred()) goto error;
          goto fallback;
        }
      }
      if (outputs[1] == NULL) outputs[1] = Py_NewRef(Py_None);
      PyObject* timing = has_timing ? NewTiming(timing_type, buf_obj, t_s, t_e)
                                    : Py_NewRef(empty_timing);
      if (timing == NULL) {
        Py_DECREF(outputs[0]);
        Py_DECREF(outputs[1]);
        goto error;
      }
      PyObject* fields = Py_BuildValue("(NNNN)", outputs[0], outputs[1],
                                       PyLong_FromLongLong(cached), timing);
      if (fields == NULL) goto error;
      PyObject* targs = PyTuple_Pack(1, fields);
      Py_DECREF(fields);
      if (targs == NULL) goto error;
      r = tuple_new((PyTypeObject*)result_type, targs, NULL);
      Py_DECREF(targs);
    }
    if (r == NULL) goto error;
    PyList_SetItem(out, seen++, r);
  }
  if (seen != n) goto fallback;
  return Py_BuildValue("(NO)", out, failed ? Py_True : Py_False);
fallback:
  Py_DECREF(out);
  Py_RETURN_NONE;
error:
  Py_DECREF(out);
  return NULL;
}

/* Sets fut's result (method set_result) or exception (set_exception) to value, unless fut is
 * done already (its caller stopped waiting). 0, or -1 with a Python error. */
static int SettleFuture(PyObject* fut, PyObject* method, PyObject* value) {
  PyObject* done = PyObject_CallMethodObjArgs(fut, s_done, NULL);
  if (done == NULL) return -1;
  const int is_done = PyObject_IsTrue(done);
  Py_DECREF(done);
  if (is_done != 0) return is_done < 0 ? -1 : 0;
  PyObject* r = PyObject_CallMethodObjArgs(fut, method, value, NULL);
  if (r == NULL) return -1;
  Py_DECREF(r);
  return 0;
}

/* batch_step_settle(capsule, futures, queries, StepResult, ServerTiming, ndarray, float32,
 *                   error_of)
 * The items of a completed batch_step_start (its completion came with code 0) straight into
 * their callers' futures: item i's StepResult (o an ndarray of queries[i]'s shape and dtype over
 * the answer's bytes, lse float32 [heads, tokens] or None, cached tokens, timing) as futures[i]'s
 * result, or error_of(code, message) as its exception. A future that is done already (its caller
 * stopped waiting) is left as it is. */
static PyObject* BatchStepSettle(PyObject* self, PyObject* args) {
  (void)self;
  PyObject *capsule, *futures, *queries, *result_type, *timing_type, *ndarray_type, *float32,
      *error_of;
  if (!PyArg_ParseTuple(args, "OO!O!OOOOO", &capsule, &PyList_Type, &futures, &PyList_Type,
                        &queries, &result_type, &timing_type, &ndarray_type, &float32,
                        &error_of)) {
    return NULL;
  }
  Batch* b = PyCapsule_GetPointer(capsule, "attnd._fast.Batch");
  if (b == NULL) return NULL;
  if ((size_t)PyList_Size(futures) != b->n || (size_t)PyList_Size(queries) != b->n) {
    PyErr_SetString(PyExc_ValueError, "attnd._fast: one future and one query per item");
    return NULL;
  }
  static newfunc tuple_new = NULL;
  if (tuple_new == NULL) tuple_new = (newfunc)PyType_GetSlot(&PyTuple_Type, Py_tp_new);
  for (size_t i = 0; i < b->n; ++i) {
    const StepItem* it = &b->items[i];
    PyObject* fut = PyList_GetItem(futures, (Py_ssize_t)i);
    PyObject* value = NULL;
    PyObject* method = s_set_result;
    if (it->code != 0) {
      value = PyObject_CallFunction(error_of, "is", (int)it->code, it->message);
      method = s_set_exception;
    } else {
      PyObject* q = PyList_GetItem(queries, (Py_ssize_t)i);
      PyObject* shape = PyObject_GetAttr(q, s_shape);
      PyObject* dtype = PyObject_GetAttr(q, s_dtype);
      PyObject* o = NULL;
      PyObject* lse = NULL;
      if (shape != NULL && dtype != NULL) {
        o = PyObject_CallFunctionObjArgs(ndarray_type, shape, dtype, b->outputs[2 * i], NULL);
      }
      if (o != NULL) {
        PyObject* lse_bytes = b->outputs[2 * i + 1];
        if (lse_bytes == Py_None) {
          lse = Py_NewRef(Py_None);
        } else if (PyTuple_Check(shape) && PyTuple_Size(shape) == 3) {
          PyObject* lse_shape = PyTuple_Pack(2, PyTuple_GetItem(shape, 1),
                                             PyTuple_GetItem(shape, 0));
          if (lse_shape != NULL) {
            lse = PyObject_CallFunctionObjArgs(ndarray_type, lse_shape, float32, lse_bytes, NULL);
            Py_DECREF(lse_shape);
          }
        } else {
          PyErr_SetString(PyExc_ValueError, "attnd._fast: a query of 3 dimensions");
        }
      }
      Py_XDECREF(shape);
      Py_XDECREF(dtype);
      PyObject* timing = NULL;
      if (lse != NULL) {
        PyObject* buf = PyBytes_FromStringAndSize((const char*)it->timing,
                                                  (Py_ssize_t)it->timing_size);
        if (buf != NULL) {
          timing = NewTiming(timing_type, buf, 0, it->timing_size);
          Py_DECREF(buf);
        }
      }
      if (timing != NULL) {
        PyObject* fields = Py_BuildValue("(NNLN)", o, lse, (long long)it->cached_tokens, timing);
        o = lse = timing = NULL; /* stolen, even on failure */
        if (fields != NULL) {
          PyObject* targs = PyTuple_Pack(1, fields);
          Py_DECREF(fields);
          if (targs != NULL) {
            value = tuple_new((PyTypeObject*)result_type, targs, NULL);
            Py_DECREF(targs);
          }
        }
      }
      Py_XDECREF(o);
      Py_XDECREF(lse);
    }
    if (value == NULL) return NULL;
    const int settled = SettleFuture(fut, method, value);
    Py_DECREF(value);
    if (settled != 0) return NULL;
  }
  Py_RETURN_NONE;
}

static PyMethodDef kMethods[] = {
    {"bind", Bind, METH_VARARGS,
     "bind(address of attn_c_step[, of attn_c_batch_step_start[, of attn_c_step_start]])"},
    {"step", Step, METH_VARARGS, "One Step of numpy arrays through attn_c_step."},
    {"batch_step_start", BatchStepStart, METH_VARARGS,
     "A BatchStep (or with single, a Step) of numpy arrays started on a completion queue."},
    {"batch_step_read", BatchStepRead, METH_O, "The items of a completed batch_step_start."},
    {"batch_step_settle", BatchStepSettle, METH_VARARGS,
     "The items of a completed batch_step_start as their callers' futures' outcomes."},
    {"code_batch_step", CodeBatchStep, METH_VARARGS,
     "Client.batch_step's items as one BatchStep message (or None: coded in Python)."},
    {"read_batch_step", ReadBatchStep, METH_VARARGS,
     "The results of a BatchStep answer whose outputs lie in regions (or None: read in Python)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_fast", NULL, -1, kMethods, NULL, NULL, NULL, NULL,
};

/* PLAN: the layout of code_batch_step's plan that read_batch_step reads (attnd/_core.py takes
 * the module only where it is the one it knows: a stale binary beside newer Python would
 * otherwise be handed plans of another layout). */
enum { kPlanVersion = 2 };

PyMODINIT_FUNC PyInit__fast(void) {
  if (InternNames() != 0) return NULL;
  PyObject* m = PyModule_Create(&kModule);
  if (m != NULL && PyModule_AddIntConstant(m, "PLAN", kPlanVersion) != 0) Py_CLEAR(m);
  return m;
}
