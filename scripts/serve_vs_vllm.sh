#!/usr/bin/env bash
# Serving throughput and latency of three servers on the same model under the same guidellm load:
# vLLM's CPU build (compiled, its default), `cb serve` (default config: vLLM's CPU server limits,
# 128 sequences and 2,048 tokens a step; and cbcore-64x256, a budget that trades inter-token
# latency for time to first token) and `transformers serve --continuous-batching`. One server at a time, alone on the machine: start,
# wait for /v1/models, one warm-up request, guidellm at 1 stream (single-stream ITL) and at each
# of $STREAMS concurrent streams, stop, wait for the port to be free, next server.
# Load: 128-token synthetic prompts, exactly 64 output tokens, greedy, streamed /v1/completions
# (the one endpoint all three serve with plain-text prompts).
# With REPEAT=N the whole server list runs N times, reversed on every other round (A B, B A, A B,
# ...), so drift of a shared machine's speed over the run falls on every server alike; the table
# then gives each figure's median over the rounds.
# Prints one markdown table; guidellm's JSON reports and logs and the server logs stay in $OUT.
#
# Usage: scripts/serve_vs_vllm.sh   (from anywhere), settings in the environment:
#   SERVERS="vllm cbcore cbcore-64x256 transformers"   which servers, in this order; any
#                                        cbcore-SEQSxTOKENS: cb serve with that budget (most sequences x tokens a step)
#                                        vllm-fcfs / vllm-edf: the same vLLM with cbcore_vllm.Scheduler deciding
#                                        (contrib/vllm; fcfs or contrib edf, vLLM's CPU limits in its budget)
#   STREAMS="16 64"                      concurrent streams, one guidellm run each
#   REPEAT=1                             rounds of the whole server list (order reversed every other round)
#   REQUESTS=                            requests per run (default: max(48, 3 x streams))
#   SINGLE_REQUESTS=8                    requests of the 1-stream run
#   CB_ARGS= / TF_ARGS=                  extra `cb serve` / `transformers serve` arguments
#   DTYPE=float32                        the model's dtype on every server (float32 or bfloat16)
#   OUT=/tmp/serve-vs-vllm  WORK=.bench-venvs (guidellm's venv)  VENV=.venv  VLLM_VENV=.venv-vllm
#   MODEL=                               model directory (default: cbcore's default model, as HF files)
#   HEALTH_TIMEOUT=900  RUN_TIMEOUT=1800 seconds a server may take to start / one guidellm run may last
# SERVERS=mock runs guidellm's mock server instead: a check of this script that loads no model.
# The adapter against vLLM alone (docs/vllm.md, "Speed"), all in one run, five alternated rounds:
#   SERVERS="vllm vllm-fcfs vllm-edf" STREAMS="16 64" REPEAT=5 scripts/serve_vs_vllm.sh
# then the table also gives each adapter server's ratio to vllm per round, with a 95 % interval
# (scripts/serve_ratio.py).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SERVERS=${SERVERS:-vllm cbcore cbcore-64x256 transformers}
STREAMS=${STREAMS:-16 64}
REPEAT=${REPEAT:-1}
[[ $REPEAT =~ ^[1-9][0-9]*$ ]] || { echo "REPEAT must be a positive integer, got '$REPEAT'" >&2; exit 2; }
SINGLE_REQUESTS=${SINGLE_REQUESTS:-8}
CB_ARGS=${CB_ARGS:-}
DTYPE=${DTYPE:-float32}
[[ $DTYPE =~ ^(float32|bfloat16)$ ]] || { echo "DTYPE must be float32 or bfloat16, got '$DTYPE'" >&2; exit 2; }
# transformers sizes its KV cache from 90% of free memory, on a CPU the machine's RAM. 91 blocks of
# 256 tokens (one per request of this load) are ~1 GiB of float32 KV for the default model, what
# vLLM (VLLM_CPU_KVCACHE_SPACE=1 below) and cb serve (kv_cache.max_memory_mb) get.
TF_ARGS=${TF_ARGS:---cb-num-blocks 91}
OUT=${OUT:-/tmp/serve-vs-vllm}
WORK=${WORK:-$ROOT/.bench-venvs}
abs() { case $1 in /*) echo "$1" ;; *) echo "$ROOT/$1" ;; esac; }
VENV=$(abs "${VENV:-.venv}")
VLLM_VENV=$(abs "${VLLM_VENV:-.venv-vllm}")
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-900}
RUN_TIMEOUT=${RUN_TIMEOUT:-1800}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# guidellm shares the cores with the server it measures: two worker processes carry 64 streams
# (each worker is async) and cost less than its default of ten.
export GUIDELLM__MAX_WORKER_PROCESSES=${GUIDELLM__MAX_WORKER_PROCESSES:-2}

# --- venvs: guidellm's own; the repo's through make, only when missing ---
GLV=$WORK/guidellm
if [ ! -x "$GLV/bin/guidellm" ]; then
  mkdir -p "$WORK"
  python3 -m venv "$GLV"
  # torch first: guidellm needs one, and pip would otherwise fetch the newest (CUDA) build.
  "$GLV/bin/pip" install -q torch==2.13.0
  "$GLV/bin/pip" install -q guidellm==0.8.1
fi
need=()
[ -x "$VENV/bin/cb" ] || need+=(setup)
[[ " $SERVERS " != *" vllm "* ]] || [ -x "$VLLM_VENV/bin/python" ] || need+=(vllm-setup)
[ ${#need[@]} -eq 0 ] || make VENV="$VENV" VLLM_VENV="$VLLM_VENV" "${need[@]}"

# cb serve's default model, converted to an HF directory on first use: the others load that directory.
MODEL_FLAG=()
if [ -n "${MODEL:-}" ]; then
  MODEL_FLAG=(--model "$MODEL")
else
  MODEL=$("$VENV/bin/python" -c 'from cbcore.models.default_model import default_model_dir; print(default_model_dir())')
fi
mkdir -p "$OUT"
POINTS=1  # the 1-stream run first, for single-stream ITL
for s in $STREAMS; do [ "$s" = 1 ] || POINTS+=" $s"; done
: > "$OUT/commands.txt"

free_port() { "$GLV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
quoted() {  # a command line to copy: words single-quoted where the shell would need it
  local a out=()
  for a; do if [[ $a =~ ^[A-Za-z0-9_./=:,@+-]+$ ]]; then out+=("$a"); else out+=("'$a'"); fi; done
  echo "${out[*]}"
}
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# adapter_config QUEUE: vLLM's --additional-config for cbcore_vllm.Scheduler with that queue policy.
adapter_config() {
  printf '{"cbcore": {"scheduler": {"queue": {"name": "%s"}, "budget": {"name": "token-budget", "max_num_seqs": 128, "max_num_batched_tokens": 2048}, "prefill": {"name": "chunked-prefill", "chunk_size": null}}}}' "$1"
}

# server_log NAME: the server's log of this round (no round suffix when there is one round).
server_log() { if [ "$REPEAT" = 1 ]; then echo "$OUT/$1-server.log"; else echo "$OUT/$1-server-r$round.log"; fi; }

# start_server NAME PORT: in a session of its own, so stopping it reaches every process it spawned.
start_server() {
  local log
  log=$(server_log "$1")
  case $1 in
    vllm | vllm-fcfs | vllm-edf)  # vllm_env() of contrib/vllm/tests/vllm_helpers.py, multiprocessing left on
      # (vLLM's default); 0.32 logs no requests unless --enable-log-requests, so no --disable-log-requests.
      # The adapter's servers differ from vllm only by the scheduler class and its config: the budget has
      # vLLM's CPU limits (vllm/engine/arg_utils.py, get_batch_defaults: 128 sequences, 2,048 tokens a step,
      # cbcore's default too), the prefill no chunk cap beyond the budget (vLLM's default).
      local bind=0 adapter=()
      [ "$(nproc)" -eq 1 ] || bind=0-$(($(nproc) - 1))
      [ "$1" = vllm ] || adapter=(--scheduler-cls cbcore_vllm.Scheduler --middleware cbcore_vllm.RequestCheck
        --additional-config "$(adapter_config "${1#vllm-}")")
      setsid env -u VIRTUAL_ENV LD_PRELOAD="$VLLM_VENV/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=1 \
        VLLM_CPU_OMP_THREADS_BIND="$bind" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1 \
        "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype "$DTYPE" \
        --host 127.0.0.1 --port "$2" --max-model-len 2048 --block-size 32 "${adapter[@]}" >"$log" 2>&1 &
      ;;
    cbcore)
      # shellcheck disable=SC2086  # CB_ARGS is a list of words
      setsid "$VENV/bin/cb" serve "${MODEL_FLAG[@]}" --dtype "$DTYPE" --host 127.0.0.1 --port "$2" $CB_ARGS >"$log" 2>&1 &
      ;;
    cbcore-[0-9]*x[0-9]*)  # another budget: cbcore-SEQSxTOKENS (most sequences x tokens a step)
      local shape=${1#cbcore-}
      # shellcheck disable=SC2086
      setsid "$VENV/bin/cb" serve "${MODEL_FLAG[@]}" --dtype "$DTYPE" --host 127.0.0.1 --port "$2" \
        --set "scheduler.budget.max_num_seqs=${shape%x*}" --set "scheduler.budget.max_num_batched_tokens=${shape#*x}" \
        $CB_ARGS >"$log" 2>&1 &
      ;;
    transformers)
      # shellcheck disable=SC2086
      setsid "$VENV/bin/transformers" serve "$MODEL" --continuous-batching --device cpu --dtype "$DTYPE" \
        --host 127.0.0.1 --port "$2" $TF_ARGS >"$log" 2>&1 &
      ;;
    mock)
      setsid "$GLV/bin/guidellm" mock-server --host 127.0.0.1 --port "$2" --model mock \
        --ttft-ms 40 --itl-ms 10 --output-tokens 200 >"$log" 2>&1 &
      ;;
    *) echo "unknown server '$1' (SERVERS: vllm vllm-fcfs vllm-edf cbcore cbcore-SEQSxTOKENS transformers)" >&2; return 1 ;;
  esac
  SERVER_PID=$!
}

stop_server() {
  [ -n "${SERVER_PID:-}" ] || return 0
  kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  for _ in $(seq 30); do listening "$SERVER_PORT" || break; sleep 1; done
  SERVER_PID=
}
trap stop_server EXIT
trap 'exit 130' INT  # Ctrl-C reaches guidellm too; then the EXIT trap stops the server
trap 'exit 143' TERM

# wait_ready NAME PORT: /v1/models answers; on failure the log's tail says why.
wait_ready() {
  local t0=$SECONDS
  until curl -sf "http://127.0.0.1:$2/v1/models" >/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null || ((SECONDS - t0 > HEALTH_TIMEOUT)); then
      echo "!! $1 did not come up (exited, or no answer in ${HEALTH_TIMEOUT}s); $(server_log "$1") ends:" >&2
      tail -n 40 "$(server_log "$1")" >&2
      return 1
    fi
    sleep 2
  done
  echo "$1 up after $((SECONDS - t0))s"
}

# guidellm fixes the output length with max_tokens and ignore_eos; vLLM and cb serve honour both.
# transformers serve refuses any field it does not know (422 on ignore_eos): a null in guidellm's
# extras overrides it and guidellm drops null fields before sending, and EOS is switched off in a
# generation config of the request's own (eos_token_id -1), which leaves do_sample unset: greedy.
sampling() {  # the body fields each server gets beside max_tokens: greedy, and no early EOS
  case $1 in
    transformers) echo '"generation_config":"{\"eos_token_id\":-1}"' ;;
    *) echo '"temperature":0.0' ;;
  esac
}

# report NAME STREAMS ROUND: the path of one guidellm report (no round suffix when there is one round).
report() { if [ "$REPEAT" = 1 ]; then echo "$OUT/$1-c$2"; else echo "$OUT/$1-c$2-r$3"; fi; }

# run_point NAME URL MODEL_ID STREAMS REQUESTS ROUND: one guidellm run, its JSON in $OUT.
run_point() {
  local body extra
  body=$(sampling "$1")
  extra=$body
  [ "$1" != transformers ] || extra="\"ignore_eos\":null,$body"
  local cmd=("$GLV/bin/guidellm" run
    --backend "$(printf '{"kind":"openai_http","target":"%s","model":"%s","request_format":"/v1/completions","extras":{"body":{%s}}}' "$2" "$3" "$extra")"
    --tokenizer "kind=huggingface_auto,model=$MODEL"
    --data kind=synthetic_text,prompt_tokens=128,output_tokens=64
    # a seed per point: the same prompts for every server, none repeated across points (prefix caches)
    --seed "kind=static,value=$4"
    --profile "kind=concurrent,streams=$4"
    --constraint "kind=max_requests,count=$5"
    --constraint "kind=max_duration,seconds=$RUN_TIMEOUT"  # a stuck server ends the run, with a report
    --output "kind=json,path=$(report "$1" "$4" "$6").json"
    --disable-progress)
  echo "$1: $4 streams, $5 requests (round $6 of $REPEAT)"
  quoted "${cmd[@]}" | tee -a "$OUT/commands.txt"
  rm -f "$(report "$1" "$4" "$6").json"
  "${cmd[@]}" >"$(report "$1" "$4" "$6").log" 2>&1 || echo "!! guidellm failed (rc $?), see $(report "$1" "$4" "$6").log" >&2
}

status=0
order=($SERVERS)
for ((round = 1; round <= REPEAT; round++)); do
  if ((round > 1)); then  # the list reversed: A B, B A, A B, ...
    reversed=(); for ((i = ${#order[@]} - 1; i >= 0; i--)); do reversed+=("${order[i]}"); done
    order=("${reversed[@]}")
  fi
  for server in "${order[@]}"; do
    SERVER_PORT=$(free_port)
    start_server "$server" "$SERVER_PORT" || { status=1; continue; }
    url=http://127.0.0.1:$SERVER_PORT
    if wait_ready "$server" "$SERVER_PORT"; then
      id=$(curl -sf "$url/v1/models" | "$GLV/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
      # Warm-up (transformers starts its batching loop on the first request, with that request's config).
      curl -sf "$url/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\":\"$id\",\"prompt\":\"Hello\",\"max_tokens\":8,$(sampling "$server")}" >/dev/null ||
        { echo "!! $server: warm-up request failed" >&2; status=1; }
      for s in $POINTS; do
        n=${REQUESTS:-$((3 * s > 48 ? 3 * s : 48))}
        [ "$s" != 1 ] || n=$SINGLE_REQUESTS
        run_point "$server" "$url" "$id" "$s" "$n" "$round"
      done
    else
      status=1
    fi
    stop_server
  done
done
rows=()  # one row per server and point: its reports of every round, comma-separated
for server in $SERVERS; do
  for s in $POINTS; do
    paths=(); for ((round = 1; round <= REPEAT; round++)); do paths+=("$(report "$server" "$s" "$round").json"); done
    rows+=("$server:$s=$(IFS=,; echo "${paths[*]}")")
  done
done

versions() {  # what ran: the commit, and each venv's package as installed
  local out py_pkg
  out="cbcore $(git describe --always --dirty 2>/dev/null || echo '?')"
  for py_pkg in "$VLLM_VENV vllm-cpu" "$VENV transformers" "$GLV guidellm"; do
    set -- $py_pkg
    if [ -x "$1/bin/python" ]; then
      out+=", $2 $("$1/bin/python" -c "import importlib.metadata as m; print(m.version('$2'))")"
    fi
  done
  echo "$out"
}
{
  echo "Machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "Command: SERVERS=\"$SERVERS\" STREAMS=\"$STREAMS\" REPEAT=$REPEAT REQUESTS=\"${REQUESTS:-}\" CB_ARGS=\"$CB_ARGS\" TF_ARGS=\"$TF_ARGS\" DTYPE=$DTYPE scripts/serve_vs_vllm.sh"
  echo "Model: $MODEL; 128 prompt + 64 output tokens, greedy, /v1/completions streamed"
  echo "Versions: $(versions)"
  echo
  "$GLV/bin/python" scripts/serve_table.py "${rows[@]}"
  if [[ " $SERVERS " == *" vllm "* && " $SERVERS " == *" vllm-"* && $REPEAT -ge 2 ]]; then
    echo
    "$GLV/bin/python" scripts/serve_ratio.py --baseline vllm "${rows[@]}"
  fi
} | tee "$OUT/table.md"
exit $status
