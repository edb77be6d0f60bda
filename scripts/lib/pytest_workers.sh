# shellcheck shell=bash
# The Python suite's parallel workers (pytest-xdist), for scripts/test and
# scripts/test-pip-torch: PYTEST_WORKERS_ARGS is "-n N --dist loadfile", each
# test file whole in one worker (a module's daemon fixture and the tests that
# share it stay in one process), or nothing where xdist is missing or
# ACTSTASH_PYTEST_WORKERS=0. N: ACTSTASH_PYTEST_WORKERS, default the core
# count. Usage: pytest_workers PYTHON (the interpreter that runs pytest).
# shellcheck disable=SC2034  # PYTEST_WORKERS_ARGS: read by the caller
pytest_workers() {
  local workers=${ACTSTASH_PYTEST_WORKERS:-$(nproc)}
  PYTEST_WORKERS_ARGS=()
  if [ "$workers" != 0 ] && "$1" -c 'import xdist' 2> /dev/null; then
    PYTEST_WORKERS_ARGS=(-n "$workers" --dist loadfile)
  fi
}
