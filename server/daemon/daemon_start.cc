// How a Daemon starts: afresh, after a crash (from what the service manager
// kept, server/restart/crash_recovery.h), or taking over from a daemon that
// serves beside it (server/restart/take_over.h). Start chooses; each mode
// is one function built from the shared steps below it. Everything here
// runs on the main thread before anything is served.
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/attach_wire.h"
#include "common/protocol.h"
#include "common/units.h"
#include "server/base/socket_path.h"
#include "server/daemon/cuda_probe.h"
#include "server/daemon/daemon.h"
#include "spdlog/spdlog.h"

namespace actstash::server {

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonConfig& config,
                                                      std::unique_ptr<DeviceMemory> device_memory) {
  spdlog::info("actstashd {} starting (pid {}); {}", kVersion, getpid(), DescribeCudaDevices());
  // Taken first: a daemon restarted after a crash recovers from them even
  // when its command line says --take-over (it was a successor itself).
  absl::StatusOr<std::vector<PassedFd>> passed = TakePassedFds();
  std::optional<TakenOver> taken;
  if (config.take_over != Tristate::kOff) {
    absl::StatusOr<TakenOver> received = ReceiveTakeOver(config);
    if (received.ok()) {
      taken.emplace(*std::move(received));
    } else if (config.take_over == Tristate::kAuto && absl::IsUnavailable(received.status())) {
      spdlog::info("take-over (auto): {}; starting afresh",
                   std::string(received.status().message()));
    } else if (absl::IsUnavailable(received.status()) && passed.ok() && !passed->empty()) {
      spdlog::info("take-over: {}; the service manager passed kept fds: recovering from them",
                   std::string(received.status().message()));
    } else {
      return received.status();
    }
  }
  absl::StatusOr<std::unique_ptr<ServiceNotifier>> notifier = ServiceNotifier::FromEnvironment();
  if (!notifier.ok()) return notifier.status();
  if (taken) {
    return StartTakingOver(config, std::move(device_memory), *std::move(notifier),
                           *std::move(taken));
  }
  if (!passed.ok()) {
    spdlog::warn("recovery: {}; starting afresh", passed.status().ToString());
  } else if (!passed->empty() && *notifier == nullptr) {
    spdlog::warn("recovery: {} fds were passed but NOTIFY_SOCKET is not set; starting afresh",
                 passed->size());
  } else if (!passed->empty()) {
    return StartAfterCrash(config, std::move(device_memory), *std::move(notifier),
                           *std::move(passed));
  }
  return StartFresh(config, std::move(device_memory), *std::move(notifier));
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::StartFresh(
    const DaemonConfig& config, std::unique_ptr<DeviceMemory> device_memory,
    std::unique_ptr<ServiceNotifier> notifier) {
  if (absl::Status s = MakeParentDirectory(config.socket_path); !s.ok()) return s;
  if (absl::Status s = ClaimSocketPath(config.socket_path); !s.ok()) return s;
  Parts parts;
  parts.notifier = std::move(notifier);
  if (absl::Status s = CreateMemory(config, std::move(device_memory), &parts); !s.ok()) return s;
  if (parts.notifier != nullptr) {
    absl::StatusOr<bool> kept =
        KeepStateForRestart(config, nullptr, std::vector<bool>(GeometryOf(config).segments, false),
                            /*store_table=*/true, {}, /*give_up_on_failure=*/true, &parts);
    if (!kept.ok()) return kept.status();
  }
  if (absl::Status s = OpenSpillTier(config, &parts); !s.ok()) return s;
  if (absl::Status s = OpenAttachSocket(config, UniqueFd(), AttachFrom::kNew, &parts); !s.ok()) {
    return s;
  }
  std::unique_ptr<Daemon> daemon(new Daemon(config, std::move(parts)));
  if (absl::Status s = daemon->FinishStart(UniqueFd(), /*recovered=*/false); !s.ok()) return s;
  return daemon;
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::StartAfterCrash(
    const DaemonConfig& config, std::unique_ptr<DeviceMemory> device_memory,
    std::unique_ptr<ServiceNotifier> notifier, std::vector<PassedFd> passed) {
  Recovery recovery =
      CollectRecovery(GeometryOf(config), !config.device_pools.empty(), std::move(passed));
  if (!recovery.why_lost.empty()) {
    spdlog::error(
        "recovery: the state of the daemon that crashed is not trusted ({}); starting empty: "
        "its clients' sessions and leases are lost, and they are told so",
        recovery.why_lost);
  }
  if (absl::Status s = MakeParentDirectory(config.socket_path); !s.ok()) return s;
  if (absl::Status s = ClaimSocketPath(config.socket_path); !s.ok()) return s;
  // Without a trusted table this is a fresh start that still uses what the
  // service manager kept beside it: the attach listener (clients wait in
  // its backlog) and the names of fds to drop.
  const bool recovered = recovery.table != nullptr;
  std::vector<bool> reused_segments(GeometryOf(config).segments, recovered);
  AdoptedSegments adopt;
  if (recovered) {
    for (size_t i = 0; i < recovery.segments.size(); ++i) {
      reused_segments[i] = recovery.segments[i].valid();
    }
    adopt.fds = std::move(recovery.segments);
    adopt.held_inline = recovery.reused_free;
  }
  Parts parts;
  parts.notifier = std::move(notifier);
  if (absl::Status s =
          CreateMemory(config, std::move(device_memory), &parts, recovered ? &adopt : nullptr);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<bool> kept = KeepStateForRestart(
      config, std::move(recovery.table), std::move(reused_segments), /*store_table=*/!recovered,
      recovery.dropped_names, /*give_up_on_failure=*/true, &parts);
  if (!kept.ok()) return kept.status();
  if (absl::Status s = OpenSpillTier(config, &parts); !s.ok()) return s;
  if (absl::Status s = OpenAttachSocket(config, std::move(recovery.attach_listener),
                                        AttachFrom::kServiceManager, &parts);
      !s.ok()) {
    return s;
  }
  std::unique_ptr<Daemon> daemon(new Daemon(config, std::move(parts)));
  if (recovered) {
    if (absl::Status s = daemon->AdoptRecovered(&recovery); !s.ok()) return s;
  }
  if (absl::Status s = daemon->FinishStart(UniqueFd(), recovered); !s.ok()) return s;
  return daemon;
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::StartTakingOver(
    const DaemonConfig& config, std::unique_ptr<DeviceMemory> device_memory,
    std::unique_ptr<ServiceNotifier> notifier, TakenOver taken) {
  // The predecessor's segments (fds 0 .. segments-1), with their data. The
  // socket path is claimed only once the predecessor is gone (below).
  AdoptedSegments adopt;
  for (uint32_t i = 0; i < taken.state.segments(); ++i) {
    adopt.fds.push_back(std::move(taken.fds[i]));
  }
  adopt.held_inline.assign(taken.state.held_inline().begin(), taken.state.held_inline().end());
  Parts parts;
  parts.notifier = std::move(notifier);
  if (absl::Status s = CreateMemory(config, std::move(device_memory), &parts, &adopt); !s.ok()) {
    return s;
  }
  // Under a service manager the successor goes on with a copy of its
  // predecessor's table (handed_table: what that copy holds), or a fresh
  // one it fills as it adopts; either replaces the kept table only once the
  // predecessor is gone (the take-over may still fail until then).
  std::optional<RecoveredState> handed_table;
  bool drop_kept_table = false;  // after the take-over: no table of this daemon's is kept
  if (parts.notifier != nullptr) {
    std::unique_ptr<StateTable> table = CopyHandedTable(config, taken, &handed_table);
    // The segments the store holds are the very memfds handed over; those
    // it does not (a store that failed) are stored now.
    std::vector<bool> reused_segments(GeometryOf(config).segments, false);
    if (handed_table.has_value()) {
      for (size_t i = 0; i < reused_segments.size() && i < handed_table->kept.size(); ++i) {
        reused_segments[i] = handed_table->kept[i];
      }
    }
    // A failure drops the predecessor's table from the store, once it is gone.
    absl::StatusOr<bool> kept =
        KeepStateForRestart(config, std::move(table), std::move(reused_segments),
                            /*store_table=*/false, {},
                            /*give_up_on_failure=*/false, &parts);
    if (!kept.ok()) return kept.status();
    drop_kept_table = !*kept;
  }
  if (absl::Status s = OpenSpillTier(config, &parts); !s.ok()) return s;
  if (absl::Status s =
          OpenAttachSocket(config, std::move(taken.fds[taken.state.attach_listener_fd()]),
                           AttachFrom::kPredecessor, &parts);
      !s.ok()) {
    return s;
  }
  std::unique_ptr<Daemon> daemon(new Daemon(config, std::move(parts)));
  // A fresh table records the handed spill files with their fds, which the
  // adoption moves into the spill tier.
  std::vector<std::pair<v1::SpillFileState, UniqueFd>> spills_to_record;
  if (daemon->journal_ != nullptr && !handed_table.has_value()) {
    absl::StatusOr<std::vector<std::pair<v1::SpillFileState, UniqueFd>>> dups =
        DupSpillFiles(taken);
    if (!dups.ok()) return dups.status();
    spills_to_record = *std::move(dups);
  }
  if (absl::Status s = daemon->AdoptState(&taken); !s.ok()) return s;
  if (daemon->journal_ != nullptr) {
    daemon->RecordTakenOver(taken, handed_table, std::move(spills_to_record));
  }
  UniqueFd handed_listener = std::move(taken.fds[taken.state.handover_listener_fd()]);
  // The predecessor still holds its TCP and metrics ports until it exits:
  // wait for that (its end of the connection closing, as when it execs with
  // after_take_over = wait) when this daemon needs them, and before it
  // changes what the service manager keeps: a confirmation that fails (the
  // predecessor gave up waiting and serves again) leaves the store as the
  // predecessor keeps it, and so does a socket path it still serves.
  const bool needs_ports = !config.listen_tcp.empty() || !config.metrics_address.empty();
  const bool changes_store = daemon->journal_ != nullptr || drop_kept_table;
  absl::Status confirmed = ConfirmTakeOver(
      &taken, needs_ports || changes_store ? std::chrono::seconds(30) : std::chrono::seconds(0));
  if (!confirmed.ok() && changes_store) {
    return absl::Status(confirmed.code(),
                        absl::StrCat("take-over: ", confirmed.message(),
                                     "; the service manager's fd store is left as it was"));
  }
  if (!confirmed.ok() && needs_ports) {
    spdlog::warn("take-over: {}; serving anyway", confirmed.ToString());
  }
  if (absl::Status s = ClaimSocketPath(config.socket_path); !s.ok()) return s;
  // The predecessor is gone: from now on this daemon's table is the one a
  // restart after a crash must find.
  if (daemon->journal_ != nullptr) {
    if (absl::Status s = daemon->journal_->StoreTable(); !s.ok()) {
      spdlog::error(
          "keeping the state table for a restart after a crash failed: {}; this daemon's "
          "sessions will not survive a crash",
          s.ToString());
      daemon->journal_->GiveUp();
    } else {
      spdlog::info("take-over: the service manager keeps this daemon's state table from now on");
    }
  } else if (drop_kept_table) {
    (void)daemon->notifier_->RemoveFds(kStateFdName);
  }
  if (absl::Status s = daemon->FinishStart(std::move(handed_listener), /*recovered=*/false);
      !s.ok()) {
    return s;
  }
  return daemon;
}

absl::StatusOr<bool> Daemon::KeepStateForRestart(const DaemonConfig& config,
                                                 std::unique_ptr<StateTable> table,
                                                 std::vector<bool> reused_segments,
                                                 bool store_table,
                                                 const std::vector<std::string>& dropped_names,
                                                 bool give_up_on_failure, Parts* parts) {
  if (table == nullptr) {
    absl::StatusOr<std::unique_ptr<StateTable>> fresh = StateTable::Create(GeometryOf(config));
    if (!fresh.ok()) return fresh.status();
    table = *std::move(fresh);
  }
  parts->journal = std::make_unique<DaemonJournal>(std::move(table), parts->notifier.get());
  parts->journal->SetPool(parts->pool.get());
  // Before anything is served: a lease granted from now on must find its
  // segments' memfds kept.
  absl::Status s = parts->journal->KeepForRestart(reused_segments, store_table, dropped_names);
  if (s.ok()) return true;
  spdlog::error(
      "keeping the pool for a restart after a crash failed: {}; this daemon's sessions will not "
      "survive a crash (is FileDescriptorStoreMax at least {}?)",
      s.ToString(), GeometryOf(config).segments + 2);
  if (give_up_on_failure) parts->journal->GiveUp();
  parts->journal.reset();
  return false;
}

absl::Status Daemon::OpenSpillTier(const DaemonConfig& config, Parts* parts) {
  if (config.spill_dir.empty()) return absl::OkStatus();
  SpillOptions spill_options;
  spill_options.dir = config.spill_dir;
  spill_options.size_bytes = config.spill_bytes;
  absl::StatusOr<std::unique_ptr<SpillTier>> spill = SpillTier::Open(spill_options);
  if (!spill.ok()) return spill.status();
  parts->spill = *std::move(spill);
  spdlog::info("spill tier in {} ({}), {}", config.spill_dir,
               config.spill_bytes > 0 ? absl::StrCat("at most ", FormatBytes(config.spill_bytes))
                                      : std::string("bounded by the free space"),
               parts->spill->Stats().io_mode());
  parts->spill->SetJournal(parts->journal.get());
  return absl::OkStatus();
}

absl::Status Daemon::OpenAttachSocket(const DaemonConfig& config, UniqueFd listener,
                                      AttachFrom from, Parts* parts) {
  AttachServerOptions options;
  options.socket_path = attach::AttachSocketPath(config.socket_path);
  options.socket_mode = config.socket_mode;
  options.allow_uids = config.allow_uids;
  options.allow_gids = config.allow_gids;
  options.recoverable = parts->journal != nullptr;
  options.accept_later = true;  // FinishStart, once the sessions are in
  bool kept_serves = false;     // the service manager's listener serves again
  auto open = [&]() -> absl::StatusOr<AttachSocket> {
    if (from == AttachFrom::kPredecessor) {
      return AttachServer::FromHandedListener(options, std::move(listener));
    }
    if (listener.valid()) {
      absl::StatusOr<AttachSocket> kept =
          AttachServer::FromHandedListener(options, std::move(listener));
      kept_serves = kept.ok();
      if (kept.ok()) return kept;
      spdlog::warn("recovery: the kept attach listener is unusable ({}); listening anew",
                   kept.status().ToString());
    }
    return AttachServer::Listen(options);
  };
  absl::StatusOr<AttachSocket> socket = open();
  if (!socket.ok()) return socket.status();
  parts->attach_socket.emplace(*std::move(socket));
  if (parts->journal != nullptr && !kept_serves) {
    (void)parts->notifier->RemoveFds(kAttachFdName);
    if (absl::Status s =
            parts->notifier->StoreFd(kAttachFdName, parts->attach_socket->listener_fd());
        !s.ok()) {
      spdlog::warn("keeping the attach listener for a restart failed: {}", s.ToString());
    }
  }
  return absl::OkStatus();
}

absl::Status Daemon::FinishStart(UniqueFd handed_listener, bool recovered) {
  if (absl::Status s = StartServing(std::move(handed_listener)); !s.ok()) return s;
  pool_->StartBackgroundWork();  // an adopted pool's mlock, now that it serves
  started_ = true;
  if (notifier_ != nullptr) {
    const std::string status = absl::StrCat("READY=1\nSTATUS=serving on ", config_.socket_path,
                                            recovered ? "; recovered after a crash" : "");
    if (absl::Status s = notifier_->Notify(status); !s.ok()) {
      spdlog::warn("telling the service manager that actstashd is ready: {}", s.ToString());
    }
  }
  return absl::OkStatus();
}

}  // namespace actstash::server
