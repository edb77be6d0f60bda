#include "server/spill/spill_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/clock.h"
#include "common/unique_fd.h"
#include "common/units.h"
#include "server/spill/spill_io.h"
#include "spdlog/spdlog.h"

namespace actstash::server {
namespace {

std::string FreeSpace(int fd) {
  struct statvfs fs {};
  if (fstatvfs(fd, &fs) != 0) return "";
  return absl::StrCat("; the file system has ", FormatBytes(uint64_t{fs.f_bavail} * fs.f_frsize),
                      " free of ", FormatBytes(uint64_t{fs.f_blocks} * fs.f_frsize));
}

}  // namespace

struct SpillTier::File {
  enum class State { kWriting, kOnDisk, kReading };
  uint64_t id = 0;
  uint64_t session_id = 0;
  uint64_t bytes = 0;
  UniqueFd fd;  // empty until created
  uint64_t checksum = 0;
  State state = State::kWriting;
  bool dropped = false;  // dropped while an operation was in flight
};

void SpillTier::JournalGone(absl::Span<const uint64_t> ids) const {
  if (journal_ == nullptr) return;
  for (uint64_t id : ids) journal_->SpillFileGone(id);
}

absl::StatusOr<std::unique_ptr<SpillTier>> SpillTier::Open(const SpillOptions& options) {
  UniqueFd dir_fd(open(options.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir_fd.valid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("spill dir ", options.dir, ": ", std::strerror(errno)));
  }
  bool tmpfile = true;
  UniqueFd probe(openat(dir_fd.get(), ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  if (!probe.valid() && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    tmpfile = false;
    const std::string name = absl::StrCat(".actstash-spill-probe-", getpid());
    probe.Reset(openat(dir_fd.get(), name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
    if (probe.valid()) unlinkat(dir_fd.get(), name.c_str(), 0);
  }
  if (!probe.valid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "spill dir ", options.dir, ": cannot create files there: ", std::strerror(errno)));
  }
  probe.Reset();
  return std::unique_ptr<SpillTier>(new SpillTier(options, std::move(dir_fd), tmpfile));
}

SpillTier::SpillTier(const SpillOptions& options, UniqueFd dir_fd, bool tmpfile)
    : options_(options), dir_fd_(std::move(dir_fd)), tmpfile_(tmpfile) {
  {
    SpillFileIo probe(1, 4096);
    io_mode_ = probe.mode();
  }
  const uint32_t workers = std::max<uint32_t>(1, options_.workers);
  for (uint32_t i = 0; i < workers; ++i) workers_.emplace_back([this] { RunWorker(); });
}

SpillTier::~SpillTier() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
  // The members close every file (files_), then the directory (dir_fd_).
}

void SpillTier::Post(std::function<void(SpillFileIo&)> job) {
  absl::MutexLock lock(&mu_);
  jobs_.push_back(std::move(job));
}

void SpillTier::RunWorker() {
  SpillFileIo io(options_.depth, options_.chunk_bytes);
  for (;;) {
    std::function<void(SpillFileIo&)> job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !jobs_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (jobs_.empty()) return;  // stopping, and nothing left to run
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job(io);
  }
}

absl::StatusOr<UniqueFd> SpillTier::CreateFile(uint64_t bytes) {
  const int flags = O_RDWR | O_CLOEXEC;
  auto create = [&](int extra) {
    if (tmpfile_) return UniqueFd(openat(dir_fd_.get(), ".", O_TMPFILE | flags | extra, 0600));
    const std::string name =
        absl::StrCat(".actstash-spill-", getpid(), "-", name_counter_.fetch_add(1));
    UniqueFd fd(openat(dir_fd_.get(), name.c_str(), O_CREAT | O_EXCL | flags | extra, 0600));
    if (fd.valid()) unlinkat(dir_fd_.get(), name.c_str(), 0);
    return fd;
  };
  // Direct I/O: the pages go from the pool to the disk without filling the
  // page cache (which would compete with the pool for the node's memory).
  UniqueFd fd = create(O_DIRECT);
  if (!fd.valid() && errno == EINVAL) fd = create(0);  // tmpfs and others
  if (!fd.valid()) {
    const int err = errno;
    if (err == ENOSPC || err == EDQUOT) {
      return absl::ResourceExhaustedError(absl::StrCat("creating a spill file in ", options_.dir,
                                                       ": ", std::strerror(err),
                                                       FreeSpace(dir_fd_.get())));
    }
    return absl::InternalError(
        absl::StrCat("creating a spill file in ", options_.dir, ": ", std::strerror(err)));
  }
  // Reserve the blocks first: a full disk fails here, before any byte is
  // written, not in the middle of the write.
  int rc = 0;
  do {
    rc = fallocate(fd.get(), 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0 && errno != EOPNOTSUPP) {
    const int err = errno;
    fd.Reset();
    const std::string what =
        absl::StrCat("reserving ", FormatBytes(bytes), " in spill dir ", options_.dir, ": ",
                     std::strerror(err), FreeSpace(dir_fd_.get()));
    if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(what);
    return absl::InternalError(what);
  }
  return fd;
}

void SpillTier::SpillBytes(std::shared_ptr<Session> session, const std::byte* data, uint64_t bytes,
                           std::shared_ptr<const void> keepalive, SpillDone done) {
  uint64_t id = 0;
  absl::Status refused;  // answered outside mu_: `done` may call back in
  {
    absl::MutexLock lock(&mu_);
    if (session->closed()) {
      refused =
          absl::FailedPreconditionError(absl::StrCat("session ", session->id(), " is closed"));
    } else if (options_.size_bytes > 0 && reserved_bytes_ + bytes > options_.size_bytes) {
      totals_.set_failures(totals_.failures() + 1);
      refused = absl::ResourceExhaustedError(
          absl::StrCat("spill space is full: ", FormatBytes(reserved_bytes_), " of ",
                       FormatBytes(options_.size_bytes),
                       " (--spill-size) on disk or being written; this spill "
                       "needs ",
                       FormatBytes(bytes)));
    } else {
      reserved_bytes_ += bytes;
      totals_.set_writing_bytes(totals_.writing_bytes() + bytes);
      id = next_id_++;
      auto file = std::make_shared<File>();
      file->id = id;
      file->session_id = session->id();
      file->bytes = bytes;
      files_.emplace(id, std::move(file));
      sessions_[session->id()];
    }
  }
  if (!refused.ok()) return done(refused);
  const bool journaled = journal_ != nullptr;
  Post([this, id, bytes, data, journaled, session = std::move(session),
        keepalive = std::move(keepalive), done = std::move(done)](SpillFileIo& io) {
    const uint64_t start = MonotonicNowNs();
    const uint64_t checksum = Xxh3(data, bytes);
    absl::StatusOr<UniqueFd> fd = CreateFile(bytes);
    absl::Status status = fd.status();
    if (status.ok()) status = io.Write(fd->get(), data, bytes);
    if (!status.ok() && status.code() == absl::StatusCode::kResourceExhausted && fd.ok()) {
      status =
          absl::ResourceExhaustedError(absl::StrCat(status.message(), FreeSpace(dir_fd_.get())));
    }
    const bool in_journal = status.ok() && journaled;
    if (in_journal) {
      // Before the id is answered: a client never holds one that a restart
      // after a crash would not know.
      v1::SpillFileState kept;
      kept.set_id(id);
      kept.set_session_id(session->id());
      kept.set_bytes(bytes);
      kept.set_checksum(checksum);
      journal_->SpillFileKept(kept, fd->get());
    }
    const uint64_t elapsed = MonotonicNowNs() - start;
    UniqueFd to_close;
    absl::StatusOr<Written> result = Written{id, checksum};
    {
      absl::MutexLock lock(&mu_);
      totals_.set_writing_bytes(totals_.writing_bytes() - bytes);
      auto it = files_.find(id);
      File& file = *it->second;
      if (status.ok() && (file.dropped || session->closed())) {
        status = absl::FailedPreconditionError(
            absl::StrCat("session ", session->id(), " closed while spilling"));
      }
      if (!status.ok()) {
        if (fd.ok()) to_close = *std::move(fd);
        reserved_bytes_ -= bytes;
        if (status.code() != absl::StatusCode::kFailedPrecondition)
          totals_.set_failures(totals_.failures() + 1);
        files_.erase(it);
        result = status;
      } else {
        file.fd = *std::move(fd);
        file.checksum = checksum;
        file.state = File::State::kOnDisk;
        totals_.set_bytes_written(totals_.bytes_written() + bytes);
        totals_.set_spills(totals_.spills() + 1);
        totals_.set_write_seconds(totals_.write_seconds() + static_cast<double>(elapsed) * 1e-9);
        PerSession& per = sessions_[session->id()];
        per.stats.set_on_disk_bytes(per.stats.on_disk_bytes() + bytes);
        per.stats.set_spilled_bytes(per.stats.spilled_bytes() + bytes);
        per.stats.set_spills(per.stats.spills() + 1);
      }
    }
    to_close.Reset();
    if (!result.ok() && in_journal) JournalGone({id});  // its session went meanwhile
    done(std::move(result));
  });
}

void SpillTier::RestoreBytes(std::shared_ptr<Session> session, uint64_t spill_id, std::byte* data,
                             uint64_t bytes, std::shared_ptr<const void> keepalive,
                             std::function<void(absl::Status)> done) {
  std::shared_ptr<File> file;
  absl::Status refused;  // answered outside mu_: `done` may call back in
  {
    absl::MutexLock lock(&mu_);
    auto it = files_.find(spill_id);
    if (it == files_.end() || it->second->session_id != session->id() || it->second->dropped) {
      refused =
          absl::NotFoundError(absl::StrCat("no spilled segment ", spill_id, " in this session"));
    } else if (it->second->state != File::State::kOnDisk) {
      refused = absl::FailedPreconditionError(
          absl::StrCat("spilled segment ", spill_id, " is still being ",
                       it->second->state == File::State::kWriting ? "written" : "restored"));
    } else if (it->second->bytes != bytes) {
      refused = absl::InvalidArgumentError(absl::StrCat("spilled segment ", spill_id, " holds ",
                                                        it->second->bytes,
                                                        " bytes; the memory holds ", bytes));
    } else {
      file = it->second;
      file->state = File::State::kReading;
      totals_.set_reading_bytes(totals_.reading_bytes() + file->bytes);
    }
  }
  if (!refused.ok()) return done(refused);
  Post([this, file = std::move(file), session = std::move(session), data,
        keepalive = std::move(keepalive), done = std::move(done)](SpillFileIo& io) {
    const uint64_t start = MonotonicNowNs();
    absl::Status status = io.Read(file->fd.get(), data, file->bytes);
    bool corrupt = false;
    if (status.ok()) {
      const uint64_t checksum = Xxh3(data, file->bytes);
      if (checksum != file->checksum) {
        corrupt = true;
        status = absl::DataLossError(absl::StrCat(
            "spilled segment ", file->id, " of session ", file->session_id, " (",
            FormatBytes(file->bytes), ") failed its checksum when read back from ", options_.dir,
            ": XXH3 ", checksum, ", written as ", file->checksum,
            "; its data is lost (the spill file was changed or the disk returned bad data)"));
        spdlog::error("{}", std::string(status.message()));
      }
    }
    const uint64_t elapsed = MonotonicNowNs() - start;
    UniqueFd to_close;
    bool left = false;  // the tier let the file go
    {
      absl::MutexLock lock(&mu_);
      totals_.set_reading_bytes(totals_.reading_bytes() - file->bytes);
      const bool gone = file->dropped || session->closed();
      if (status.ok() && gone) {
        status = absl::FailedPreconditionError(
            absl::StrCat("session ", session->id(), " closed while restoring"));
      }
      if (!status.ok() && !corrupt && !gone) {
        file->state = File::State::kOnDisk;  // an I/O error: the caller may try again
        totals_.set_failures(totals_.failures() + 1);
      } else {
        // Restored (the file is no longer needed), corrupt, or dropped.
        if (corrupt) totals_.set_checksum_failures(totals_.checksum_failures() + 1);
        if (status.ok()) {
          totals_.set_bytes_read(totals_.bytes_read() + file->bytes);
          totals_.set_restores(totals_.restores() + 1);
          totals_.set_read_seconds(totals_.read_seconds() + static_cast<double>(elapsed) * 1e-9);
        }
        auto it = sessions_.find(file->session_id);
        if (it != sessions_.end()) {
          it->second.stats.set_on_disk_bytes(it->second.stats.on_disk_bytes() - file->bytes);
          if (status.ok()) {
            it->second.stats.set_restored_bytes(it->second.stats.restored_bytes() + file->bytes);
            it->second.stats.set_restores(it->second.stats.restores() + 1);
          }
        }
        reserved_bytes_ -= file->bytes;
        to_close = std::move(file->fd);
        files_.erase(file->id);
        left = true;
      }
    }
    to_close.Reset();
    // Answered before the journal forgets the file: a crash in between
    // leaves a file its session no longer names (dropped with the session),
    // never bytes read back that the answer did not reach and the file no
    // longer holds.
    done(status);
    if (left) JournalGone({file->id});
  });
}

absl::StatusOr<RemovedTotals> SpillTier::Drop(uint64_t session_id, absl::Span<const uint64_t> ids) {
  std::vector<UniqueFd> to_close;  // closed once mu_ is released
  std::vector<uint64_t> left;      // the files the tier let go
  RemovedTotals totals;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = files_.find(ids[i]);
      if (it == files_.end() || it->second->session_id != session_id || it->second->dropped) {
        return absl::NotFoundError(
            absl::StrCat("no spilled segment ", ids[i], " in this session; nothing dropped"));
      }
      for (size_t j = 0; j < i; ++j) {
        if (ids[j] == ids[i]) {
          return absl::InvalidArgumentError(
              absl::StrCat("spilled segment ", ids[i], " named twice; nothing dropped"));
        }
      }
    }
    for (uint64_t id : ids) {
      auto it = files_.find(id);
      File& file = *it->second;
      totals.objects += 1;
      totals.bytes += file.bytes;
      if (file.state != File::State::kOnDisk) {
        file.dropped = true;  // the operation in flight removes it
        continue;
      }
      sessions_[session_id].stats.set_on_disk_bytes(sessions_[session_id].stats.on_disk_bytes() -
                                                    file.bytes);
      reserved_bytes_ -= file.bytes;
      to_close.push_back(std::move(file.fd));
      left.push_back(id);
      files_.erase(it);
    }
  }
  to_close.clear();
  JournalGone(left);
  return totals;
}

RemovedTotals SpillTier::ReleaseSession(uint64_t session_id) {
  std::vector<uint64_t> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, file] : files_) {
      if (file->session_id == session_id && !file->dropped) ids.push_back(id);
    }
  }
  absl::StatusOr<RemovedTotals> dropped = Drop(session_id, ids);
  absl::MutexLock lock(&mu_);
  sessions_.erase(session_id);
  return dropped.ok() ? *dropped : RemovedTotals{};
}

absl::Status SpillTier::Export(v1::DaemonState* state, std::vector<UniqueFd>* fds) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, file] : files_) {
    if (file->state != File::State::kOnDisk) {
      return absl::UnavailableError(
          absl::StrCat("spill file ", id, " is still being written or read; retry"));
    }
  }
  for (const auto& [id, file] : files_) {
    if (file->dropped) continue;
    absl::StatusOr<UniqueFd> dup = DupFd(file->fd.get(), "dup of a spill file for the take-over");
    if (!dup.ok()) return dup.status();
    v1::SpillFileState* out = state->add_spill_files();
    out->set_id(id);
    out->set_session_id(file->session_id);
    out->set_bytes(file->bytes);
    out->set_checksum(file->checksum);
    out->set_fd(static_cast<int32_t>(fds->size()));
    fds->push_back(*std::move(dup));
  }
  state->set_next_spill_id(next_id_);
  *state->mutable_spill_totals() = totals_;
  return absl::OkStatus();
}

absl::Status SpillTier::Adopt(const v1::DaemonState& state, std::vector<UniqueFd>* fds) {
  absl::MutexLock lock(&mu_);
  if (!files_.empty()) return absl::FailedPreconditionError("the spill tier already has files");
  absl::flat_hash_map<uint64_t, std::shared_ptr<File>> adopted;
  absl::flat_hash_set<int32_t> fd_indices;
  absl::flat_hash_set<uint64_t> sessions;
  for (const v1::SessionState& session : state.sessions()) sessions.insert(session.id());
  uint64_t bytes = 0;
  uint64_t next_id = state.next_spill_id();
  for (const v1::SpillFileState& in : state.spill_files()) {
    if (in.fd() < 0 || static_cast<size_t>(in.fd()) >= fds->size() || !(*fds)[in.fd()].valid()) {
      return absl::InvalidArgumentError(
          absl::StrCat("spill file ", in.id(), " names fd ", in.fd(), ", which was not handed"));
    }
    struct stat st {};
    if (fstat((*fds)[in.fd()].get(), &st) != 0 || !S_ISREG(st.st_mode) ||
        static_cast<uint64_t>(st.st_size) < in.bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spill file ", in.id(), " is not a regular file of at least ", in.bytes(), " bytes"));
    }
    if (in.id() == 0 || in.id() == UINT64_MAX || adopted.contains(in.id()) ||
        !fd_indices.insert(in.fd()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("spill file ", in.id(), " (fd ", in.fd(),
                       "): an id out of range, or an id or fd repeated"));
    }
    if (!sessions.contains(in.session_id())) {
      return absl::InvalidArgumentError(absl::StrCat("spill file ", in.id(), " belongs to session ",
                                                     in.session_id(), ", which was not handed"));
    }
    auto file = std::make_shared<File>();
    file->id = in.id();
    file->session_id = in.session_id();
    file->bytes = in.bytes();
    file->checksum = in.checksum();
    file->state = File::State::kOnDisk;
    adopted.emplace(in.id(), std::move(file));
    bytes += in.bytes();
    next_id = std::max(next_id, in.id() + 1);
  }
  // Checked, so taken: the fds move only now.
  for (const v1::SpillFileState& in : state.spill_files()) {
    adopted[in.id()]->fd = std::move((*fds)[in.fd()]);
  }
  files_ = std::move(adopted);
  reserved_bytes_ = bytes;
  next_id_ = std::max(next_id_, next_id);
  totals_ = state.spill_totals();
  totals_.set_writing_bytes(0);
  totals_.set_reading_bytes(0);
  for (const v1::SessionState& session : state.sessions()) {
    if (session.has_spill()) sessions_[session.id()].stats = session.spill();
  }
  for (auto& [id, per] : sessions_) per.stats.set_on_disk_bytes(0);
  for (const auto& [id, file] : files_) {
    v1::SessionSpillStats& stats = sessions_[file->session_id].stats;
    stats.set_on_disk_bytes(stats.on_disk_bytes() + file->bytes);
  }
  return absl::OkStatus();
}

bool SpillTier::Holds(uint64_t session_id, uint64_t id, uint64_t bytes) const {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(id);
  return it != files_.end() && it->second->session_id == session_id && it->second->bytes == bytes &&
         !it->second->dropped;
}

v1::SpillStats SpillTier::Stats() const {
  absl::MutexLock lock(&mu_);
  v1::SpillStats stats = totals_;
  stats.set_dir(options_.dir);
  stats.set_capacity_bytes(options_.size_bytes);
  stats.set_on_disk_bytes(reserved_bytes_);
  stats.set_files(files_.size());
  stats.set_io_mode(io_mode_);
  return stats;
}

v1::SessionSpillStats SpillTier::SessionStats(uint64_t session_id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  return it == sessions_.end() ? v1::SessionSpillStats() : it->second.stats;
}

}  // namespace actstash::server
