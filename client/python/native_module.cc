// actstash._native: the C++ client for Python. Does not link torch: tensors
// cross as (data pointer, byte count), so any torch >= 1.13 works, GPU
// builds included. Long operations release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "actstash/client.h"
#include "actstash/copy_engine.h"

namespace py = pybind11;

namespace {

py::object& ErrorClass(absl::StatusCode code) {
  static py::object* base = nullptr;
  static py::object* unavailable = nullptr;
  static py::object* full = nullptr;
  static py::object* not_found = nullptr;
  if (base == nullptr) {
    py::module_ m = py::module_::import("actstash._native");
    base = new py::object(m.attr("StashError"));
    unavailable = new py::object(m.attr("StashUnavailable"));
    full = new py::object(m.attr("StashFull"));
    not_found = new py::object(m.attr("StashNotFound"));
  }
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return *unavailable;
    case absl::StatusCode::kResourceExhausted:
      return *full;
    case absl::StatusCode::kNotFound:
      return *not_found;
    default:
      return *base;
  }
}

// The one place where a Status becomes a Python exception.
[[noreturn]] void Raise(const absl::Status& status) {
  py::object& cls = ErrorClass(status.code());
  PyErr_SetString(cls.ptr(), std::string(status.ToString()).c_str());
  throw py::error_already_set();
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

using Ticket = std::pair<uint64_t, uint64_t>;  // (id, nbytes)

// The outcome of an asynchronous Store: its event and, once done, its ticket.
class PendingStore {
 public:
  explicit PendingStore(std::shared_ptr<actstash::Client> client) : client_(std::move(client)) {}
  void SetEvent(std::shared_ptr<actstash::CopyEvent> event) { event_ = std::move(event); }
  void SetTicket(actstash::Ticket ticket) {
    absl::MutexLock lock(&mu_);
    ticket_ = ticket;
  }
  bool Done() const { return event_->Done(); }
  absl::Status WaitStatus() const { return event_->Wait(); }
  Ticket Wait() const {
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = event_->Wait();
    }
    Check(status);
    absl::MutexLock lock(&mu_);
    return {ticket_.id, ticket_.nbytes};
  }
  actstash::Ticket ticket() const {
    absl::MutexLock lock(&mu_);
    return ticket_;
  }
  const std::shared_ptr<actstash::Client>& client() const { return client_; }

 private:
  const std::shared_ptr<actstash::Client> client_;
  std::shared_ptr<actstash::CopyEvent> event_;
  mutable absl::Mutex mu_;
  actstash::Ticket ticket_ ABSL_GUARDED_BY(mu_);
};

std::shared_ptr<actstash::Client> Connect(const std::string& address, uint64_t quota,
                                          const std::string& name, const std::string& attach,
                                          int64_t rpc_timeout_ms, int64_t connect_timeout_ms,
                                          uint32_t lease_batch) {
  actstash::ClientOptions options;
  options.address = address;
  options.quota_bytes = quota;
  options.client_name = name;
  options.rpc_timeout = std::chrono::milliseconds(rpc_timeout_ms);
  options.connect_timeout = std::chrono::milliseconds(connect_timeout_ms);
  options.lease_batch = lease_batch;
  if (attach == "auto") {
    options.attach = actstash::AttachMode::kAuto;
  } else if (attach == "required") {
    options.attach = actstash::AttachMode::kRequired;
  } else if (attach == "off") {
    options.attach = actstash::AttachMode::kOff;
  } else {
    throw py::value_error("attach must be 'auto', 'required' or 'off'");
  }
  absl::StatusOr<std::unique_ptr<actstash::Client>> client;
  {
    py::gil_scoped_release release;
    client = actstash::Client::Connect(options);
  }
  if (!client.ok()) Raise(client.status());
  return std::shared_ptr<actstash::Client>(std::move(*client));
}

py::dict StatsDict(actstash::Client& client, bool all_sessions) {
  absl::StatusOr<actstash::StatsSnapshot> stats;
  {
    py::gil_scoped_release release;
    stats = client.Stats(all_sessions);
  }
  if (!stats.ok()) Raise(stats.status());
  auto session = [](const actstash::SessionStatsEntry& e) {
    py::dict d;
    d["session_id"] = e.session_id;
    d["client_name"] = e.client_name;
    d["client_pid"] = e.client_pid;
    d["quota_bytes"] = e.quota_bytes;
    d["used_bytes"] = e.used_bytes;
    d["objects"] = e.objects;
    d["bytes_stored"] = e.bytes_stored;
    d["bytes_fetched"] = e.bytes_fetched;
    d["attached"] = e.attached;
    d["peer_pid"] = e.peer_pid;
    d["leases"] = e.leases;
    d["leased_bytes"] = e.leased_bytes;
    d["local_objects"] = e.local_objects;
    d["local_bytes"] = e.local_bytes;
    return d;
  };
  py::dict d;
  d["pool_total_bytes"] = stats->pool_total_bytes;
  d["pool_used_bytes"] = stats->pool_used_bytes;
  d["pool_leased_bytes"] = stats->pool_leased_bytes;
  d["sessions"] = stats->sessions;
  d["objects"] = stats->objects;
  d["self"] = session(stats->self);
  py::list all;
  for (const auto& e : stats->all_sessions) all.append(session(e));
  d["all_sessions"] = all;
  return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "actstash native client (no torch dependency)";
  py::object base = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
  py::object stash_error = py::reinterpret_steal<py::object>(
      PyErr_NewException("actstash._native.StashError", base.ptr(), nullptr));
  m.attr("StashError") = stash_error;
  m.attr("StashUnavailable") = py::reinterpret_steal<py::object>(
      PyErr_NewException("actstash._native.StashUnavailable", stash_error.ptr(), nullptr));
  m.attr("StashFull") = py::reinterpret_steal<py::object>(
      PyErr_NewException("actstash._native.StashFull", stash_error.ptr(), nullptr));
  m.attr("StashNotFound") = py::reinterpret_steal<py::object>(
      PyErr_NewException("actstash._native.StashNotFound", stash_error.ptr(), nullptr));

  py::class_<actstash::Client, std::shared_ptr<actstash::Client>>(m, "Client")
      .def(py::init(&Connect), py::arg("address") = "", py::arg("quota") = 0, py::arg("name") = "",
           py::arg("attach") = "auto", py::arg("rpc_timeout_ms") = 30000,
           py::arg("connect_timeout_ms") = 5000, py::arg("lease_batch") = 4)
      .def_property_readonly("attached", &actstash::Client::attached)
      .def_property_readonly(
          "attach_error",
          [](const actstash::Client& c) { return std::string(c.attach_status().message()); })
      .def_property_readonly("session_id", &actstash::Client::session_id)
      .def_property_readonly("quota", &actstash::Client::quota_bytes)
      .def_property_readonly("address", &actstash::Client::address)
      .def("store",
           [](actstash::Client& c, uintptr_t ptr, uint64_t nbytes) -> Ticket {
             absl::StatusOr<actstash::Ticket> t;
             {
               py::gil_scoped_release release;
               t = c.Store(reinterpret_cast<const void*>(ptr), nbytes);
             }
             if (!t.ok()) Raise(t.status());
             return {t->id, t->nbytes};
           })
      .def("fetch",
           [](actstash::Client& c, Ticket ticket, uintptr_t dst, uint64_t capacity) {
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.Fetch(actstash::Ticket{ticket.first, ticket.second},
                           reinterpret_cast<void*>(dst), capacity);
             }
             Check(s);
           })
      .def("release",
           [](actstash::Client& c, Ticket ticket) {
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = c.Release(actstash::Ticket{ticket.first, ticket.second});
             }
             Check(s);
           })
      .def("stats", &StatsDict, py::arg("all_sessions") = false)
      .def("close", [](actstash::Client& c) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = c.Close();
        }
        Check(s);
      });

  py::class_<PendingStore, std::shared_ptr<PendingStore>>(m, "PendingStore")
      .def("done", &PendingStore::Done)
      .def("wait", &PendingStore::Wait, "Blocks until stored; returns the ticket or raises.");

  py::class_<actstash::CopyEvent, std::shared_ptr<actstash::CopyEvent>>(m, "CopyEvent")
      .def("done", &actstash::CopyEvent::Done)
      .def("wait", [](const actstash::CopyEvent& e) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = e.Wait();
        }
        Check(s);
      });

  py::class_<actstash::CopyEngine, std::shared_ptr<actstash::CopyEngine>>(m, "CopyEngine")
      .def(py::init([](int64_t max_delay_us, uint64_t seed) {
             actstash::HostCopyEngineOptions options;
             options.max_injected_delay = std::chrono::microseconds(max_delay_us);
             options.seed = seed;
             return std::shared_ptr<actstash::CopyEngine>(actstash::CreateHostCopyEngine(options));
           }),
           py::arg("max_delay_us") = 0, py::arg("seed") = 0)
      .def(
          "store_async",
          [](actstash::CopyEngine& engine, std::shared_ptr<actstash::Client> client, uintptr_t ptr,
             uint64_t nbytes) {
            // The caller keeps the source alive until the returned store is done.
            auto pending = std::make_shared<PendingStore>(client);
            pending->SetEvent(engine.SubmitAsync(
                actstash::CopyStream::kStore, [client, ptr, nbytes, pending]() -> absl::Status {
                  absl::StatusOr<actstash::Ticket> t =
                      client->Store(reinterpret_cast<const void*>(ptr), nbytes);
                  if (!t.ok()) return t.status();
                  pending->SetTicket(*t);
                  return absl::OkStatus();
                }));
            return pending;
          },
          "Stores nbytes at ptr asynchronously on the store stream.")
      .def(
          "fetch_async",
          [](actstash::CopyEngine& engine, std::shared_ptr<PendingStore> stored, uintptr_t dst,
             uint64_t capacity) {
            // Ordered after the store (it may still be running).
            return engine.SubmitAsync(
                actstash::CopyStream::kFetch, [stored, dst, capacity]() -> absl::Status {
                  if (absl::Status s = stored->WaitStatus(); !s.ok()) return s;
                  return stored->client()->Fetch(stored->ticket(), reinterpret_cast<void*>(dst),
                                                 capacity);
                });
          },
          "Fetches a store's bytes into dst asynchronously on the fetch stream.")
      .def("release_async",
           [](actstash::CopyEngine& engine, std::shared_ptr<PendingStore> stored) {
             // On the fetch stream: after every fetch of it submitted before.
             return engine.SubmitAsync(actstash::CopyStream::kFetch, [stored]() -> absl::Status {
               if (!stored->WaitStatus().ok()) return absl::OkStatus();  // nothing was stored
               return stored->client()->Release(stored->ticket());
             });
           })
      .def("synchronize", [](actstash::CopyEngine& engine) {
        py::gil_scoped_release release;
        engine.Synchronize();
      });
}
