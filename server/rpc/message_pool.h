// Request and response messages of a unary callback method, reused from call to call. A parsed
// message keeps its strings' capacity when it is cleared, so the next call's parse writes the
// tensor bytes into memory that is already allocated and mapped instead of fresh pages (for a
// BatchStep of 64 decode steps: 192 strings, about 1.3 MB, on every call). Messages that grew
// large (a prefill chunk) are freed rather than kept, so that the pool holds at most
// max_pooled x max_kept_bytes.
//
// gRPC owns a holder from AllocateMessages until it calls Release after the call is over;
// whoever last touches the messages hands them off first (HandOffToGrpc on the response).
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include <grpcpp/support/message_allocator.h>

#include "common/tsan_annotations.h"

namespace attn {

template <class Request, class Response>
class MessagePool : public grpc::MessageAllocator<Request, Response> {
 public:
  MessagePool(size_t max_pooled, size_t max_kept_bytes)
      : max_pooled_(max_pooled), max_kept_bytes_(max_kept_bytes) {}
  MessagePool(const MessagePool&) = delete;
  MessagePool& operator=(const MessagePool&) = delete;

  grpc::MessageHolder<Request, Response>* AllocateMessages() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        Holder* h = free_.back().release();
        free_.pop_back();
        return h;
      }
    }
    return new Holder(this);
  }

  size_t pooled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return free_.size();
  }

 private:
  class Holder : public grpc::MessageHolder<Request, Response> {
   public:
    explicit Holder(MessagePool* pool) : pool_(pool) {
      this->set_request(&request_);
      this->set_response(&response_);
    }
    void Release() override {
      TakeBackFromGrpc(&response_);
      pool_->Return(this);
    }

   private:
    friend class MessagePool;
    MessagePool* pool_;
    Request request_;
    Response response_;
  };

  void Return(Holder* h) {
    std::unique_ptr<Holder> holder(h);
    if (h->request_.ByteSizeLong() + h->response_.ByteSizeLong() > max_kept_bytes_) return;
    h->request_.Clear();
    h->response_.Clear();
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < max_pooled_) free_.push_back(std::move(holder));
  }

  const size_t max_pooled_;
  const size_t max_kept_bytes_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Holder>> free_;
};

}  // namespace attn
