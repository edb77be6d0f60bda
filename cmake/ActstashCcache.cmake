# Compiles C, C++ and CUDA through scripts/ccache, the project's compiler
# cache (one cache per machine, outside the clone; the script says where and
# how it is keyed), where ccache is installed (scripts/setup installs it);
# -DACTSTASH_CCACHE=OFF compiles without it. Included before any target is
# defined: the launcher is read when a target is created.
#
# Sets ACTSTASH_SOURCE_PREFIX: the prefix the compiler sees on the project's
# source paths, which -fmacro-prefix-map takes off __FILE__ (CMakeLists.txt).
# Without the cache it is the checkout's absolute path. Through the cache it
# is the checkout relative to the build directory ("../": ccache rewrites the
# paths under its base_dir, the checkout, to paths relative to the directory
# the compiler runs in, Ninja's build root), so that neither the hash nor the
# binary holds the checkout's absolute path.
option(ACTSTASH_CCACHE "Compile through the project's compiler cache (scripts/ccache)" ON)
find_program(ACTSTASH_CCACHE_PROGRAM ccache)
set(ACTSTASH_SOURCE_PREFIX "${PROJECT_SOURCE_DIR}/")
if(ACTSTASH_CCACHE AND ACTSTASH_CCACHE_PROGRAM)
  set(_actstash_launcher "${PROJECT_SOURCE_DIR}/scripts/ccache")
  foreach(lang C CXX CUDA)
    if(NOT CMAKE_${lang}_COMPILER_LAUNCHER)
      set(CMAKE_${lang}_COMPILER_LAUNCHER "${_actstash_launcher}")
    endif()
  endforeach()
  unset(_actstash_launcher)
  # "../" for build/ (CMake 3.25 ends a relative path to a parent with "/"),
  # "../src/" for /build beside /src, "" for a build in the checkout itself.
  file(RELATIVE_PATH ACTSTASH_SOURCE_PREFIX "${CMAKE_BINARY_DIR}" "${PROJECT_SOURCE_DIR}")
  if(ACTSTASH_SOURCE_PREFIX AND NOT ACTSTASH_SOURCE_PREFIX MATCHES "/$")
    string(APPEND ACTSTASH_SOURCE_PREFIX "/")
  endif()
  message(STATUS "actstash: compiling through ${ACTSTASH_CCACHE_PROGRAM} (scripts/ccache)")
endif()
