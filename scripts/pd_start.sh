#!/usr/bin/env bash
# Start or stop a pdserve system (router + ranks, one process group) on one port.
#
#   scripts/pd_start.sh --colocated N [--model NAME|PATH] [--port P] [--host H] [more launch flags]
#   scripts/pd_start.sh --prefill N --decode M [--transfer auto|nixl|shm] ...   (PD mode)
#   scripts/pd_start.sh stop [--port P]
#
# PD mode starts N prefill and M decode ranks; the decode ranks pull each prompt's KV from the
# prefill ranks (--transfer: NIXL/UCX, or shared memory on one host; auto picks NIXL when it
# starts). --handoff-lease-s, --handoff-pool-gb, --prefill-host and --decode-host go along.
# Start bootstraps if needed, launches `python -m launcher.launch` under setsid, writes
# logs and the group's pid to runs/<port>/, waits until /health is 200 (every rank loaded)
# with progress on the console, and prints the URL. Any other flag goes to the launcher
# (see `.venv/bin/python -m launcher.launch --help`: page size, KV size, max running
# sequences, chunked-prefill budget, max model length, routing policy, dtype, device).
# Stop sends SIGTERM to the whole group, then SIGKILL to what is left after 10 s.
# Faults: --supervise restarts a rank that died or hung (--max-restarts, --restart-backoff-s);
# a rank not ready --rank-start-timeout-s after its start is marked dead. Across hosts, export
# PDSERVE_CLUSTER_SECRET (or pass --cluster-secret) here and on every rank started by hand.
# Multi-host: --ray ADDRESS|auto places the ranks on a Ray cluster as actors (scripts/setup_ray.sh
# on every host first; docs/deployment.md); stop removes them on every node.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT=8000
HOST=127.0.0.1
COLOCATED=""
PREFILL=""
DECODE=""
ACTION=start
TIMEOUT_S="${PD_START_TIMEOUT_S:-900}"
PASS=()

if [[ "${1:-}" == "stop" ]]; then
    ACTION=stop
    shift
fi
while [[ $# -gt 0 ]]; do
    case "$1" in
        --port) PORT="$2"; shift 2 ;;
        --port=*) PORT="${1#*=}"; shift ;;
        --host) HOST="$2"; shift 2 ;;
        --host=*) HOST="${1#*=}"; shift ;;
        --colocated) COLOCATED="$2"; shift 2 ;;
        --prefill) PREFILL="$2"; shift 2 ;;
        --decode) DECODE="$2"; shift 2 ;;
        -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) PASS+=("$1"); shift ;;
    esac
done
RUN_DIR="$ROOT/runs/$PORT"
PID_FILE="$RUN_DIR/pd_start.pid"

say() { echo "[pd_start] $*" >&2; }

group_alive() { kill -0 -- "-$1" 2>/dev/null; }

stop_group() {
    if [[ ! -f "$PID_FILE" ]]; then
        say "no system recorded on port $PORT ($PID_FILE missing)"
        return 0
    fi
    local pgid
    pgid="$(cat "$PID_FILE")"
    if group_alive "$pgid"; then
        say "stopping process group $pgid (port $PORT)"
        kill -TERM -- "-$pgid" 2>/dev/null || true
        for _ in $(seq 1 100); do
            group_alive "$pgid" || break
            sleep 0.1
        done
        if group_alive "$pgid"; then
            say "still running after 10s: SIGKILL"
            kill -KILL -- "-$pgid" 2>/dev/null || true
            sleep 0.5
        fi
    fi
    rm -f "$PID_FILE"
    say "stopped"
}

if [[ "$ACTION" == stop ]]; then
    stop_group
    exit 0
fi

if [[ -n "$PREFILL" || -n "$DECODE" ]]; then
    if ! [[ "$PREFILL" =~ ^[1-9][0-9]*$ && "$DECODE" =~ ^[1-9][0-9]*$ ]]; then
        say "error: PD mode needs --prefill N and --decode M, both positive (got '$PREFILL', '$DECODE')"
        exit 2
    fi
    if [[ -n "$COLOCATED" ]]; then
        say "error: --colocated cannot be combined with --prefill/--decode"
        exit 2
    fi
    RANKS=(--prefill "$PREFILL" --decode "$DECODE")
    WHAT="$PREFILL prefill + $DECODE decode rank(s)"
else
    COLOCATED="${COLOCATED:-1}"
    if ! [[ "$COLOCATED" =~ ^[1-9][0-9]*$ ]]; then
        say "error: --colocated needs a positive count, got '$COLOCATED'"
        exit 2
    fi
    RANKS=(--colocated "$COLOCATED")
    WHAT="$COLOCATED colocated rank(s)"
fi

if [[ -f "$PID_FILE" ]] && group_alive "$(cat "$PID_FILE")"; then
    say "a system is already running on port $PORT (group $(cat "$PID_FILE")); stop it first: $0 stop --port $PORT"
    exit 1
fi

"$ROOT/scripts/bootstrap.sh"
PY="$ROOT/.venv/bin/python"
mkdir -p "$RUN_DIR"
cd "$ROOT"
# setsid: the launcher leads a new process group holding every rank it starts, so stop can
# signal them all at once.
setsid "$PY" -m launcher.launch "${RANKS[@]}" --port "$PORT" --host "$HOST" \
    --run-dir "$RUN_DIR" "${PASS[@]}" </dev/null >"$RUN_DIR/router.log" 2>&1 &
PGID=$!
echo "$PGID" > "$PID_FILE"
say "starting $WHAT on port $PORT (group $PGID, logs in $RUN_DIR)"

URL="http://$HOST:$PORT"
[[ "$HOST" == "0.0.0.0" ]] && URL="http://127.0.0.1:$PORT"
start=$SECONDS
last=""
while true; do
    if ! kill -0 "$PGID" 2>/dev/null; then
        say "the launcher exited during start-up; last lines of $RUN_DIR/router.log:"
        tail -n 20 "$RUN_DIR/router.log" >&2
        stop_group >/dev/null 2>&1
        exit 1
    fi
    body="$(curl -s -m 2 "$URL/health" || true)"
    if [[ "$body" == *'"status":"ok"'* ]]; then
        break
    fi
    if [[ "$body" == *'"status":"unavailable"'* ]]; then
        say "every rank died during start-up; last lines of their logs:"
        for f in "$RUN_DIR"/rank-*.log; do echo "==> $f" >&2; tail -n 15 "$f" >&2; done
        stop_group >/dev/null 2>&1
        exit 1
    fi
    progress="$("$PY" -c '
import json, sys
try:
    h = json.loads(sys.argv[1])
except ValueError:
    print("router starting"); sys.exit()
print(", ".join("%s %s" % (r["name"], r["state"]) for r in h["ranks"]) or "no ranks yet")
' "$body")"
    if [[ "$progress" != "$last" ]]; then
        say "$progress ($((SECONDS - start))s)"
        last="$progress"
    fi
    if (( SECONDS - start > TIMEOUT_S )); then
        say "not ready after ${TIMEOUT_S}s; stopping. See $RUN_DIR"
        stop_group
        exit 1
    fi
    sleep 1
done
say "ready in $((SECONDS - start))s"
echo "$URL/v1"
