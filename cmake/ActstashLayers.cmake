# The layers of the source tree, held by the build: a target can include
# "<folder>/x.h" only for the folders it is given here (its own, and through
# its PUBLIC dependencies theirs), never through a source-root include
# directory. Each folder gets an include root of its own in the build tree,
# ${CMAKE_BINARY_DIR}/layers/<name>/, holding one symbolic link <folder> ->
# the source folder; a header of a layer the target does not depend on is
# then not found, and the compiler says so. The allowed edges are listed in
# docs/ARCHITECTURE.md ("Layers") and checked over the whole tree, headers
# and tests included, by scripts/check-layers.
#
# Tests and benchmarks sit on top and see the whole tree (they test
# internals); they use ${PROJECT_SOURCE_DIR} directly.

# actstash_layer_include(<target> <PUBLIC|PRIVATE|INTERFACE> <folder>):
# <folder> is relative to the source root ("common", "client/capi").
function(actstash_layer_include target scope folder)
  string(REPLACE "/" "_" name "${folder}")
  set(root "${CMAKE_BINARY_DIR}/layers/${name}")
  set(link "${root}/${folder}")
  if(NOT IS_SYMLINK "${link}")
    get_filename_component(parent "${link}" DIRECTORY)
    file(MAKE_DIRECTORY "${parent}")
    file(CREATE_LINK "${PROJECT_SOURCE_DIR}/${folder}" "${link}" SYMBOLIC)
  endif()
  target_include_directories(${target} ${scope} $<BUILD_INTERFACE:${root}>)
endfunction()
