// Copy-engine bindings of actstash._native: asynchronous stores, fetches and
// releases of tensors given as (data pointer, bytes, layout, stream), on the
// host engine (CPU tensors) or a CUDA engine (CUDA tensors; the caller's
// stream crosses as an integer, so torch is not linked).
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "actstash/client.h"
#include "actstash/copy_engine.h"
#include "client/python/bindings.h"

namespace py = pybind11;

namespace actstash::python {
namespace {

using TicketPair = std::pair<uint64_t, uint64_t>;  // (id, nbytes)

// One store, in flight or done. Two kinds:
//  - copied: Client::Store runs as host work on the store stream (inline or
//    zero-copy); the ticket is known once the event is done.
//  - placed: Client::Reserve placed it in leased memory and an engine copy
//    fills it; the ticket is known at once, fetches read it in place
//    (Locate), and it must be released even when the copy failed.
// Thread-safe.
class PendingStore {
 public:
  PendingStore(std::shared_ptr<Client> client, bool placed, bool bf16 = false)
      : client_(std::move(client)), placed_(placed), bf16_(bf16) {}
  void SetEvent(std::shared_ptr<CopyEvent> event) { event_ = std::move(event); }
  void SetTicket(Ticket ticket) {
    absl::MutexLock lock(&mu_);
    ticket_ = ticket;
  }
  bool Done() const { return event_->Done(); }
  absl::Status WaitStatus() const { return event_->Wait(); }
  TicketPair Wait() const {
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = event_->Wait();
    }
    Check(status);
    absl::MutexLock lock(&mu_);
    return {ticket_.id, ticket_.nbytes};
  }
  Ticket ticket() const {
    absl::MutexLock lock(&mu_);
    return ticket_;
  }
  bool placed() const { return placed_; }
  // Stored as bf16 (downcast from fp32): fetches convert back.
  bool bf16() const { return bf16_; }
  const std::shared_ptr<CopyEvent>& event() const { return event_; }
  const std::shared_ptr<Client>& client() const { return client_; }

 private:
  const std::shared_ptr<Client> client_;
  const bool placed_;
  const bool bf16_;
  std::shared_ptr<CopyEvent> event_;  // set once, before the store is shared
  mutable absl::Mutex mu_;
  Ticket ticket_ ABSL_GUARDED_BY(mu_);
};

using PendingPtr = std::shared_ptr<PendingStore>;

// pybind11 passes None as a null shared_ptr: refuse it before anything uses it.
template <typename T>
const T& NotNone(const std::shared_ptr<T>& p, const char* what) {
  if (p == nullptr) throw py::type_error(std::string(what) + " must not be None");
  return *p;
}

std::shared_ptr<CopyEngine> ValueOrRaise(absl::StatusOr<std::unique_ptr<CopyEngine>> engine) {
  if (!engine.ok()) Raise(engine.status());
  return std::shared_ptr<CopyEngine>(*std::move(engine));
}

// Stores the tensor at `ptr` (`nbytes` once packed) into memory reserved in
// the client's leases: one copy (or one gather when not dense) on the store
// stream, after the work already on the caller's `stream`. A CUDA gather
// kernel can write host memory only when it is registered (mapped): with
// `gather_needs_pinned`, a gather that landed in unpinned memory is not
// started and None is returned (the caller packs the tensor and copies it).
py::object StoreTensorAsync(CopyEngine& engine, std::shared_ptr<Client> client, uintptr_t ptr,
                            uint64_t nbytes, std::optional<std::vector<int64_t>> sizes,
                            std::optional<std::vector<int64_t>> strides, int element_size,
                            uintptr_t stream, bool gather_needs_pinned, int device_pool,
                            const std::string& downcast) {
  NotNone(client, "client");
  const bool bf16 = downcast == "bf16";
  if (!bf16 && !downcast.empty()) throw py::value_error("downcast must be '' or 'bf16'");
  if (bf16 && (sizes.has_value() || nbytes % 2 != 0)) {
    throw py::value_error("a bf16 downcast stores a dense fp32 tensor: nbytes = elements * 2");
  }
  auto pending = std::make_shared<PendingStore>(client, /*placed=*/true, bf16);
  absl::Status status;
  bool unpinned_gather = false;
  {
    py::gil_scoped_release release;
    absl::StatusOr<Reservation> reserved =
        device_pool >= 0 ? client->ReserveOnDevice(nbytes, static_cast<uint32_t>(device_pool))
                         : client->Reserve(nbytes);
    status = reserved.status();
    unpinned_gather = status.ok() && sizes.has_value() && gather_needs_pinned &&
                      !reserved->pinned && !reserved->on_device;
    if (unpinned_gather) {
      (void)client->Release(reserved->ticket);
    } else if (status.ok()) {
      absl::StatusOr<std::shared_ptr<CopyEvent>> event;
      const void* src = reinterpret_cast<const void*>(ptr);
      if (sizes.has_value()) {
        TensorLayout layout{*sizes, strides.value_or(std::vector<int64_t>{}), element_size};
        event = engine.GatherAsync(CopyStream::kStore, reserved->data, nbytes, src, layout,
                                   StreamHandle{stream});
      } else if (bf16) {
        event = engine.ConvertAsync(CopyStream::kStore, reserved->data, src, nbytes / 2,
                                    Conversion::kFp32ToBf16, StreamHandle{stream});
      } else {
        event =
            engine.CopyAsync(CopyStream::kStore, reserved->data, src, nbytes, StreamHandle{stream});
      }
      if (event.ok()) {
        pending->SetTicket(reserved->ticket);
        pending->SetEvent(*std::move(event));
      } else {
        status = event.status();
        (void)client->Release(reserved->ticket);  // nothing was enqueued
      }
    }
  }
  Check(status);
  if (unpinned_gather) return py::none();
  return py::cast(pending);
}

std::shared_ptr<CopyEvent> FetchAsync(CopyEngine& engine, PendingPtr stored, uintptr_t dst,
                                      uint64_t capacity, uintptr_t stream) {
  NotNone(stored, "stored");
  if (!stored->placed()) {
    // Ordered after the store (it may still be running) by waiting for it.
    py::gil_scoped_release release;  // may wait for room on a busy stream
    return engine.SubmitAsync(CopyStream::kFetch, [stored, dst, capacity]() -> absl::Status {
      if (absl::Status s = stored->WaitStatus(); !s.ok()) return s;
      return stored->client()->Fetch(stored->ticket(), reinterpret_cast<void*>(dst), capacity);
    });
  }
  absl::StatusOr<std::shared_ptr<CopyEvent>> event;
  {
    py::gil_scoped_release release;
    absl::StatusOr<StoredBytes> where = stored->client()->Locate(stored->ticket());
    if (!where.ok()) {
      event = where.status();
    } else if ((stored->bf16() ? where->nbytes * 2 : where->nbytes) > capacity) {
      event = absl::OutOfRangeError(absl::StrCat("stored tensor holds ", where->nbytes,
                                                 stored->bf16() ? " bytes of bf16" : " bytes",
                                                 "; the destination holds ", capacity));
    } else if (stored->bf16()) {
      const std::shared_ptr<CopyEvent> deps[] = {stored->event()};
      event = engine.ConvertAsync(CopyStream::kFetch, reinterpret_cast<void*>(dst), where->data,
                                  where->nbytes / 2, Conversion::kBf16ToFp32, StreamHandle{stream},
                                  deps);
    } else {
      const std::shared_ptr<CopyEvent> deps[] = {stored->event()};
      event = engine.CopyAsync(CopyStream::kFetch, reinterpret_cast<void*>(dst), where->data,
                               where->nbytes, StreamHandle{stream}, deps);
    }
  }
  if (!event.ok()) Raise(event.status());
  return *std::move(event);
}

std::shared_ptr<CopyEvent> ReleaseAsync(CopyEngine& engine, PendingPtr stored) {
  NotNone(stored, "stored");
  // On the fetch stream: after every fetch of it submitted before, and after
  // its own store (waited for), so no copy still reads or writes the memory.
  py::gil_scoped_release release;
  return engine.SubmitAsync(CopyStream::kFetch, [stored]() -> absl::Status {
    const bool stored_ok = stored->WaitStatus().ok();
    if (!stored_ok && !stored->placed()) return absl::OkStatus();  // nothing was stored
    return stored->client()->Release(stored->ticket());
  });
}

}  // namespace

void BindCopyEngines(py::module_& m) {
  py::class_<PendingStore, PendingPtr>(m, "PendingStore")
      .def("done", &PendingStore::Done)
      .def("wait", &PendingStore::Wait, "Blocks until stored; returns the ticket or raises.")
      .def_property_readonly("event", &PendingStore::event);

  py::class_<CopyEvent, std::shared_ptr<CopyEvent>>(m, "CopyEvent")
      .def("done", &CopyEvent::Done)
      .def("wait", [](const CopyEvent& e) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = e.Wait();
        }
        Check(s);
      });

  m.def("cuda_available", &CudaDeviceAvailable,
        "Whether this build has CUDA and a device can be used.");
  m.def(
      "cuda_copy_engine",
      [](int device, uint32_t max_in_flight) {
        CudaCopyEngineOptions options;
        options.device = device;
        options.max_in_flight = max_in_flight;
        return ValueOrRaise(CreateCudaCopyEngine(options));
      },
      py::arg("device") = 0, py::arg("max_in_flight") = 64,
      "A CopyEngine with dedicated CUDA streams on `device` (StashError when unavailable).");

  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "CopyEngine")
      .def(py::init([](int64_t max_delay_us, uint64_t seed) {
             HostCopyEngineOptions options;
             options.max_injected_delay = std::chrono::microseconds(max_delay_us);
             options.seed = seed;
             return std::shared_ptr<CopyEngine>(CreateHostCopyEngine(options));
           }),
           py::arg("max_delay_us") = 0, py::arg("seed") = 0)
      .def(
          "store_async",
          [](CopyEngine& engine, std::shared_ptr<Client> client, uintptr_t ptr, uint64_t nbytes) {
            // The caller keeps the source alive until the returned store is done.
            NotNone(client, "client");
            auto pending = std::make_shared<PendingStore>(client, /*placed=*/false);
            py::gil_scoped_release release;
            pending->SetEvent(engine.SubmitAsync(
                CopyStream::kStore, [client, ptr, nbytes, pending]() -> absl::Status {
                  absl::StatusOr<Ticket> t =
                      client->Store(reinterpret_cast<const void*>(ptr), nbytes);
                  if (!t.ok()) return t.status();
                  pending->SetTicket(*t);
                  return absl::OkStatus();
                }));
            return pending;
          },
          "Stores nbytes at ptr asynchronously on the store stream (Client::Store).")
      .def("store_tensor_async", &StoreTensorAsync, py::arg("client"), py::arg("ptr"),
           py::arg("nbytes"), py::arg("sizes") = py::none(), py::arg("strides") = py::none(),
           py::arg("element_size") = 1, py::arg("stream") = 0,
           py::arg("gather_needs_pinned") = false, py::arg("device_pool") = -1,
           py::arg("downcast") = "",
           "Reserves nbytes in leased memory and copies the tensor at ptr into it on the store "
           "stream after the caller's stream; sizes/strides (elements) gather a non-dense "
           "tensor. The caller keeps the source alive until the store is done. Needs an "
           "attached client. None when gather_needs_pinned and the memory is not pinned. "
           "device_pool >= 0: reserve in the daemon's device pool on that GPU (CUDA engine).")
      .def("fetch_async", &FetchAsync, py::arg("stored"), py::arg("dst"), py::arg("capacity"),
           py::arg("stream") = 0,
           "Fetches a store's bytes into dst on the fetch stream, after the store and after the "
           "caller's stream (dst must stay alive until the event is done).")
      .def("release_async", &ReleaseAsync,
           "Frees a store once its copies (and the fetches submitted before) are done.")
      .def(
          "order_after",
          [](CopyEngine& engine, const std::shared_ptr<CopyEvent>& event, uintptr_t stream) {
            NotNone(event, "event");
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = engine.OrderAfterAsync(StreamHandle{stream}, *event);
            }
            Check(s);
          },
          py::arg("event"), py::arg("stream") = 0,
          "Orders the caller's stream after event (CUDA: no host wait; host engine: waits).")
      .def("synchronize", [](CopyEngine& engine) {
        py::gil_scoped_release release;
        engine.Synchronize();
      });
}

}  // namespace actstash::python
