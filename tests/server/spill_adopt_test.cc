// SpillTier::Adopt (take-over): a predecessor's spill files are taken only
// when every one checks out (its fd handed, a regular file as long as it
// says, an id in range and unrepeated, a session the state holds); then
// they count as this tier's own.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "server/spill/spill_tier.h"

namespace actstash::server {
namespace {

class SpillAdoptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "actstash-spill-adopt-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    SpillOptions options;
    options.dir = dir_;
    absl::StatusOr<std::unique_ptr<SpillTier>> tier = SpillTier::Open(options);
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = *std::move(tier);
    file_ = UniqueFd(open(dir_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
    ASSERT_TRUE(file_.valid());
    ASSERT_EQ(ftruncate(file_.get(), 8192), 0);
  }
  void TearDown() override {
    tier_.reset();
    std::filesystem::remove_all(dir_);
  }
  // A state of session 7 holding spill file 3 (8 KiB, fd index 0).
  static v1::DaemonState State() {
    v1::DaemonState state;
    state.add_sessions()->set_id(7);
    v1::SpillFileState* file = state.add_spill_files();
    file->set_id(3);
    file->set_session_id(7);
    file->set_bytes(8192);
    file->set_checksum(42);
    file->set_fd(0);
    state.set_next_spill_id(4);
    return state;
  }
  std::vector<UniqueFd> Fds(int count = 1) {
    std::vector<UniqueFd> fds;
    for (int i = 0; i < count; ++i) fds.emplace_back(dup(file_.get()));
    return fds;
  }

  std::string dir_;
  std::unique_ptr<SpillTier> tier_;
  UniqueFd file_;
};

TEST_F(SpillAdoptTest, EveryForgedFileRefusesThemAll) {
  const std::vector<std::function<void(v1::DaemonState*)>> forgeries = {
      [](v1::DaemonState* s) { s->mutable_spill_files(0)->set_session_id(8); },
      [](v1::DaemonState* s) { s->mutable_spill_files(0)->set_bytes(16384); },
      [](v1::DaemonState* s) { s->mutable_spill_files(0)->set_fd(2); },  // 2 fds handed
      [](v1::DaemonState* s) { s->mutable_spill_files(0)->set_fd(-1); },
      [](v1::DaemonState* s) { s->mutable_spill_files(0)->set_id(0); },
      [](v1::DaemonState* s) { s->mutable_spill_files(0)->set_id(UINT64_MAX); },
      [](v1::DaemonState* s) {  // a second file on the same fd
        *s->add_spill_files() = s->spill_files(0);
        s->mutable_spill_files(1)->set_id(5);
      },
      [](v1::DaemonState* s) {  // a second file with the same id
        *s->add_spill_files() = s->spill_files(0);
      },
  };
  for (size_t i = 0; i < forgeries.size(); ++i) {
    SCOPED_TRACE(i);
    v1::DaemonState state = State();
    forgeries[i](&state);
    std::vector<UniqueFd> fds = Fds(2);
    absl::Status status = tier_->Adopt(state, &fds);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    // Nothing taken: the fds are still the caller's, the tier is empty.
    EXPECT_TRUE(fds[0].valid() && fds[1].valid());
    EXPECT_EQ(tier_->Stats().files(), 0u);
    EXPECT_FALSE(tier_->Holds(7, 3, 8192));
  }
}

TEST_F(SpillAdoptTest, AdoptedFilesAreTheTiersOwn) {
  v1::DaemonState state = State();
  state.mutable_sessions(0)->mutable_spill()->set_spills(9);
  state.mutable_spill_totals()->set_spills(11);
  std::vector<UniqueFd> fds = Fds();
  ASSERT_TRUE(tier_->Adopt(state, &fds).ok());
  EXPECT_FALSE(fds[0].valid());  // taken
  EXPECT_TRUE(tier_->Holds(7, 3, 8192));
  EXPECT_FALSE(tier_->Holds(8, 3, 8192));  // another session's view
  EXPECT_FALSE(tier_->Holds(7, 3, 4096));
  const v1::SpillStats stats = tier_->Stats();
  EXPECT_EQ(stats.files(), 1u);
  EXPECT_EQ(stats.on_disk_bytes(), 8192u);
  EXPECT_EQ(stats.spills(), 11u);  // the predecessor's totals go on
  EXPECT_EQ(tier_->SessionStats(7).on_disk_bytes(), 8192u);
  EXPECT_EQ(tier_->SessionStats(7).spills(), 9u);
  // A second adoption is refused; exported again, the file keeps its id and
  // the id counter stays past it.
  std::vector<UniqueFd> more = Fds();
  EXPECT_FALSE(tier_->Adopt(State(), &more).ok());
  v1::DaemonState out;
  std::vector<UniqueFd> out_fds;
  ASSERT_TRUE(tier_->Export(&out, &out_fds).ok());
  ASSERT_EQ(out.spill_files_size(), 1);
  EXPECT_EQ(out.spill_files(0).id(), 3u);
  EXPECT_EQ(out.spill_files(0).checksum(), 42u);
  EXPECT_GE(out.next_spill_id(), 4u);
  ASSERT_EQ(out_fds.size(), 1u);
  // Dropping it frees the session's bytes.
  const uint64_t id = 3;
  ASSERT_TRUE(tier_->Drop(7, absl::MakeConstSpan(&id, 1)).ok());
  EXPECT_EQ(tier_->Stats().files(), 0u);
  EXPECT_EQ(tier_->SessionStats(7).on_disk_bytes(), 0u);
}

}  // namespace
}  // namespace actstash::server
