#!/usr/bin/env bash
# Container entrypoint: turns FLASHPAGE_* environment variables into `python -m server` flags, then
# execs the server, so that it replaces this shell and receives docker's SIGTERM itself.
#
#   FLASHPAGE_<FLAG>=value    -> --<flag> value, for every flag of `python -m server --help`:
#                                upper case, dashes as underscores (FLASHPAGE_MAX_NUM_SEQS=64 ->
#                                --max-num-seqs 64); an empty value is skipped
#   FLASHPAGE_<FLAG>=true     -> --<flag>       (FLASHPAGE_ENFORCE_EAGER=true -> --enforce-eager)
#   FLASHPAGE_<FLAG>=false    -> --no-<flag>    (for flags that have a --no- form)
#   FLASHPAGE_HOST, _PORT     -> --host (default 0.0.0.0: the container's network), --port (8000)
#   FLASHPAGE_EXTRA_ARGS      -> split on whitespace and appended as they are
#   FLASHPAGE_API_KEY         -> left in the environment for the server, never put on the command
#                                line (where `ps` would show it)
#   FLASHPAGE_DETERMINISTIC, _GEMV16, _FUSED_ADD_RMSNORM, _BF16_ROUND_BITS, _DECODE_MERGE,
#   _FAULT_INJECT             -> left in the environment: the server's modules read them themselves
#                                (FLASHPAGE_DETERMINISTIC=1 as --deterministic, which takes no value)
#   FLASHPAGE_TENSOR_PARALLEL_SIZE=all -> --tensor-parallel-size N, N the GPUs the container sees
#                                (nvidia-smi -L; compose's --profile tp)
#   FLASHPAGE_DRY_RUN=1       -> print the command instead of running it
#   arguments (docker run IMAGE --flag ...) are appended last, so they win over the environment;
#   a first argument that is not a flag is run as a command instead (docker run IMAGE bash).
set -euo pipefail

if [[ $# -gt 0 && $1 != -* ]]; then
  exec "$@"
fi

if [[ ${FLASHPAGE_TENSOR_PARALLEL_SIZE:-} == all ]]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  if [[ ${gpus:-0} -lt 1 ]]; then
    echo "FLASHPAGE_TENSOR_PARALLEL_SIZE=all: no GPU visible to this container (nvidia-smi -L)" >&2
    exit 1
  fi
  export FLASHPAGE_TENSOR_PARALLEL_SIZE=$gpus
fi

# Not flags of the server (or not to be passed as flags).
reserved=" HOST PORT EXTRA_ARGS DRY_RUN API_KEY "
reserved+="DETERMINISTIC GEMV16 FUSED_ADD_RMSNORM BF16_ROUND_BITS DECODE_MERGE FAULT_INJECT "

args=(--host "${FLASHPAGE_HOST:-0.0.0.0}" --port "${FLASHPAGE_PORT:-8000}")
while IFS= read -r var; do
  key=${var#FLASHPAGE_}
  [[ $reserved == *" $key "* ]] && continue
  value=${!var}
  [[ -z $value ]] && continue
  flag=--$(tr '[:upper:]_' '[:lower:]-' <<<"$key")
  case ${value,,} in
    true) args+=("$flag") ;;
    false) args+=("--no-${flag#--}") ;;
    *) args+=("$flag" "$value") ;;
  esac
done < <(compgen -e | grep '^FLASHPAGE_' | LC_ALL=C sort)

if [[ -n ${FLASHPAGE_EXTRA_ARGS:-} ]]; then
  read -r -a extra <<<"$FLASHPAGE_EXTRA_ARGS"
  args+=("${extra[@]}")
fi
args+=("$@")

if [[ -n ${FLASHPAGE_DRY_RUN:-} && ${FLASHPAGE_DRY_RUN} != 0 ]]; then
  printf '%q ' python -m server "${args[@]}"
  printf '\n'
  exit 0
fi
exec python -m server "${args[@]}"
