# Resolves ACTSTASH_WITH_CUDA (AUTO/ON/OFF) into ACTSTASH_HAVE_CUDA and, when
# on, enables the CUDA language with the default architectures sm_80 and sm_90
# (override with -DCMAKE_CUDA_ARCHITECTURES=...).
set(ACTSTASH_HAVE_CUDA OFF)
if(NOT ACTSTASH_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS "/usr/local/cuda/bin/nvcc")
    set(CMAKE_CUDA_COMPILER "/usr/local/cuda/bin/nvcc")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    # CMake 3.25.0 and 3.25.1 (Debian 12's) stop in FindCUDAToolkit ("could not
    # find TARGET CUDA::nvToolsExt") when the toolkit has no libnvToolsExt (CUDA
    # 13) and the project requires CMake >= 3.25: the deprecation note it puts on
    # that target is gated on CMAKE_MINIMUM_REQUIRED_VERSION alone. Fixed in
    # 3.25.2; older releases get the note skipped.
    if(CMAKE_VERSION VERSION_LESS 3.25.2)
      set(_actstash_cmake_minimum ${CMAKE_MINIMUM_REQUIRED_VERSION})
      set(CMAKE_MINIMUM_REQUIRED_VERSION 3.24)
    endif()
    find_package(CUDAToolkit REQUIRED)
    if(DEFINED _actstash_cmake_minimum)
      set(CMAKE_MINIMUM_REQUIRED_VERSION ${_actstash_cmake_minimum})
      unset(_actstash_cmake_minimum)
    endif()
    # cudaGetDriverEntryPointByVersion (common/cuda_device_guard.cc) is 12.5+.
    if(CUDAToolkit_VERSION VERSION_LESS 12.5)
      if(ACTSTASH_WITH_CUDA STREQUAL "ON")
        message(FATAL_ERROR "actstash needs CUDA >= 12.5; found ${CUDAToolkit_VERSION}")
      endif()
      message(WARNING "actstash: CUDA ${CUDAToolkit_VERSION} < 12.5: building without CUDA")
    else()
      set(ACTSTASH_HAVE_CUDA ON)
    endif()
  elseif(ACTSTASH_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ACTSTASH_WITH_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()
# Also in the cache (CMakeCache.txt), where .ci/run checks that a machine with
# nvcc really built the CUDA code. The normal variable above is what the
# CMakeLists read; this copy is only a record, rewritten on every configure.
set(ACTSTASH_HAVE_CUDA ${ACTSTASH_HAVE_CUDA}
    CACHE INTERNAL "CUDA support resolved from ACTSTASH_WITH_CUDA")
message(STATUS "actstash: CUDA support ${ACTSTASH_HAVE_CUDA}")
