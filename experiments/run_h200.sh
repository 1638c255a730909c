#!/usr/bin/env bash
# One device call on the H200: `bash experiments/run_h200.sh STAGE...` with STAGE in
#   tests    native GPU run of the kernel and invariance tests (bf16 paths the interpreter can't run)
#   tune     experiments/tune_gemm.py -> kernels/tuned/gemm_CARD.json (each card its own table;
#            another card's points overlay the H200's, kernels.gemm.overlay)
#   tune_moe / tune_mla  experiments/tune_moe.py / tune_mla.py -> kernels/tuned/{moe,mla}_h200.json
#   kernels  experiments/bench_kernels.py, merged into the committed kernels-CARD.json (+ png)
#   probe-gemm  experiments/probe_gemm_m1.py -> probe-gemm-m1-CARD.json (the GEMM at M 1 against M 8)
#   probe-narrow-n  experiments/probe_gemm_narrow_n.py -> probe-gemm-narrow-n-CARD.json (kv_a's N 576
#            as 512 wide columns and 64 narrow ones, two launches)
#   probe-tail  experiments/probe_gemm_tail.py -> probe-gemm-tail-CARD.json (tail tiles, 128 + 64
#            columns, at kv_a, q_a and Qwen3-8B's qkv beside the pick)
#   probe-capture  experiments/probe_capture_spread.py -> probe-capture-spread-CARD.json (a pick's
#            and cuBLAS's time over several graph captures, same and fresh operands)
#   probe-capture-survey  the same, fresh operands only, at every GEMM of the kernels table at
#            M 128 and 256 -> probe-capture-spread-survey-CARD.json
#   launch   experiments/bench_launch_cost.py -> launch-cost-h200.json (host us per op, GPU us beside)
#   logits   experiments/bench_logits_processing.py -> logits-processing-CARD.json (batched vs row by row)
#   models   experiments/bench_models.py -> models-h200.json; MODELS_ARGS adds flags (e.g. --decode-batch 128 --name ...)
#   offline  experiments/bench_offline.py -> offline-h200.json (+ png); OFFLINE_ARGS adds flags
#   sweep    experiments/sweep_offline.py -> sweep-offline-h200.json (+ png)
#   headline  SWEEP_ARGS points -> sweep-offline-h200-run5.json, then offline at the best corun point
#   gpuengine  tests/engine/test_gpu_engine.py (graph replay == eager, packed bits, BI-tuned)
#   serving  experiments/bench_serving.py --launch -> serving-h200.json (+ png per mode)
#   serving-step  corun at several packed steps T beside default and the tuned peer under the
#            serving load -> serving-step-h200.json
#   serving-peer-graphs  default and the tuned peer with their small prefill / mixed steps from
#            graphs and eager, beside corun -> serving-peer-graphs-h200.json
#   serving-corun-sweep  corun's serving settings (overlap, C, T, stall budget) against the
#            graphed peers -> serving-corun-sweep-h200.json
#   serving-low-load  corun at B = 64 and smaller B beside default and the tuned peer at 1 and 4
#            req/s, with each run's engine steps -> serving-low-load-CARD.json
#   paper    experiments/bench_paper.py -> paper-h200.json; one family a call (~3-4 min each):
#            PAPER_MODELS=hy3 (default all three: ~11 min, past one call's 10); it merges the
#            committed experiments/results/paper-h200.json's other families; PAPER_ARGS adds flags
#   pathtests  native run of the path-invariance and attention tests (decode == prefill rows)
#   onpolicy experiments/onpolicy.py -> onpolicy-CARD.json (sampled vs scored / trainer
#            logprobs per model and mode); ONPOLICY_ARGS adds flags
#   rl       examples/grpo.py at Qwen3-8B's shape, 3 iterations -> rl-loop-CARD.json (rollout
#            throughput, weight-sync time); RL_ARGS adds flags
#   atlas    experiments/invariance_atlas.py -> invariance-atlas-h200.json (< 3 min)
#   ablate-AXIS  experiments/ablate.py AXIS -> ablate-AXIS-h200.json + png, e.g. ablate-overlap;
#            AXIS: decode-batch decode-split-size cuda-graphs prefill-policy prefill-chunk
#            prefill-step-tokens stall-budget overlap decode-fused-combine peer-graphs kernel-policy
#            serving-load; ABLATE_ARGS adds flags
# TUNED_FROM_LAST_CALL=1: the device copies the working tree at each call, so a table tuned in
# one call is gone in the next; the tune stages also keep their table in .device-tuned/ (ignored
# by git, so a warm machine keeps it between calls), and with this set the call starts from
# those tables instead of the committed ones (a fresh machine has none: the log says which ran).
# Results land in $OUT/results (bundled as results.tgz), logs in $OUT/*.log. The image's python3
# holds torch/triton; packages it lacks travel as wheels in .whl (carry it): experiments/device_wheels.sh
# downloads them (the server's stack for serving, Liger-Kernel, outlines-core).
set -uo pipefail
OUT=${OUT:-/tmp/corun-out}
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1 CORUN_RESULTS_DIR="$OUT/results" HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
# The card the files of the tests and the logits benchmark are named after (h200, h100): one
# card's native runs never merge into another's file.
CARD=$(python3 -c 'from experiments.harness import card_tag; print(card_tag())')
[ -n "$CARD" ] || { echo "== the card's tag failed (experiments.harness.card_tag): unknown"; CARD=unknown; }

keep_tuned() {  # keep_tuned FILE: the tuned table, for a later call's TUNED_FROM_LAST_CALL=1
  mkdir -p .device-tuned && cp "kernels/tuned/$1" .device-tuned/
}
if [ "${TUNED_FROM_LAST_CALL:-0}" = 1 ]; then
  for table in .device-tuned/*.json; do
    [ -f "$table" ] || { echo "== TUNED_FROM_LAST_CALL: no table kept on this machine; the committed ones run"; break; }
    cp "$table" kernels/tuned/ && echo "== TUNED_FROM_LAST_CALL: kernels/tuned/$(basename "$table") from the last call"
  done
fi

run() {  # run NAME SECONDS CMD...: time-limited, logged, never stops the script; returns the
  # command's status (124, or 137 after the kill: cut by the limit), so `run ... && cp` copies
  # only a finished file
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - start))s"; tail -n 12 "$OUT/$name.log"
  return $rc
}

native_tests() {  # native_tests STAGE SECONDS PYTEST-ARGS...: pytest with a JUnit XML, whose
  # counts and failing ids go into results/native-tests-$CARD.json (merged with the other stage's)
  local name=$1 limit=$2; shift 2
  local xml="$OUT/results/pytest-$name.xml"
  local cmd=(python3 -m pytest -v --tb=short -p no:cacheprovider --junitxml="$xml" "$@")
  run "$name" "$limit" "${cmd[@]}"
  local rc=$?
  local merge=experiments/results/native-tests-$CARD.json
  [ -f "$OUT/results/native-tests-$CARD.json" ] && merge="$OUT/results/native-tests-$CARD.json"
  [ -f "$xml" ] && python3 -m experiments.native_tests "$name" "$xml" --pytest-command "${cmd[*]}" \
    --merge "$merge"
  return $rc
}

h200_only() {  # h200_only STAGE: the MoE and MLA tables (kernels/tuned/{moe,mla}_h200.json)
  # hold the H200's timings, which another card's tuning would overwrite (GEMM has a table per card)
  [ "$CARD" = h200 ] && return 0
  echo "== $1: skipped on $CARD: kernels/tuned/*_h200.json is tuned on the H200 only"
  return 1
}

for stage in "$@"; do
  case $stage in
    # path invariance: the kernels' decode == prefill rows natively (the MMA at 16- and
    # 128-row tiles), then generated vs scored logprobs per mode (experiments/onpolicy.py)
    pathtests) native_tests pathtests ${PATHTESTS_LIMIT:-150} -n 4 \
               invariance_tests/test_path_invariance.py invariance_tests/test_attention_invariance.py \
               tests/kernels/test_attention.py --timeout=120 ;;
    onpolicy) run onpolicy ${ONPOLICY_LIMIT:-300} python3 -m experiments.onpolicy ${ONPOLICY_ARGS:-} ;;
    rl)      run rl ${RL_LIMIT:-150} python3 -m examples.grpo --model qwen3-8b --iterations 3 \
               --prompts 8 --n 8 --max-tokens 64 --optimizer sgd --lr 1e-6 \
               --record rl-loop-$CARD ${RL_ARGS:-} ;;
    tests)   native_tests tests ${TESTS_LIMIT:-110} -n 8 tests/kernels invariance_tests \
               --ignore=invariance_tests/test_engine_determinism.py --timeout=60 ;;
    # tune_gemm writes this card's table after every shape (a cut run resumes): copied whatever
    # the status
    tune)    run tune ${TUNE_LIMIT:-150} python3 -m experiments.tune_gemm --budget-s ${TUNE_BUDGET:-250} ${TUNE_ARGS:-}
             [ -f "kernels/tuned/gemm_$CARD.json" ] && cp "kernels/tuned/gemm_$CARD.json" "$OUT/results/" \
               && keep_tuned "gemm_$CARD.json" ;;
    tune_moe) h200_only tune_moe || continue
             run tune_moe ${TUNE_MOE_LIMIT:-150} python3 -m experiments.tune_moe --budget-s ${TUNE_MOE_BUDGET:-120} \
               && cp kernels/tuned/moe_h200.json "$OUT/results/" && keep_tuned moe_h200.json ;;
    tune_mla) h200_only tune_mla || continue
             run tune_mla ${TUNE_MLA_LIMIT:-330} python3 -m experiments.tune_mla --budget-s ${TUNE_MLA_BUDGET:-270} \
               && cp kernels/tuned/mla_h200.json "$OUT/results/" && keep_tuned mla_h200.json ;;
    # each card's runs merge into its own file (kernels-h200.json, kernels-h100.json); a card's
    # first run writes it afresh
    kernels) merge=(); [ -f "experiments/results/kernels-$CARD.json" ] \
               && merge=(--merge "experiments/results/kernels-$CARD.json")
             run kernels ${KERNELS_LIMIT:-330} python3 -m experiments.bench_kernels \
               "${merge[@]}" ${KERNELS_ARGS:-} ;;
    probe-gemm) run probe-gemm ${PROBE_LIMIT:-120} python3 -m experiments.probe_gemm_m1 ;;
    probe-narrow-n) run probe-narrow-n ${PROBE_LIMIT:-150} python3 -m experiments.probe_gemm_narrow_n ;;
    probe-tail) run probe-tail ${PROBE_LIMIT:-150} python3 -m experiments.probe_gemm_tail ;;
    probe-capture) run probe-capture ${PROBE_LIMIT:-150} python3 -m experiments.probe_capture_spread ;;
    probe-capture-survey) run probe-capture-survey ${PROBE_LIMIT:-300} \
               python3 -m experiments.probe_capture_spread --survey --budget-s ${SURVEY_BUDGET:-240} ;;
    launch)  run launch ${LAUNCH_LIMIT:-120} python3 -m experiments.bench_launch_cost ;;
    logits)  run logits ${LOGITS_LIMIT:-90} python3 -m experiments.bench_logits_processing \
                 --device cuda --name logits-processing-$CARD ;;
    models)  run models ${MODELS_LIMIT:-150} python3 -m experiments.bench_models ${MODELS_ARGS:-} ;;
    offline) run offline ${OFFLINE_LIMIT:-300} python3 -m experiments.bench_offline ${OFFLINE_ARGS:-} ;;
    sweep)   run sweep ${SWEEP_LIMIT:-330} python3 -m experiments.sweep_offline --time-budget-s ${SWEEP_BUDGET:-300} ${SWEEP_ARGS:-} ;;
    headline)  # more sweep points (SWEEP_ARGS), then the offline headline at the best corun point
               # of every sweep file (the committed ones and this run's, under a new name)
               run sweep ${SWEEP_LIMIT:-200} python3 -m experiments.sweep_offline --name ${HEADLINE_SWEEP_NAME:-sweep-offline-h200-run5} \
                 --time-budget-s ${SWEEP_BUDGET:-170} ${SWEEP_ARGS:-}
               best=$(python3 -m experiments.sweep_offline --print-best experiments/results/sweep-offline-h200*.json \
                 $(ls "$OUT"/results/${HEADLINE_SWEEP_NAME:-sweep-offline-h200-run5}.json 2>/dev/null))
               if [ -z "$best" ]; then  # never the engine's defaults in the best point's place
                 echo "== headline: no best corun point (see the sweep log); offline skipped"
               else
                 echo "== best corun settings: $best"
                 run offline ${OFFLINE_LIMIT:-380} python3 -m experiments.bench_offline ${OFFLINE_ARGS:-} --corun-set $best
               fi ;;
    gpuengine) native_tests gpuengine ${GPUENGINE_LIMIT:-240} tests/engine/test_gpu_engine.py \
               invariance_tests/test_engine_determinism.py::test_corun_graph_replay_matches_eager_on_gpu --timeout=140 ;;
    serving) python3 -c 'import uvicorn, fastapi' 2>/dev/null \
               || echo "== serving needs the server's wheels: bash experiments/device_wheels.sh, carry .whl"
             # SERVING_MODES / SERVING_SERVER_ARGS / SERVING_NAME: e.g. corun at a smaller packed
             # step, SERVING_MODES=corun SERVING_SERVER_ARGS="--prefill-step-tokens 2048
             # --prefill-token-budget 2048" SERVING_NAME=serving-h200-corun-t2048
             run serving ${SERVING_LIMIT:-330} python3 -m experiments.bench_serving --launch \
               --modes ${SERVING_MODES:-corun,batch_invariant_tuned,batch_invariant,default} \
               --model qwen3-8b \
               --server-args "--max-num-seqs 64 --decode-batch-size 64 --max-model-len 4096 ${SERVING_SERVER_ARGS:-}" \
               --request-rate 4,16 --max-concurrency 64 --random-input-len 512 --random-output-len 128 \
               --time-budget-s ${SERVING_BUDGET:-120} --result-name ${SERVING_NAME:-serving-h200} \
               --result-dir "$OUT/results" ;;
    serving-step)  # corun's packed step T under serving load, beside default and the tuned peer in
               # the same run: SERVING_STEPS (T or T:budget; the stall budget is T unless given)
             variants=()
             for tb in ${SERVING_STEPS:-1024 2048 4096}; do  # T or T:budget
               t=${tb%%:*}; b=${tb#*:}; label=corun-t$t; [ "$b" != "$tb" ] && label=$label-b$b
               variants+=(--variant "$label=corun --prefill-step-tokens $t --prefill-token-budget $b")
             done
             run serving-step ${SERVING_LIMIT:-540} python3 -m experiments.bench_serving --launch \
               --modes ${SERVING_STEP_MODES:-corun,default,batch_invariant_tuned} "${variants[@]}" --model qwen3-8b \
               --server-args "--max-num-seqs 64 --decode-batch-size 64 --max-model-len 4096" \
               --request-rate 4,16 --max-concurrency 64 --random-input-len 512 --random-output-len 128 \
               --time-budget-s ${SERVING_BUDGET:-240} --result-name serving-step-h200 \
               --result-dir "$OUT/results" ;;
    serving-peer-graphs)  # the peers' small prefill / mixed steps from graphs or eager, beside
               # corun, under the serving load: what the graphs (--dynamic-graph-tokens) give them
             run serving-peer-graphs ${SERVING_LIMIT:-540} python3 -m experiments.bench_serving --launch \
               --modes corun,default,batch_invariant_tuned \
               --variant "default-eager-mixed=default --dynamic-graph-tokens none" \
               --variant "batch_invariant_tuned-eager-mixed=batch_invariant_tuned --dynamic-graph-tokens none" \
               --model qwen3-8b --server-args "--max-num-seqs 64 --decode-batch-size 64 --max-model-len 4096" \
               --request-rate 4,16 --max-concurrency 64 --random-input-len 512 --random-output-len 128 \
               --time-budget-s ${SERVING_BUDGET:-150} --result-name serving-peer-graphs-h200 \
               --result-dir "$OUT/results" ;;
    serving-corun-sweep)  # corun's serving settings against the peers as they now run (their
               # small steps from graphs): the overlap, C, T and the stall budget at the loads
               # where the graphed peers lead (16 req/s, concurrency 64)
             run serving-corun-sweep ${SERVING_LIMIT:-560} python3 -m experiments.bench_serving --launch \
               --modes corun,default,batch_invariant_tuned \
               --variant "corun-overlap=corun --overlap-prefill-decode" \
               --variant "corun-c256=corun --prefill-chunk-size 256" \
               --variant "corun-t1024-b2048=corun --prefill-token-budget 2048" \
               --variant "corun-t2048=corun --prefill-step-tokens 2048 --prefill-token-budget 2048" \
               --model qwen3-8b --server-args "--max-num-seqs 64 --decode-batch-size 64 --max-model-len 4096" \
               --request-rate 16 --max-concurrency 64 --random-input-len 512 --random-output-len 128 \
               --time-budget-s ${SERVING_BUDGET:-100} --result-name serving-corun-sweep-h200 \
               --result-dir "$OUT/results" ;;
    serving-low-load)  # what corun's fixed decode batch costs when few requests are live: corun
               # at B = 64 (its serving default) and smaller B beside default and the tuned peer
               # (who step the live rows only) at low rates, each run's engine steps recorded
               # from /metrics (decode step ms by kind): SERVING_LOW_BATCHES, e.g. "16 32"
             variants=()
             for b in ${SERVING_LOW_BATCHES:-16 32}; do
               variants+=(--variant "corun-b$b=corun --max-num-seqs $b --decode-batch-size $b")
             done
             run serving-low-load ${SERVING_LIMIT:-560} python3 -m experiments.bench_serving --launch \
               --modes corun,default,batch_invariant_tuned "${variants[@]}" --model qwen3-8b \
               --server-args "--max-num-seqs 64 --decode-batch-size 64 --max-model-len 4096" \
               --request-rate 1,4 --random-input-len 1024 --random-output-len 256 \
               --time-budget-s ${SERVING_BUDGET:-200} --result-name serving-low-load-$CARD \
               --result-dir "$OUT/results" ;;
    gputest) run gputest ${GPUTEST_LIMIT:-60} python3 -m pytest -v --tb=short -p no:cacheprovider \
               invariance_tests/test_engine_determinism.py -k "graph" --timeout=55 ;;
    paper)   run paper ${PAPER_LIMIT:-570} python3 -m experiments.bench_paper \
               --models ${PAPER_MODELS:-qwen3-235b-a22b deepseek-v3 hy3} \
               --merge experiments/results/paper-h200.json ${PAPER_ARGS:-} ;;
    atlas)   run atlas ${ATLAS_LIMIT:-200} python3 -m experiments.invariance_atlas \
               --time-budget-s ${ATLAS_BUDGET:-160} ${ATLAS_ARGS:-} ;;
    ablate-serving-load) run ablate-serving-load ${ABLATE_LIMIT:-570} python3 -m experiments.ablate \
               serving-load --time-budget-s ${ABLATE_BUDGET:-240} ${ABLATE_ARGS:-} ;;
    ablate-*) run "$stage" ${ABLATE_LIMIT:-570} python3 -m experiments.ablate "${stage#ablate-}" \
               --time-budget-s ${ABLATE_BUDGET:-450} ${ABLATE_ARGS:-} ;;
    *) echo "unknown stage $stage" ;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$OUT" results
ls -la "$OUT/results"
