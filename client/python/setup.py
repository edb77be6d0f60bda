"""Builds the actstash wheel: the Python sources of this folder plus the native
part (libactstash.so, actstashd, the actstash CLI), stripped of debug info.

The native part comes from a CMake build tree: $ACTSTASH_BUILD_DIR if set (it is
brought up to date), else <repo>/build when it has been configured, else a fresh
build in <repo>/build-python (daemon, CLI and C library only; CUDA when nvcc is
found, as the project's CMake decides). Set ACTSTASH_CMAKE_ARGS for extra
configure arguments of a fresh build.

The shared libraries they load beyond the C/C++ runtime (gRPC, Protobuf, Abseil,
OpenSSL, ...) are copied into actstash/lib and found through RUNPATH $ORIGIN
(patchelf), so the installed package runs in an image that lacks them, as
auditwheel would do; ACTSTASH_VENDOR_LIBS=0 (or no patchelf) skips that and the
package then needs those libraries installed.

The wheel is tagged py3-none-<platform>: the library does not link Python, so
one wheel serves every CPython >= 3.9.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("ACTSTASH_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
NATIVE_TARGETS = ["actstash_c", "actstashd", "actstash"]
# Every Linux system has these (glibc, the GCC runtime); never vendored.
SYSTEM_LIBRARY = re.compile(
    r"^(ld-linux[-\w.]*|linux-vdso|libc|libm|libdl|libpthread|librt|libutil|libresolv|"
    r"libgcc_s|libstdc\+\+|libcuda|libnvidia-[\w-]+)\.so")


def project_version():
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        match = re.search(r"project\(actstash VERSION ([0-9.]+)", f.read())
    if not match:
        sys.exit("setup.py: no 'project(actstash VERSION ...)' in CMakeLists.txt")
    return match.group(1)


def log(message):
    print(f"actstash setup.py: {message}", file=sys.stderr, flush=True)


def build_tree():
    """A configured build tree with the native targets up to date."""
    build = os.environ.get("ACTSTASH_BUILD_DIR")
    if not build and os.path.exists(os.path.join(REPO, "build", "CMakeCache.txt")):
        build = os.path.join(REPO, "build")
    if not build:
        build = os.path.join(REPO, "build-python")
        if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            command = ["cmake", "-S", REPO, "-B", build, *generator,
                       "-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DACTSTASH_BUILD_TESTS=OFF",
                       "-DACTSTASH_BUILD_BENCH=OFF", "-DACTSTASH_BUILD_TORCH=OFF",
                       *shlex.split(os.environ.get("ACTSTASH_CMAKE_ARGS", ""))]
            log(" ".join(command))
            subprocess.check_call(command)
    command = ["cmake", "--build", build, "--parallel", str(os.cpu_count() or 1),
               "--target", *NATIVE_TARGETS]
    log(" ".join(command))
    subprocess.check_call(command)
    return build


def find_artifact(build, *relatives):
    for relative in relatives:
        path = os.path.join(build, relative)
        if os.path.isfile(path):
            return path
    sys.exit(f"setup.py: none of {', '.join(relatives)} in {build}")


class BuildPyWithNative(build_py):
    """build_py, then the native part copied next to the sources."""

    def run(self):
        super().run()
        build = build_tree()
        package = os.path.join(self.build_lib, "actstash")
        artifacts = {
            "libactstash.so": find_artifact(build, "python/actstash/libactstash.so",
                                            "client/capi/libactstash.so"),
            "bin/actstashd": find_artifact(build, "server/actstashd"),
            "bin/actstash": find_artifact(build, "tools/actstash"),
        }
        strip = shutil.which("strip")
        for name, source in artifacts.items():
            target = os.path.join(package, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)
            if strip:
                subprocess.check_call([strip, "--strip-debug", target])
            log(f"{source} -> {name} ({os.path.getsize(target) >> 20} MiB)")
        vendor_libraries(package, [os.path.join(package, name) for name in artifacts])


def shared_dependencies(path):
    """(soname, resolved path) of every library `path` loads, transitively (ldd)."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if "=>" not in parts:
            continue
        name, target = parts[0], parts[parts.index("=>") + 1]
        if target == "not":
            sys.exit(f"setup.py: {path} needs {name}, which is not found")
        found.append((name, target))
    return found


def vendor_libraries(package, objects):
    """Copies the non-system libraries `objects` load into package/lib and points
    each object's RUNPATH there."""
    patchelf = shutil.which("patchelf")
    if os.environ.get("ACTSTASH_VENDOR_LIBS", "1") == "0" or patchelf is None:
        log("not vendoring shared libraries (" + ("ACTSTASH_VENDOR_LIBS=0" if patchelf else
                                                  "no patchelf") + "): the package needs them "
            "installed where it runs")
        return
    libdir = os.path.join(package, "lib")
    shutil.rmtree(libdir, ignore_errors=True)
    os.makedirs(libdir)
    total = 0
    for obj in objects:
        for name, source in shared_dependencies(obj):
            target = os.path.join(libdir, name)
            if SYSTEM_LIBRARY.match(name) or os.path.exists(target):
                continue
            shutil.copyfile(os.path.realpath(source), target)
            os.chmod(target, 0o755)
            subprocess.check_call([patchelf, "--set-rpath", "$ORIGIN", target])
            total += os.path.getsize(target)
        relative = os.path.relpath(libdir, os.path.dirname(obj))
        subprocess.check_call([patchelf, "--set-rpath", "$ORIGIN/" + relative, obj])
    log(f"vendored {len(os.listdir(libdir))} shared libraries ({total >> 20} MiB) into "
        f"actstash/lib")


class NativeDistribution(Distribution):
    """Carries native code (without extension modules): installed to platlib, and
    the wheel's root is not pure."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """Native code but no Python ABI: py3-none-<platform>."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


# Intermediate files go to the CMake build folder's side, not into the sources.
_scratch = os.path.join(REPO, "build-python", "setuptools")
os.makedirs(_scratch, exist_ok=True)
setup(
    distclass=NativeDistribution,
    version=project_version(),
    cmdclass={"build_py": BuildPyWithNative, "bdist_wheel": PlatformWheel},
    options={"build": {"build_base": os.path.join(_scratch, "build")},
             "egg_info": {"egg_base": _scratch}},
)
