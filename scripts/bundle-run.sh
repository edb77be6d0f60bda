#!/usr/bin/env bash
# Builds and tests actstash from a bundle made by scripts/bundle (this file is
# the bundle's run.sh), on a machine that has a compiler, CMake, ninja and
# python3 (with pytest, numpy and torch for the Python suite), optionally
# CUDA (nvcc on PATH or in /usr/local/cuda) and a GPU, but none of the
# project's C++ dependencies and no network. No root, no apt or dpkg database.
#
#   bash run.sh RESULTS_DIR [--cpu-only | --no-cuda] [--jobs N] [--work DIR]
#                           [--budget SECONDS] [--build-timeout SECONDS]
#
#   --cpu-only        configure with ACTSTASH_WITH_CUDA=AUTO (CUDA code is built
#                     when nvcc is found, but a GPU is not required); default:
#                     ON when nvcc is found (the configure fails without CUDA),
#                     AUTO when it is not
#   --no-cuda         ACTSTASH_WITH_CUDA=OFF
#   --jobs N          build jobs (default: all cores)
#   --work DIR        where the source, the package prefix and the build go
#                     (default: a new folder under ${TMPDIR:-/tmp}; kept)
#   --budget S        the whole run's time limit, default 570 (0: none); each
#                     phase also has its own limit (see below) and is cut at
#                     what is left of the budget
#   --build-timeout S the build phase's own limit (default 480)
#   --python PATH     the Python for the tests (default: python3 on PATH; when
#                     that cannot import torch, /opt/torch/.venv/bin/python3 if
#                     that can)
#   --werror          ACTSTASH_WERROR=ON (default here: OFF, so that warnings
#                     of a newer compiler than the project's CI (GCC 12) are
#                     counted in build.log instead of stopping the build)
#
# Phases, each logged to RESULTS_DIR/<phase>.log; a failing phase does not
# stop the others (those that cannot run without it are marked not run):
#   env        uname, OS, glibc, nvidia-smi, nvcc, gcc, cmake, ninja, python, torch
#   extract    the source into WORK/src; every debs/*.deb with `dpkg-deb -x` (or
#              ar + tar) into WORK/prefix; wrappers for the prefix's protoc,
#              grpc_cpp_plugin, pkg-config and openssl (they need the prefix's
#              libraries: LD_LIBRARY_PATH is set for them alone) in WORK/tools;
#              the symbol versions the packages need from glibc and libstdc++
#              next to what this machine has
#   configure  cmake against the prefix (CMAKE_PREFIX_PATH; pkg-config with a
#              sysroot; ACTSTASH_TRANSITIVE_RPATH so binaries find the prefix's
#              libraries without LD_LIBRARY_PATH). The libtorch adapter is built
#              when torch's CMake config (torch.utils.cmake_prefix_path) passes
#              a probe configure (WORK/torch-probe, log torch-probe.log) and the
#              main configure then passes; otherwise it is left out and the run
#              goes on (summary: "torch adapter")
#   build      ninja, keeps going past errors (-k 0)
#   ctest      every test, all labels (gpu ones skip without a device)
#   pytest     tests/python with this python3 (skipped when torch is missing)
#   bench      with a CUDA build: bench/gpu_copy_bench (full run)
# RESULTS_DIR/summary.txt lists each phase's status, exit code and seconds;
# the exit code is non-zero when any phase failed or was not run.

# The phase_* functions run through `bash run.sh --phase NAME` (run_phase).
# shellcheck disable=SC2317
set -euo pipefail

self=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
bundle=$(dirname "$self")
arch_triplet=x86_64-linux-gnu

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$self"; }
now() { date +%s; }

# --- one phase, run in a child of this script (so that `timeout` can stop it
# with everything it started): bash run.sh --phase NAME, state in the
# environment (AS_*) and in WORK/state/ ----------------------------------------
state_get() { cat "$AS_WORK/state/$1" 2>/dev/null || true; }
state_set() { mkdir -p "$AS_WORK/state"; printf '%s\n' "$2" > "$AS_WORK/state/$1"; }

phase_env() {
  local cmd
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for cmd in "uname -a" "cat /etc/os-release" "getconf GNU_LIBC_VERSION" "nproc" \
             "free -g" "df -h $AS_WORK" "nvidia-smi" \
             "nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv" \
             "${AS_NVCC:-nvcc} --version" "gcc --version" "g++ --version" "cmake --version" \
             "ninja --version" "$AS_PYTHON --version" "ulimit -a"; do
    echo "\$ $cmd"
    timeout 20 bash -c "$cmd" 2>&1 || echo "(exit $?)"
    echo
  done
  echo "\$ $AS_PYTHON: torch, numpy, pytest"
  timeout 90 "$AS_PYTHON" - <<'PY' 2>&1 || echo "(python probe failed: exit $?)"
import importlib, sys
print("python", sys.version.replace("\n", " "), "at", sys.executable)
for name in ("numpy", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "NOT importable:", e)
try:
    import torch, torch.utils
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "cuda available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    print("torch cmake prefix", torch.utils.cmake_prefix_path)
except Exception as e:
    print("torch NOT importable:", e)
PY
}

phase_extract() {
  local src=$AS_WORK/src prefix=$AS_WORK/prefix tools=$AS_WORK/tools deb d link target
  rm -rf "$src" "$prefix" "$tools"
  mkdir -p "$src" "$prefix" "$tools"
  tar -xzf "$AS_BUNDLE/source.tar.gz" -C "$src"
  echo "source: $(sed -n 's/^source: //p' "$AS_BUNDLE/MANIFEST" 2>/dev/null)"
  local count=0 scratch
  scratch=$(mktemp -d "$AS_WORK/deb.XXXXXX")
  for deb in "$AS_BUNDLE"/debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$prefix"
    else
      rm -rf "${scratch:?}"/*
      (cd "$scratch" && ar x "$deb" && tar -xf data.tar.* -C "$prefix")
    fi
    count=$((count + 1))
  done
  rm -rf "$scratch"
  echo "extracted $count packages into $prefix ($(command -v dpkg-deb >/dev/null && echo dpkg-deb -x || echo ar + tar))"
  # Debian 12 still ships some libraries in /lib: merge it into usr/ as a
  # merged-/usr system has it, so that one directory holds every library.
  for d in lib lib64 bin sbin; do
    if [ -d "$prefix/$d" ] && [ ! -L "$prefix/$d" ]; then
      mkdir -p "$prefix/usr/$d"
      cp -a "$prefix/$d/." "$prefix/usr/$d/"
      rm -rf "${prefix:?}/$d"
      ln -s "usr/$d" "$prefix/$d"
    fi
  done
  # Absolute links (libz.so -> /lib/...so.1.2.13) would point at this
  # machine's files: make them relative, inside the prefix.
  local fixed=0
  while IFS= read -r -d '' link; do
    target=$(readlink "$link")
    case "$target" in
      /*) ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$prefix$target")" "$link"
          fixed=$((fixed + 1)) ;;
    esac
  done < <(find "$prefix" -type l -print0)
  echo "made $fixed absolute links relative"

  local lib=$prefix/usr/lib/$arch_triplet
  # Tools from the prefix, each with the prefix's libraries.
  write_wrapper() {  # name binary [extra export lines]
    local name=$1 binary=$2
    shift 2
    {
      echo '#!/bin/sh'
      echo "# $name from the bundle's package prefix (made by run.sh)"
      echo "LD_LIBRARY_PATH='$lib'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
      echo "export LD_LIBRARY_PATH"
      for line in "$@"; do echo "$line"; done
      echo "exec '$binary' \"\$@\""
    } > "$tools/$name"
    chmod +x "$tools/$name"
  }
  write_wrapper protoc "$prefix/usr/bin/protoc"
  write_wrapper grpc_cpp_plugin "$prefix/usr/bin/grpc_cpp_plugin"
  # Debian's .pc files say prefix=/usr: the sysroot puts the prefix in front of
  # their -I and -L paths; only the prefix's .pc files are searched.
  write_wrapper pkg-config "$prefix/usr/bin/pkgconf" \
    "PKG_CONFIG_LIBDIR='$lib/pkgconfig:$prefix/usr/lib/pkgconfig:$prefix/usr/share/pkgconfig'" \
    "PKG_CONFIG_SYSROOT_DIR='$prefix'" \
    "PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1" "PKG_CONFIG_ALLOW_SYSTEM_LIBS=1" \
    "export PKG_CONFIG_LIBDIR PKG_CONFIG_SYSROOT_DIR PKG_CONFIG_ALLOW_SYSTEM_CFLAGS PKG_CONFIG_ALLOW_SYSTEM_LIBS"
  write_wrapper openssl "$prefix/usr/bin/openssl" \
    "[ -n \"\${OPENSSL_CONF:-}\" ] || { OPENSSL_CONF='$prefix/etc/ssl/openssl.cnf'; export OPENSSL_CONF; }"
  echo "protoc: $("$tools/protoc" --version)"
  echo "pkg-config: $("$tools/pkg-config" --version)"
  echo "openssl: $("$tools/openssl" version)"
  # grpc_cpp_plugin has no --version: an empty request must get an empty answer.
  "$tools/grpc_cpp_plugin" < /dev/null > /dev/null
  echo "grpc_cpp_plugin: runs"
  "$tools/pkg-config" --cflags --libs libxxhash liburing

  # What the packages need from this machine's glibc and libstdc++.
  echo
  if command -v objdump >/dev/null; then
    local versions need_glibc need_cxx have_glibc have_cxx libstdcxx
    versions=$(find "$lib" "$prefix/usr/bin" -type f \( -name '*.so*' -o -perm -u+x \) -print0 |
      xargs -0 -r objdump -T 2>/dev/null | grep -oE '\b(GLIBC_2\.[0-9]+|GLIBCXX_3\.4\.[0-9]+)\b' |
      sort -u || true)
    need_glibc=$(grep '^GLIBC_' <<< "$versions" | sort -V | tail -n 1 || true)
    need_cxx=$(grep '^GLIBCXX_' <<< "$versions" | sort -V | tail -n 1 || true)
    have_glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print "GLIBC_" $2}')
    libstdcxx=$(readlink -f "$(g++ -print-file-name=libstdc++.so.6 2>/dev/null)" || true)
    have_cxx=$(objdump -T "$libstdcxx" 2>/dev/null | grep -oE '\bGLIBCXX_3\.4\.[0-9]+\b' |
      sort -uV | tail -n 1 || true)
    echo "bundled packages need up to $need_glibc and $need_cxx"
    echo "this machine has $have_glibc and libstdc++ $libstdcxx up to $have_cxx"
    local verdict=ok
    [ "$(printf '%s\n%s\n' "$need_glibc" "$have_glibc" | sort -V | tail -n 1)" = "$have_glibc" ] ||
      verdict="TOO OLD: glibc"
    [ "$(printf '%s\n%s\n' "$need_cxx" "$have_cxx" | sort -V | tail -n 1)" = "$have_cxx" ] ||
      verdict="TOO OLD: libstdc++"
    state_set abi "needs $need_glibc, $need_cxx; has $have_glibc, $have_cxx: $verdict"
  else
    state_set abi "not checked (no objdump)"
  fi
}

cmake_common_args() {  # -> CMAKE_ARGS (array)
  CMAKE_ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo --no-warn-unused-cli
    "-DACTSTASH_WERROR=$AS_WERROR"
    "-DPython3_EXECUTABLE=$AS_PYTHON" "-DPython_EXECUTABLE=$AS_PYTHON"
    "-DACTSTASH_WITH_CUDA=$AS_CUDA_MODE")
  [ -n "$AS_NVCC" ] && [ "$AS_CUDA_MODE" != OFF ] && CMAKE_ARGS+=("-DCMAKE_CUDA_COMPILER=$AS_NVCC")
  [ -n "$AS_CUDA_ARCH" ] && [ "$AS_CUDA_MODE" != OFF ] &&
    CMAKE_ARGS+=("-DCMAKE_CUDA_ARCHITECTURES=$AS_CUDA_ARCH")
  return 0
}

phase_configure() {
  local src=$AS_WORK/src prefix=$AS_WORK/prefix tools=$AS_WORK/tools build=$AS_WORK/build
  local torch_info torch_cmake torch_version torch_dir="" torch_note
  cmake_common_args
  torch_info=$(timeout 90 "$AS_PYTHON" -c \
    'import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.__version__)' \
    2>/dev/null || true)
  torch_cmake=$(sed -n 1p <<< "$torch_info")
  torch_version=$(sed -n 2p <<< "$torch_info")
  if [ -n "$torch_cmake" ] && [ -f "$torch_cmake/Torch/TorchConfig.cmake" ]; then
    torch_dir=$torch_cmake/Torch
    # Probe: torch's CMake config on its own, with the project's CUDA setup
    # (cmake/ActstashCuda.cmake), before the real configure depends on it.
    local probe=$AS_WORK/torch-probe
    rm -rf "$probe"
    mkdir -p "$probe"
    cat > "$probe/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.25)
project(actstash_torch_probe LANGUAGES C CXX)
list(APPEND CMAKE_MODULE_PATH "${ACTSTASH_SOURCE_DIR}/cmake")
include(ActstashCuda)
find_package(Torch CONFIG REQUIRED)
message(STATUS "torch probe: Torch ${Torch_VERSION} from ${Torch_DIR}; libraries: ${TORCH_LIBRARIES}")
CMAKE
    echo "== torch probe: cmake $probe with Torch_DIR=$torch_dir (log: torch-probe.log)"
    if timeout 90 cmake -S "$probe" -B "$probe/build" "${CMAKE_ARGS[@]}" "-DTorch_DIR=$torch_dir" \
         "-DACTSTASH_SOURCE_DIR=$src" > "$AS_RESULTS/torch-probe.log" 2>&1; then
      torch_note="probe passed"
    else
      torch_note="skipped: torch's CMake config failed the probe ($(awk \
        '/CMake Error/ { f = 1 } f && NF { printf "%s ", $0; if (++n == 3) exit }' \
        "$AS_RESULTS/torch-probe.log" | tr -s ' ' | cut -c1-240); see torch-probe.log)"
      torch_dir=""
    fi
    echo "== torch probe: $torch_note"
  elif [ -z "$torch_info" ]; then
    torch_note="skipped: $AS_PYTHON cannot import torch"
    echo "== $torch_note"
  else
    torch_note="skipped: torch $torch_version has no Torch/TorchConfig.cmake under ${torch_cmake:-?}"
    echo "== $torch_note"
  fi

  configure_main() {  # extra args...
    rm -rf "$build"
    echo "== cmake -S $src -B $build ${CMAKE_ARGS[*]} $*"
    timeout 120 cmake -S "$src" -B "$build" "${CMAKE_ARGS[@]}" \
      "-DCMAKE_PREFIX_PATH=$prefix/usr" \
      "-DACTSTASH_TRANSITIVE_RPATH=ON" \
      "-DProtobuf_PROTOC_EXECUTABLE=$tools/protoc" \
      "-DGRPC_CPP_PLUGIN=$tools/grpc_cpp_plugin" \
      "-DPKG_CONFIG_EXECUTABLE=$tools/pkg-config" \
      "$@"
  }
  local rc=0
  if [ -n "$torch_dir" ]; then
    if configure_main "-DTorch_DIR=$torch_dir"; then
      if grep -q 'actstash_torch' "$build/build.ninja"; then
        torch_note="configured with torch $torch_version ($torch_dir; $torch_note)"
      else
        torch_note="skipped: client/torch did not find libtorch at $torch_dir ($torch_note)"
      fi
    else
      echo "== configure with torch FAILED; configuring again without the libtorch adapter"
      torch_note="skipped: the configure with Torch_DIR=$torch_dir failed (probe passed); see configure.log"
      configure_main -DACTSTASH_BUILD_TORCH=OFF || rc=$?
    fi
  else
    configure_main -DACTSTASH_BUILD_TORCH=OFF || rc=$?
  fi
  state_set torch "$torch_note"
  if [ -f "$build/CMakeCache.txt" ]; then
    state_set cuda "$(sed -n 's/^ACTSTASH_HAVE_CUDA:INTERNAL=//p' "$build/CMakeCache.txt")"
  fi
  if ! grep -q ACTSTASH_TRANSITIVE_RPATH "$src/CMakeLists.txt"; then
    echo "WARNING: this source has no ACTSTASH_TRANSITIVE_RPATH: binaries may not find the" \
      "prefix's libraries of libraries without LD_LIBRARY_PATH"
  fi
  return "$rc"
}

phase_build() {
  local build=$AS_WORK/build rc=0
  cmake --build "$build" --parallel "$AS_JOBS" -- -k 0 || rc=$?
  if [ "$rc" -ne 0 ] && grep -q 'actstash_torch' "$build/build.ninja"; then
    # The libtorch adapter is optional: rebuild without it so that everything
    # else can still be tested; the phase still counts as failed (exit 3).
    echo
    echo "== the build with the libtorch adapter FAILED (above); again without it"
    state_set torch "FAILED to build: $(state_get torch); rebuilt without it (build.log)"
    if cmake -S "$AS_WORK/src" -B "$build" -DACTSTASH_BUILD_TORCH=OFF &&
       cmake --build "$build" --parallel "$AS_JOBS" -- -k 0; then
      rc=3
    fi
  fi
  echo "warnings: $(grep -c 'warning:' "$AS_RESULTS/build.log" 2>/dev/null || true)"
  echo
  echo "== where the daemon and libactstash.so find their libraries"
  local f
  for f in "$build/server/actstashd" "$build/python/actstash/libactstash.so"; do
    [ -e "$f" ] || continue
    echo "\$ readelf -d $f | grep PATH"
    readelf -d "$f" 2>/dev/null | grep -E 'R(UN)?PATH' || true
    echo "\$ ldd $f"
    ldd "$f" 2>&1 || true
  done
  return "$rc"
}

phase_ctest() {
  ACTSTASH_TEST_PYTHON=$AS_PYTHON ctest --test-dir "$AS_WORK/build" --output-on-failure \
    --timeout 300 --output-junit "$AS_RESULTS/ctest.xml"
}

phase_pytest() {
  local build=$AS_WORK/build
  cd "$AS_WORK/src"
  PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" ACTSTASH_BUILD_DIR="$build" \
    "$AS_PYTHON" -m pytest -v -rs --durations=15 -p no:cacheprovider \
    --junitxml="$AS_RESULTS/pytest.xml" tests/python
}

phase_bench() {
  local bench=$AS_WORK/build/bench/gpu_copy_bench
  echo "\$ $bench"
  "$bench"
}

if [ "${1:-}" = --phase ]; then
  export PATH="$AS_WORK/tools:$PATH"
  "phase_$2"
  exit $?
fi

# --- arguments -----------------------------------------------------------------
results=""
cuda_flag=""
jobs=$(nproc)
work=""
budget=570
build_timeout=480
python=""
werror=OFF
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python=$2; shift 2 ;;
    --werror) werror=ON; shift ;;
    --cpu-only|--no-cuda) cuda_flag=$1; shift ;;
    --jobs) jobs=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --build-timeout) build_timeout=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ -z "$results" ] || { echo "run.sh: one RESULTS_DIR only" >&2; exit 2; }
       results=$1; shift ;;
  esac
done
[ -n "$results" ] || { usage >&2; exit 2; }
if [ ! -f "$bundle/source.tar.gz" ] || [ ! -d "$bundle/debs" ]; then
  echo "run.sh: $bundle is not a bundle (source.tar.gz, debs/)" >&2
  exit 2
fi
mkdir -p "$results"
results=$(cd "$results" && pwd)
if [ -z "$work" ]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/actstash-bundle-work.XXXXXX")
else
  mkdir -p "$work"
fi
work=$(cd "$work" && pwd)
rm -rf "$work/state"
start=$(now)

if [ -z "$python" ]; then
  python=$(command -v python3 || true)
  if { [ -z "$python" ] || ! timeout 90 "$python" -c 'import torch' >/dev/null 2>&1; } &&
     [ -x /opt/torch/.venv/bin/python3 ] &&
     timeout 90 /opt/torch/.venv/bin/python3 -c 'import torch' >/dev/null 2>&1; then
    python=/opt/torch/.venv/bin/python3
  fi
fi
# nvcc: /usr/local/cuda's (where cmake/ActstashCuda.cmake looks too), else PATH's.
nvcc=""
if [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc=/usr/local/cuda/bin/nvcc
else
  nvcc=$(command -v nvcc || true)
fi
case "$cuda_flag" in
  --no-cuda) cuda_mode=OFF ;;
  --cpu-only) cuda_mode=AUTO ;;
  *) if [ -n "$nvcc" ]; then cuda_mode=ON; else cuda_mode=AUTO; fi ;;
esac
cuda_arch=""
gpu="none found (nvidia-smi)"
if command -v nvidia-smi >/dev/null; then
  gpu=$(timeout 30 nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total \
    --format=csv,noheader 2>/dev/null | head -n 1 || true)
  cuda_arch=$(cut -d, -f2 <<< "$gpu" | tr -d ' .')
  [[ "$cuda_arch" =~ ^[0-9]+$ ]] || cuda_arch=""
  [ -n "$gpu" ] || gpu="none (nvidia-smi found no device)"
fi
[ "$cuda_mode" != OFF ] || cuda_arch=""
torch_line=$(timeout 90 "${python:-python3}" -c 'import torch; print("torch", torch.__version__,
    "(CUDA", str(torch.version.cuda) + ", device available:", str(torch.cuda.is_available()) + ")")' \
  2>/dev/null || true)
export AS_BUNDLE=$bundle AS_WORK=$work AS_RESULTS=$results AS_JOBS=$jobs AS_PYTHON=${python:-python3}
export AS_NVCC=$nvcc AS_CUDA_MODE=$cuda_mode AS_CUDA_ARCH=$cuda_arch AS_WERROR=$werror

deadline=0
[ "$budget" -gt 0 ] && deadline=$((start + budget))
declare -A status=()
summary_rows=()
any_failed=0

record() {  # phase status exit seconds note
  summary_rows+=("$(printf '%-10s %-8s %-5s %6s  %s' "$1" "$2" "$3" "$4" "$5")")
  echo "run.sh: $(printf '%-10s %-8s exit %-4s %5s s  %s' "$1" "$2" "$3" "$4" "$5")"
  status[$1]=$2
  case "$2" in ok|skipped) ;; *) any_failed=1 ;; esac
}

run_phase() {  # name limit_seconds
  local name=$1 limit=$2 t0 rc=0 left
  if [ "$deadline" -gt 0 ]; then
    left=$((deadline - $(now)))
    if [ "$left" -lt 5 ]; then
      record "$name" "not-run" "-" 0 "time budget (${budget} s) used up"
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  t0=$(now)
  timeout --kill-after=20 "$limit" bash "$self" --phase "$name" > "$results/$name.log" 2>&1 || rc=$?
  local took=$(( $(now) - t0 ))
  if [ "$rc" -eq 0 ]; then
    record "$name" ok 0 "$took" "$name.log"
  elif [ "$name" = build ] && [ "$rc" -eq 3 ]; then
    record "$name" PARTIAL "$rc" "$took" "$name.log: all but the libtorch adapter built"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "run.sh: $name stopped after ${limit} s" >> "$results/$name.log"
    record "$name" TIMEOUT "$rc" "$took" "$name.log (limit ${limit} s)"
  else
    record "$name" FAILED "$rc" "$took" "$name.log"
  fi
}

skip() { record "$1" "$2" "-" 0 "$3"; }

echo "run.sh: bundle $bundle; work $work; results $results; $jobs jobs; CUDA $cuda_mode" \
  "(nvcc: ${nvcc:-none}, GPU arch: ${cuda_arch:-none found})"
run_phase env 120
run_phase extract 120
if [ "${status[extract]}" = ok ]; then
  run_phase configure 360
else
  skip configure not-run "extract failed"
fi
if [ "${status[configure]}" = ok ]; then
  run_phase build "$build_timeout"
  run_phase ctest 300
  if [ -n "$torch_line" ]; then
    run_phase pytest 900
  else
    skip pytest skipped "torch is not importable by $AS_PYTHON"
  fi
  if [ "$(state_get cuda)" != ON ]; then
    skip bench skipped "no CUDA build (gpu_copy_bench is CUDA-only; the bench label's smoke runs are in ctest)"
  elif [ ! -x "$work/build/bench/gpu_copy_bench" ]; then
    skip bench not-run "the build did not make bench/gpu_copy_bench"
  else
    run_phase bench 240
  fi
else
  for p in build ctest pytest bench; do skip "$p" not-run "configure did not succeed"; done
fi
total=$(( $(now) - start ))

{
  echo "actstash bundle run, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -n), $(nproc) cores, $jobs jobs"
  sed -n 's/^source: /source: /p' "$bundle/MANIFEST" 2>/dev/null || true
  if [ "$(state_get cuda)" = ON ]; then
    echo "CUDA: built (ACTSTASH_WITH_CUDA=$cuda_mode, nvcc $nvcc), architectures:" \
      "${cuda_arch:-project default (cmake/ActstashCuda.cmake)}" \
      "${cuda_arch:+(compute capability of the GPU)}"
  else
    echo "CUDA: not built (ACTSTASH_WITH_CUDA=$cuda_mode, nvcc ${nvcc:-none})"
  fi
  echo "torch adapter: $(state_get torch)"
  echo "ABI: $(state_get abi)"
  echo "GPU: $gpu"
  echo "python: $AS_PYTHON, ${torch_line:-torch not importable}"
  echo "ACTSTASH_WERROR=$werror; $(grep -m1 '^warnings:' "$results/build.log" 2>/dev/null ||
    echo 'warnings: -') (build.log)"
  echo "work: $work"
  echo
  printf '%-10s %-8s %-5s %6s  %s\n' phase status exit sec "log / note"
  printf '%s\n' "${summary_rows[@]}"
  echo
  if [ "$any_failed" = 0 ]; then
    echo "result: PASS in $total s"
  else
    echo "result: FAILED in $total s"
  fi
} > "$results/summary.txt"
echo
cat "$results/summary.txt"
exit "$any_failed"
