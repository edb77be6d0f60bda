#include "server/sessions/session.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace actstash::server {

QuotaReservation& QuotaReservation::operator=(QuotaReservation&& other) noexcept {
  if (this != &other) {
    Reset();
    session_ = std::move(other.session_);
    bytes_ = other.bytes_;
    other.bytes_ = 0;
  }
  return *this;
}

void QuotaReservation::Reset() {
  if (session_ != nullptr) session_->Release(bytes_);
  session_.reset();
  bytes_ = 0;
}

Session::Session(uint64_t id, std::string token, std::string name, uint32_t pid,
                 uint64_t quota_bytes, int64_t opened_unix_ms)
    : id_(id),
      token_(std::move(token)),
      name_(std::move(name)),
      pid_(pid),
      quota_bytes_(quota_bytes),
      opened_unix_ms_(opened_unix_ms),
      last_active_ms_(SteadyNowMs()) {}

absl::StatusOr<QuotaReservation> Session::Reserve(uint64_t bytes) {
  if (closed()) {
    return absl::FailedPreconditionError(absl::StrCat("session ", id_, " is closed"));
  }
  {
    absl::MutexLock lock(&mu_);
    const uint64_t available = quota_bytes_ - used_bytes_;
    if (bytes > available) {
      return absl::ResourceExhaustedError(
          absl::StrCat("session quota exceeded: requested ", bytes, " bytes, available ", available,
                       " bytes (quota ", quota_bytes_, ", in use ", used_bytes_, ")"));
    }
    used_bytes_ += bytes;
  }
  return QuotaReservation(shared_from_this(), bytes);
}

void Session::Release(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  ACTSTASH_CHECK(bytes <= used_bytes_, "session quota released more than it reserved");
  used_bytes_ -= bytes;
}

uint64_t Session::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

void Session::RecordStore(uint64_t bytes) {
  MarkCopying();
  bytes_stored_.fetch_add(bytes, std::memory_order_relaxed);
  puts_.fetch_add(1, std::memory_order_relaxed);
}

void Session::RecordFetch(uint64_t bytes) {
  MarkCopying();
  bytes_fetched_.fetch_add(bytes, std::memory_order_relaxed);
  gets_.fetch_add(1, std::memory_order_relaxed);
}

void Session::RecordClientUsage(const v1::ClientUsage& usage) {
  absl::MutexLock lock(&mu_);
  if (usage.bytes_stored() != client_usage_.bytes_stored() ||
      usage.bytes_fetched() != client_usage_.bytes_fetched()) {
    MarkCopying();
  }
  client_usage_ = usage;
}

void Session::SetCopyProbe(double store_bytes_per_second, double fetch_bytes_per_second) {
  absl::MutexLock lock(&mu_);
  probe_store_bps_ = store_bytes_per_second;
  probe_fetch_bps_ = fetch_bytes_per_second;
}

uint64_t Session::leased_bytes() const {
  absl::MutexLock lock(&mu_);
  return leased_bytes_;
}

void Session::AddLeases(int64_t count, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  leases_ += count;
  leased_bytes_ += bytes;
}

void Session::SetAttached(const PeerCredentials& peer) {
  absl::MutexLock lock(&mu_);
  attached_ = true;
  peer_ = peer;
}

void Session::SetDetached() {
  absl::MutexLock lock(&mu_);
  attached_ = false;
}

bool Session::attached() const {
  absl::MutexLock lock(&mu_);
  return attached_;
}

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Session::Touch() { last_active_ms_.store(SteadyNowMs(), std::memory_order_relaxed); }

void Session::FillStats(v1::SessionStats* out) const {
  out->set_session_id(id_);
  out->set_client_name(name_);
  out->set_client_pid(pid_);
  out->set_quota_bytes(quota_bytes_);
  out->set_bytes_stored(bytes_stored_.load(std::memory_order_relaxed));
  out->set_bytes_fetched(bytes_fetched_.load(std::memory_order_relaxed));
  out->set_puts(puts_.load(std::memory_order_relaxed));
  out->set_gets(gets_.load(std::memory_order_relaxed));
  out->set_opened_unix_ms(opened_unix_ms_);
  absl::MutexLock lock(&mu_);
  out->set_used_bytes(used_bytes_);
  out->set_attached(attached_);
  out->set_peer_uid(peer_.uid);
  out->set_peer_gid(peer_.gid);
  out->set_peer_pid(peer_.pid);
  out->set_leases(leases_);
  out->set_leased_bytes(leased_bytes_);
  *out->mutable_client() = client_usage_;
  out->set_probe_store_bytes_per_second(probe_store_bps_);
  out->set_probe_fetch_bytes_per_second(probe_fetch_bps_);
  out->set_numa_node(numa_node_.load(std::memory_order_relaxed));
  out->set_leases_off_node(leases_off_node_.load(std::memory_order_relaxed));
  out->set_reclaims_asked(reclaims_asked_.load(std::memory_order_relaxed));
  out->set_reclaim_bytes_asked(reclaim_bytes_asked_.load(std::memory_order_relaxed));
  const int64_t last_copy = last_copy_ms_.load(std::memory_order_relaxed);
  out->set_idle_ms(last_copy == INT64_MIN / 2 ? -1 : SteadyNowMs() - last_copy);
}

void Session::ExportState(v1::SessionState* out) const {
  out->set_id(id_);
  out->set_token(token_);
  out->set_name(name_);
  out->set_pid(pid_);
  out->set_quota_bytes(quota_bytes_);
  out->set_opened_unix_ms(opened_unix_ms_);
  out->set_attach_fd(-1);
  out->set_numa_node(numa_node_.load(std::memory_order_relaxed));
  out->set_bytes_stored(bytes_stored_.load(std::memory_order_relaxed));
  out->set_bytes_fetched(bytes_fetched_.load(std::memory_order_relaxed));
  out->set_puts(puts_.load(std::memory_order_relaxed));
  out->set_gets(gets_.load(std::memory_order_relaxed));
  out->set_leases_off_node(leases_off_node_.load(std::memory_order_relaxed));
  absl::MutexLock lock(&mu_);
  out->set_peer_uid(peer_.uid);
  out->set_peer_gid(peer_.gid);
  out->set_peer_pid(peer_.pid);
  *out->mutable_client_usage() = client_usage_;
}

void Session::RestoreCounters(const v1::SessionState& state) {
  numa_node_.store(state.numa_node(), std::memory_order_relaxed);
  bytes_stored_.store(state.bytes_stored(), std::memory_order_relaxed);
  bytes_fetched_.store(state.bytes_fetched(), std::memory_order_relaxed);
  puts_.store(state.puts(), std::memory_order_relaxed);
  gets_.store(state.gets(), std::memory_order_relaxed);
  leases_off_node_.store(state.leases_off_node(), std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  client_usage_ = state.client_usage();
}

}  // namespace actstash::server
