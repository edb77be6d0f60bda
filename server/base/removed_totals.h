// RemovedTotals: what a removal took away, the answer of every part that
// removes a session's things (the catalog's objects, the lease manager's
// leases, the spill tier's files).
#ifndef ACTSTASH_SERVER_BASE_REMOVED_TOTALS_H_
#define ACTSTASH_SERVER_BASE_REMOVED_TOTALS_H_

#include <cstdint>

namespace actstash::server {

struct RemovedTotals {
  uint64_t objects = 0;
  uint64_t bytes = 0;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_BASE_REMOVED_TOTALS_H_
