/* The attnd client library's C interface (libattn_client_c.so): a connection to attnd and
 * blocking raw calls of Attend, Echo, Step and BatchStep whose bytes the caller codes and reads
 * itself (the attn.v1 messages as protobuf serializes them). For bindings of other languages: the
 * Python package's native transport loads it with ctypes, so that its blocking calls cost what the
 * C++ client's cost.
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
#define ATTN_C_ABI_VERSION 1

typedef struct attn_c_client attn_c_client;
typedef struct attn_c_response attn_c_response;

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
