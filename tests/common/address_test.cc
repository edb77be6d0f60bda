// Unit tests of the address helpers (gRPC targets, socket paths, client
// address resolution).
#include "common/address.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/protocol.h"

namespace actstash {
namespace {

TEST(ToGrpcTargetTest, UnixTargetsAreKept) {
  EXPECT_EQ(ToGrpcTarget("unix:///run/actstash/actstash.sock"),
            "unix:///run/actstash/actstash.sock");
  EXPECT_EQ(ToGrpcTarget("unix:relative/x.sock"), "unix:relative/x.sock");
}

TEST(ToGrpcTargetTest, PathsBecomeUnixTargets) {
  EXPECT_EQ(ToGrpcTarget("/run/actstash/actstash.sock"), "unix:///run/actstash/actstash.sock");
  EXPECT_EQ(ToGrpcTarget("./x.sock"), "unix:./x.sock");
  EXPECT_EQ(ToGrpcTarget("../dir/x.sock"), "unix:../dir/x.sock");
}

TEST(ToGrpcTargetTest, EverythingElseIsTcp) {
  EXPECT_EQ(ToGrpcTarget("localhost:50051"), "localhost:50051");
  EXPECT_EQ(ToGrpcTarget("10.0.0.7:7070"), "10.0.0.7:7070");
  EXPECT_EQ(ToGrpcTarget("[::1]:50051"), "[::1]:50051");
  EXPECT_EQ(ToGrpcTarget("dns:///node-3:50051"), "dns:///node-3:50051");
}

TEST(UnixSocketPathTest, ExtractsThePathOfUnixTargets) {
  EXPECT_EQ(UnixSocketPath("unix:///a/b.sock"), "/a/b.sock");
  EXPECT_EQ(UnixSocketPath("unix:rel/b.sock"), "rel/b.sock");
  EXPECT_EQ(UnixSocketPath("unix:./b.sock"), "./b.sock");
}

TEST(UnixSocketPathTest, EmptyForTcp) {
  EXPECT_EQ(UnixSocketPath("localhost:50051"), "");
  EXPECT_EQ(UnixSocketPath("dns:///h:1"), "");
  EXPECT_EQ(UnixSocketPath(""), "");
}

TEST(UnixSocketPathTest, InvertsToGrpcTargetForPaths) {
  for (const char* path : {"/run/actstash/actstash.sock", "/tmp/a b/c.sock", "./x.sock"}) {
    EXPECT_EQ(UnixSocketPath(ToGrpcTarget(path)), path);
  }
}

TEST(DefaultSocketPathTest, RootUsesRunDirectory) {
  if (geteuid() != 0) GTEST_SKIP() << "not running as root";
  EXPECT_EQ(DefaultSocketPath(), "/run/actstash/actstash.sock");
}

// Runs DefaultSocketPath() in a child as uid 65534 with XDG_RUNTIME_DIR set to
// `runtime_dir` (or unset) and returns what it gave, or nullopt if the child
// could not switch user.
std::optional<std::string> DefaultSocketPathAsNobody(const char* runtime_dir) {
  int fds[2];
  if (pipe(fds) != 0) return std::nullopt;
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(77);
    if (runtime_dir != nullptr) {
      setenv("XDG_RUNTIME_DIR", runtime_dir, 1);
    } else {
      unsetenv("XDG_RUNTIME_DIR");
    }
    const std::string path = DefaultSocketPath();
    const bool written =
        write(fds[1], path.data(), path.size()) == static_cast<ssize_t>(path.size());
    _exit(written ? 0 : 1);
  }
  close(fds[1]);
  std::string result;
  char buffer[256];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) > 0) result.append(buffer, n);
  close(fds[0]);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) return std::nullopt;
  return result;
}

TEST(DefaultSocketPathTest, NonRootUsesRuntimeDirElseTmp) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to switch to another user";
  std::optional<std::string> with_xdg = DefaultSocketPathAsNobody("/run/user/65534");
  if (!with_xdg.has_value()) GTEST_SKIP() << "cannot switch to uid 65534 here";
  EXPECT_EQ(*with_xdg, "/run/user/65534/actstash/actstash.sock");
  EXPECT_EQ(DefaultSocketPathAsNobody(nullptr), "/tmp/actstash-65534/actstash.sock");
  // A relative XDG_RUNTIME_DIR is ignored.
  EXPECT_EQ(DefaultSocketPathAsNobody("relative/dir"), "/tmp/actstash-65534/actstash.sock");
}

class ResolveClientAddressTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* value = std::getenv(kAddressEnv)) saved_ = value;
  }
  void TearDown() override {
    if (saved_.has_value()) {
      setenv(kAddressEnv, saved_->c_str(), 1);
    } else {
      unsetenv(kAddressEnv);
    }
  }
  std::optional<std::string> saved_;
};

TEST_F(ResolveClientAddressTest, ExplicitAddressWins) {
  setenv(kAddressEnv, "/from/env.sock", 1);
  EXPECT_EQ(ResolveClientAddress("/explicit.sock"), "unix:///explicit.sock");
  EXPECT_EQ(ResolveClientAddress("host:1234"), "host:1234");
}

TEST_F(ResolveClientAddressTest, EnvironmentWhenNoExplicitAddress) {
  setenv(kAddressEnv, "/from/env.sock", 1);
  EXPECT_EQ(ResolveClientAddress(""), "unix:///from/env.sock");
  setenv(kAddressEnv, "node-2:50051", 1);
  EXPECT_EQ(ResolveClientAddress(""), "node-2:50051");
  setenv(kAddressEnv, "unix:///x/y.sock", 1);
  EXPECT_EQ(ResolveClientAddress(""), "unix:///x/y.sock");
}

TEST_F(ResolveClientAddressTest, DefaultSocketWithoutEnvironment) {
  unsetenv(kAddressEnv);
  EXPECT_EQ(ResolveClientAddress(""), absl::StrCat("unix://", DefaultSocketPath()));
  if (geteuid() == 0) {
    EXPECT_EQ(ResolveClientAddress(""), "unix:///run/actstash/actstash.sock");
  }
  setenv(kAddressEnv, "", 1);  // empty counts as unset
  EXPECT_EQ(ResolveClientAddress(""), absl::StrCat("unix://", DefaultSocketPath()));
}

}  // namespace
}  // namespace actstash
