#!/usr/bin/env bash
# The GPU checks and benchmarks, meant for one device call on an H100/H200 (10 minutes at most per command):
#
#   bash benchmarks/gpu.sh                       # attention, ttft, profile, then the tests with the time left
#                                                # (device tool: run(command=..., carry=[".whl"], timeout_s=600))
#   bash benchmarks/gpu.sh tests                 # only the steps named: the tests alone get the whole budget
#   bash benchmarks/gpu.sh memory                # the shared-blocks experiment (not in the default: unchanged x3)
#   bash benchmarks/gpu.sh --wheels              # here, with network: fetch the wheels the device image lacks
#   bash benchmarks/gpu.sh --dry-run             # here, on the CPU: each step's command proven (collected, --help)
#                                                # and the time limits checked against the budget; nothing timed
#
# Steps: "attention", "ttft", "profile" and "memory" run benchmarks/attention.py, benchmarks/ttft.py,
# benchmarks/profile_link.py --graphs and benchmarks/memory.py --model mistral-7b-random, which write
# benchmarks/results/{attention,ttft,memory_gpu}.{json,png} and profile.txt. "tests" runs the graphs, launch-count,
# engine, oracle and kernel tests on CUDA (PIC_TEST_DEVICE=cuda), most telling first; the compile check for sm_80 is
# left to the CPU's CI (it needs no GPU; sm_90's runs here).
# "attention" times the prefill kernel both ways beside SDPA-flash (512 rows over 4K-32K keys, and the 544-row link
# pass): K rotated once per layer by rotate_k_kernel (`pic`, the plan's choice there) and rotated in the KV loop
# (`pic_k_in_loop`), with the rotation launch alone (`pic_rotate_k_only`); it runs those passes before the decodes
# and rewrites its JSON after every case, so a step cut short by its limit still returns them.
# "ttft" times the default (auto) beside full, mepic, legolink and naive at 4K-32K, auto, mepic and naive again with
# CUDA graphs, and decode at batch 1 and 16 with and without graphs (108 s of work on the H200, 2026-11-28; 115 s was too
# little with the plot). "profile" profiles a 16K link under naive, mepic and full, then again with graphs.
# Each step has its own time limit in seconds (ATTENTION_S, TTFT_S, PROFILE_S, TESTS_S, MEMORY_S), and all of them
# share one budget, TOTAL_S (570: a device call may run 600 s): a step gets at most what is left of it (less 20 s
# for its kill and copies), and a step with under 30 s left is skipped; the tests, last, take all that is left unless
# TESTS_S is set. A step that fails, runs out of time or is skipped is logged and the next one runs, and the script
# exits 1 if any did. The default steps' limits (60, 135, 50, 255), each with 10 s to be killed, and 30 s of checks
# fit the budget even if every step used all of its limit (the end of the log says so). The benchmarks go first
# because the tests do not fit beside them with a cold Triton cache: on the H200 (2026-11-28, 19c3797) the tests took
# all of 230 s for 68 of 185 tests, and 130 more in 225 s on the same machine after (no failure in either).
# With $OUT set (the device tool's output folder, which returns at most 8 files) each step's results are copied
# there as it ends, with gpu.log (the whole output).
#
# The device image has torch, transformers, triton, pytest and matplotlib, not pydantic or redis: `--wheels` puts
# wheels of the versions installed in the project's .venv (or $PYTHON's; CPython 3.12, manylinux x86-64) in .whl/
# (ignored by git); carry it (run(..., carry=[".whl"])) and this script installs them into /tmp/site first.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(pydantic pydantic_core annotated_types typing_inspection typing_extensions redis)
TOTAL_S=${TOTAL_S:-570}
TESTS_S=${TESTS_S:-}

if [ "${1:-}" = "--wheels" ]; then  # pin what the project runs with: its venv's versions, not python3's on PATH
    [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
    pins=$($PY -c "import importlib.metadata as m, sys; print(' '.join(f'{p}=={m.version(p)}' for p in sys.argv[1:]))" \
        "${WHEELS[@]}") || exit 1
    exec $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG=${OUT:-/tmp}/gpu.log
: >"$LOG"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
$PY - "${WHEELS[@]}" msgpack xxhash tqdm transformers triton pytest matplotlib <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.util, sys
import torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}: {gpu}")
missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]
print("missing:", " ".join(missing) or "nothing", "(bash benchmarks/gpu.sh --wheels, then carry .whl)" * bool(missing))
EOF

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1 && shift
failed=()
planned=30  # seconds: the checks before the first step, then each step's limit and its 10 s to be killed
step() {  # name, seconds, files to copy to $OUT (space-separated), command ...
    local name=$1 limit=$2 files=$3 start=$SECONDS part=/tmp/gpu_step.log marker=/tmp/gpu_step.start
    local left=$((TOTAL_S - SECONDS - 20))
    planned=$((planned + limit + 10))
    shift 3
    if [ "$left" -lt 30 ]; then
        echo "=== $name: skipped, ${left} s of the ${TOTAL_S} s budget left" | tee -a "$LOG"
        failed+=("$name")
        return
    fi
    # the limit, or what is left of the budget; the tests, last, take all of it unless TESTS_S is set
    [ "$limit" -gt "$left" ] || [ "$name$TESTS_S" = tests ] && limit=$left
    if [ $DRY -eq 1 ]; then  # prove the command: the tests collected, each benchmark's options parsed
        echo "=== $name: would run for at most ${limit} s: $*" | tee -a "$LOG"
        case $name in
            tests) set -- "${@/-q/--collect-only}" && set -- "${@/PIC_TEST_DEVICE=cuda/PIC_TEST_DEVICE=cpu}" ;;
            *) set -- "$@" --help ;;
        esac
    fi
    touch "$marker"
    echo "=== $name (at most ${limit} s): $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" >"$part" 2>&1
    local rc=$?
    cat "$part" >>"$LOG"
    tail -n 30 "$part"
    echo "=== $name: exit $rc after $((SECONDS - start)) s$([ $rc -eq 124 ] && echo ' (time limit)')" | tee -a "$LOG"
    [ $rc -eq 0 ] || failed+=("$name")
    if [ -n "${OUT:-}" ]; then
        for f in $files; do [ "$f" -nt "$marker" ] && cp "$f" "$OUT/"; done  # written by this step, not stale
    fi
}

R=benchmarks/results
TESTS=(tests/test_graphs.py tests/test_launches.py tests/test_cuda_paths.py tests/test_engine.py tests/test_strides.py
    tests/test_oracle.py tests/test_triton_plan.py tests/test_triton_split.py tests/test_triton.py
    --deselect "tests/test_triton.py::test_kernels_compile_as_launched_pipelined_without_spills[80]")
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(attention ttft profile tests)
for s in "${steps[@]}"; do
    case $s in
        attention) step attention "${ATTENTION_S:-60}" "$R/attention.json $R/attention.png" $PY benchmarks/attention.py ;;
        ttft) step ttft "${TTFT_S:-135}" "$R/ttft.json $R/ttft.png" $PY benchmarks/ttft.py --repeats 2 --decode-repeats 1 ;;
        profile) step profile "${PROFILE_S:-50}" "$R/profile.txt" $PY benchmarks/profile_link.py --graphs ;;
        tests) step tests "${TESTS_S:-255}" "" env PIC_TEST_DEVICE=cuda $PY -m pytest -q -rfE -p no:cacheprovider "${TESTS[@]}" ;;
        memory) step memory "${MEMORY_S:-55}" "$R/memory_gpu.json $R/memory_gpu.png" \
            $PY benchmarks/memory.py --model mistral-7b-random ;;
        *) echo "unknown step $s (tests, attention, ttft, profile, memory)"; failed+=("$s") ;;
    esac
done
echo "=== planned at most ${planned} s (limits, kills, checks), budget ${TOTAL_S} s; took $SECONDS s" | tee -a "$LOG"
if [ "$planned" -gt "$TOTAL_S" ]; then  # a later step would get less than its limit if the earlier ones used theirs
    echo "=== the limits exceed the budget: lower TESTS_S, ATTENTION_S, TTFT_S, PROFILE_S or MEMORY_S" | tee -a "$LOG"
    failed+=(budget)
fi
echo "=== failed: ${failed[*]:-none}" | tee -a "$LOG"
[ ${#failed[@]} -eq 0 ]
