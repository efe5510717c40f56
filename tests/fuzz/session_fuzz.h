// The session half of the fuzz target: bytes -> a program of session requests (CreateSession,
// Step, BatchStep, TruncateSession, ForkSession, CloseSession, each a serialized attn.v1
// message) run through the server's own session manager, step validation and CPU backend, with
// every answer checked against a float64 model of the caches, and every page back on the free
// list once the program's sessions are closed.
//
// Input: kSessionMagic, then records of [op: 1 byte][length: 2 bytes, little-endian][message].
// A session_id "#k" names the k-th session the program created (modulo their count).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attend_fuzz.h"

namespace attn::fuzz {

inline constexpr char kSessionMagic[] = "SESS";
enum class SessionOp : uint8_t { kCreate = 0, kStep, kBatchStep, kTruncate, kFork, kClose, kCount };

Outcome RunSessionInput(const uint8_t* data, size_t size);

// Appends one record to a program (for seeds and tests).
void AppendRecord(std::string* program, SessionOp op, const std::string& message);

// Either half, by the input's first bytes: a session program when it starts with kSessionMagic,
// else an AttendRequest.
Outcome RunInput(const uint8_t* data, size_t size);

}  // namespace attn::fuzz
