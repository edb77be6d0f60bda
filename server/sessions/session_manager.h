// SessionManager: opens, authenticates and closes sessions.
#ifndef ACTSTASH_SERVER_SESSIONS_SESSION_MANAGER_H_
#define ACTSTASH_SERVER_SESSIONS_SESSION_MANAGER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/base/state_journal.h"
#include "server/sessions/session.h"

namespace actstash::server {

struct SessionManagerOptions {
  uint64_t default_quota_bytes = 0;  // granted when a client asks for 0
  uint64_t max_quota_bytes = 0;      // cap on any session's quota
  size_t max_sessions = 1024;
};

// Thread-safe: every member may be called from any thread (gRPC handlers).
class SessionManager {
 public:
  // `journal` (not owned; null: none) records every open and close, and
  // must outlive the manager.
  explicit SessionManager(const SessionManagerOptions& options, StateJournal* journal = nullptr);
  SessionManager(const SessionManager&) = delete;
  SessionManager& operator=(const SessionManager&) = delete;

  // Opens a session with a fresh random token. The quota is the default when
  // `requested_quota` is 0, else min(requested, max). RESOURCE_EXHAUSTED when
  // max_sessions are open; INVALID_ARGUMENT for an overlong name.
  absl::StatusOr<std::shared_ptr<Session>> Open(absl::string_view client_name,
                                                uint64_t requested_quota, uint32_t pid);
  // The open session with this token, else UNAUTHENTICATED (the message
  // never echoes the token).
  absl::StatusOr<std::shared_ptr<Session>> Authenticate(absl::string_view token) const;
  // Marks the session closed and forgets it (its token stops working at
  // once). Returns nullptr when it was not open. Freeing its objects is the
  // caller's job (Catalog::RemoveSession), after this returns.
  std::shared_ptr<Session> Close(uint64_t session_id);
  std::vector<std::shared_ptr<Session>> List() const;
  // Open sessions without an attach connection whose last call is older than
  // `ttl_ms` at `now_ms` (steady clock, SteadyNowMs).
  std::vector<std::shared_ptr<Session>> IdleSessions(int64_t now_ms, int64_t ttl_ms) const;
  size_t size() const;
  // When no session is open, refuses every later Open (UNAVAILABLE), checked
  // and set under one lock: a daemon that exits once unused must not open a
  // session in the moment it decides to go. Returns whether it refused.
  bool RefuseIfUnused();

  // Take-over: a session of the daemon this one succeeds, with its id and
  // token (and counters), before anything is served. INVALID_ARGUMENT for
  // an empty or repeated token or id, an overlong name, or more sessions
  // than max_sessions. Ids given later stay above every adopted one.
  absl::StatusOr<std::shared_ptr<Session>> Adopt(const v1::SessionState& state);
  // The id the next Open gives (exported with the state).
  uint64_t next_id() const;
  // Sets it to at least `id` (a successor's ids never repeat its
  // predecessor's).
  void AdvanceNextId(uint64_t id);

 private:
  const SessionManagerOptions options_;
  StateJournal* const journal_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Session>> by_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint64_t> id_by_token_ ABSL_GUARDED_BY(mu_);
  bool refusing_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_SESSIONS_SESSION_MANAGER_H_
