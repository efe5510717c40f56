/* The attnd client library's C interface (libattn_client_c.so): a connection to attnd and raw
 * calls of Attend, Echo, Step and BatchStep whose bytes the caller codes and reads itself (the
 * attn.v1 messages as protobuf serializes them), blocking or through a completion queue that an
 * event loop watches, and Steps and BatchSteps of arrays coded and read here. For bindings of
 * other languages: the Python package's native transport loads it with ctypes, so that its calls
 * cost what the C++ client's cost.
 *
 * Thread-safe: one client may serve many threads at once. Only the attn_c_ symbols are exported;
 * the library carries its own copy of the C++ client and links the system's gRPC. */
#ifndef ATTN_CLIENT_C_API_H_
#define ATTN_CLIENT_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a signature below changes; bindings check it before their first call. */
#define ATTN_C_ABI_VERSION 3

typedef struct attn_c_client attn_c_client;
typedef struct attn_c_response attn_c_response;
typedef struct attn_c_queue attn_c_queue;

int attn_c_abi_version(void);

/* A client from n (key, value) settings, both NUL-terminated strings:
 *   target                      host:port, dns:///name:port, unix:/path (required)
 *   tls                         "1": TLS, against the system's roots unless tls_ca_pem is given
 *   tls_ca_pem, tls_cert_pem, tls_key_pem, tls_server_name
 *   token                       bearer token, sent as "authorization: Bearer <token>"
 *   connections                 HTTP/2 connections the calls are spread over, round robin
 *   max_message_bytes           largest message sent or received
 *   wait_for_ready              "1": calls wait for the connection (up to their deadline)
 *   lb_policy                   gRPC load-balancing policy, e.g. round_robin
 *   retry_max_attempts          attempts of Attend and Echo on UNAVAILABLE (1: none; default 1)
 *   arg:<name>                  an integer gRPC channel argument
 * Returns NULL on an error, with its message in error (error_size bytes at most, NUL-terminated):
 * an unknown key, a value that is not a number where one is expected, or the C++ client's own
 * checks. */
attn_c_client* attn_c_client_create(const char* const* keys, const char* const* values, size_t n,
                                    char* error, size_t error_size);
void attn_c_client_destroy(attn_c_client* client);

/* One blocking call of method ("Attend", "Echo", "Step" or "BatchStep") with the request's
 * serialized bytes (read in place, not copied; they must stay unchanged until the call returns).
 * timeout_ms <= 0: no deadline. Returns the call's gRPC status code: 0 with *response set (read it
 * with attn_c_response_take), else the status message in message (message_size bytes at most,
 * NUL-terminated) and *response NULL. An unknown method is INVALID_ARGUMENT (3). The calling
 * thread blocks in the call and in nothing else. */
int attn_c_call(attn_c_client* client, const char* method, const void* request,
                size_t request_size, int64_t timeout_ms, attn_c_response** response,
                char* message, size_t message_size);

/* The same with the request's bytes in n parts, sent in order as they lie (none copied): a
 * message whose tensors stay in the caller's arrays. */
int attn_c_call_parts(attn_c_client* client, const char* method, const void* const* parts,
                      const size_t* sizes, size_t n, int64_t timeout_ms,
                      attn_c_response** response, char* message, size_t message_size);

/* One Step written and read here: q [q0, q1, q2], k_new and v_new [k0, k1, k2] (dtype: attn.v1
 * DType numbers, data read in place) with the options of attn.v1 StepRequest (window -1/-1:
 * none). o (o_size bytes: q's dtype and shape) and, with return_lse, lse (lse_size bytes: float32
 * [q1, q0]) are written where the caller says; *cached_tokens gets the layer's tokens after the
 * step, and timing (timing_capacity bytes) the serialized attn.v1 ServerTiming, its size in
 * *timing_size (0 when it does not fit). A StepResponse whose o or lse has another dtype or size
 * is INTERNAL (13), the outputs then unspecified. Returns the status code as attn_c_call. */
int attn_c_step(attn_c_client* client, const char* session_id, int32_t layer, int32_t q_dtype,
                int64_t q0, int64_t q1, int64_t q2, const void* q, size_t q_size,
                int32_t k_dtype, int64_t k0, int64_t k1, int64_t k2, const void* k_new,
                size_t k_size, int32_t v_dtype, int64_t v0, int64_t v1, int64_t v2,
                const void* v_new, size_t v_size, float softmax_scale, int32_t return_lse,
                int32_t window_left, int32_t window_right, int64_t timeout_ms, void* o,
                size_t o_size, void* lse, size_t lse_size, int64_t* cached_tokens, void* timing,
                size_t timing_capacity, size_t* timing_size, char* message, size_t message_size);

/* ---- Calls that do not block ----------------------------------------------------------------
 * A call started on a queue runs on gRPC's threads; when it has finished, and gRPC has let go of
 * the caller's bytes, its completion (the caller's tag, its status code and its response) waits
 * in the queue until attn_c_queue_poll takes it. The queue's file descriptor is readable while
 * completions wait: an event loop watches it, reads its 8 bytes (an eventfd counter), then polls
 * until none is left. It may turn readable with none waiting (one queued between that read and
 * the poll was taken by the poll); a poll then returns 0.
 * A queue is used by one thread at a time; calls may be started on it from any client. */

/* A queue, or NULL with the reason in error. */
attn_c_queue* attn_c_queue_create(char* error, size_t error_size);
/* The file descriptor to watch (owned by the queue). */
int attn_c_queue_fd(const attn_c_queue* queue);
/* Calls started and not yet polled. */
size_t attn_c_queue_pending(const attn_c_queue* queue);
/* Cancels the call started with tag, if it is still running (its completion then comes with
 * CANCELLED, 1, unless it finished first). */
void attn_c_queue_cancel(attn_c_queue* queue, uint64_t tag);
/* Takes up to max completions: tags[i], codes[i] and responses[i]. A completion's response is
 * the answer's bytes when its code is 0, else the status message's bytes (UTF-8; read either with
 * attn_c_response_size/take). Returns how many it took. */
size_t attn_c_queue_poll(attn_c_queue* queue, uint64_t* tags, int32_t* codes,
                         attn_c_response** responses, size_t max);
/* Cancels the calls still running, waits for them to finish, and frees the queue with the
 * completions nobody took. The clients of its calls must outlive this. */
void attn_c_queue_destroy(attn_c_queue* queue);

/* attn_c_call_parts without blocking: returns 0 once started (its completion, with tag, comes
 * through queue; the parts must stay unchanged until then), else its status code with the
 * message, and nothing is queued. A request of 256 KiB or more, and any call started while
 * more than two of the queue's calls run (here and in attn_c_batch_step_start), is started from
 * the queue's own thread, made with the first such call: gRPC's start of a call takes tens of
 * microseconds of the thread that makes it (the write of its first bytes among them), and the
 * caller goes on meanwhile. A lone small call starts on the caller's thread. */
int attn_c_call_start(attn_c_client* client, attn_c_queue* queue, const char* method,
                      const void* const* parts, const size_t* sizes, size_t n,
                      int64_t timeout_ms, uint64_t tag, char* message, size_t message_size);

/* One step of a BatchStep coded and read here: attn_c_step's inputs and outputs, and its own
 * outcome, written when the call completes. */
typedef struct attn_c_step_item {
  /* In. */
  const char* session_id;
  int32_t layer;
  int32_t q_dtype, k_dtype, v_dtype;
  int64_t q_shape[3], k_shape[3], v_shape[3];
  const void* q;
  const void* k_new;
  const void* v_new;
  size_t q_size, k_size, v_size;
  float softmax_scale;
  int32_t return_lse;
  int32_t window_left, window_right; /* -1/-1: no window */
  void* o;                           /* o_size bytes: q's dtype and shape */
  size_t o_size;
  void* lse;                         /* with return_lse: float32 [q_shape[1], q_shape[0]] */
  size_t lse_size;
  char* message;                     /* the item's status message (message_size bytes at most) */
  size_t message_size;
  void* timing;                      /* the serialized attn.v1 ServerTiming */
  size_t timing_capacity;
  /* Out, once its call completes with code 0 (the call's own failure leaves them unset). */
  int32_t code;                      /* the item's status code; 0: o and lse written */
  int64_t cached_tokens;
  size_t timing_size;                /* 0 when it does not fit */
} attn_c_step_item;

/* A BatchStep of items[0..n) coded here, started on queue: the items (and their tensors) must
 * stay valid until its completion is polled; each item's outcome is then in it. The completion's
 * code is the call's own: 0 when the BatchStep was answered (each item then has its code), else
 * the call's failure (the items' outcomes unset). Returns 0 once started, else the status code
 * with the message (an item's bad dtype or NULL data: INVALID_ARGUMENT naming it). */
int attn_c_batch_step_start(attn_c_client* client, attn_c_queue* queue, attn_c_step_item* items,
                            size_t n, int64_t timeout_ms, uint64_t tag, char* message,
                            size_t message_size);

/* One Step of item (attn_c_step's call) coded here, started on queue; item (and its tensors)
 * must stay valid until its completion is polled. The completion's code is the Step's: 0 with
 * item's outcome written (code 0, o, lse, cached_tokens, timing), else its failure (the message
 * in the completion's response; item's outcome unset). Returns as attn_c_batch_step_start. */
int attn_c_step_start(attn_c_client* client, attn_c_queue* queue, attn_c_step_item* item,
                      int64_t timeout_ms, uint64_t tag, char* message, size_t message_size);

/* The response's size in bytes. */
size_t attn_c_response_size(const attn_c_response* response);
/* Copies the response's bytes to dst (attn_c_response_size of them) and frees it. */
void attn_c_response_take(attn_c_response* response, void* dst);
/* Frees a response without reading it. */
void attn_c_response_free(attn_c_response* response);

#ifdef __cplusplus
}
#endif

#endif /* ATTN_CLIENT_C_API_H_ */
