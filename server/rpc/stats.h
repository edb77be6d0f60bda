// The daemon's stats, put together in one place. The wire messages of
// stash.proto are the schema end to end: each part of the daemon fills the
// fields it keeps (pools: PoolStats; sessions: SessionStats; the spill tier:
// SpillStats and SessionSpillStats; clients report ClientUsage) and this
// file assembles them into a StatsReply. The Stats RPC answers with it and
// /metrics reads it; the client returns it as is.
#ifndef ACTSTASH_SERVER_RPC_STATS_H_
#define ACTSTASH_SERVER_RPC_STATS_H_

#include "actstash/v1/stash.pb.h"
#include "server/rpc/stash_core.h"
#include "server/sessions/session.h"

namespace actstash::server {

// Fills `out` (empty) with the daemon's numbers: the pools as sessions see
// them (memory being renewed or zeroed moves from used_bytes to
// renewing_bytes), totals, `self` when not null, and every open session
// when `all_sessions`. Any thread; reads only thread-safe parts of `core`.
void FillStats(const StashCore& core, const Session* self, bool all_sessions, v1::StatsReply* out);

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_RPC_STATS_H_
