// Test helper: runs a Python script (Debian's /usr/bin/python3 by default,
// which has torch; ACTSTASH_TEST_PYTHON overrides) over files in a scratch
// directory, so that tests can compare against an independent reference.
#ifndef ACTSTASH_TESTS_KERNELS_PYTHON_RUNNER_H_
#define ACTSTASH_TESTS_KERNELS_PYTHON_RUNNER_H_

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#ifndef ACTSTASH_TEST_PYTHON
#define ACTSTASH_TEST_PYTHON "/usr/bin/python3"
#endif

namespace actstash::kernels::testing {

inline std::string TestPython() {
  const char* override_path = std::getenv("ACTSTASH_TEST_PYTHON");
  return override_path != nullptr && *override_path != '\0' ? override_path : ACTSTASH_TEST_PYTHON;
}

// Runs `command` through the shell; true when it exited with status 0.
inline bool RunQuietly(const std::string& command) {
  const int status = std::system((command + " >/dev/null 2>&1").c_str());
  return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// True when the test interpreter runs and can import `module` ("" = none).
inline bool PythonHas(const std::string& module) {
  const std::string code = module.empty() ? "pass" : "import " + module;
  return RunQuietly("'" + TestPython() + "' -c '" + code + "'");
}

// A scratch directory, removed with the object.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = ::testing::TempDir() + "actstash_kernels_XXXXXX";
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  bool ok() const { return !path_.empty(); }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

  // Writes `script` to script.py and runs it with the directory as argv[1];
  // on failure, the script's output is in script.log.
  bool RunPython(const std::string& script) const {
    WriteBytes("script.py", script.data(), script.size());
    const std::string command = "'" + TestPython() + "' '" + File("script.py") + "' '" + path_ +
                                "' >'" + File("script.log") + "' 2>&1";
    const int status = std::system(command.c_str());
    return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }

  std::string Log() const {
    std::ifstream in(File("script.log"));
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  void WriteBytes(const std::string& name, const void* data, size_t size) const {
    std::ofstream out(File(name), std::ios::binary);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  }

  template <typename T>
  void Write(const std::string& name, const std::vector<T>& values) const {
    WriteBytes(name, values.data(), values.size() * sizeof(T));
  }

  // The file's contents as T values (little-endian, like the writer's).
  template <typename T>
  std::vector<T> Read(const std::string& name) const {
    std::ifstream in(File(name), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<T> values(bytes.size() / sizeof(T));
    if (!values.empty()) std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
    return values;
  }

 private:
  std::string path_;
};

}  // namespace actstash::kernels::testing

#endif  // ACTSTASH_TESTS_KERNELS_PYTHON_RUNNER_H_
