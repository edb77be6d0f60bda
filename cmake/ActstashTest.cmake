# actstash_add_test(NAME <name> SOURCES <src...> [LIBS <lib...>]
#                   LABELS <label...> [TIMEOUT <seconds>] [RUN_SERIAL])
# Builds a GoogleTest binary and registers it with ctest under the given
# labels (unit, integration, python, gpu, slow). Tests labelled `gpu` are
# expected to skip (GTEST_SKIP) when no device is present.
find_package(GTest CONFIG REQUIRED)
function(actstash_add_test)
  cmake_parse_arguments(T "RUN_SERIAL" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  actstash_project_options(${T_NAME})
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  # The test suites keep Abseil's deadlock detection (common/mutex_mode.h),
  # which the shipped daemon and libraries turn off.
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
    SKIP_RETURN_CODE 77 ENVIRONMENT ACTSTASH_MUTEX_DEADLOCK_DETECTION=1)
  if(T_RUN_SERIAL)
    set_tests_properties(${T_NAME} PROPERTIES RUN_SERIAL TRUE)
  endif()
endfunction()
