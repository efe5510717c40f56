#include "rpc/step_request_decoder.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "attn/util/wire_fields.h"
#include "attn/util/wire_reader.h"
#include "common/status_util.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/unknown_field_set.h"

namespace attn {
namespace {

using wire::kEndGroup;
using wire::kFixed32;
using wire::kFixed64;
using wire::kLengthDelimited;
using wire::kStartGroup;
using wire::kVarint;
using wire::MakeTag;
using wire::Tag;

// protobuf's parser: how deep messages and groups may nest below the one parsed (its recursion
// limit), the longest tag and length varints, and the largest length.
constexpr int kMaxDepth = 100;
constexpr uint64_t kMaxTagBytes = 5;
constexpr uint64_t kMaxLengthBytes = 5;
constexpr uint64_t kMaxLength = INT_MAX - 16;

// A field's place in the request, named only when an error needs it (names cost allocations):
// "session_id" in a StepRequest, "steps[3].q.shape" in a BatchStepRequest.
struct FieldPath {
  const FieldPath* parent = nullptr;  // null: the message itself, or a batch's step
  const char* name = nullptr;         // null: "field <number>"
  uint64_t number = 0;
  int64_t step = -1;  // >= 0: the step of that index in a batch ("steps[3]")

  std::string Name() const {
    std::string own = step >= 0         ? absl::StrCat("steps[", step, "]")
                      : name != nullptr ? std::string(name)
                                        : absl::StrCat("field ", number);
    if (parent == nullptr) return own;
    // A message's own name ("StepRequest") prefixes none of its fields; a batch's step does.
    if (parent->parent == nullptr && parent->step < 0) return own;
    return absl::StrCat(parent->Name(), ".", own);
  }
};

const char* StepFieldName(uint64_t n) {
  switch (n) {
    case v1::StepRequest::kSessionIdFieldNumber: return "session_id";
    case v1::StepRequest::kLayerFieldNumber: return "layer";
    case v1::StepRequest::kQFieldNumber: return "q";
    case v1::StepRequest::kKNewFieldNumber: return "k_new";
    case v1::StepRequest::kVNewFieldNumber: return "v_new";
    case v1::StepRequest::kSoftmaxScaleFieldNumber: return "softmax_scale";
    case v1::StepRequest::kReturnLseFieldNumber: return "return_lse";
    case v1::StepRequest::kWindowFieldNumber: return "window";
    case v1::StepRequest::kORegionFieldNumber: return "o_region";
    case v1::StepRequest::kLseRegionFieldNumber: return "lse_region";
    case v1::StepRequest::kKNewScalesFieldNumber: return "k_new_scales";
    case v1::StepRequest::kVNewScalesFieldNumber: return "v_new_scales";
    default: return nullptr;
  }
}

const char* TensorFieldName(uint64_t n) {
  switch (n) {
    case v1::Tensor::kDtypeFieldNumber: return "dtype";
    case v1::Tensor::kShapeFieldNumber: return "shape";
    case v1::Tensor::kDataFieldNumber: return "data";
    case v1::Tensor::kRegionFieldNumber: return "region";
    default: return nullptr;
  }
}

const char* RegionFieldName(uint64_t n) {
  switch (n) {
    case v1::RegionSlice::kRegionFieldNumber: return "region";
    case v1::RegionSlice::kOffsetFieldNumber: return "offset";
    case v1::RegionSlice::kBytesFieldNumber: return "bytes";
    default: return nullptr;
  }
}

const char* WindowFieldName(uint64_t n) {
  switch (n) {
    case v1::SlidingWindow::kLeftFieldNumber: return "left";
    case v1::SlidingWindow::kRightFieldNumber: return "right";
    default: return nullptr;
  }
}

// Reads one message's fields, as protobuf's generated parser does, straight into the messages
// given. Every Read* takes the field being read (for errors) and where its tag started. depth:
// how much deeper messages and groups may still nest, as protobuf counts it.
class StepDecoder {
 public:
  StepDecoder(std::span<const std::string_view> pieces, absl::string_view message)
      : r_(pieces), message_(message) {}

  bool AtEnd() const { return r_.AtLimit(); }
  uint64_t position() const { return r_.position(); }

  // The fields of a step up to the reader's limit (the end of the message or of the step).
  absl::Status Step(const FieldPath& step, int depth, v1::StepRequest* h, WireTensors* data) {
    while (!r_.AtLimit()) {
      const uint64_t at = r_.position();
      Tag tag;
      RETURN_IF_ERROR(ReadTag(step, &tag));
      const FieldPath f{&step, StepFieldName(tag.number), tag.number};
      switch (tag.number << 3 | tag.type) {
        case MakeTag(v1::StepRequest::kSessionIdFieldNumber, kLengthDelimited):
          RETURN_IF_ERROR(ReadString(f, at, h->mutable_session_id()));
          break;
        case MakeTag(v1::StepRequest::kLayerFieldNumber, kVarint): {
          uint64_t v = 0;
          RETURN_IF_ERROR(ReadVarint(f, at, &v));
          h->set_layer(static_cast<int32_t>(v));
          break;
        }
        case MakeTag(v1::StepRequest::kQFieldNumber, kLengthDelimited):
          RETURN_IF_ERROR(ReadTensor(f, at, depth, h->mutable_q(), &data->q));
          break;
        case MakeTag(v1::StepRequest::kKNewFieldNumber, kLengthDelimited):
          RETURN_IF_ERROR(ReadTensor(f, at, depth, h->mutable_k_new(), &data->k));
          break;
        case MakeTag(v1::StepRequest::kVNewFieldNumber, kLengthDelimited):
          RETURN_IF_ERROR(ReadTensor(f, at, depth, h->mutable_v_new(), &data->v));
          break;
        case MakeTag(v1::StepRequest::kSoftmaxScaleFieldNumber, kFixed32): {
          float v = 0;
          RETURN_IF_ERROR(ReadFixed(f, at, &v));
          h->set_softmax_scale(v);
          break;
        }
        case MakeTag(v1::StepRequest::kReturnLseFieldNumber, kVarint): {
          uint64_t v = 0;
          RETURN_IF_ERROR(ReadVarint(f, at, &v));
          h->set_return_lse(v != 0);
          break;
        }
        case MakeTag(v1::StepRequest::kWindowFieldNumber, kLengthDelimited):
          RETURN_IF_ERROR(ReadWindow(f, at, depth, h->mutable_window()));
          break;
        case MakeTag(v1::StepRequest::kORegionFieldNumber, kLengthDelimited):
          RETURN_IF_ERROR(ReadRegion(f, at, depth, h->mutable_o_region()));
          break;
        case MakeTag(v1::StepRequest::kLseRegionFieldNumber, kLengthDelimited):
          RETURN_IF_ERROR(ReadRegion(f, at, depth, h->mutable_lse_region()));
          break;
        case MakeTag(v1::StepRequest::kKNewScalesFieldNumber, kLengthDelimited):
          RETURN_IF_ERROR(ReadPackedFloats(f, at, h->mutable_k_new_scales()));
          break;
        case MakeTag(v1::StepRequest::kKNewScalesFieldNumber, kFixed32): {
          float v = 0;
          RETURN_IF_ERROR(ReadFixed(f, at, &v));
          h->add_k_new_scales(v);
          break;
        }
        case MakeTag(v1::StepRequest::kVNewScalesFieldNumber, kLengthDelimited):
          RETURN_IF_ERROR(ReadPackedFloats(f, at, h->mutable_v_new_scales()));
          break;
        case MakeTag(v1::StepRequest::kVNewScalesFieldNumber, kFixed32): {
          float v = 0;
          RETURN_IF_ERROR(ReadFixed(f, at, &v));
          h->add_v_new_scales(v);
          break;
        }
        default:  // unknown, or a known number with another wire type: unknown to protobuf too
          RETURN_IF_ERROR(ReadUnknown(f, tag, at, depth, UnknownFieldsOf(h)));
      }
    }
    return absl::OkStatus();
  }

  // An embedded message (its tag just read): its length, then body(depth left inside it) over
  // exactly its bytes.
  template <typename Body>
  absl::Status ReadEmbedded(const FieldPath& f, uint64_t at, int depth, Body body) {
    uint64_t n;
    RETURN_IF_ERROR(ReadLength(f, at, &n));
    if (depth <= 0) return Malformed(f, "messages nested too deeply", at);
    uint64_t outer = 0;
    r_.PushLimit(n, &outer);  // ReadLength checked n: it fits
    RETURN_IF_ERROR(body(depth - 1));
    r_.PopLimit(outer);
    return absl::OkStatus();
  }

  // A field no message here knows (its tag just read): checked as protobuf checks it and kept in
  // into (null: skipped), groups with everything in them.
  absl::Status ReadUnknown(const FieldPath& f, const Tag& tag, uint64_t at, int depth,
                           google::protobuf::UnknownFieldSet* into) {
    const int number = static_cast<int>(tag.number);
    switch (tag.type) {
      case kVarint: {
        uint64_t v = 0;
        RETURN_IF_ERROR(ReadVarint(f, at, &v));
        if (into != nullptr) into->AddVarint(number, v);
        return absl::OkStatus();
      }
      case kFixed64: {
        uint64_t v = 0;
        RETURN_IF_ERROR(ReadFixed(f, at, &v));
        if (into != nullptr) into->AddFixed64(number, v);
        return absl::OkStatus();
      }
      case kFixed32: {
        uint32_t v = 0;
        RETURN_IF_ERROR(ReadFixed(f, at, &v));
        if (into != nullptr) into->AddFixed32(number, v);
        return absl::OkStatus();
      }
      case kLengthDelimited: {
        uint64_t n;
        RETURN_IF_ERROR(ReadLength(f, at, &n));
        if (into != nullptr) {
          r_.AppendTo(n, into->AddLengthDelimited(number));
        } else {
          r_.Skip(n);
        }
        return absl::OkStatus();
      }
      case kStartGroup: {
        if (depth <= 0) return Malformed(f, "groups nested too deeply", at);
        google::protobuf::UnknownFieldSet* group =
            into != nullptr ? into->AddGroup(number) : nullptr;
        for (;;) {
          if (r_.AtLimit()) return Malformed(f, "group without its end", at);
          const uint64_t inner_at = r_.position();
          Tag inner;
          RETURN_IF_ERROR(ReadTag(f, &inner));
          if (inner.type == kEndGroup) {
            if (inner.number != tag.number) return Malformed(f, "mismatched end of group", inner_at);
            return absl::OkStatus();
          }
          RETURN_IF_ERROR(ReadUnknown(f, inner, inner_at, depth - 1, group));
        }
      }
      default:  // kEndGroup outside a group
        return Malformed(f, "end of a group that was not started", at);
    }
  }

  // The next tag of the message being read (in names it).
  absl::Status ReadTag(const FieldPath& in, Tag* tag) {
    const uint64_t at = r_.position();
    uint64_t raw;
    if (!r_.ReadVarint(&raw) || r_.position() - at > kMaxTagBytes) {
      return Malformed(in, "truncated or over-long field tag", at);
    }
    // Tags are 32 bits: protobuf's parser drops any higher bits of the varint, and so does this.
    tag->number = (raw & 0xffffffffu) >> 3;
    tag->type = static_cast<uint32_t>(raw & 7);
    if (tag->number == 0) return Malformed(in, "field number 0", at);
    if (tag->type > kFixed32) {
      return Malformed(in, absl::StrCat("unknown wire type ", tag->type), at);
    }
    return absl::OkStatus();
  }

  absl::Status Malformed(const FieldPath& f, absl::string_view what, uint64_t at) const {
    return absl::InvalidArgumentError(absl::StrCat(message_, " is malformed: ", f.Name(), ": ",
                                                   what, " (at byte ", at, " of the message)"));
  }

 private:
  static google::protobuf::UnknownFieldSet* UnknownFieldsOf(google::protobuf::Message* m) {
    return m->GetReflection()->MutableUnknownFields(m);
  }

  absl::Status ReadVarint(const FieldPath& f, uint64_t at, uint64_t* v) {
    if (r_.ReadVarint(v)) return absl::OkStatus();
    return Malformed(f, "truncated or over-long varint", at);
  }

  template <typename T>
  absl::Status ReadFixed(const FieldPath& f, uint64_t at, T* v) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8);
    if (r_.CopyTo(sizeof(T), reinterpret_cast<char*>(v))) return absl::OkStatus();
    return Malformed(f, sizeof(T) == 4 ? "truncated 4-byte value" : "truncated 8-byte value", at);
  }

  // The length of the length-delimited field whose tag was just read, checked to fit.
  absl::Status ReadLength(const FieldPath& f, uint64_t at, uint64_t* n) {
    const uint64_t from = r_.position();
    if (!r_.ReadVarint(n) || r_.position() - from > kMaxLengthBytes || *n > kMaxLength) {
      return Malformed(f, "truncated or over-long length", at);
    }
    if (*n > r_.remaining()) {
      return Malformed(f,
                       absl::StrCat("length ", *n, " runs past the end of its message (",
                                    r_.remaining(), " bytes left)"),
                       at);
    }
    return absl::OkStatus();
  }

  // A string field (proto3: UTF-8 checked); the last one wins.
  absl::Status ReadString(const FieldPath& f, uint64_t at, std::string* out) {
    uint64_t n;
    RETURN_IF_ERROR(ReadLength(f, at, &n));
    out->clear();
    r_.AppendTo(n, out);
    if (!google::protobuf::internal::IsStructurallyValidUTF8(out->data(),
                                                             static_cast<int>(out->size()))) {
      return Malformed(f, "a string that is not valid UTF-8", at);
    }
    return absl::OkStatus();
  }

  absl::Status ReadPackedFloats(const FieldPath& f, uint64_t at,
                                google::protobuf::RepeatedField<float>* out) {
    uint64_t n;
    RETURN_IF_ERROR(ReadLength(f, at, &n));
    if (n % sizeof(float) != 0) {
      return Malformed(f, absl::StrCat("packed floats of ", n, " bytes, not a multiple of 4"), at);
    }
    const int count = static_cast<int>(n / sizeof(float));
    out->Reserve(out->size() + count);
    r_.CopyTo(n, reinterpret_cast<char*>(out->AddNAlreadyReserved(count)));
    return absl::OkStatus();
  }

  absl::Status ReadPackedVarints(const FieldPath& f, uint64_t at,
                                 google::protobuf::RepeatedField<int64_t>* out) {
    uint64_t n, outer = 0;
    RETURN_IF_ERROR(ReadLength(f, at, &n));
    // At most n values; a few reserved at once (n itself could be far more than is sent).
    out->Reserve(out->size() + static_cast<int>(std::min<uint64_t>(n, 8)));
    r_.PushLimit(n, &outer);
    while (!r_.AtLimit()) {
      uint64_t v = 0;
      if (!r_.ReadVarint(&v)) {
        return Malformed(f, "truncated or over-long varint in a packed field", at);
      }
      out->Add(static_cast<int64_t>(v));
    }
    r_.PopLimit(outer);
    return absl::OkStatus();
  }

  // q, k_new or v_new: data into *data as pieces (a later data field replaces an earlier one),
  // every other field into t (merged, as protobuf merges a message that comes again).
  absl::Status ReadTensor(const FieldPath& in, uint64_t at, int depth, v1::Tensor* t,
                          WireBytes* data) {
    return ReadEmbedded(in, at, depth, [&](int inner) -> absl::Status {
      while (!r_.AtLimit()) {
        const uint64_t field_at = r_.position();
        Tag tag;
        RETURN_IF_ERROR(ReadTag(in, &tag));
        const FieldPath f{&in, TensorFieldName(tag.number), tag.number};
        switch (tag.number << 3 | tag.type) {
          case MakeTag(v1::Tensor::kDtypeFieldNumber, kVarint): {
            uint64_t v = 0;
            RETURN_IF_ERROR(ReadVarint(f, field_at, &v));
            t->set_dtype(static_cast<v1::DType>(static_cast<int>(v)));
            break;
          }
          case MakeTag(v1::Tensor::kShapeFieldNumber, kVarint): {
            uint64_t v = 0;
            RETURN_IF_ERROR(ReadVarint(f, field_at, &v));
            t->add_shape(static_cast<int64_t>(v));
            break;
          }
          case MakeTag(v1::Tensor::kShapeFieldNumber, kLengthDelimited):
            RETURN_IF_ERROR(ReadPackedVarints(f, field_at, t->mutable_shape()));
            break;
          case MakeTag(v1::Tensor::kDataFieldNumber, kLengthDelimited): {
            uint64_t n;
            RETURN_IF_ERROR(ReadLength(f, field_at, &n));
            data->pieces.clear();
            data->size = n;
            r_.ReadPieces(n, &data->pieces);
            break;
          }
          case MakeTag(v1::Tensor::kRegionFieldNumber, kLengthDelimited):
            RETURN_IF_ERROR(ReadRegion(f, field_at, inner, t->mutable_region()));
            break;
          default:
            RETURN_IF_ERROR(ReadUnknown(f, tag, field_at, inner, UnknownFieldsOf(t)));
        }
      }
      return absl::OkStatus();
    });
  }

  absl::Status ReadRegion(const FieldPath& in, uint64_t at, int depth, v1::RegionSlice* s) {
    return ReadEmbedded(in, at, depth, [&](int inner) -> absl::Status {
      while (!r_.AtLimit()) {
        const uint64_t field_at = r_.position();
        Tag tag;
        RETURN_IF_ERROR(ReadTag(in, &tag));
        const FieldPath f{&in, RegionFieldName(tag.number), tag.number};
        uint64_t v = 0;
        switch (tag.number << 3 | tag.type) {
          case MakeTag(v1::RegionSlice::kRegionFieldNumber, kLengthDelimited):
            RETURN_IF_ERROR(ReadString(f, field_at, s->mutable_region()));
            break;
          case MakeTag(v1::RegionSlice::kOffsetFieldNumber, kVarint):
            RETURN_IF_ERROR(ReadVarint(f, field_at, &v));
            s->set_offset(v);
            break;
          case MakeTag(v1::RegionSlice::kBytesFieldNumber, kVarint):
            RETURN_IF_ERROR(ReadVarint(f, field_at, &v));
            s->set_bytes(v);
            break;
          default:
            RETURN_IF_ERROR(ReadUnknown(f, tag, field_at, inner, UnknownFieldsOf(s)));
        }
      }
      return absl::OkStatus();
    });
  }

  absl::Status ReadWindow(const FieldPath& in, uint64_t at, int depth, v1::SlidingWindow* w) {
    return ReadEmbedded(in, at, depth, [&](int inner) -> absl::Status {
      while (!r_.AtLimit()) {
        const uint64_t field_at = r_.position();
        Tag tag;
        RETURN_IF_ERROR(ReadTag(in, &tag));
        const FieldPath f{&in, WindowFieldName(tag.number), tag.number};
        uint64_t v = 0;
        switch (tag.number << 3 | tag.type) {
          case MakeTag(v1::SlidingWindow::kLeftFieldNumber, kVarint):
            RETURN_IF_ERROR(ReadVarint(f, field_at, &v));
            w->set_left(static_cast<int32_t>(v));
            break;
          case MakeTag(v1::SlidingWindow::kRightFieldNumber, kVarint):
            RETURN_IF_ERROR(ReadVarint(f, field_at, &v));
            w->set_right(static_cast<int32_t>(v));
            break;
          default:
            RETURN_IF_ERROR(ReadUnknown(f, tag, field_at, inner, UnknownFieldsOf(w)));
        }
      }
      return absl::OkStatus();
    });
  }

  WireReader r_;
  absl::string_view message_;  // "StepRequest" or "BatchStepRequest", for errors
};

// How many steps a BatchStepRequest holds, counted before they are read so that the decoded
// requests are placed once; on malformed bytes, those before the fault (decoding then finds it).
size_t CountSteps(std::span<const std::string_view> pieces) {
  WireReader r(pieces);
  size_t steps = 0;
  while (!r.AtLimit()) {
    uint64_t tag, n;
    if (!r.ReadVarint(&tag)) break;
    if (tag != MakeTag(v1::BatchStepRequest::kStepsFieldNumber, kLengthDelimited)) break;
    if (!r.ReadVarint(&n) || !r.Skip(n)) break;
    ++steps;
  }
  return steps;
}

}  // namespace

absl::Status DecodeStepRequest(std::span<const std::string_view> pieces, DecodedStepRequest* out) {
  StepDecoder d(pieces, "StepRequest");
  const FieldPath step{nullptr, "StepRequest"};
  return d.Step(step, kMaxDepth, &out->header(), &out->data);
}

absl::Status DecodeBatchStepRequest(std::span<const std::string_view> pieces,
                                    std::vector<DecodedStepRequest>* out,
                                    google::protobuf::Arena* arena) {
  StepDecoder d(pieces, "BatchStepRequest");
  const FieldPath batch{nullptr, "BatchStepRequest"};
  out->reserve(out->size() + CountSteps(pieces));
  while (!d.AtEnd()) {
    const uint64_t at = d.position();
    Tag tag;
    RETURN_IF_ERROR(d.ReadTag(batch, &tag));
    if (tag.number != v1::BatchStepRequest::kStepsFieldNumber || tag.type != kLengthDelimited) {
      // Unknown to BatchStepRequest (or steps with another wire type): checked and skipped.
      const FieldPath f{&batch, nullptr, tag.number};
      RETURN_IF_ERROR(d.ReadUnknown(f, tag, at, kMaxDepth, nullptr));
      continue;
    }
    FieldPath step;
    step.step = static_cast<int64_t>(out->size());
    DecodedStepRequest& decoded = out->emplace_back(arena);
    RETURN_IF_ERROR(d.ReadEmbedded(step, at, kMaxDepth, [&](int depth) {
      return d.Step(step, depth, &decoded.header(), &decoded.data);
    }));
  }
  return absl::OkStatus();
}

}  // namespace attn
