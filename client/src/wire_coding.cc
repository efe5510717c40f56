#include "attn/client/wire_coding.h"

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_join.h"
#include "attn/util/wire_fields.h"
#include "attn/util/wire_reader.h"
#include "tensor_bytes.h"

// Returns from the enclosing function when expr yields a non-OK absl::Status.
#define RETURN_IF_ERROR(expr)                                \
  do {                                                       \
    if (absl::Status _st = (expr); !_st.ok()) return _st;    \
  } while (0)

namespace attn::client {
namespace {

using wire::AppendVarint;
using wire::MakeTag;
using wire::VarintSize;

// ---- Requests ---------------------------------------------------------------------------------

// Field numbers, as in attention.proto (checked against the generated ones by the tests).
enum : uint32_t {
  kTensorDtype = 1, kTensorShape = 2, kTensorData = 3,
  kReqQ = 1, kReqK = 2, kReqV = 3, kReqCuSeqlensQ = 4, kReqCuSeqlensK = 5, kReqCausal = 6,
  kReqSoftmaxScale = 7, kReqWindow = 8, kReqReturnLse = 9, kReqPriority = 10, kReqRequestId = 11,
  kReqFp8 = 20,
  kWindowLeft = 1, kWindowRight = 2,
  kEchoPayload = 1, kEchoResponseBytes = 2,
  kStepSessionId = 1, kStepLayer = 2, kStepQ = 3, kStepKNew = 4, kStepVNew = 5,
  kStepSoftmaxScale = 6, kStepReturnLse = 7, kStepWindow = 8, kStepKNewScales = 22,
  kStepVNewScales = 23,
  kBatchSteps = 1,
  kResultResponse = 3,
};

void AppendVarintField(uint32_t number, uint64_t value, std::string* out) {
  AppendVarint(MakeTag(number, wire::kVarint), out);
  AppendVarint(value, out);
}

// A packed repeated integer field (int32 and int64 alike: a negative value is sign-extended to
// ten bytes); nothing when empty, as protobuf writes it.
template <typename Int>
void AppendPacked(uint32_t number, std::span<const Int> values, std::string* out) {
  if (values.empty()) return;
  size_t bytes = 0;
  for (Int v : values) bytes += VarintSize(static_cast<uint64_t>(int64_t{v}));
  AppendVarint(MakeTag(number, wire::kLengthDelimited), out);
  AppendVarint(bytes, out);
  for (Int v : values) AppendVarint(static_cast<uint64_t>(int64_t{v}), out);
}

// Tensor t as field `number`, up to and including its data field's tag and length (the data
// itself follows in a slice of its own); fields at their default are left out, as protobuf does.
void AppendTensorHead(uint32_t number, const TensorRef& t, std::string* out) {
  std::string fields;
  if (const v1::DType dtype = ToWireDType(t.dtype); dtype != v1::DTYPE_UNSPECIFIED) {
    AppendVarintField(kTensorDtype, static_cast<uint64_t>(dtype), &fields);
  }
  AppendPacked<int64_t>(kTensorShape, t.shape, &fields);
  const uint32_t data_tag = MakeTag(kTensorData, wire::kLengthDelimited);
  size_t body = fields.size();
  if (!t.data.empty()) body += VarintSize(data_tag) + VarintSize(t.data.size()) + t.data.size();
  AppendVarint(MakeTag(number, wire::kLengthDelimited), out);
  AppendVarint(body, out);
  out->append(fields);
  if (t.data.empty()) return;
  AppendVarint(data_tag, out);
  AppendVarint(t.data.size(), out);
}

// The sliding window as field `number`, present when either side is bounded (as
// BuildAttendRequest and BuildStepRequest set it).
void AppendWindow(uint32_t number, int32_t left, int32_t right, std::string* out) {
  if (left < 0 && right < 0) return;
  std::string fields;
  // int32 fields: negative values are sign-extended, zeros left out.
  if (left != 0) AppendVarintField(kWindowLeft, static_cast<uint64_t>(int64_t{left}), &fields);
  if (right != 0) AppendVarintField(kWindowRight, static_cast<uint64_t>(int64_t{right}), &fields);
  AppendVarint(MakeTag(number, wire::kLengthDelimited), out);
  AppendVarint(fields.size(), out);
  out->append(fields);
}

// A float field, left out at 0.0 (protobuf compares the bits: -0.0 is written, 0.0 is not).
void AppendFloatField(uint32_t number, float value, std::string* out) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if (bits == 0) return;
  AppendVarint(MakeTag(number, wire::kFixed32), out);
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(bits >> (8 * i)));
}

// A message being written: its small fields in head, and the borrowed data that follows the
// run of head ending at cuts[i] in data[i] (Assemble puts them together).
struct SplicedMessage {
  std::string head;
  std::vector<size_t> cuts;
  std::vector<std::string_view> data;

  // Tensor t as field `number`, its data (if any) to be spliced in.
  void AppendTensor(uint32_t number, const TensorRef& t) {
    AppendTensorHead(number, t, &head);
    if (t.data.empty()) return;
    cuts.push_back(head.size());
    data.push_back(t.data);
  }
  // inner as a length-delimited field `number` of this message.
  void AppendMessage(uint32_t number, const SplicedMessage& inner) {
    size_t body = inner.head.size();
    for (std::string_view d : inner.data) body += d.size();
    AppendVarint(MakeTag(number, wire::kLengthDelimited), &head);
    AppendVarint(body, &head);
    const size_t at = head.size();
    head.append(inner.head);
    for (size_t c : inner.cuts) cuts.push_back(at + c);
    data.insert(data.end(), inner.data.begin(), inner.data.end());
  }
};

// A packed repeated float field; nothing when empty.
void AppendPackedFloats(uint32_t number, std::span<const float> values, std::string* out) {
  if (values.empty()) return;
  AppendVarint(MakeTag(number, wire::kLengthDelimited), out);
  AppendVarint(values.size() * sizeof(float), out);
  for (float v : values) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(bits >> (8 * i)));
  }
}

// The fields of BuildStepRequest(in), in field order.
SplicedMessage StepMessage(const StepInputRef& in) {
  SplicedMessage m;
  if (!in.session_id.empty()) {
    AppendVarint(MakeTag(kStepSessionId, wire::kLengthDelimited), &m.head);
    AppendVarint(in.session_id.size(), &m.head);
    m.head.append(in.session_id);
  }
  if (in.layer != 0) {
    AppendVarintField(kStepLayer, static_cast<uint64_t>(int64_t{in.layer}), &m.head);
  }
  m.AppendTensor(kStepQ, in.q);
  m.AppendTensor(kStepKNew, in.k_new);
  m.AppendTensor(kStepVNew, in.v_new);
  const StepOptions& o = in.options;
  AppendFloatField(kStepSoftmaxScale, o.softmax_scale, &m.head);
  if (o.return_lse) AppendVarintField(kStepReturnLse, 1, &m.head);
  AppendWindow(kStepWindow, o.window_left, o.window_right, &m.head);
  AppendPackedFloats(kStepKNewScales, in.k_new_scales, &m.head);
  AppendPackedFloats(kStepVNewScales, in.v_new_scales, &m.head);
  return m;
}

// Every field of AttendRequest after v, in field order.
void AppendAttendOptions(const Tensor& k, const AttendOptions& o, uint64_t request_id,
                         std::string* out) {
  AppendPacked<int32_t>(kReqCuSeqlensQ, o.cu_seqlens_q, out);
  AppendPacked<int32_t>(kReqCuSeqlensK, o.cu_seqlens_k, out);
  if (o.causal) AppendVarintField(kReqCausal, 1, out);
  AppendFloatField(kReqSoftmaxScale, o.softmax_scale, out);
  AppendWindow(kReqWindow, o.window_left, o.window_right, out);
  if (o.return_lse) AppendVarintField(kReqReturnLse, 1, out);
  if (o.high_priority) AppendVarintField(kReqPriority, v1::PRIORITY_HIGH, out);
  if (request_id != 0) AppendVarintField(kReqRequestId, request_id, out);
  if (std::optional<v1::Fp8Attend> fp8 = Fp8Field(k, o)) {
    const std::string body = fp8->SerializeAsString();
    AppendVarint(MakeTag(kReqFp8, wire::kLengthDelimited), out);
    AppendVarint(body.size(), out);
    out->append(body);
  }
}

// One buffer of m's head runs and the borrowed data between them: data[i] follows the run of
// head that ends at cuts[i]. head is copied once into a slice that the runs are cut from.
grpc::ByteBuffer Assemble(const SplicedMessage& m, BorrowedSlices* borrowed) {
  const grpc::Slice all(m.head);
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * m.data.size() + 1);
  size_t at = 0;
  for (size_t i = 0; i < m.data.size(); ++i) {
    slices.push_back(all.sub(at, m.cuts[i]));
    slices.push_back(borrowed->Borrow(m.data[i].data(), m.data[i].size()));
    at = m.cuts[i];
  }
  if (at < m.head.size()) slices.push_back(all.sub(at, m.head.size()));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// ---- Responses --------------------------------------------------------------------------------

absl::Status Malformed(absl::string_view message, const std::string& field, const std::string& what,
                       uint64_t at) {
  return absl::InternalError(absl::StrCat("the server's ", message, " is malformed: ", field, ": ",
                                          what, " (at byte ", at, " of the message)"));
}

// A field's name for messages: "o.shape", or "field 9" for one the descriptor does not know.
std::string FieldName(const google::protobuf::Descriptor* d, uint64_t number,
                      const std::string& prefix = "") {
  const google::protobuf::FieldDescriptor* f =
      number <= uint64_t{std::numeric_limits<int>::max()} ? d->FindFieldByNumber(int(number))
                                                           : nullptr;
  return prefix + (f != nullptr ? f->name() : absl::StrCat("field ", number));
}

// A field's name, made only when a message needs it (names cost allocations).
using Name = absl::FunctionRef<std::string()>;

// Reads the value of the field whose tag was just read into message, as protobuf's parser
// would: the field is copied as it lies on the wire and merged.
absl::Status MergeField(WireReader& r, const wire::Tag& tag, absl::string_view what, Name field,
                        uint64_t at, google::protobuf::Message* message) {
  std::string bytes, error;
  if (!wire::CopyField(r, tag, &bytes, &error)) return Malformed(what, field(), error, at);
  if (!message->MergeFromString(bytes)) {
    return Malformed(what, field(),
                     "protobuf could not parse this field (a bad embedded message, or a string "
                     "that is not UTF-8)", at);
  }
  return absl::OkStatus();
}

absl::Status ReadTag(WireReader& r, absl::string_view what, Name where, wire::Tag* tag) {
  const uint64_t at = r.position();
  std::string error;
  if (!wire::ReadTag(r, tag, &error)) return Malformed(what, where(), error, at);
  return absl::OkStatus();
}

// The length of a length-delimited field and a check that it fits in what is left.
absl::Status ReadLength(WireReader& r, absl::string_view what, Name field, uint64_t at,
                        uint64_t* n) {
  if (!r.ReadVarint(n)) return Malformed(what, field(), "truncated or over-long length", at);
  if (*n > r.remaining()) {
    return Malformed(what, field(), absl::StrCat("length ", *n, " runs past the end of its message (",
                                                 r.remaining(), " bytes left)"), at);
  }
  return absl::OkStatus();
}

// The body of one occurrence of o or lse (the reader limited to it); what names the message
// being read. Its data field's pieces go to data (a later one replaces an earlier one, as in
// protobuf), its other fields, as they lie on the wire, to fields.
absl::Status DecodeTensor(WireReader& r, absl::string_view what, Name name, std::string* fields,
                          std::vector<std::string_view>* data, uint64_t* size) {
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    wire::Tag tag;
    RETURN_IF_ERROR(ReadTag(r, what, name, &tag));
    auto field = [&] { return FieldName(v1::Tensor::descriptor(), tag.number, name() + "."); };
    if (tag.number == kTensorData && tag.type == wire::kLengthDelimited) {
      uint64_t n;
      RETURN_IF_ERROR(ReadLength(r, what, field, at, &n));
      data->clear();
      *size = n;
      r.ReadPieces(n, data);
      continue;
    }
    std::string error;
    if (!wire::CopyField(r, tag, fields, &error)) return Malformed(what, field(), error, at);
  }
  return absl::OkStatus();
}

// An AttendResponse or StepResponse (the reader limited to it; o and lse are fields 1 and 2 of
// both); what names the message being read, prefix this one inside it ("results[2].response.").
// Every field but the data of o and lse is gathered as it came (o and lse re-encoded without
// their data) and parsed by protobuf in one go, as it would parse the original.
template <typename Header>
absl::Status DecodeOutputs(WireReader& r, absl::string_view what, Name prefix,
                           DecodedOutputs<Header>* out) {
  const google::protobuf::Descriptor* d = Header::descriptor();
  auto whole = [&] {
    const std::string p = prefix();
    return p.empty() ? std::string(what) : p.substr(0, p.size() - 1);
  };
  struct FieldAt {
    size_t offset;
    uint64_t number, at;
  };
  // Scratch kept by the thread from call to call (the items of a BatchStep answer are decoded one
  // after another, never nested): no allocation per item once they have grown.
  thread_local std::vector<FieldAt> fields;
  thread_local std::string head, tensor;
  fields.clear();
  head.clear();
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    wire::Tag tag;
    RETURN_IF_ERROR(ReadTag(r, what, whole, &tag));
    auto field = [&] { return FieldName(d, tag.number, prefix()); };
    fields.push_back({head.size(), tag.number, at});
    // o or lse with another wire type is an unknown field to protobuf: copied as is.
    const bool o = tag.number == Header::kOFieldNumber;
    const bool lse = tag.number == Header::kLseFieldNumber;
    if ((o || lse) && tag.type == wire::kLengthDelimited) {
      uint64_t n, outer = 0;  // ReadLength checked n: PushLimit succeeds
      RETURN_IF_ERROR(ReadLength(r, what, field, at, &n));
      r.PushLimit(n, &outer);
      tensor.clear();
      RETURN_IF_ERROR(o ? DecodeTensor(r, what, field, &tensor, &out->o_data, &out->o_size)
                        : DecodeTensor(r, what, field, &tensor, &out->lse_data, &out->lse_size));
      r.PopLimit(outer);
      AppendVarint(MakeTag(static_cast<uint32_t>(tag.number), wire::kLengthDelimited), &head);
      AppendVarint(tensor.size(), &head);
      head.append(tensor);
      continue;
    }
    std::string error;
    if (!wire::CopyField(r, tag, &head, &error)) return Malformed(what, field(), error, at);
  }
  if (out->header.MergeFromString(head)) return absl::OkStatus();
  // Refused (a bad embedded message, or a string that is not UTF-8): find the field, alone.
  for (size_t i = 0; i < fields.size(); ++i) {
    const size_t end = i + 1 < fields.size() ? fields[i + 1].offset : head.size();
    Header alone;
    if (!alone.MergeFromString(head.substr(fields[i].offset, end - fields[i].offset))) {
      return Malformed(what, FieldName(d, fields[i].number, prefix()),
                       "protobuf could not parse this field (a bad embedded message, or a string "
                       "that is not UTF-8)", fields[i].at);
    }
  }
  return Malformed(what, whole(), "protobuf could not parse its fields together",
                   fields.empty() ? 0 : fields.front().at);
}

absl::StatusOr<DType> DTypeFromWire(const std::string& name, int dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return DType::kFloat32;
    case v1::DTYPE_FLOAT16: return DType::kFloat16;
    case v1::DTYPE_BFLOAT16: return DType::kBFloat16;
    case v1::DTYPE_FLOAT8_E4M3: return DType::kFloat8E4M3;
    default: return absl::InternalError(absl::StrCat("server sent unknown dtype ", dtype, " in ", name));
  }
}

// The dtype of a received tensor once its header is checked against its data's size.
absl::StatusOr<DType> CheckTensor(const std::string& name, const v1::Tensor& header,
                                  uint64_t size) {
  if (header.has_region()) {
    return absl::InternalError(absl::StrCat("the server wrote ", name, " into region '",
                                            header.region().region(),
                                            "' instead of sending it, which this call did not ask"));
  }
  auto dtype = DTypeFromWire(name, header.dtype());
  if (!dtype.ok()) return dtype.status();
  auto bytes = WireTensorBytes(name, header, *dtype);
  if (!bytes.ok()) return bytes.status();
  if (*bytes != size) {
    return absl::InternalError(absl::StrCat(
        "the server sent ", size, " bytes of ", name, " where its shape [",
        absl::StrJoin(header.shape(), ", "), "] and dtype need ", *bytes));
  }
  return *dtype;
}

// The one copy: from the received pieces into t's buffer, reused when large enough (clear +
// reserve + append: no zero-fill, and no fresh pages for a caller that calls in a loop).
void CopyTensor(DType dtype, const v1::Tensor& header, const std::vector<std::string_view>& data,
                uint64_t size, Tensor* t) {
  t->dtype = dtype;
  t->shape.assign(header.shape().begin(), header.shape().end());
  t->data.clear();
  t->data.reserve(size);
  for (std::string_view p : data) t->data.append(p);
}

// o and lse of a decoded response checked (both, before either is copied: on an error the
// outputs are left as they were) and copied into *o and *lse.
template <typename Header>
absl::Status ReadOutputs(const DecodedOutputs<Header>& decoded, absl::string_view what, Tensor* o,
                         std::optional<Tensor>* lse) {
  const Header& h = decoded.header;
  if (!h.has_o()) return absl::InternalError(absl::StrCat("the server's ", what, " has no o"));
  const absl::StatusOr<DType> o_dtype = CheckTensor("o", h.o(), decoded.o_size);
  if (!o_dtype.ok()) return o_dtype.status();
  absl::StatusOr<DType> lse_dtype = DType::kFloat32;
  if (h.has_lse()) lse_dtype = CheckTensor("lse", h.lse(), decoded.lse_size);
  if (!lse_dtype.ok()) return lse_dtype.status();
  CopyTensor(*o_dtype, h.o(), decoded.o_data, decoded.o_size, o);
  if (h.has_lse()) {
    if (!*lse) lse->emplace();
    CopyTensor(*lse_dtype, h.lse(), decoded.lse_data, decoded.lse_size, &**lse);
  } else {
    lse->reset();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> WireTensorBytes(const std::string& name, const v1::Tensor& t,
                                         DType dtype) {
  uint64_t bytes = DTypeBytes(dtype);
  for (int64_t s : t.shape()) {
    if (s < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(s), &bytes)) {
      return absl::InternalError(absl::StrCat("the server's ", name, " has an impossible shape [",
                                              absl::StrJoin(t.shape(), ", "), "]"));
    }
  }
  return bytes;
}

// ---- BorrowedSlices ---------------------------------------------------------------------------

grpc::Slice BorrowedSlices::Borrow(const void* data, size_t size) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++outstanding_;
  }
#if defined(__SANITIZE_THREAD__)
  // gRPC releases the slice on a thread of its own; the library is not built for TSan, which
  // cannot see that it got the slice (and this object) from this thread. Release takes it back.
  __tsan_release(this);
#endif
  // gRPC never writes through a slice it sends: the const_cast only fits its constructor.
  return grpc::Slice(const_cast<void*>(data), size, &BorrowedSlices::Release, this);
}

void BorrowedSlices::Release(void* self) {
  auto* b = static_cast<BorrowedSlices*>(self);
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(b);
#endif
  std::function<void()> on_released;
  {
    // Notified under the lock: Wait cannot return (and the object go) before this is done with
    // it.
    std::lock_guard<std::mutex> lock(b->mu_);
    if (--b->outstanding_ == 0) {
      b->released_.notify_all();
      on_released = std::exchange(b->on_released_, nullptr);
    }
  }
  // Outside the lock and last: it may destroy b.
  if (on_released) on_released();
}

void BorrowedSlices::NotifyWhenReleased(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (outstanding_ > 0) {
      on_released_ = std::move(fn);
      return;
    }
  }
  fn();
}

void BorrowedSlices::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  released_.wait(lock, [this] { return outstanding_ == 0; });
}

int64_t BorrowedSlices::outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  return outstanding_;
}

// ---- Encoding ---------------------------------------------------------------------------------

grpc::ByteBuffer EncodeAttendRequest(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const AttendOptions& options, BorrowedSlices* borrowed,
                                     uint64_t request_id) {
  SplicedMessage m;
  m.AppendTensor(kReqQ, RefOf(q));
  m.AppendTensor(kReqK, RefOf(k));
  m.AppendTensor(kReqV, RefOf(v));
  AppendAttendOptions(k, options, request_id, &m.head);
  return Assemble(m, borrowed);
}

grpc::ByteBuffer EncodeEchoRequest(std::string_view payload, int64_t response_bytes,
                                   BorrowedSlices* borrowed) {
  SplicedMessage m;
  if (!payload.empty()) {
    AppendVarint(MakeTag(kEchoPayload, wire::kLengthDelimited), &m.head);
    AppendVarint(payload.size(), &m.head);
    m.cuts.push_back(m.head.size());
    m.data.push_back(payload);
  }
  if (response_bytes != 0) {
    AppendVarintField(kEchoResponseBytes, static_cast<uint64_t>(response_bytes), &m.head);
  }
  return Assemble(m, borrowed);
}

TensorRef RefOf(const Tensor& t) { return TensorRef{t.dtype, t.shape, t.data}; }

StepInputRef RefOf(const StepInput& in) {
  return StepInputRef{in.session_id, in.layer, RefOf(in.q), RefOf(in.k_new), RefOf(in.v_new),
                      in.options, in.k_new_scales, in.v_new_scales};
}

grpc::ByteBuffer EncodeStepRequest(const StepInput& in, BorrowedSlices* borrowed) {
  return Assemble(StepMessage(RefOf(in)), borrowed);
}

grpc::ByteBuffer EncodeStepRequest(const StepInputRef& in, BorrowedSlices* borrowed) {
  return Assemble(StepMessage(in), borrowed);
}

grpc::ByteBuffer EncodeBatchStepRequest(const std::vector<StepInput>& items,
                                        const std::vector<size_t>* indices,
                                        BorrowedSlices* borrowed) {
  SplicedMessage m;
  const size_t n = indices != nullptr ? indices->size() : items.size();
  for (size_t i = 0; i < n; ++i) {
    m.AppendMessage(kBatchSteps,
                    StepMessage(RefOf(items[indices != nullptr ? (*indices)[i] : i])));
  }
  return Assemble(m, borrowed);
}

grpc::ByteBuffer EncodeBatchStepRequest(std::span<const StepInputRef> items,
                                        BorrowedSlices* borrowed) {
  SplicedMessage m;
  for (const StepInputRef& item : items) m.AppendMessage(kBatchSteps, StepMessage(item));
  return Assemble(m, borrowed);
}

// ---- Decoding ---------------------------------------------------------------------------------

absl::Status ReceivedBytes::Take(grpc::ByteBuffer* buffer) {
  const grpc::Status st = buffer->Dump(&slices);
  buffer->Clear();
  if (!st.ok()) {
    return absl::InternalError(absl::StrCat("cannot read the received message: ",
                                            st.error_message()));
  }
  pieces.reserve(slices.size());
  for (const grpc::Slice& s : slices) {
    pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return absl::OkStatus();
}

absl::Status DecodeAttendResponse(std::span<const std::string_view> pieces,
                                  DecodedAttendResponse* out) {
  WireReader r(pieces);
  return DecodeOutputs(r, "AttendResponse", [] { return std::string(); }, out);
}

absl::Status ReadAttendResult(const DecodedAttendResponse& decoded, AttendResult* result) {
  RETURN_IF_ERROR(ReadOutputs(decoded, "AttendResponse", &result->o, &result->lse));
  result->timing = decoded.header.timing();
  return absl::OkStatus();
}

absl::Status ReadAttendResponse(grpc::ByteBuffer* response, AttendResult* result) {
  ReceivedBytes received;
  RETURN_IF_ERROR(received.Take(response));
  DecodedAttendResponse decoded;
  RETURN_IF_ERROR(DecodeAttendResponse(received.pieces, &decoded));
  return ReadAttendResult(decoded, result);
}

absl::StatusOr<AttendResult> AttendResultFromWire(grpc::ByteBuffer* response) {
  AttendResult result;
  RETURN_IF_ERROR(ReadAttendResponse(response, &result));
  return result;
}

absl::Status DecodeStepResponse(std::span<const std::string_view> pieces,
                                DecodedStepResponse* out) {
  WireReader r(pieces);
  return DecodeOutputs(r, "StepResponse", [] { return std::string(); }, out);
}

absl::Status ReadStepResult(const DecodedStepResponse& decoded, StepResult* result) {
  RETURN_IF_ERROR(ReadOutputs(decoded, "StepResponse", &result->o, &result->lse));
  result->cached_tokens = decoded.header.cached_tokens();
  result->timing = decoded.header.timing();
  return absl::OkStatus();
}

absl::StatusOr<StepResult> StepResultFromWire(grpc::ByteBuffer* response) {
  ReceivedBytes received;
  RETURN_IF_ERROR(received.Take(response));
  DecodedStepResponse decoded;
  RETURN_IF_ERROR(DecodeStepResponse(received.pieces, &decoded));
  StepResult result;
  RETURN_IF_ERROR(ReadStepResult(decoded, &result));
  return result;
}

absl::Status DecodeBatchStepResponse(std::span<const std::string_view> pieces, size_t items,
                                     std::vector<DecodedStepResult>* out) {
  constexpr char kBatchStepResponse[] = "BatchStepResponse";
  std::vector<DecodedStepResult>& decoded = *out;
  decoded.clear();
  decoded.reserve(items);  // as many as asked for, unless the server sent others
  WireReader r(pieces);
  while (!r.AtLimit()) {
    uint64_t at = r.position();
    wire::Tag tag;
    RETURN_IF_ERROR(ReadTag(r, kBatchStepResponse, [&] { return std::string(kBatchStepResponse); },
                            &tag));
    const size_t index = decoded.size();
    auto name = [index] { return absl::StrCat("results[", index, "]"); };
    if (tag.number != kBatchSteps || tag.type != wire::kLengthDelimited) {
      std::string error;  // unknown to BatchStepResponse: checked and skipped
      if (!wire::CopyField(r, tag, nullptr, &error)) {
        return Malformed(kBatchStepResponse, absl::StrCat("field ", tag.number), error, at);
      }
      continue;
    }
    uint64_t n, outer = 0;
    RETURN_IF_ERROR(ReadLength(r, kBatchStepResponse, name, at, &n));
    r.PushLimit(n, &outer);
    DecodedStepResult& item = decoded.emplace_back();
    while (!r.AtLimit()) {
      at = r.position();
      RETURN_IF_ERROR(ReadTag(r, kBatchStepResponse, name, &tag));
      auto field = [&] {
        return FieldName(v1::StepResult::descriptor(), tag.number, name() + ".");
      };
      if (tag.number == kResultResponse && tag.type == wire::kLengthDelimited) {
        uint64_t inner_n, inner_outer = 0;
        RETURN_IF_ERROR(ReadLength(r, kBatchStepResponse, field, at, &inner_n));
        r.PushLimit(inner_n, &inner_outer);
        // A repeated response field merges into the earlier one, as in protobuf.
        RETURN_IF_ERROR(DecodeOutputs(r, kBatchStepResponse, [&] { return field() + "."; },
                                      &item.response));
        r.PopLimit(inner_outer);
        continue;
      }
      RETURN_IF_ERROR(MergeField(r, tag, kBatchStepResponse, field, at, &item.status));
    }
    r.PopLimit(outer);
  }
  if (decoded.size() != items) {
    return absl::InternalError(absl::StrCat("BatchStep: the server sent ", decoded.size(),
                                            " results for ", items, " items"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<absl::StatusOr<StepResult>>> BatchStepResultsFromWire(
    grpc::ByteBuffer* response, size_t items) {
  ReceivedBytes received;
  RETURN_IF_ERROR(received.Take(response));
  std::vector<DecodedStepResult> decoded;
  RETURN_IF_ERROR(DecodeBatchStepResponse(received.pieces, items, &decoded));
  std::vector<absl::StatusOr<StepResult>> out;
  out.reserve(items);
  for (const DecodedStepResult& item : decoded) {
    if (item.status.status_code() != 0) {
      out.push_back(absl::Status(static_cast<absl::StatusCode>(item.status.status_code()),
                                 item.status.status_message()));
      continue;
    }
    StepResult result;
    absl::Status st = ReadStepResult(item.response, &result);
    if (st.ok()) {
      out.push_back(std::move(result));
    } else {
      out.push_back(st);
    }
  }
  return out;
}

absl::Status ReadEchoResponse(grpc::ByteBuffer* response, std::string* payload_out) {
  ReceivedBytes received;
  RETURN_IF_ERROR(received.Take(response));
  constexpr char kEchoResponse[] = "EchoResponse";
  WireReader r(received.pieces);
  std::vector<std::string_view> payload;
  uint64_t size = 0;
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    wire::Tag tag;
    RETURN_IF_ERROR(ReadTag(r, kEchoResponse, [&] { return std::string(kEchoResponse); }, &tag));
    auto field = [&] { return FieldName(v1::EchoResponse::descriptor(), tag.number); };
    if (tag.number == kEchoPayload && tag.type == wire::kLengthDelimited) {
      RETURN_IF_ERROR(ReadLength(r, kEchoResponse, field, at, &size));
      payload.clear();
      r.ReadPieces(size, &payload);
      continue;
    }
    std::string error;  // anything else is unknown to EchoResponse: checked and skipped
    if (!wire::CopyField(r, tag, nullptr, &error)) return Malformed(kEchoResponse, field(), error, at);
  }
  // The one copy, into the caller's string (its buffer reused where large enough).
  payload_out->clear();
  payload_out->reserve(size);
  for (std::string_view p : payload) payload_out->append(p);
  return absl::OkStatus();
}

absl::StatusOr<std::string> EchoPayloadFromWire(grpc::ByteBuffer* response) {
  std::string out;
  RETURN_IF_ERROR(ReadEchoResponse(response, &out));
  return out;
}

}  // namespace attn::client
