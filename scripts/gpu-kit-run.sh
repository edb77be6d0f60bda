#!/usr/bin/env bash
# Runs the GPU kit made by scripts/gpu-kit (this file is the kit's run.sh) on
# a CUDA machine where nothing is built: no compiler, no network, no root.
#
#   bash run.sh OUT [quick|full|pareto]
#
#   quick (default; about 5 minutes at most): the environment, the carried
#         libraries, the gpu gtests, the libtorch adapter's gtests (CPU and
#         CUDA tensors, against this machine's torch), the registration
#         probe, the CUDA pytest and a CPU pytest (the kit's package and
#         daemon at work), the copy benchmark's quick mode
#   full  (its phases' limits add up to about 11 minutes; the first full run
#         took under 3): quick's phases, then the step benchmark
#         (bench/gpu_step_bench.py), the optimizer step on the device path
#         (bench/gpu_optimizer_bench.py), the full copy benchmark, and
#         compute-sanitizer memcheck over the copy-engine test when the
#         machine has compute-sanitizer
#   pareto (about 9 minutes at most; a command of its own): the environment, then
#         bench/auto_plan_bench.py on the GPU (--device cuda, the real link): a
#         12-layer GPT, plain, the uniform plans, torch's checkpoint and SAC,
#         torch.compile at activation_memory_budget 0.1/0.5/0.9 (left out, with
#         the error, where inductor cannot compile) and auto across the budgets;
#         OUT/pareto.json (bench/auto_plan_bench.py --from-json prints it)
#
# Each phase logs to OUT/<phase>.log (gtests also OUT/<phase>.xml) and adds a
# line to OUT/summary.txt: its status, exit code and seconds. Statuses: ok;
# FAILED; TIMEOUT (the phase's limit passed; the next phase still runs);
# skipped (no GPU) when the machine has none (the binary still ran and
# reported the skip); skipped (no torch) when no Python can import torch.
# Python: /opt/torch/.venv/bin/python3 when it imports torch, else python3 on
# PATH ($ACTSTASH_KIT_PYTHON overrides). Exit status: 1 when a phase FAILED
# or timed out, else 0.
set -uo pipefail

kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:?usage: bash run.sh OUT [quick|full|pareto]}
mode=${2:-quick}
case "$mode" in quick|full|pareto) ;; *) echo "run.sh: mode is quick, full or pareto" >&2; exit 2 ;; esac
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary=$out/summary.txt
: > "$summary"
build=$kit/build
export ACTSTASH_BUILD_DIR=$build
export PYTHONDONTWRITEBYTECODE=1
# The tests find the daemon and workers next to themselves; this is the same
# binary, named for the tools that look in the environment first.
export ACTSTASH_DAEMON_BINARY=$build/server/actstashd
export ACTSTASH_DAEMON=$build/server/actstashd
export ACTSTASH_CLI=$build/tools/actstash
failed=0

gpu=no
if command -v nvidia-smi > /dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then gpu=yes; fi
python=""
for candidate in "${ACTSTASH_KIT_PYTHON:-}" /opt/torch/.venv/bin/python3 python3; do
  if [ -n "$candidate" ] && "$candidate" -c 'import torch, pytest' > /dev/null 2>&1; then
    python=$candidate
    break
  fi
done
# The libtorch adapter's tests load this machine's libtorch (the kit carries
# none): its lib/ goes on their LD_LIBRARY_PATH.
torch_lib=""
if [ -n "$python" ]; then
  torch_lib=$("$python" -c 'import os, torch; print(os.path.join(torch.__path__[0], "lib"))' 2>/dev/null)
fi

# summary_line NAME STATUS RC SECONDS: one phase's line of the summary.
summary_line() {
  printf '%-22s %-22s rc=%-3s %4ss\n' "$1" "$2" "$3" "$4" >> "$summary"
}
# skipped NAME WHY: a phase that cannot run here.
skipped() { summary_line "$1" "skipped ($2)" - 0; }

# phase NAME LIMIT_S KIND COMMAND...: KIND is gpu (skipped-no-GPU when there is
# none and the command exits 0 or 77), torch (needs $python), or cpu.
phase() {
  local name=$1 limit=$2 kind=$3 start rc status
  shift 3
  start=$(date +%s)
  if [ "$kind" = torch ] && [ -z "$python" ]; then
    skipped "$name" "no torch"
    echo "no Python here imports torch and pytest" > "$out/$name.log"
    return
  fi
  # Through bash -c: the phases are often this script's (exported) functions.
  timeout --kill-after=10 "$limit" bash -c '"$@"' phase "$@" > "$out/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    status="TIMEOUT (${limit}s)"
  elif [ "$gpu" = no ] && [ "$kind" = gpu ] && { [ $rc -eq 0 ] || [ $rc -eq 77 ]; }; then
    status="skipped (no GPU)"
  elif [ $rc -eq 77 ]; then
    status="skipped"
  elif [ $rc -eq 0 ]; then
    status=ok
  else
    status=FAILED
  fi
  case "$status" in FAILED|TIMEOUT*) failed=1 ;; esac
  summary_line "$name" "$status" "$rc" "$(( $(date +%s) - start ))"
  echo "run.sh: $name: $status"
}

env_report() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  cat "$kit/MANIFEST"
  echo
  local cmd
  for cmd in "uname -a" "getconf GNU_LIBC_VERSION" "nproc" "free -g" "ulimit -l" "ulimit -a" \
             "nvidia-smi" \
             "nvidia-smi --query-gpu=name,driver_version,compute_mode,compute_cap,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv" \
             "nvidia-smi topo -m" "command -v compute-sanitizer"; do
    echo "\$ $cmd"
    timeout 20 bash -c "$cmd" 2>&1 || echo "(exit $?)"
    echo
  done
  echo "python: ${python:-none that imports torch and pytest}"
  if [ -n "$python" ]; then
    "$python" - <<'PY' 2>&1
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
PY
  fi
}

# Every carried native file resolves all of its libraries here (the libtorch
# adapter's tests with this machine's torch).
libraries() {
  local missing=0 file path
  while IFS= read -r -d '' file; do
    path=""
    case "$file" in
      "$build"/tests/torch/*)
        if [ -z "$torch_lib" ]; then echo "needs torch (none here): ${file#"$kit"/}"; continue; fi
        path=$torch_lib ;;
    esac
    if LD_LIBRARY_PATH=$path ldd "$file" 2>&1 | grep -q 'not found'; then
      echo "UNRESOLVED: $file"
      LD_LIBRARY_PATH=$path ldd "$file" | grep 'not found'
      missing=1
    else
      echo "ok: ${file#"$kit"/}"
    fi
  done < <(find "$build" -type f \( -perm -u+x -o -name '*.so*' \) ! -name '*.py' -print0)
  return $missing
}

gtest() {  # name binary
  "$build/$2" --gtest_output="xml:$out/$1.xml"
}

torch_gtest() {  # name binary: a libtorch adapter test, on this machine's torch
  if [ -z "$torch_lib" ]; then echo "no Python here imports torch"; return 77; fi
  if [ ! -x "$build/$2" ]; then
    if grep -q '^libtorch adapter tests: not carried' "$kit/MANIFEST"; then
      echo "the kit carries no $2 (built with --no-torch)"
      return 77
    fi
    echo "the kit should carry $2 (MANIFEST) but does not"
    return 1
  fi
  LD_LIBRARY_PATH=$torch_lib "$build/$2" --gtest_output="xml:$out/$1.xml"
}

pytest_run() {  # pytest arguments
  (cd "$kit" && "$python" -m pytest -q -p no:cacheprovider "$@")
}

# The step benchmark's peers (scripts/gpu-kit --peers): installed without
# dependencies or network into OUT/peers-site, which the step benchmark gets
# on its PYTHONPATH; then torchtune's OffloadActivations must load.
peers() {
  if ! compgen -G "$kit/peers/*.whl" > /dev/null; then
    echo "the kit carries no peers (scripts/gpu-kit --peers)"
    return 77
  fi
  "$python" -m pip install --no-index --no-deps --disable-pip-version-check \
    --target "$out/peers-site" "$kit"/peers/*.whl || return 1
  PYTHONPATH=$out/peers-site:$kit/bench "$python" -c '
import sys, llama_peers
cls, why = llama_peers._torchtune_offload(True)
print("torchtune OffloadActivations:", cls or why)
sys.exit(0 if cls else 1)'
}

export kit out build python torch_lib
export -f env_report libraries gtest torch_gtest pytest_run peers
echo "run.sh: $mode, GPU: $gpu, Python: ${python:-none}; logs in $out"
phase env 60 cpu env_report
if [ "$mode" = pareto ]; then
  # fp32, 12 x 1024, context 1024, batch 4: about 1 GiB of saved activations per block.
  phase pareto_bench 540 gpu bash -c '"$0" "$1/bench/auto_plan_bench.py" --device cuda \
    --models gpt --rounds 2 --steps 3 --gpt-layers 12 --gpt-dim 1024 --gpt-heads 16 \
    --gpt-context 1024 --gpt-batch 4 --gpt-vocab 8192 --min-bytes 1048576 \
    --compile-budgets 0.1,0.5,0.9 --json > "$2/pareto.json"' "$python" "$kit" "$out"
  echo
  cat "$summary"
  exit $failed
fi
phase libraries 60 cpu libraries
phase daemon_smoke 60 cpu bash -c '
  dir=$(mktemp -d) && trap "kill \$pid 2>/dev/null; rm -rf \$dir" EXIT
  "$ACTSTASH_DAEMON" --socket "$dir/s.sock" --pool-size 64MiB --segment-size 4MiB &
  pid=$!
  for _ in $(seq 100); do [ -S "$dir/s.sock" ] && break; sleep 0.1; done
  "$ACTSTASH_CLI" --address "unix://$dir/s.sock" stats'
phase gtest_copy_engine 90 gpu gtest gtest_copy_engine tests/client/cuda_copy_engine_gpu_test
phase gtest_kernels 60 gpu gtest gtest_kernels tests/kernels/kernels_gpu_test
phase gtest_device_pool 90 gpu gtest gtest_device_pool tests/integration/device_pool_gpu_test
phase gtest_torch_cpu 120 torch torch_gtest gtest_torch_cpu tests/torch/torch_offload_test
phase gtest_torch_optim 60 torch torch_gtest gtest_torch_optim tests/torch/torch_optim_test
phase gtest_torch_cuda 120 gpu torch_gtest gtest_torch_cuda tests/torch/torch_cuda_test
phase register_probe 60 gpu "$build/bench/register_probe" --gib 1 --reps 3
phase pytest_cuda 240 torch pytest_run tests/python/test_cuda.py tests/python/test_device_modes.py -rs
phase pytest_cpu 150 torch pytest_run tests/python/test_offload.py tests/python/test_stats.py
phase copy_bench_quick 90 gpu "$build/bench/gpu_copy_bench" --quick
phase peers 60 torch peers
if [ "$mode" = full ]; then
  phase step_bench 240 torch env PYTHONPATH="$out/peers-site" "$python" \
    "$kit/bench/gpu_step_bench.py" --csv "$out/step_bench.csv"
  phase optimizer_bench 120 torch "$python" "$kit/bench/gpu_optimizer_bench.py" \
    --csv "$out/optimizer_bench.csv"
  phase copy_bench_full 180 gpu "$build/bench/gpu_copy_bench"
  if command -v compute-sanitizer > /dev/null; then
    phase memcheck 120 gpu compute-sanitizer --tool memcheck --error-exitcode 1 \
      "$build/tests/client/cuda_copy_engine_gpu_test"
  else
    skipped memcheck "no compute-sanitizer"
  fi
fi
echo
cat "$summary"
exit $failed
