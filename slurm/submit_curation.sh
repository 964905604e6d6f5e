#!/bin/bash
# Submit the curation stage to Slurm: an embedding array job, then the dedup/decontaminate/
# rebalance/write/report job that starts only if every array task succeeded (afterok).
# With --search-tasks N the kNN is sharded in between: an index job (`curate index`: train + save
# the faiss index once) and an N-task search array (`curate search`: each task its query chunks);
# the finishing job then only merges the pairs. With --kmeans-tasks N (rebalance.mode=hierarchical)
# the finishing job is split around a distributed k-means: a dedup/decontaminate job, one
# `srun --ntasks N python -m curation.cli kmeans --curate` job (slurm/curate_kmeans.sbatch), then
# rebalance (on that k-means: rebalance.kmeans_dir=kmeans)/write/report. Each job starts after the
# one before succeeded. With --finish-tasks N the finishing job(s) get N Slurm tasks (--ntasks=N, each
# --cpus CPUs, spread over as many nodes as Slurm gives) and run curate with tasks.launcher=srun
# tasks.count=N: the batch script's one process orchestrates, and every sharded step after embedding
# (hash dedup, index add, verification, searches, k-means tree, sampling, shards, decisions) runs as
# one `srun --ntasks=N` step over the allocation.
#
#   slurm/submit_curation.sh [options] -- --config configs/curation/default.yaml \
#       input.paths=[/data/pool] output.dir=/data/curated [key=value ...]
#
# Options (each also from an environment variable; nothing site-specific is built in):
#   -n, --tasks N          embedding array tasks               CURATE_TASKS     (default 4)
#   -p, --partition P      partition                           CURATE_PARTITION
#   -A, --account A        account                             CURATE_ACCOUNT
#   -t, --time T           time limit per embedding task       CURATE_TIME      (default 04:00:00)
#       --finish-time T    time limit of the finishing job     CURATE_FINISH_TIME (default 04:00:00)
#   -s, --search-tasks N   kNN search array tasks (0: kNN in   CURATE_SEARCH_TASKS (default 0)
#                          the finishing job)
#   -k, --kmeans-tasks N   k-means processes (0: k-means in    CURATE_KMEANS_TASKS (default 0)
#                          the finishing job)
#       --finish-tasks N   Slurm tasks of the finishing job(s) CURATE_FINISH_TASKS (default 0: one
#                          (0: one task, tasks.launcher as      task on one node)
#                          configured)
#   -g, --gpus N           GPUs per embedding task (0 = CPU)   CURATE_GPUS      (default 1)
#       --finish-gpus N    GPUs of the finishing job (faiss)   CURATE_FINISH_GPUS (default = --gpus)
#   -c, --cpus N           CPUs per task (decode workers)      CURATE_CPUS      (default 8)
#       --mem M            memory per job                      CURATE_MEM
#       --logs DIR         where the job logs go               CURATE_LOG_DIR   (default slurm-logs)
#       --dry-run          print the sbatch commands, submit nothing
# The jobs run CURATE_SETUP (e.g. "source .venv/bin/activate") first and call CURATE_CMD (curate).
# Prints the job ids. The same curate arguments run locally: curate run <the same arguments>.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tasks="${CURATE_TASKS:-4}" partition="${CURATE_PARTITION:-}" account="${CURATE_ACCOUNT:-}"
time_limit="${CURATE_TIME:-04:00:00}" finish_time="${CURATE_FINISH_TIME:-04:00:00}"
gpus="${CURATE_GPUS:-1}" finish_gpus="${CURATE_FINISH_GPUS:-}" cpus="${CURATE_CPUS:-8}"
mem="${CURATE_MEM:-}" logs="${CURATE_LOG_DIR:-slurm-logs}" dry_run=0
search_tasks="${CURATE_SEARCH_TASKS:-0}" kmeans_tasks="${CURATE_KMEANS_TASKS:-0}"
finish_tasks="${CURATE_FINISH_TASKS:-0}"

usage() { sed -n '2,45p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        -n|--tasks) tasks="$2"; shift 2 ;;
        -s|--search-tasks) search_tasks="$2"; shift 2 ;;
        -k|--kmeans-tasks) kmeans_tasks="$2"; shift 2 ;;
        --finish-tasks) finish_tasks="$2"; shift 2 ;;
        -p|--partition) partition="$2"; shift 2 ;;
        -A|--account) account="$2"; shift 2 ;;
        -t|--time) time_limit="$2"; shift 2 ;;
        --finish-time) finish_time="$2"; shift 2 ;;
        -g|--gpus) gpus="$2"; shift 2 ;;
        --finish-gpus) finish_gpus="$2"; shift 2 ;;
        -c|--cpus) cpus="$2"; shift 2 ;;
        --mem) mem="$2"; shift 2 ;;
        --logs) logs="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) usage 0 ;;
        --) shift; break ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || { echo "error: give the curate arguments after --" >&2; usage; }
[[ "$tasks" =~ ^[1-9][0-9]*$ ]] || { echo "error: --tasks must be a positive integer, got '$tasks'" >&2; exit 2; }
[[ "$search_tasks" =~ ^[0-9]+$ ]] || { echo "error: --search-tasks must be >= 0, got '$search_tasks'" >&2; exit 2; }
[[ "$kmeans_tasks" =~ ^[0-9]+$ ]] || { echo "error: --kmeans-tasks must be >= 0, got '$kmeans_tasks'" >&2; exit 2; }
[[ "$finish_tasks" =~ ^[0-9]+$ ]] || { echo "error: --finish-tasks must be >= 0, got '$finish_tasks'" >&2; exit 2; }
finish_gpus="${finish_gpus:-$gpus}"
# the curate arguments of the finishing jobs (index, prepare, finish): with --finish-tasks N their sharded
# steps run as srun steps over the job's N tasks (the embedding and search arrays are unchanged)
prep_args=("$@")
[ "$finish_tasks" != 0 ] && prep_args+=(tasks.launcher=srun tasks.count="$finish_tasks")
finish_args=("${prep_args[@]}")
if [ "$kmeans_tasks" != 0 ]; then
    case " $* " in *" rebalance.kmeans_dir="*) ;; *) finish_args+=(rebalance.kmeans_dir=kmeans) ;; esac
fi

common=(--cpus-per-task="$cpus")
[ -n "$partition" ] && common+=(--partition="$partition")
[ -n "$account" ] && common+=(--account="$account")
[ -n "$mem" ] && common+=(--mem="$mem")
embed_opts=("${common[@]}" --time="$time_limit" --array="0-$((tasks - 1))"
            --output="$logs/%x-%A_%a.out")
finish_opts=("${common[@]}" --time="$finish_time" --output="$logs/%x-%j.out")
[ "$finish_tasks" != 0 ] && finish_opts+=(--ntasks="$finish_tasks")
[ "$gpus" != 0 ] && embed_opts+=(--gpus-per-task="$gpus")
[ "$finish_gpus" != 0 ] && finish_opts+=(--gpus-per-task="$finish_gpus")

search_opts=("${common[@]}" --time="$time_limit" --array="0-$((search_tasks - 1))" --requeue
             --output="$logs/%x-%A_%a.out")
index_opts=("${common[@]}" --time="$finish_time" --output="$logs/%x-%j.out")
[ "$finish_tasks" != 0 ] && index_opts+=(--ntasks="$finish_tasks")
[ "$gpus" != 0 ] && search_opts+=(--gpus-per-task="$gpus")
[ "$finish_gpus" != 0 ] && index_opts+=(--gpus-per-task="$finish_gpus")
kmeans_opts=("${common[@]}" --time="$finish_time" --ntasks="$kmeans_tasks" --output="$logs/%x-%j.out")
[ "$finish_gpus" != 0 ] && kmeans_opts+=(--gpus-per-task="$finish_gpus")

if [ "$dry_run" = 1 ]; then
    printf 'sbatch --parsable %s %s %s\n' "${embed_opts[*]}" "$here/curate.sbatch" "$*"
    prev="<embed job id>"
    if [ "$search_tasks" != 0 ]; then
        printf 'CURATE_STEPS=index sbatch --parsable --dependency=afterok:%s %s %s %s\n' "$prev" \
            "${index_opts[*]}" "$here/curate_finish.sbatch" "${prep_args[*]}"
        printf 'CURATE_STEP=search sbatch --parsable --dependency=afterok:<index job id> %s %s %s\n' \
            "${search_opts[*]}" "$here/curate.sbatch" "$*"
        prev="<search job id>"
    fi
    finish_env=""
    if [ "$kmeans_tasks" != 0 ]; then
        printf 'CURATE_STEPS="dedup decontaminate" sbatch --parsable --dependency=afterok:%s %s %s %s\n' \
            "$prev" "${finish_opts[*]}" "$here/curate_finish.sbatch" "${prep_args[*]}"
        printf 'sbatch --parsable --dependency=afterok:<prepare job id> %s %s %s\n' \
            "${kmeans_opts[*]}" "$here/curate_kmeans.sbatch" "${finish_args[*]}"
        prev="<kmeans job id>" finish_env='CURATE_STEPS="rebalance write report" '
    fi
    printf '%ssbatch --parsable --dependency=afterok:%s %s %s %s\n' "$finish_env" "$prev" \
        "${finish_opts[*]}" "$here/curate_finish.sbatch" "${finish_args[*]}"
    exit 0
fi
mkdir -p "$logs"
embed_id="$(sbatch --parsable "${embed_opts[@]}" "$here/curate.sbatch" "$@")"
embed_id="${embed_id%%;*}"  # "id;cluster" on multi-cluster setups
echo "embed array job: ${embed_id} (${tasks} tasks)"
prev="$embed_id"
if [ "$search_tasks" != 0 ]; then
    index_id="$(sbatch --parsable --dependency="afterok:${prev}" --job-name=curate-index \
        --export=ALL,CURATE_STEPS=index,CURATE_NUM_TASKS="$tasks" "${index_opts[@]}" \
        "$here/curate_finish.sbatch" "${prep_args[@]}")"
    index_id="${index_id%%;*}"
    search_id="$(sbatch --parsable --dependency="afterok:${index_id}" --job-name=curate-search \
        --export=ALL,CURATE_STEP=search "${search_opts[@]}" "$here/curate.sbatch" "$@")"
    search_id="${search_id%%;*}"
    echo "index job:       ${index_id} (after ${prev} succeeds)"
    echo "search array job: ${search_id} (${search_tasks} tasks, after ${index_id} succeeds)"
    prev="$search_id"
fi
finish_steps="dedup decontaminate rebalance write report"
if [ "$kmeans_tasks" != 0 ]; then
    prep_id="$(sbatch --parsable --dependency="afterok:${prev}" --job-name=curate-prepare \
        --export=ALL,CURATE_STEPS="dedup decontaminate",CURATE_NUM_TASKS="$tasks" "${finish_opts[@]}" \
        "$here/curate_finish.sbatch" "${prep_args[@]}")"
    prep_id="${prep_id%%;*}"
    kmeans_id="$(sbatch --parsable --dependency="afterok:${prep_id}" \
        --export=ALL,CURATE_NUM_TASKS="$tasks" "${kmeans_opts[@]}" "$here/curate_kmeans.sbatch" "${finish_args[@]}")"
    kmeans_id="${kmeans_id%%;*}"
    echo "prepare job:     ${prep_id} (dedup + decontaminate, after ${prev} succeeds)"
    echo "k-means job:     ${kmeans_id} (${kmeans_tasks} tasks, after ${prep_id} succeeds)"
    prev="$kmeans_id" finish_steps="rebalance write report"
fi
finish_id="$(sbatch --parsable --dependency="afterok:${prev}" \
    --export=ALL,CURATE_STEPS="$finish_steps",CURATE_NUM_TASKS="$tasks" "${finish_opts[@]}" \
    "$here/curate_finish.sbatch" "${finish_args[@]}")"
finish_id="${finish_id%%;*}"
echo "finish job:      ${finish_id} (after ${prev} succeeds)"
echo "logs in ${logs}/; follow with: squeue -j ${embed_id},${index_id:+${index_id},${search_id},}${kmeans_id:+${prep_id},${kmeans_id},}${finish_id}"
