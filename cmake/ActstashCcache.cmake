# Compiles C, C++ and CUDA through scripts/ccache, the project's compiler
# cache (one cache per machine, outside the clone; the script says where and
# how it is keyed). -DACTSTASH_CCACHE=OFF compiles without it; the script also
# runs the compiler directly where ccache is not installed, so a machine
# without it builds the same, only without the cache. Included before any
# target is defined: the launcher is read when a target is created.
option(ACTSTASH_CCACHE "Compile through the project's compiler cache (scripts/ccache)" ON)
if(ACTSTASH_CCACHE)
  set(_actstash_launcher "${PROJECT_SOURCE_DIR}/scripts/ccache")
  foreach(lang C CXX CUDA)
    if(NOT CMAKE_${lang}_COMPILER_LAUNCHER)
      set(CMAKE_${lang}_COMPILER_LAUNCHER "${_actstash_launcher}")
    endif()
  endforeach()
  unset(_actstash_launcher)
endif()
