#include "tests/client/sim_gpu_runtime.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "kernels/strided_copy.h"

namespace actstash::client_internal::testing {

// One RecordEvent call: done when its op ran, with the stream's status then.
struct SimGpuRuntime::Mark {
  bool done = false;  // guarded by the runtime's mu_
  absl::Status status;
};

// `latest` is the most recent record (null: never recorded).
struct SimGpuRuntime::EventState {
  std::shared_ptr<Mark> latest;
};

struct SimGpuRuntime::Op {
  enum class Kind { kRecord, kWait, kCopy, kHost };
  Kind kind = Kind::kHost;
  GpuEvent event = 0;                  // kRecord, kWait: resolved by Enqueue into `mark`
  std::shared_ptr<Mark> mark;          // kRecord: its record; kWait: the record to wait for
  std::function<absl::Status()> work;  // kCopy, kHost
};

struct SimGpuRuntime::Stream {
  explicit Stream(uint64_t seed) : rng(seed) {}
  std::deque<Op> ops;                        // guarded by the runtime's mu_
  bool busy = false;                         // guarded by mu_
  bool stopping = false;                     // guarded by mu_
  absl::Status error;                        // guarded by mu_: sticky
  std::chrono::microseconds extra_delay{0};  // guarded by mu_
  int64_t copies_pending = 0;                // guarded by mu_
  std::mt19937_64 rng;                       // the worker's only
  std::thread thread;
};

SimGpuRuntime::SimGpuRuntime(const SimOptions& options) : options_(options) {
  absl::MutexLock lock(&mu_);
  auto stream = std::make_unique<Stream>(options_.seed);
  Stream* raw = stream.get();
  streams_[0] = std::move(stream);
  raw->thread = std::thread([this, raw] { Run(raw); });
}

SimGpuRuntime::~SimGpuRuntime() {
  std::vector<std::unique_ptr<Stream>> streams;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [handle, stream] : streams_) streams.push_back(std::move(stream));
    streams_.clear();
  }
  for (auto& stream : streams) StopAndJoin(std::move(stream));
}

void SimGpuRuntime::StopAndJoin(std::unique_ptr<Stream> stream) {
  {
    absl::MutexLock lock(&mu_);
    stream->stopping = true;
  }
  stream->thread.join();
}

SimGpuRuntime::Stream* SimGpuRuntime::FindStreamLocked(GpuStream stream) {
  auto it = streams_.find(stream);
  if (it == streams_.end()) {
    ++bad_handle_uses_;
    return nullptr;
  }
  return it->second.get();
}

std::shared_ptr<SimGpuRuntime::EventState> SimGpuRuntime::FindEventLocked(GpuEvent event) {
  auto it = events_.find(event);
  if (it == events_.end()) {
    ++bad_handle_uses_;
    return nullptr;
  }
  return it->second;
}

absl::StatusOr<GpuStream> SimGpuRuntime::CreateStream() {
  absl::MutexLock lock(&mu_);
  const GpuStream handle = next_stream_++;
  auto stream = std::make_unique<Stream>(options_.seed * 1000003 + handle);
  Stream* raw = stream.get();
  streams_[handle] = std::move(stream);
  ++streams_created_;
  raw->thread = std::thread([this, raw] { Run(raw); });
  return handle;
}

absl::Status SimGpuRuntime::DestroyStream(GpuStream stream) {
  std::unique_ptr<Stream> owned;
  {
    absl::MutexLock lock(&mu_);
    if (stream == 0 || FindStreamLocked(stream) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("sim: unknown stream ", stream));
    }
    owned = std::move(streams_[stream]);
    streams_.erase(stream);
    ++streams_destroyed_;
  }
  StopAndJoin(std::move(owned));
  return absl::OkStatus();
}

absl::StatusOr<GpuEvent> SimGpuRuntime::CreateEvent() {
  absl::MutexLock lock(&mu_);
  const GpuEvent handle = next_event_++;
  events_[handle] = std::make_shared<EventState>();
  ++events_created_;
  return handle;
}

absl::Status SimGpuRuntime::DestroyEvent(GpuEvent event) {
  absl::MutexLock lock(&mu_);
  if (FindEventLocked(event) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("sim: unknown event ", event));
  }
  events_.erase(event);  // pending ops keep the state alive
  ++events_destroyed_;
  return absl::OkStatus();
}

absl::Status SimGpuRuntime::Enqueue(GpuStream stream, Op op) {
  absl::MutexLock lock(&mu_);
  Stream* s = FindStreamLocked(stream);
  if (s == nullptr) return absl::InvalidArgumentError(absl::StrCat("sim: unknown stream ", stream));
  if (op.kind == Op::Kind::kRecord || op.kind == Op::Kind::kWait) {
    std::shared_ptr<EventState> event = FindEventLocked(op.event);
    if (event == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("sim: unknown event ", op.event));
    }
    if (op.kind == Op::Kind::kRecord) event->latest = std::make_shared<Mark>();
    op.mark = event->latest;  // a wait captures the record current at the call
  }
  if (op.kind == Op::Kind::kCopy) {
    ++s->copies_pending;
    int64_t& max = max_copies_[stream];
    max = std::max(max, s->copies_pending);
  }
  ++ops_enqueued_;
  s->ops.push_back(std::move(op));
  return absl::OkStatus();
}

void SimGpuRuntime::Run(Stream* stream) {
  while (true) {
    Op op;
    std::chrono::microseconds delay{0};
    {
      absl::MutexLock lock(&mu_);
      auto ready = [stream] { return stream->stopping || !stream->ops.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stream->ops.empty()) return;
      op = std::move(stream->ops.front());
      stream->ops.pop_front();
      stream->busy = true;
      delay = stream->extra_delay;
    }
    if (options_.max_op_delay.count() > 0) {
      delay += std::chrono::microseconds(stream->rng() % (options_.max_op_delay.count() + 1));
    }
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    absl::Status failed;
    bool run = false;
    {
      absl::MutexLock lock(&mu_);
      switch (op.kind) {
        case Op::Kind::kRecord:
          op.mark->done = true;
          op.mark->status = stream->error;
          break;
        case Op::Kind::kWait:
          if (Mark* mark = op.mark.get()) {
            auto reached = [mark] { return mark->done; };
            mu_.Await(absl::Condition(&reached));
            if (stream->error.ok()) stream->error = mark->status;
          }
          break;
        default:
          run = stream->error.ok();
      }
    }
    if (run) failed = op.work();
    absl::MutexLock lock(&mu_);
    if (!failed.ok() && stream->error.ok()) stream->error = failed;
    if (op.kind == Op::Kind::kCopy) --stream->copies_pending;
    stream->busy = false;
  }
}

absl::Status SimGpuRuntime::RecordEvent(GpuEvent event, GpuStream stream) {
  Op op;
  op.kind = Op::Kind::kRecord;
  op.event = event;
  return Enqueue(stream, std::move(op));
}

absl::Status SimGpuRuntime::StreamWaitEvent(GpuStream stream, GpuEvent event) {
  Op op;
  op.kind = Op::Kind::kWait;
  op.event = event;
  return Enqueue(stream, std::move(op));
}

absl::Status SimGpuRuntime::MemcpyAsync(void* dst, const void* src, size_t nbytes,
                                        GpuStream stream) {
  if (nbytes > 0 && (dst == nullptr || src == nullptr)) {
    return absl::InvalidArgumentError("sim: null pointer in a memcpy");
  }
  Op op;
  op.kind = Op::Kind::kCopy;
  op.work = [dst, src, nbytes] {
    if (nbytes > 0) std::memcpy(dst, src, nbytes);
    return absl::OkStatus();
  };
  return Enqueue(stream, std::move(op));
}

absl::Status SimGpuRuntime::GatherAsync(const void* src, const kernels::StridedLayout& src_layout,
                                        void* dst, size_t dst_bytes, GpuStream stream) {
  absl::Status checked = kernels::CheckStridedCopy(src, src_layout, dst, dst_bytes, false).status();
  if (!checked.ok()) return checked;
  Op op;
  op.kind = Op::Kind::kCopy;
  op.work = [=] { return kernels::GatherCpu(src, src_layout, dst, dst_bytes); };
  return Enqueue(stream, std::move(op));
}

absl::Status SimGpuRuntime::ConvertAsync(void* dst, const void* src, size_t elements,
                                         Conversion conversion, GpuStream stream) {
  Op op;
  op.kind = Op::Kind::kCopy;
  op.work = [=] {
    if (conversion == Conversion::kFp32ToBf16) {
      kernels::Fp32ToBf16Cpu(static_cast<const float*>(src), static_cast<uint16_t*>(dst), elements);
    } else {
      kernels::Bf16ToFp32Cpu(static_cast<const uint16_t*>(src), static_cast<float*>(dst), elements);
    }
    return absl::OkStatus();
  };
  return Enqueue(stream, std::move(op));
}

absl::Status SimGpuRuntime::ScatterAsync(const void* src, size_t src_bytes, void* dst,
                                         const kernels::StridedLayout& dst_layout,
                                         GpuStream stream) {
  absl::Status checked = kernels::CheckStridedCopy(dst, dst_layout, src, src_bytes, true).status();
  if (!checked.ok()) return checked;
  Op op;
  op.kind = Op::Kind::kCopy;
  op.work = [=] { return kernels::ScatterCpu(src, src_bytes, dst, dst_layout); };
  return Enqueue(stream, std::move(op));
}

absl::StatusOr<bool> SimGpuRuntime::QueryEvent(GpuEvent event) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<EventState> state = FindEventLocked(event);
  if (state == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("sim: unknown event ", event));
  if (state->latest == nullptr) return true;
  if (!state->latest->done) return false;
  if (!state->latest->status.ok()) return state->latest->status;
  return true;
}

absl::Status SimGpuRuntime::SynchronizeEvent(GpuEvent event) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<EventState> state = FindEventLocked(event);
  if (state == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("sim: unknown event ", event));
  const std::shared_ptr<Mark> mark = state->latest;
  if (mark == nullptr) return absl::OkStatus();
  Mark* raw = mark.get();
  auto reached = [raw] { return raw->done; };
  mu_.Await(absl::Condition(&reached));
  return mark->status;
}

absl::Status SimGpuRuntime::LaunchHostAsync(GpuStream stream, std::function<absl::Status()> work) {
  Op op;
  op.kind = Op::Kind::kHost;
  op.work = std::move(work);
  return Enqueue(stream, std::move(op));
}

void SimGpuRuntime::SetStreamDelay(GpuStream stream, std::chrono::microseconds delay) {
  absl::MutexLock lock(&mu_);
  if (Stream* s = FindStreamLocked(stream)) s->extra_delay = delay;
}

void SimGpuRuntime::SynchronizeStream(GpuStream stream) {
  absl::MutexLock lock(&mu_);
  Stream* s = FindStreamLocked(stream);
  if (s == nullptr) return;
  auto idle = [s] { return s->ops.empty() && !s->busy; };
  mu_.Await(absl::Condition(&idle));
}

int64_t SimGpuRuntime::events_created() const {
  absl::MutexLock lock(&mu_);
  return events_created_;
}
int64_t SimGpuRuntime::events_destroyed() const {
  absl::MutexLock lock(&mu_);
  return events_destroyed_;
}
int64_t SimGpuRuntime::live_events() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(events_.size());
}
int64_t SimGpuRuntime::streams_created() const {
  absl::MutexLock lock(&mu_);
  return streams_created_;
}
int64_t SimGpuRuntime::streams_destroyed() const {
  absl::MutexLock lock(&mu_);
  return streams_destroyed_;
}
int64_t SimGpuRuntime::bad_handle_uses() const {
  absl::MutexLock lock(&mu_);
  return bad_handle_uses_;
}
int64_t SimGpuRuntime::ops_enqueued() const {
  absl::MutexLock lock(&mu_);
  return ops_enqueued_;
}
int64_t SimGpuRuntime::max_copies_in_flight(GpuStream stream) const {
  absl::MutexLock lock(&mu_);
  auto it = max_copies_.find(stream);
  return it == max_copies_.end() ? 0 : it->second;
}

namespace {

class SharedRuntime final : public GpuRuntime {
 public:
  explicit SharedRuntime(std::shared_ptr<GpuRuntime> runtime) : r_(std::move(runtime)) {}
  absl::StatusOr<GpuStream> CreateStream() override { return r_->CreateStream(); }
  absl::Status DestroyStream(GpuStream s) override { return r_->DestroyStream(s); }
  absl::StatusOr<GpuEvent> CreateEvent() override { return r_->CreateEvent(); }
  absl::Status DestroyEvent(GpuEvent e) override { return r_->DestroyEvent(e); }
  absl::Status RecordEvent(GpuEvent e, GpuStream s) override { return r_->RecordEvent(e, s); }
  absl::Status StreamWaitEvent(GpuStream s, GpuEvent e) override {
    return r_->StreamWaitEvent(s, e);
  }
  absl::Status MemcpyAsync(void* dst, const void* src, size_t n, GpuStream s) override {
    return r_->MemcpyAsync(dst, src, n, s);
  }
  absl::Status GatherAsync(const void* src, const kernels::StridedLayout& layout, void* dst,
                           size_t dst_bytes, GpuStream s) override {
    return r_->GatherAsync(src, layout, dst, dst_bytes, s);
  }
  absl::Status ConvertAsync(void* dst, const void* src, size_t n, Conversion c,
                            GpuStream s) override {
    return r_->ConvertAsync(dst, src, n, c, s);
  }
  absl::Status ScatterAsync(const void* src, size_t src_bytes, void* dst,
                            const kernels::StridedLayout& layout, GpuStream s) override {
    return r_->ScatterAsync(src, src_bytes, dst, layout, s);
  }
  absl::StatusOr<bool> QueryEvent(GpuEvent e) override { return r_->QueryEvent(e); }
  absl::Status SynchronizeEvent(GpuEvent e) override { return r_->SynchronizeEvent(e); }

 private:
  const std::shared_ptr<GpuRuntime> r_;
};

}  // namespace

std::unique_ptr<GpuRuntime> ShareRuntime(std::shared_ptr<GpuRuntime> runtime) {
  return std::make_unique<SharedRuntime>(std::move(runtime));
}

}  // namespace actstash::client_internal::testing
