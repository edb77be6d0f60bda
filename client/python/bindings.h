// Shared pieces of actstash._native: the Status → Python exception mapping
// (the only one) and the registration of the copy-engine bindings.
#ifndef ACTSTASH_CLIENT_PYTHON_BINDINGS_H_
#define ACTSTASH_CLIENT_PYTHON_BINDINGS_H_

#include <pybind11/pybind11.h>

#include "absl/status/status.h"

namespace actstash::python {

// Raises the StashError subclass for the status's code (UNAVAILABLE and
// DEADLINE_EXCEEDED → StashUnavailable, RESOURCE_EXHAUSTED → StashFull,
// NOT_FOUND → StashNotFound, others StashError). Needs the GIL.
[[noreturn]] void Raise(const absl::Status& status);

// Raises when `status` is not OK.
inline void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

// CopyEngine, CopyEvent, PendingStore, cuda_copy_engine(), cuda_available().
void BindCopyEngines(pybind11::module_& m);

}  // namespace actstash::python

#endif  // ACTSTASH_CLIENT_PYTHON_BINDINGS_H_
