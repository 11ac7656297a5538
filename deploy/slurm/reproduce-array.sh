#!/bin/bash
# reproduce-array.sh: `sdcstudy reproduce` spread over a Slurm job array, one shard per task,
# then one job that merges the shards into the scorecard (docs/reproduction.md).
#
#   jobid=$(sbatch --parsable --array=0-7 deploy/slurm/reproduce-array.sh)
#   sbatch --dependency=afterany:$jobid deploy/slurm/reproduce-array.sh merge
#
# Array task I of N runs `sdcstudy reproduce ... --shard I/N --out $SDC_OUT/shard-I-of-N`,
# every N-th run of the plan from the I-th (I counts from the array's first index, N is the
# array's task count), and adds --resume when that folder already holds a reproduce
# manifest, so a requeued or preempted task keeps its finished runs and continues the others.
# The array must be one range (--array=A-B, a %M limit allowed): in an array of other indices
# (--array=0,2,4, or --array=3,5 to run two failed shards again) the tasks would number the
# shards anew and run other runs than the shards they stand for, so the task refuses (exit 2).
# To run failed shards again, requeue their tasks (scontrol requeue JOBID_I): the array stays.
# `merge` (not an array task) runs `sdcstudy reproduce --merge $SDC_OUT/shard-*-of-N --out
# $SDC_OUT/scorecard`; afterany lets it score whatever the shards finished (the runs of a
# failed shard show as "not run"). Both exit with sdcstudy's exit code.
#
# Settings, from the environment (sbatch passes it on) or from the file $SDC_CONFIG (sourced
# first when readable; a value set there wins):
#   SDC_CONFIG      settings file (default /etc/sdcstudy/reproduce.env)
#   SDC_CMD         the sdcstudy command, split on spaces (default "sdcstudy")
#   SDC_OUT         the folder of the shards and the scorecard (default ./reproduce)
#   SDC_PRESET      tiny | small | medium (default small)
#   SDC_NODES       paper nodes, e.g. 1,4,11, or all (default all)
#   SDC_MODES       which runs of each node, e.g. paramsync,free, or all (default all)
#   SDC_STEPS       optimizer steps per run (default: the preset's)
#   SDC_DTYPE       float32 | bfloat16 (default: the preset's, float32)
#   SDC_SHARDS      shards when not read from Slurm (default $SLURM_ARRAY_TASK_COUNT)
#   SDC_EXTRA_ARGS  more arguments for each shard, split on spaces (e.g. "--set experiment.seed=1")
#   JAX_DEFAULT_MATMUL_PRECISION  default highest: XLA:GPU's default multiplies float32 on TF32
#                   tensor cores, and the float32 ABFT run (appendix D) then flags healthy
#                   products (RESULTS.md, "On one GPU")
#SBATCH --job-name=sdc-reproduce
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=8
#SBATCH --time=08:00:00
#SBATCH --output=sdc-reproduce-%A_%a.out
set -u

SDC_CONFIG=${SDC_CONFIG:-/etc/sdcstudy/reproduce.env}
# shellcheck source=/dev/null
if [ -r "$SDC_CONFIG" ]; then . "$SDC_CONFIG"; fi

SDC_CMD=${SDC_CMD:-sdcstudy}
SDC_OUT=${SDC_OUT:-reproduce}
SDC_PRESET=${SDC_PRESET:-small}
SDC_NODES=${SDC_NODES:-all}
SDC_MODES=${SDC_MODES:-}
SDC_STEPS=${SDC_STEPS:-}
SDC_DTYPE=${SDC_DTYPE:-}
SDC_EXTRA_ARGS=${SDC_EXTRA_ARGS:-}
export JAX_DEFAULT_MATMUL_PRECISION=${JAX_DEFAULT_MATMUL_PRECISION:-highest}
read -r -a sdc_cmd <<<"$SDC_CMD"
read -r -a extra_args <<<"$SDC_EXTRA_ARGS"

fail() {  # MESSAGE: one sentence on stderr, exit 2 (bad input, as sdcstudy's own)
    printf 'reproduce-array.sh: %s\n' "$1" >&2
    exit 2
}

if [ "${1:-}" = merge ]; then
    shards=()
    for dir in "$SDC_OUT"/shard-*-of-*; do
        if [ -d "$dir" ]; then shards+=("$dir"); fi
    done
    if [ "${#shards[@]}" -eq 0 ]; then
        fail "no shard folders in $SDC_OUT (shard-I-of-N); run the array first."
    fi
    exec "${sdc_cmd[@]}" reproduce --merge "${shards[@]}" --out "$SDC_OUT/scorecard" \
        --no-progress
fi
if [ -n "${1:-}" ]; then
    fail "unknown argument $1; give none (an array task) or merge."
fi

task=${SLURM_ARRAY_TASK_ID:-}
count=${SDC_SHARDS:-${SLURM_ARRAY_TASK_COUNT:-}}
if [ -z "$task" ] || [ -z "$count" ]; then
    fail "not a Slurm array task (no SLURM_ARRAY_TASK_ID); submit with sbatch --array=0-N."
fi
first=${SLURM_ARRAY_TASK_MIN:-0}
last=${SLURM_ARRAY_TASK_MAX:-}
tasks=${SLURM_ARRAY_TASK_COUNT:-}
if [ -n "$last" ] && [ -n "$tasks" ] && [ $((last - first + 1)) -ne "$tasks" ]; then
    fail "the array's $tasks tasks are not the one range $first-$last, so task $task cannot \
tell which shard it is; submit --array=A-B, and requeue failed tasks (scontrol requeue)."
fi
index=$((task - first))
out="$SDC_OUT/shard-$index-of-$count"

args=(reproduce --preset "$SDC_PRESET" --nodes "$SDC_NODES" --shard "$index/$count"
      --out "$out" --no-progress)
if [ -n "$SDC_MODES" ]; then args+=(--modes "$SDC_MODES"); fi
if [ -n "$SDC_STEPS" ]; then args+=(--steps "$SDC_STEPS"); fi
if [ -n "$SDC_DTYPE" ]; then args+=(--dtype "$SDC_DTYPE"); fi
if [ -f "$out/reproduce.json" ]; then args+=(--resume); fi
mkdir -p "$SDC_OUT"
# ${a[@]+"${a[@]}"}: an empty array under set -u, also in bash before 4.4 (RHEL 7).
exec "${sdc_cmd[@]}" "${args[@]}" ${extra_args[@]+"${extra_args[@]}"}
