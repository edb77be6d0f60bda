# actstash_project_options(<target>): warnings (and -Werror unless
# ACTSTASH_WERROR=OFF) for project code only; generated protobuf code and
# third-party headers are left alone. Under clang the locking annotations
# (ABSL_GUARDED_BY, ...) are checked too (-Wthread-safety); gcc ignores them,
# so scripts/thread-safety runs that analysis over the gcc build's sources.
function(actstash_project_options target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:Clang>>:-Wthread-safety>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${ACTSTASH_WERROR}>>:-Werror>)
  # gcc's flow analysis is unreliable on instrumented code: under ASan it
  # reports libstdc++'s own <regex> as maybe-uninitialized (its manual warns
  # that sanitizers cause such false positives).
  if(ACTSTASH_SANITIZE AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-maybe-uninitialized>)
  endif()
endfunction()
