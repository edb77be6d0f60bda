#include <string>

#include "client/python/bindings.h"

namespace py = pybind11;

namespace actstash::python {
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

}  // namespace

void Raise(const absl::Status& status) {
  py::object& cls = ErrorClass(status.code());
  PyErr_SetString(cls.ptr(), std::string(status.ToString()).c_str());
  throw py::error_already_set();
}

}  // namespace actstash::python
