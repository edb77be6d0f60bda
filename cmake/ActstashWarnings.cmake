# actstash_project_options(<target>): warnings (and -Werror unless
# ACTSTASH_WERROR=OFF) for project code only; generated protobuf code and
# third-party headers are left alone.
function(actstash_project_options target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${ACTSTASH_WERROR}>>:-Werror>)
endfunction()
