#include "tests/torch/session_counts.h"

#include "actstash/v1/stash.pb.h"

namespace actstash::torch {

absl::StatusOr<SessionCounts> CountSession(Client& client) {
  absl::StatusOr<v1::StatsReply> stats = client.Stats();
  if (!stats.ok()) return stats.status();
  SessionCounts counts;
  counts.zero_copy_objects = stats->self().client().objects();
  counts.inline_objects = stats->self().objects();
  counts.used_bytes = stats->self().used_bytes();
  counts.state_bytes = client.zero_copy_usage().state_bytes();
  return counts;
}

}  // namespace actstash::torch
