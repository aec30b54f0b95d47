# Shared steps of the sbatch templates in this directory (sourced, not run): activate the
# virtual environment, build the launch command, run the ranks so that SIGUSR1 before the
# time limit makes them checkpoint and the job requeue. slurm/README.md explains the variables.

: "${VENV:=.venv}"
: "${LAUNCH:=srun}"
: "${MPI_TYPE:=pmi2}"
: "${SRUN_OPTIONS:=}"
: "${MPIEXEC_OPTIONS:=}"
: "${SHOW_INFO:=1}"
: "${CHECKPOINT_GRACE:=90}"
: "${MAX_RESTARTS:=10}"
: "${REQUEUE_EXIT_STATUS:=42}"    # mpistrat.checkpoint.PREEMPTION_EXIT_STATUS: "saved, run me again"
: "${MIN_RANKS:=}"                # set: elastic (see job_setup)
: "${ELASTIC_TIMEOUT:=60}"

job_fail() {
    echo "mpistrat-job: $*" >&2
    exit 2
}

# job_setup: activate VENV, set the thread count, and fill the array `launch` with the
# command that starts one process per Slurm task as one MPI world.
# With MIN_RANKS (elastic), `mpistrat run -n $SLURM_NTASKS --min-ranks $MIN_RANKS` is the
# launcher itself (the array `elastic` holds those options; the templates put them after
# the runner): it starts the ranks through hydra's mpiexec, whose proxies srun starts, and
# when a node is lost it launches the job again on the nodes left, where the ranks restore
# their in-RAM snapshot. `launch` is then mpiexec, used for `mpistrat info` only. Submit
# elastic jobs with --no-kill: without it Slurm ends the whole job (NODE_FAIL, requeued)
# once it marks the lost node down, about SlurmdTimeout after the loss, ending the
# relaunched ranks too; with it, Slurm removes the node from the job and the job goes on.
job_setup() {
    if [ "$VENV" != none ]; then
        [ -f "$VENV/bin/activate" ] || job_fail "no virtual environment at '$VENV' (from $PWD): run 'bash bin/demo' in the checkout first and submit from there, or set VENV=/path/to/venv (VENV=none: use the python and mpistrat on PATH)"
        source "$VENV/bin/activate"
    fi
    command -v mpistrat >/dev/null || job_fail "mpistrat is not on PATH (VENV=$VENV): install it (pip install mpistrat) or set VENV"
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    local extra
    elastic=()
    if [ -n "$MIN_RANKS" ]; then
        # No SRUN_CPUS_PER_TASK here: hydra's srun starts one proxy per node, which forks
        # all of the node's ranks, so its step must hold every CPU of the job on the node
        # (srun's default), not --cpus-per-task of them (that implies --exact).
        read -r -a extra <<< "$MPIEXEC_OPTIONS"
        launch=(mpiexec -n "${SLURM_NTASKS:-1}" "${extra[@]}")
        elastic=(-n "${SLURM_NTASKS:-1}" --min-ranks "$MIN_RANKS" --timeout "$ELASTIC_TIMEOUT")
    else
        # Slurm 22.05-23.02's srun does not take --cpus-per-task from the allocation; this it reads.
        [ -n "${SLURM_CPUS_PER_TASK:-}" ] && export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
        case "$LAUNCH" in
            srun)
                read -r -a extra <<< "$SRUN_OPTIONS"
                launch=(srun --mpi="$MPI_TYPE" --kill-on-bad-exit=1 "${extra[@]}") ;;
            mpiexec)
                read -r -a extra <<< "$MPIEXEC_OPTIONS"
                launch=(mpiexec -n "${SLURM_NTASKS:-1}" "${extra[@]}") ;;
            *) job_fail "LAUNCH='$LAUNCH'; expected srun or mpiexec" ;;
        esac
    fi
    local how="launch: ${launch[*]}"
    [ -n "$MIN_RANKS" ] && how="elastic: mpistrat run ${elastic[*]} (the job must be submitted with --no-kill)"
    echo "mpistrat-job: job ${SLURM_JOB_ID:-?} '${SLURM_JOB_NAME:-?}' restart ${SLURM_RESTART_COUNT:-0}," \
         "nodes ${SLURM_JOB_NODELIST:-?}, ${SLURM_NTASKS:-?} task(s) x ${SLURM_CPUS_PER_TASK:-1} CPU(s), $how"
}

# job_gpus BIND: GPU jobs. srun binds each task to its GPUs (srun --gpu-bind=BIND). mpiexec
# (also the one an elastic mpistrat run starts) starts one proxy per node with srun, so that
# step must hold all the node's GPUs; the ranks then see them all in CUDA_VISIBLE_DEVICES
# and take theirs by local rank.
job_gpus() {
    export CUDA_DEVICE_ORDER=PCI_BUS_ID    # CUDA numbers the GPUs as nvidia-smi and Slurm do
    if [ "$LAUNCH" = srun ] && [ -z "$MIN_RANKS" ]; then
        SRUN_OPTIONS="--gpu-bind=$1 $SRUN_OPTIONS"
    elif [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then
        unset SLURM_GPUS_PER_TASK
        export SLURM_GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
    fi
}

# job_info [OPTIONS]: with SHOW_INFO=1, log what Slurm and MPI gave each rank; a launch
# that does not make one MPI world stops the job here, before the real work.
job_info() {
    [ "$SHOW_INFO" = 1 ] || return 0
    "${launch[@]}" mpistrat info "$@" || job_fail "'${launch[*]} mpistrat info' failed (exit status $?): the launch does not work, see above"
}

# job_run COMMAND...: run COMMAND on every rank and exit with its status. SIGUSR1 (from
# --signal=B:USR1@SECONDS before the time limit, or scancel --signal=USR1 --batch) is passed
# on to the ranks, which checkpoint and stop; after at most CHECKPOINT_GRACE seconds the job
# is requeued (at most MAX_RESTARTS times) and resumes from that checkpoint. Ranks that end
# with REQUEUE_EXIT_STATUS (they saved on a signal of their own) requeue the job too.
# Elastic (MIN_RANKS): COMMAND is `mpistrat run ...`, run here as the launcher.
job_run() {
    local child status=0 waited=0 prefix=("${launch[@]}")
    if [ ${#elastic[@]} -gt 0 ]; then
        [ "$(basename "$1")" = mpistrat ] && [ "${2:-}" = run ] \
            || job_fail "MIN_RANKS=$MIN_RANKS (elastic) needs RUNNER=mpistrat run ..., not '$1 ${2:-}': only mpistrat run launches the job again on the nodes left"
        prefix=()
    fi
    if [ "$preempted" = 0 ]; then
        "${prefix[@]}" "$@" &
        child=$!
        _job_child=$child
        while kill -0 "$child" 2>/dev/null; do
            if [ "$preempted" = 1 ]; then
                [ "$waited" -ge "$CHECKPOINT_GRACE" ] && break
                sleep 1 & wait $!
                waited=$((waited + 1))
            else
                wait "$child"    # returns early when SIGUSR1 arrives
            fi
        done
        if kill -0 "$child" 2>/dev/null; then
            echo "mpistrat-job: the ranks still run ${CHECKPOINT_GRACE} s after SIGUSR1 (CHECKPOINT_GRACE); requeueing anyway" >&2
            status=124
        else
            wait "$child"
            status=$?
        fi
    fi
    if [ "$preempted" = 1 ] || [ "$status" = "$REQUEUE_EXIT_STATUS" ]; then
        if [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_RESTARTS" ]; then
            echo "mpistrat-job: ranks stopped (exit status $status); requeueing job $SLURM_JOB_ID" \
                 "(restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )) of at most $MAX_RESTARTS)"
            scontrol requeue "$SLURM_JOB_ID" && exit 0
            echo "mpistrat-job: 'scontrol requeue $SLURM_JOB_ID' failed" >&2
        else
            echo "mpistrat-job: not requeueing: restarted ${SLURM_RESTART_COUNT:-0} time(s) already (MAX_RESTARTS=$MAX_RESTARTS)" >&2
        fi
        [ "$status" = 0 ] && status=1    # the work is not finished
    fi
    exit "$status"
}

_job_on_usr1() {
    preempted=1
    if [ -n "$_job_child" ]; then
        echo "mpistrat-job: SIGUSR1 at $(date +%T): passing it to the ranks so they checkpoint and stop"
        kill -USR1 "$_job_child" 2>/dev/null
    else    # before the ranks start (during mpistrat info): they will not start
        echo "mpistrat-job: SIGUSR1 at $(date +%T), before the ranks started"
    fi
}

# From here on SIGUSR1 is caught (its default action would end the batch shell).
preempted=0
_job_child=
elastic=()
trap '_job_on_usr1' USR1
