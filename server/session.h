// A client session: identity, token, quota accounting and counters.
#ifndef ACTSTASH_SERVER_SESSION_H_
#define ACTSTASH_SERVER_SESSION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace actstash::server {

class Session;

// Bytes of a session's quota held by one object (or one in-flight Put).
// Move-only; gives the bytes back when destroyed. Keeps its Session alive.
class QuotaReservation {
 public:
  QuotaReservation() = default;
  ~QuotaReservation() { Reset(); }
  QuotaReservation(QuotaReservation&& other) noexcept { *this = std::move(other); }
  QuotaReservation& operator=(QuotaReservation&& other) noexcept;
  QuotaReservation(const QuotaReservation&) = delete;
  QuotaReservation& operator=(const QuotaReservation&) = delete;

  uint64_t bytes() const { return bytes_; }
  void Reset();

 private:
  friend class Session;
  QuotaReservation(std::shared_ptr<Session> session, uint64_t bytes)
      : session_(std::move(session)), bytes_(bytes) {}
  std::shared_ptr<Session> session_;
  uint64_t bytes_ = 0;
};

struct SessionSnapshot {
  uint64_t id = 0;
  std::string name;
  uint32_t pid = 0;
  uint64_t quota_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t bytes_stored = 0;
  uint64_t bytes_fetched = 0;
  uint64_t puts = 0;
  uint64_t gets = 0;
  int64_t opened_unix_ms = 0;
};

// Thread-safe. Created and closed only by SessionManager; shared with
// in-flight RPCs and with the reservations of its objects, so it may outlive
// its closing.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(uint64_t id, std::string token, std::string name, uint32_t pid, uint64_t quota_bytes,
          int64_t opened_unix_ms);
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint64_t id() const { return id_; }
  const std::string& token() const { return token_; }
  const std::string& name() const { return name_; }
  uint64_t quota_bytes() const { return quota_bytes_; }

  // Reserves `bytes` of the quota. RESOURCE_EXHAUSTED (with requested, quota,
  // used and available bytes) when it does not fit; FAILED_PRECONDITION once
  // the session is closed.
  absl::StatusOr<QuotaReservation> Reserve(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t used_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  void RecordStore(uint64_t bytes);
  void RecordFetch(uint64_t bytes);
  SessionSnapshot Snapshot() const;

 private:
  friend class SessionManager;
  friend class QuotaReservation;
  void MarkClosed() { closed_.store(true, std::memory_order_release); }
  void Release(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  const uint64_t id_;
  const std::string token_;
  const std::string name_;
  const uint32_t pid_;
  const uint64_t quota_bytes_;
  const int64_t opened_unix_ms_;
  std::atomic<bool> closed_{false};
  mutable absl::Mutex mu_;
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> bytes_stored_{0};
  std::atomic<uint64_t> bytes_fetched_{0};
  std::atomic<uint64_t> puts_{0};
  std::atomic<uint64_t> gets_{0};
};

}  // namespace actstash::server

#endif  // ACTSTASH_SERVER_SESSION_H_
