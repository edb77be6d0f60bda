// Daemon's side of a take-over (server/restart/take_over.h): what the
// serving daemon exports and how a successor adopts it. Handed over: the
// host pool's segments (their memfds, so clients' mappings stay valid), the
// sessions with their tokens, their host leases, their attach connections,
// inline objects (their ranges of the pool, or their spill files), spill
// files (fds: unlinked files have no other name), the attach and take-over
// listeners, and the id counters. Refused, with the daemon serving on:
// device pools (CUDA IPC memory belongs to the exporting process), spilled
// data for a successor without a spill tier, another pool geometry.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/attach_wire.h"
#include "common/errno_status.h"
#include "common/protocol.h"
#include "common/units.h"
#include "server/daemon/daemon.h"
#include "server/restart/state_image.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

// How long the serving daemon waits for returned leases' renewals (which
// replace segment fds) before it hands the fds over.
constexpr std::chrono::seconds kRenewalWait{10};

}  // namespace

absl::StatusOr<TakenOver> Daemon::ReceiveTakeOver(const DaemonConfig& config) {
  v1::TakeOverHello hello;
  hello.set_protocol(kTakeOverProtocol);
  hello.set_daemon_version(kVersion);
  hello.set_pool_bytes(config.pool_bytes);
  hello.set_segment_bytes(config.segment_bytes);
  hello.set_pid(static_cast<uint32_t>(getpid()));
  hello.set_spill_tier(!config.spill_dir.empty());
  absl::StatusOr<TakenOver> taken =
      RequestTakeOver(config.socket_path, hello, std::chrono::seconds(60));
  if (!taken.ok()) return taken.status();
  const v1::DaemonState& state = taken->state;
  const int64_t fds = static_cast<int64_t>(taken->fds.size());
  auto in_range = [fds](int64_t index) { return index >= 0 && index < fds; };
  bool ok = state.segment_bytes() == config.segment_bytes && state.segments() <= fds &&
            in_range(state.attach_listener_fd()) && in_range(state.handover_listener_fd()) &&
            state.attach_listener_fd() >= static_cast<int64_t>(state.segments()) &&
            state.handover_listener_fd() >= static_cast<int64_t>(state.segments());
  auto past_segments = [&](int64_t index) {
    return in_range(index) && index >= static_cast<int64_t>(state.segments());
  };
  for (const v1::SessionState& session : state.sessions()) {
    ok = ok && (session.attach_fd() == -1 || past_segments(session.attach_fd()));
  }
  for (const v1::SpillFileState& file : state.spill_files()) {
    ok = ok && past_segments(file.fd());
  }
  ok = ok && (!state.has_state_table_fd() || past_segments(state.state_table_fd()));
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--take-over: the handed state does not fit (segments of ", state.segment_bytes(),
        " bytes against ", config.segment_bytes, " configured, or fd indices outside the ", fds,
        " fds handed); the serving daemon goes on"));
  }
  spdlog::info(
      "take-over: received the state of pid {} (actstashd {}): {} sessions, {} leases, {} "
      "segments, {} inline objects, {} spill files",
      state.serving_pid(), state.daemon_version(), state.sessions_size(), state.leases_size(),
      state.segments(), state.objects_size(), state.spill_files_size());
  return taken;
}

absl::Status Daemon::CheckHandover(const v1::TakeOverHello& hello) const {
  if (!device_pools_.empty()) {
    return absl::FailedPreconditionError(
        "this actstashd has device pools, whose CUDA IPC memory belongs to the process that "
        "exported it: they cannot be handed over; drain the node and restart instead");
  }
  if (hello.segment_bytes() != pool_->segment_bytes() || hello.segment_bytes() == 0 ||
      hello.pool_bytes() / hello.segment_bytes() != pool_->segment_count()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the successor's pool (", FormatBytes(hello.pool_bytes()), " in segments of ",
                     FormatBytes(hello.segment_bytes()), ") is not this one's (",
                     pool_->segment_count(), " segments of ", FormatBytes(pool_->segment_bytes()),
                     "): start it with the same pool_size and segment_size"));
  }
  if (spill_ != nullptr && !hello.spill_tier() && spill_->Stats().files() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        spill_->Stats().files(),
        " spill files are on disk and the successor has no spill tier: start it with the same "
        "spill_dir"));
  }
  return absl::OkStatus();
}

absl::StatusOr<HandoverPackage> Daemon::PrepareHandover(const v1::TakeOverHello& hello) {
  if (absl::Status s = CheckHandover(hello); !s.ok()) return s;
  taking_over_pid_ = static_cast<pid_t>(hello.pid());
  const auto started = std::chrono::steady_clock::now();
  StopServing(
      std::chrono::milliseconds(static_cast<int64_t>(config_.shutdown_grace_seconds * 1000)),
      /*wait_for_calls=*/true, /*stop_attach=*/false);
  auto resume = [this](absl::Status why) -> absl::Status {
    if (frozen_.has_value()) {
      attach_.Thaw(std::move(frozen_->listener));
      frozen_.reset();
    }
    if (absl::Status s = StartServing(); !s.ok()) {
      spdlog::critical("serving again after a refused take-over failed: {}", s.ToString());
    }
    return why;
  };
  // Returned leases are renewed on the work queue, which replaces their
  // segments' fds: the fds handed over must be the final ones.
  const auto renew_deadline = std::chrono::steady_clock::now() + kRenewalWait;
  // Spill writes and reads end too (the calls that started them have ended,
  // but a dropped file's write may still run), as objects' reads do.
  auto settled = [this]() -> absl::Status {
    if (leases_.renewals_pending() > 0) {
      return absl::UnavailableError("returned leases are still being renewed; retry");
    }
    if (spill_ != nullptr) {
      const v1::SpillStats spill = spill_->Stats();
      if (spill.writing_bytes() > 0 || spill.reading_bytes() > 0) {
        return absl::UnavailableError("spill files are still being written or read; retry");
      }
    }
    return absl::OkStatus();
  };
  absl::Status quiet = settled();
  while (!quiet.ok() && std::chrono::steady_clock::now() < renew_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    quiet = settled();
  }
  if (!quiet.ok()) return resume(quiet);
  if (absl::Status s = CheckHandover(hello); !s.ok()) return resume(s);
  absl::StatusOr<AttachServer::Handed> handed = attach_.Freeze();
  if (!handed.ok()) return resume(handed.status());
  frozen_.emplace(*std::move(handed));

  HandoverPackage package;
  v1::DaemonState state;
  state.set_daemon_version(kVersion);
  state.set_serving_pid(static_cast<uint32_t>(getpid()));
  state.set_segment_bytes(pool_->segment_bytes());
  state.set_segments(pool_->segment_count());
  for (uint32_t i : pool_->HeldInlineSegments()) state.add_held_inline(i);
  absl::StatusOr<std::vector<UniqueFd>> segments = pool_->DupSegmentFds();
  if (!segments.ok()) return resume(segments.status());
  package.fds = *std::move(segments);
  auto add_fd = [&package](UniqueFd fd) {
    package.fds.push_back(std::move(fd));
    return static_cast<int32_t>(package.fds.size() - 1);
  };
  absl::StatusOr<UniqueFd> attach_listener =
      DupFd(frozen_->listener.get(), "dup for the take-over");
  if (!attach_listener.ok()) return resume(attach_listener.status());
  state.set_attach_listener_fd(add_fd(*std::move(attach_listener)));
  absl::StatusOr<UniqueFd> handover_listener = handover_->DupListener();
  if (!handover_listener.ok()) return resume(handover_listener.status());
  state.set_handover_listener_fd(add_fd(*std::move(handover_listener)));
  if (journal_ != nullptr) {
    absl::StatusOr<UniqueFd> table = DupFd(journal_->table().fd(), "dup for the take-over");
    if (!table.ok()) return resume(table.status());
    state.set_state_table_fd(add_fd(*std::move(table)));
  }
  absl::flat_hash_map<uint64_t, int32_t> attach_fd;
  for (auto& [session_id, fd] : frozen_->connections) {
    absl::StatusOr<UniqueFd> dup = DupFd(fd.get(), "dup for the take-over");
    if (!dup.ok()) return resume(dup.status());
    attach_fd[session_id] = add_fd(*std::move(dup));
  }
  for (const std::shared_ptr<Session>& session : sessions_.List()) {
    v1::SessionState* out = state.add_sessions();
    session->ExportState(out);
    if (spill_ != nullptr) *out->mutable_spill() = spill_->SessionStats(session->id());
    if (auto it = attach_fd.find(session->id()); it != attach_fd.end()) {
      out->set_attach_fd(it->second);
    }
  }
  for (v1::LeaseState& lease : leases_.Export()) *state.add_leases() = std::move(lease);
  if (absl::Status s = catalog_.Export(&state); !s.ok()) return resume(s);
  if (spill_ != nullptr) {
    if (absl::Status s = spill_->Export(&state, &package.fds); !s.ok()) return resume(s);
  }
  state.set_next_session_id(sessions_.next_id());
  state.set_next_lease_id(leases_.next_id());
  state.set_next_object_handle(catalog_.next_handle());
  state.set_lost_object_handles_below(catalog_.lost_below());
  state.set_leases_granted_total(leases_.granted_total());
  state.set_sessions_reclaimed(core_.sessions_reclaimed.load(std::memory_order_relaxed));
  state.set_handovers(handovers_);
  absl::StatusOr<UniqueFd> image = WriteStateImage(state);
  if (!image.ok()) return resume(image.status());
  package.state_image = *std::move(image);
  spdlog::info(
      "take-over by pid {}: handing over {} sessions ({} attached), {} leases, {} segments, {} "
      "inline objects, {} spill files (stopped serving for {} ms so far)",
      hello.pid(), state.sessions_size(), attach_fd.size(), state.leases_size(), state.segments(),
      state.objects_size(), state.spill_files_size(),
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                            started)
          .count());
  return package;
}

void Daemon::FinishHandover(bool adopted) {
  if (!adopted) {
    if (frozen_.has_value()) {
      attach_.Thaw(std::move(frozen_->listener));
      frozen_.reset();
    }
    if (absl::Status s = StartServing(); !s.ok()) {
      spdlog::critical("serving again after an incomplete take-over failed: {}", s.ToString());
      return;
    }
    spdlog::info("serving again: the take-over did not complete");
    return;
  }
  // The successor holds every fd and serves the socket paths: this process
  // leaves without touching the pool, the sessions or the socket files (no
  // destructors: leases freed here would renew, i.e. empty, segments the
  // successor serves). A pool this daemon took over may still be locking.
  pool_->FinishBackgroundWork();
  // A successor this daemon started is the service's main process from now
  // on: the manager must know before this one exits, or it would take the
  // exit for the service's end and stop the successor with it.
  const bool handed_main =
      notifier_ != nullptr && taking_over_pid_ != 0 && taking_over_pid_ == expected_successor_;
  bool stay = config_.wait_after_take_over && !handed_main;
  if (handed_main) {
    absl::Status told = notifier_->Notify(absl::StrCat("MAINPID=", taking_over_pid_));
    if (told.ok()) told = notifier_->Barrier(std::chrono::seconds(5));
    // The manager ignores a MAINPID of a process that is gone.
    const bool alive = kill(taking_over_pid_, 0) == 0;
    if (told.ok() && alive) {
      spdlog::info("the service manager tracks pid {} as the main process now", taking_over_pid_);
    } else if (!alive) {
      // Exiting 0 would end the service (and flush what the manager keeps):
      // a failure makes it restart from what is kept.
      spdlog::error("the successor (pid {}) is gone after it took over; exiting 1",
                    taking_over_pid_);
      spdlog::default_logger()->flush();
      std::fflush(nullptr);
      _exit(1);
    } else {
      // The manager still tracks this process: it stays, holding nothing,
      // so that the service does not end while the successor serves.
      spdlog::error(
          "telling the service manager that pid {} is the main process now: {}; staying as the "
          "main process, holding nothing",
          taking_over_pid_, told.ToString());
      stay = true;
    }
  }
  if (stay) {
    // A fresh image that holds nothing of this one (fds are closed there)
    // and waits for SIGTERM (server/daemon/main.cc).
    spdlog::info("handed over; waiting for SIGTERM");
    // Flushed, not shut down: the main thread may still log (a SIGTERM
    // that arrives now) until the exec replaces the process.
    spdlog::default_logger()->flush();
    std::fflush(nullptr);
    char name[] = "actstashd";
    char flag[] = "--handed-over";
    char* const argv[] = {name, flag, nullptr};
    execv("/proc/self/exe", argv);
    std::fprintf(stderr, "actstashd: exec for --handed-over failed: %s; exiting\n",
                 std::strerror(errno));
    _exit(0);
  }
  spdlog::info("handed over; exiting");
  spdlog::default_logger()->flush();
  std::fflush(nullptr);
  // The successor waits for the take-over connection to close (to claim the
  // ports and change what the service manager keeps): closed now, not after
  // the kernel has torn the pool's mappings down, which takes a large pool
  // over 100 ms.
  close_range(3, ~0U, 0);
  _exit(0);
}

absl::Status Daemon::AdoptState(TakenOver* taken) {
  const v1::DaemonState& state = taken->state;
  // On any error the leases adopted so far are dropped: unrenewed, since the
  // predecessor serves their memory again.
  auto fail = [this](absl::Status why) {
    leases_.StopRenewing();
    return absl::Status(
        why.code(), absl::StrCat("--take-over: ", why.message(), "; the serving daemon goes on"));
  };
  absl::flat_hash_map<uint64_t, std::shared_ptr<Session>> by_id;
  for (const v1::SessionState& s : state.sessions()) {
    absl::StatusOr<std::shared_ptr<Session>> session = sessions_.Adopt(s);
    if (!session.ok()) return fail(session.status());
    by_id[s.id()] = *session;
  }
  for (const v1::LeaseState& lease : state.leases()) {
    auto it = by_id.find(lease.session_id());
    if (it == by_id.end()) {
      return fail(
          absl::InvalidArgumentError(absl::StrCat("lease ", lease.id(), " belongs to session ",
                                                  lease.session_id(), ", which was not handed")));
    }
    absl::StatusOr<SegmentRun> run = pool_->AdoptRun(lease.first_segment(), lease.count());
    if (!run.ok()) return fail(run.status());
    if (absl::Status s = leases_.Adopt(it->second, lease, &*run); !s.ok()) return fail(s);
  }
  if (state.spill_files_size() > 0 && spill_ == nullptr) {
    return fail(absl::FailedPreconditionError(
        "spill files were handed and this actstashd has no spill tier (spill_dir)"));
  }
  if (spill_ != nullptr) {
    if (absl::Status s = spill_->Adopt(state, &taken->fds); !s.ok()) return fail(s);
  }
  absl::flat_hash_set<uint64_t> spill_ids;  // each file held by one object at most
  for (const v1::ObjectState& object : state.objects()) {
    if (absl::Status s = AdoptObject(object, by_id, &spill_ids); !s.ok()) return fail(s);
  }
  leases_.Restore(state.next_lease_id(), state.leases_granted_total());
  sessions_.AdvanceNextId(state.next_session_id());
  catalog_.AdvanceNextHandle(state.lost_object_handles_below(), /*lost=*/true);
  catalog_.AdvanceNextHandle(state.next_object_handle());
  core_.sessions_reclaimed.store(state.sessions_reclaimed(), std::memory_order_relaxed);
  handovers_ = state.handovers() + 1;
  for (const v1::SessionState& s : state.sessions()) {
    if (s.attach_fd() < 0) continue;
    if (absl::Status st = attach_.Adopt(by_id[s.id()], std::move(taken->fds[s.attach_fd()]));
        !st.ok()) {
      return fail(st);
    }
  }
  spdlog::info(
      "took over {} sessions, {} leases, {} inline objects and {} spill files from pid {} "
      "(hand-over {} of this state)",
      state.sessions_size(), state.leases_size(), state.objects_size(), state.spill_files_size(),
      state.serving_pid(), handovers_);
  return absl::OkStatus();
}

std::unique_ptr<StateTable> Daemon::CopyHandedTable(const DaemonConfig& config,
                                                    const TakenOver& taken,
                                                    std::optional<RecoveredState>* out) {
  if (!taken.state.has_state_table_fd()) {
    spdlog::info(
        "take-over: the serving daemon kept no state table for a restart after a crash; this one "
        "keeps a new one");
    return nullptr;
  }
  RecoveredState read;
  absl::StatusOr<std::unique_ptr<StateTable>> copy =
      StateTable::Copy(taken.fds[taken.state.state_table_fd()].get(), GeometryOf(config), &read);
  if (!copy.ok()) {
    spdlog::warn("take-over: the serving daemon's state table is not used ({}); a new one is kept",
                 copy.status().ToString());
    return nullptr;
  }
  out->emplace(std::move(read));
  return *std::move(copy);
}

absl::StatusOr<std::vector<std::pair<v1::SpillFileState, UniqueFd>>> Daemon::DupSpillFiles(
    const TakenOver& taken) {
  std::vector<std::pair<v1::SpillFileState, UniqueFd>> out;
  for (const v1::SpillFileState& file : taken.state.spill_files()) {
    absl::StatusOr<UniqueFd> fd = DupFd(taken.fds[file.fd()].get(), "dup of a handed spill file");
    if (!fd.ok()) return fd.status();
    v1::SpillFileState recorded = file;
    recorded.clear_fd();
    out.emplace_back(std::move(recorded), *std::move(fd));
  }
  return out;
}

void Daemon::RecordTakenOver(const TakenOver& taken,
                             const std::optional<RecoveredState>& handed_table,
                             std::vector<std::pair<v1::SpillFileState, UniqueFd>> spills) {
  if (handed_table.has_value()) {
    // The copy records what the predecessor's table did, the store holds
    // the same files: they leave both when they leave the tier.
    journal_->SpillFilesRecovered(handed_table->spill_files);
    return;
  }
  // The adoption recorded the sessions, leases and objects into the fresh
  // table; the spill files go in with their fds (any earlier fd of a name
  // is replaced), and no handle below the predecessor's is issued again.
  for (auto& [file, fd] : spills) {
    (void)notifier_->RemoveFds(SpillFdName(file.id()));
    journal_->SpillFileKept(file, fd.get());
  }
  if (taken.state.next_object_handle() > 1) {
    journal_->ObjectHandleIssued(taken.state.next_object_handle() - 1);
  }
}

absl::Status Daemon::AdoptObject(
    const v1::ObjectState& state,
    const absl::flat_hash_map<uint64_t, std::shared_ptr<Session>>& sessions,
    absl::flat_hash_set<uint64_t>* spill_ids) {
  auto it = sessions.find(state.session_id());
  if (it == sessions.end()) {
    return absl::InvalidArgumentError(absl::StrCat("object ", state.handle(),
                                                   " belongs to session ", state.session_id(),
                                                   ", which was not handed"));
  }
  const std::shared_ptr<Session>& session = it->second;
  v1::ObjectHeader header;
  header.set_dtype(state.dtype());
  for (int64_t dim : state.shape()) header.add_shape(dim);
  header.mutable_checksum()->set_algorithm(
      static_cast<v1::ChecksumAlgorithm>(state.checksum_algorithm()));
  if (absl::Status valid = ValidateObjectHeader(header); !valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("object ", state.handle(), ": ", valid.message()));
  }
  ObjectMeta meta;
  meta.dtype = state.dtype();
  meta.shape.assign(state.shape().begin(), state.shape().end());
  meta.nbytes = state.nbytes();
  meta.checksum_algorithm = state.checksum_algorithm();
  meta.checksum = state.checksum();
  meta.put_id = state.put_id();
  std::shared_ptr<StoredObject> object;
  if (state.residence_case() == v1::ObjectState::kSpillId) {
    // Its file was adopted with the spill tier: the same session's, as long.
    if (spill_ == nullptr || !spill_->Holds(state.session_id(), state.spill_id(), state.nbytes()) ||
        !spill_ids->insert(state.spill_id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("object ", state.handle(), " names spill file ", state.spill_id(),
                       ", which its session does not hold with ", state.nbytes(),
                       " bytes, or another object names too"));
    }
    object = StoredObject::Spilled(session->id(), std::move(meta), state.spill_id(), spill_.get());
  } else if (state.residence_case() == v1::ObjectState::kPoolOffset) {
    absl::StatusOr<QuotaReservation> reservation = session->Reserve(state.nbytes());
    if (!reservation.ok()) return reservation.status();
    absl::StatusOr<Allocation> memory = pool_->AdoptAllocation(state.pool_offset(), state.nbytes());
    if (!memory.ok()) return memory.status();
    object = std::make_shared<StoredObject>(session->id(), std::move(meta), *std::move(memory),
                                            *std::move(reservation));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("object ", state.handle(), " has neither a pool offset nor a spill file"));
  }
  return catalog_.Adopt(*session, state.handle(), std::move(object));
}

}  // namespace actstash::server
