#include "server/sessions/session_manager.h"

#include <sys/random.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/protocol.h"

namespace actstash::server {
namespace {

std::string NewToken() {
  char bytes[16];
  size_t filled = 0;
  while (filled < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + filled, sizeof(bytes) - filled, 0);
    ACTSTASH_CHECK(n > 0 || errno == EINTR, "getrandom failed");
    if (n > 0) filled += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

SessionManager::SessionManager(const SessionManagerOptions& options, StateJournal* journal)
    : options_(options), journal_(journal) {}

bool SessionManager::RefuseIfUnused() {
  absl::MutexLock lock(&mu_);
  refusing_ = refusing_ || by_id_.empty();
  return refusing_;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Open(absl::string_view client_name,
                                                              uint64_t requested_quota,
                                                              uint32_t pid) {
  if (client_name.size() > kMaxClientNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("client_name is ", client_name.size(),
                                                   " bytes; at most ", kMaxClientNameBytes));
  }
  const uint64_t quota =
      std::min(requested_quota == 0 ? options_.default_quota_bytes : requested_quota,
               options_.max_quota_bytes);
  absl::MutexLock lock(&mu_);
  if (refusing_) {
    return absl::UnavailableError(
        "actstashd is shutting down (no session was open for its exit_when_unused_seconds); "
        "connect again once it is gone");
  }
  if (by_id_.size() >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "too many sessions: ", by_id_.size(), " open, the daemon allows ", options_.max_sessions));
  }
  std::string token = NewToken();
  while (id_by_token_.contains(token)) token = NewToken();
  const uint64_t id = next_id_++;
  auto session =
      std::make_shared<Session>(id, token, std::string(client_name), pid, quota, NowUnixMs());
  by_id_.emplace(id, session);
  id_by_token_.emplace(std::move(token), id);
  if (journal_ != nullptr) {
    v1::SessionState state;
    session->ExportState(&state);
    journal_->SessionOpened(state);
  }
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Authenticate(
    absl::string_view token) const {
  if (token.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat("missing session token: call OpenSession and send its token in the '",
                     kTokenMetadataKey, "' metadata"));
  }
  absl::MutexLock lock(&mu_);
  auto it = id_by_token_.find(token);
  if (it == id_by_token_.end()) {
    return absl::UnauthenticatedError(
        "unknown session token (the session was closed, or the daemon restarted since it was "
        "opened)");
  }
  return by_id_.at(it->second);
}

std::shared_ptr<Session> SessionManager::Close(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(session_id);
  if (it == by_id_.end()) return nullptr;
  std::shared_ptr<Session> session = std::move(it->second);
  by_id_.erase(it);
  id_by_token_.erase(session->token());
  session->MarkClosed();
  if (journal_ != nullptr) journal_->SessionClosed(session_id);
  return session;
}

std::vector<std::shared_ptr<Session>> SessionManager::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> sessions;
  sessions.reserve(by_id_.size());
  for (const auto& [id, session] : by_id_) sessions.push_back(session);
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return sessions;
}

std::vector<std::shared_ptr<Session>> SessionManager::IdleSessions(int64_t now_ms,
                                                                   int64_t ttl_ms) const {
  std::vector<std::shared_ptr<Session>> idle;
  for (std::shared_ptr<Session>& session : List()) {
    if (!session->attached() && now_ms - session->last_active_ms() > ttl_ms) {
      idle.push_back(std::move(session));
    }
  }
  return idle;
}

size_t SessionManager::size() const {
  absl::MutexLock lock(&mu_);
  return by_id_.size();
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Adopt(const v1::SessionState& state) {
  if (state.name().size() > kMaxClientNameBytes || state.token().empty() || state.id() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("handed session ", state.id(), " has no token, no id or an overlong name"));
  }
  absl::MutexLock lock(&mu_);
  if (by_id_.size() >= options_.max_sessions) {
    return absl::InvalidArgumentError(
        absl::StrCat("more handed sessions than max_sessions (", options_.max_sessions, ")"));
  }
  if (by_id_.contains(state.id()) || id_by_token_.contains(state.token())) {
    return absl::InvalidArgumentError(
        absl::StrCat("handed session ", state.id(), " repeats an id or a token"));
  }
  auto session = std::make_shared<Session>(state.id(), state.token(), state.name(), state.pid(),
                                           state.quota_bytes(), state.opened_unix_ms());
  session->RestoreCounters(state);
  by_id_.emplace(state.id(), session);
  id_by_token_.emplace(state.token(), state.id());
  next_id_ = std::max(next_id_, state.id() + 1);
  if (journal_ != nullptr) journal_->SessionOpened(state);
  return session;
}

uint64_t SessionManager::next_id() const {
  absl::MutexLock lock(&mu_);
  return next_id_;
}

void SessionManager::AdvanceNextId(uint64_t id) {
  absl::MutexLock lock(&mu_);
  next_id_ = std::max(next_id_, id);
}

}  // namespace actstash::server
