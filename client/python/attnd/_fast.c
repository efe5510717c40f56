/* attnd._fast: the native transport's decode step in C, so that a Step of numpy arrays costs a
 * Python caller one call instead of the ~25 us of Python (in a decode loop, caches cold) that
 * attnd/_native.py spends on its arguments and answers.
 *
 * It calls attn_c_step of libattn_client_c.so through the pointer _native.py hands it (bind), so
 * it links nothing but the interpreter. Built against the stable ABI of Python 3.11 (the buffer
 * protocol joined it then): one binary for every CPython from 3.11 on; where it is missing or
 * does not load, _native.py does the same work in Python. */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* attn/client/c_api.h's attn_c_step. */
typedef int (*StepFn)(void*, const char*, int32_t, int32_t, int64_t, int64_t, int64_t, const void*,
                      size_t, int32_t, int64_t, int64_t, int64_t, const void*, size_t, int32_t,
                      int64_t, int64_t, int64_t, const void*, size_t, float, int32_t, int32_t,
                      int32_t, int64_t, void*, size_t, void*, size_t, int64_t*, void*, size_t,
                      size_t*, char*, size_t);

static StepFn step_fn = NULL;

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
  unsigned long long address = 0;
  if (!PyArg_ParseTuple(args, "K", &address)) return NULL;
  step_fn = (StepFn)(uintptr_t)address;
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

static PyMethodDef kMethods[] = {
    {"bind", Bind, METH_VARARGS, "bind(address of attn_c_step)"},
    {"step", Step, METH_VARARGS, "One Step of numpy arrays through attn_c_step."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_fast", NULL, -1, kMethods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&kModule); }
