#!/usr/bin/env bash
# A local Ray head node for trying `ray job submit` on one machine, started the way Ray's docs
# describe (`ray start --head`), with token authentication on and every port on 127.0.0.1 only
# (the GCS, the raylet, the agents and the metrics port: Ray's one-machine mode; the dashboard:
# --dashboard-host 127.0.0.1).
#
#   cluster/local.sh start            # start the head (generates ~/.ray/auth_token once if needed)
#   eval "$(cluster/local.sh env)"    # RAY_API_SERVER_ADDRESS, RAY_AUTH_MODE (+ token path), one-machine mode
#   ray job submit --working-dir . -- python -m ray_jobs.pretrain --run-dir /shared/runs/run1 ...
#   cluster/local.sh status
#   cluster/local.sh stop             # stops THIS head only; other local Ray instances keep running
#
# Where a Prometheus binary is found (PROMETHEUS, else `prometheus` on PATH: Debian's `prometheus`
# package; PROMETHEUS=none for none), `start` also starts it on 127.0.0.1, scraping every node Ray
# lists in its service-discovery file, and tells the dashboard (RAY_PROMETHEUS_HOST) so its Metrics
# view and the ray_minilm_* gauges can be queried; `stop` ends it with the head. Set RAY_GRAFANA_HOST
# yourself for a Grafana of yours.
#
# `env` prints only values it has checked (an http://127.0.0.1:PORT address, an absolute token path of
# plain characters), shell-quoted, so evaluating its output runs nothing that the state file could hold.
#
# Settings, from the environment (defaults in brackets):
#   MINILM_RAY_DIR  state file + Ray temp dir, a folder only you can enter (created 0700; refused when
#                   another user owns it or others may write to it) [$XDG_RUNTIME_DIR/minilm-ray, else
#                   ~/.cache/minilm/ray]; keep it short (unix socket paths under it)
#   RAY_PORT [6379]  DASHBOARD_PORT [8265]  METRICS_PORT [8080]  NUM_CPUS [max(8, 2 x cores)]
#   PROMETHEUS_PORT [9090]  PROMETHEUS_SCRAPE [5s]: its scrape interval
#   DASHBOARD_AGENT_PORT, DASHBOARD_AGENT_GRPC_PORT, RUNTIME_ENV_AGENT_PORT, CLIENT_PORT: optional
#   RAY  the ray CLI [ray on PATH, else .venv/bin/ray]; its folder goes first on PATH, so a job's
#        `python` is the python that has Ray and this project
#   RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH  the token [~/.ray/auth_token]
#
# Logical CPUs default to more than the cores: training workers that take every CPU starve the
# Ray Data tasks that feed them. `ray stop` would stop every Ray on the machine; `stop` here ends
# only the processes of this head (found by a marker variable in their environment, and their
# children), in `ray stop`'s order.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${XDG_RUNTIME_DIR:-}" ]; then DEFAULT_DIR="$XDG_RUNTIME_DIR/minilm-ray"; else DEFAULT_DIR="$HOME/.cache/minilm/ray"; fi
DIR="${MINILM_RAY_DIR:-$DEFAULT_DIR}"
STATE="$DIR/head.env"
MARKER="MINILM_RAY_HEAD=$DIR"

# The state folder, private: a predictable shared path (/tmp/...) could be made, or replaced by a link,
# by another user who would then feed this script's output to your shell.
private_dir() {
    (umask 077 && mkdir -p "$DIR")
    if [ -L "$DIR" ] || [ ! -O "$DIR" ] || [ -n "$(find "$DIR" -maxdepth 0 -perm /022)" ]; then
        echo "error: $DIR must be a folder of yours that no one else can write to (set MINILM_RAY_DIR)" >&2
        exit 2
    fi
    chmod 700 "$DIR"
}

# The state file's lines that pass their check, as KEY=VALUE: nothing else is ever printed or evaluated.
checked_state() {
    [ -f "$STATE" ] || { echo "error: no head state in $STATE; cluster/local.sh start first" >&2; exit 1; }
    local line
    while IFS= read -r line; do
        case "$line" in
            RAY_API_SERVER_ADDRESS=*|RAY_GCS_ADDRESS=*|METRICS_URL=*|PROMETHEUS_URL=*)
                [[ "${line#*=}" =~ ^(http://)?127\.0\.0\.1:[0-9]{1,5}(/metrics)?$ ]] && echo "$line" ;;
            RAY_AUTH_TOKEN_PATH=*)
                [[ "${line#*=}" =~ ^/[A-Za-z0-9._/+-]+$ ]] && echo "$line" ;;
        esac
    done <"$STATE"
    return 0
}

find_ray() {
    if [ -n "${RAY:-}" ]; then echo "$RAY"
    elif command -v ray >/dev/null 2>&1; then command -v ray
    elif [ -x "$HERE/../.venv/bin/ray" ]; then echo "$HERE/../.venv/bin/ray"
    else echo "error: no ray CLI (set RAY=/path/to/ray or activate the venv)" >&2; exit 2
    fi
}

find_prometheus() {
    case "${PROMETHEUS:-}" in
        none) ;;
        "") command -v prometheus || true ;;
        *) echo "$PROMETHEUS" ;;
    esac
}

# Prometheus for this head: Ray writes the nodes' metrics addresses into its session's discovery file.
start_prometheus() {
    local prom="$1" pport="$2"
    mkdir -p "$DIR/prometheus"
    printf '%s\n' "global:" "  scrape_interval: ${PROMETHEUS_SCRAPE:-5s}" "scrape_configs:" "  - job_name: ray" \
        "    file_sd_configs:" "      - files: ['$DIR/ray/session_latest/prom_metrics_service_discovery.json']" \
        >"$DIR/prometheus/prometheus.yml"
    nohup "$prom" --config.file="$DIR/prometheus/prometheus.yml" --storage.tsdb.path="$DIR/prometheus/data" \
        --web.listen-address="127.0.0.1:$pport" >"$DIR/prometheus/prometheus.log" 2>&1 &
}

# PIDs of this head: the processes `ray start` launched (they inherit our marker variable) and all
# their descendants (workers and agents rename themselves, which can hide their environment).
head_pids() {
    local seeds=() p
    for d in /proc/[0-9]*; do
        p="${d#/proc/}"
        [ "$p" = "$$" ] && continue
        if { tr '\0' '\n' <"$d/environ"; } 2>/dev/null | grep -qxF "$MARKER"; then
            seeds+=("$p")
        fi
    done
    [ "${#seeds[@]}" -eq 0 ] && return 0
    local all=" ${seeds[*]} " changed=1 pid ppid
    while [ "$changed" -eq 1 ]; do
        changed=0
        while read -r pid ppid; do
            if [[ "$all" == *" $ppid "* && "$all" != *" $pid "* && "$pid" != "$$" ]]; then
                all="$all$pid "
                changed=1
            fi
        done < <(ps -e -o pid= -o ppid=)
    done
    echo "$all" | xargs -n1 | sort -un
}

cmd_start() {
    local ray_bin
    ray_bin="$(find_ray)"
    local prom pport="${PROMETHEUS_PORT:-9090}"
    prom="$(find_prometheus)"
    if [ -n "$prom" ] && [ ! -x "$prom" ]; then
        echo "error: PROMETHEUS=$prom is not an executable file (or PROMETHEUS=none)" >&2
        exit 2
    fi
    if [ -n "$(head_pids)" ]; then
        echo "error: a head from $DIR is already running; cluster/local.sh stop first" >&2
        exit 1
    fi
    private_dir
    local bin_dir
    bin_dir="$(cd "$(dirname "$ray_bin")" && pwd)"
    export PATH="$bin_dir:$PATH"
    export RAY_AUTH_MODE=token
    if [ -z "${RAY_AUTH_TOKEN:-}" ]; then
        if [ -n "${RAY_AUTH_TOKEN_PATH:-}" ]; then
            if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
                (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH")
            fi
        else
            "$ray_bin" get-auth-token --generate >/dev/null 2>&1  # ~/.ray/auth_token, once
        fi
    fi
    local port="${RAY_PORT:-6379}" dport="${DASHBOARD_PORT:-8265}" mport="${METRICS_PORT:-8080}"
    local cores
    cores="$(nproc 2>/dev/null || echo 2)"
    local cpus="${NUM_CPUS:-$(( 2 * cores > 8 ? 2 * cores : 8 ))}"
    local args=(start --head --port "$port" --node-ip-address 127.0.0.1
                --dashboard-host 127.0.0.1 --dashboard-port "$dport" --metrics-export-port "$mport"
                --num-cpus "$cpus" --temp-dir "$DIR/ray" --disable-usage-stats)
    local flag var
    for flag in dashboard-agent-listen-port:DASHBOARD_AGENT_PORT \
                dashboard-agent-grpc-port:DASHBOARD_AGENT_GRPC_PORT \
                runtime-env-agent-port:RUNTIME_ENV_AGENT_PORT \
                ray-client-server-port:CLIENT_PORT; do
        var="${flag#*:}"
        if [ -n "${!var:-}" ]; then args+=("--${flag%%:*}" "${!var}"); fi
    done
    # The marker scopes `stop`; RAY_ADDRESS makes Ray's own processes (Train's state actor, jobs)
    # find this head even when other local Ray instances run; state tracking feeds the Train runs API.
    export MINILM_RAY_HEAD="$DIR" RAY_ADDRESS="127.0.0.1:$port"
    # Ray's one-machine mode (its default on macOS and Windows): the node's address is 127.0.0.1. Without
    # it `ray start` turns --node-ip-address 127.0.0.1 into the machine's routable address, and the GCS,
    # the raylet and the metrics port listen on every interface.
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    export RAY_TRAIN_ENABLE_STATE_TRACKING="${RAY_TRAIN_ENABLE_STATE_TRACKING:-1}"
    if [ -n "$prom" ]; then export RAY_PROMETHEUS_HOST="http://127.0.0.1:$pport"; fi  # read by the dashboard
    "$ray_bin" "${args[@]}"
    if [ -n "$prom" ]; then start_prometheus "$prom" "$pport"; fi
    (umask 077 && {
        echo "RAY_API_SERVER_ADDRESS=http://127.0.0.1:$dport"
        echo "RAY_GCS_ADDRESS=127.0.0.1:$port"
        echo "METRICS_URL=http://127.0.0.1:$mport/metrics"
        if [ -n "${RAY_AUTH_TOKEN_PATH:-}" ]; then echo "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH"; fi
        if [ -n "$prom" ]; then echo "PROMETHEUS_URL=http://127.0.0.1:$pport"; fi
    } >"$STATE")
    echo
    echo "head started: dashboard http://127.0.0.1:$dport (token required)," \
         "metrics http://127.0.0.1:$mport/metrics"
    if [ -n "$prom" ]; then
        echo "prometheus http://127.0.0.1:$pport (try: ray_minilm_loss); its log: $DIR/prometheus/prometheus.log"
    else
        echo "no prometheus binary (apt-get install prometheus, or set PROMETHEUS=...): metrics are not kept"
    fi
    echo "submit jobs from this shell after:  eval \"\$($0 env)\""
}

cmd_env() {
    local state line
    state="$(checked_state)"
    while IFS= read -r line; do
        case "$line" in
            RAY_API_SERVER_ADDRESS=*|RAY_AUTH_TOKEN_PATH=*) printf 'export %s=%q\n' "${line%%=*}" "${line#*=}" ;;
        esac
    done <<<"$state"
    echo "export RAY_AUTH_MODE=token"
    echo "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"  # a driver run here joins the head's one-machine mode
}

cmd_status() {
    local pids
    pids="$(head_pids)"
    if [ -z "$pids" ]; then echo "no head from $DIR is running"; return 1; fi
    echo "head from $DIR: $(echo "$pids" | wc -l) processes"
    if [ -f "$STATE" ]; then checked_state; fi
}

# Live (not zombie) PIDs among the arguments.
alive() {
    local p state
    for p in "$@"; do
        state="$({ sed -e 's/^.*) //' "/proc/$p/stat"; } 2>/dev/null | cut -c1)"
        if [ -n "$state" ] && [ "$state" != "Z" ]; then echo "$p"; fi
    done
}

# SIGTERM, up to 5 s to exit, then SIGKILL.
stop_pids() {
    [ "$#" -eq 0 ] && return 0
    local left
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 1 10); do
        left="$(alive "$@")"
        [ -z "$left" ] && return 0
        sleep 0.5
    done
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null || true
}

cmd_stop() {
    local pids p name raylets=() gcs=() others=()
    pids="$(head_pids)"
    if [ -z "$pids" ]; then echo "no head from $DIR is running"; rm -f "$STATE"; return 0; fi
    # In `ray stop`'s order: the raylet first (its agents and workers follow it), the GCS last.
    for p in $pids; do
        name="$(cat "/proc/$p/comm" 2>/dev/null || true)"
        case "$name" in
            raylet) raylets+=("$p") ;;
            gcs_server) gcs+=("$p") ;;
            *) others+=("$p") ;;
        esac
    done
    stop_pids "${raylets[@]}"
    stop_pids "${others[@]}"
    stop_pids "${gcs[@]}"
    rm -f "$STATE"
    echo "stopped the head from $DIR ($(echo "$pids" | wc -l) processes)"
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) cmd_env ;;
    *) echo "usage: $0 start|env|status|stop" >&2; exit 2 ;;
esac
