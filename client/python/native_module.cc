// actstash._native: the C++ client for Python. Does not link torch: tensors
// cross as (data pointer, byte count), so any torch >= 1.13 works, GPU
// builds included. Long operations release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "actstash/client.h"
#include "client/python/bindings.h"

namespace py = pybind11;
using actstash::python::Check;
using actstash::python::Raise;

namespace {

using Ticket = std::pair<uint64_t, uint64_t>;  // (id, nbytes)

std::shared_ptr<actstash::Client> Connect(const std::string& address, uint64_t quota,
                                          const std::string& name, const std::string& attach,
                                          int64_t rpc_timeout_ms, int64_t connect_timeout_ms,
                                          uint32_t lease_batch, const std::string& pin,
                                          int cuda_device) {
  actstash::ClientOptions options;
  options.address = address;
  options.quota_bytes = quota;
  options.client_name = name;
  options.rpc_timeout = std::chrono::milliseconds(rpc_timeout_ms);
  options.connect_timeout = std::chrono::milliseconds(connect_timeout_ms);
  options.lease_batch = lease_batch;
  options.cuda_device = cuda_device;
  if (attach == "auto") {
    options.attach = actstash::AttachMode::kAuto;
  } else if (attach == "required") {
    options.attach = actstash::AttachMode::kRequired;
  } else if (attach == "off") {
    options.attach = actstash::AttachMode::kOff;
  } else {
    throw py::value_error("attach must be 'auto', 'required' or 'off'");
  }
  if (pin == "auto") {
    options.pin_leases = actstash::PinPolicy::kAuto;
  } else if (pin == "on") {
    options.pin_leases = actstash::PinPolicy::kOn;
  } else if (pin == "off") {
    options.pin_leases = actstash::PinPolicy::kOff;
  } else {
    throw py::value_error("pin must be 'auto', 'on' or 'off'");
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
           py::arg("connect_timeout_ms") = 5000, py::arg("lease_batch") = 4,
           py::arg("pin") = "auto", py::arg("cuda_device") = 0)
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
      .def_property_readonly("pin_error",
                             [](const actstash::Client& c) -> py::object {
                               absl::Status s = c.pin_status();
                               if (s.ok()) return py::none();
                               return py::str(std::string(s.message()));
                             })
      .def("device_pools",
           [](const actstash::Client& c) {
             py::list pools;
             for (const actstash::DevicePoolInfo& p : c.device_pools()) {
               py::dict d;
               d["device"] = p.device;
               d["total_bytes"] = p.total_bytes;
               d["segment_bytes"] = p.segment_bytes;
               pools.append(d);
             }
             return pools;
           })
      .def("zero_copy_usage",
           [](const actstash::Client& c) {
             const actstash::ZeroCopyUsage u = c.zero_copy_usage();
             py::dict d;
             d["leases"] = u.leases;
             d["leased_bytes"] = u.leased_bytes;
             d["pinned_bytes"] = u.pinned_bytes;
             d["unpinned_leases"] = u.unpinned_leases;
             d["objects"] = u.objects;
             d["bytes"] = u.bytes;
             return d;
           })
      .def("close", [](actstash::Client& c) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = c.Close();
        }
        Check(s);
      });

  actstash::python::BindCopyEngines(m);
}
