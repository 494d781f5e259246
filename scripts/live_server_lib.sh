# One live inference server in its own process group, for scripts/{sglang,vllm}/
# live_server.sh. A run directory records it: RUN_DIR/server.pid (the group's leader) and
# RUN_DIR/server.log (its output).
#
# A script sources this, then defines `say MESSAGE`, `device` and `start_timeout` (seconds),
# `launch RUN_DIR MODEL_DIR PORT [FLAG...]` (calls `launch_server` with its server's command)
# and `ready URL` (succeeds once the server serves), and ends with `live_server_main "$@"`.

# port_in_use PORT: something already accepts connections on 127.0.0.1:PORT.
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# claim_run_dir RUN_DIR PORT: create RUN_DIR; fail if it already records a server or if the
# port is taken (the readiness probe would otherwise be answered by the other server).
claim_run_dir() {
  local run=$1 port=$2
  mkdir -p "$run"
  [[ ! -f $run/server.pid ]] || { say "a server is already recorded in $run" >&2; exit 1; }
  ! port_in_use "$port" || { say "127.0.0.1:$port is already in use" >&2; exit 1; }
}

# launch_server RUN_DIR COMMAND...: run COMMAND in the background as the leader of a new
# process group (its children join it, so `stop_server` ends them all) and record its pid;
# with foreground=1 (`run`), become COMMAND instead: the caller owns the process.
# Environment for the server goes in front of COMMAND as `env NAME=VALUE ...`.
launch_server() {
  local run=$1
  shift
  [[ ${foreground:-0} != 1 ]] || exec "$@"
  setsid "$@" </dev/null >"$run/server.log" 2>&1 &
  echo $! >"$run/server.pid"
}

# stop_server RUN_DIR: TERM the recorded process group, KILL it after 20 s, forget it.
stop_server() {
  local run=$1 pid
  [[ -f $run/server.pid ]] || return 0
  pid=$(cat "$run/server.pid")
  if kill -TERM -- "-$pid" 2>/dev/null; then
    for _ in $(seq 40); do
      kill -0 -- "-$pid" 2>/dev/null || break
      sleep 0.5
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
    say "stopped server pid $pid"
  fi
  rm -f "$run/server.pid"
}

# wait_until_ready RUN_DIR URL TIMEOUT_S PROBE: poll `PROBE URL` every 2 s until it succeeds.
# If the server exits first, or TIMEOUT_S pass, print the log's tail, stop what is left of
# the group and exit 1.
wait_until_ready() {
  local run=$1 url=$2 timeout=$3 probe=$4 t0=$SECONDS
  until "$probe" "$url"; do
    if ! kill -0 "$(cat "$run/server.pid")" 2>/dev/null; then
      tail -n 40 "$run/server.log" >&2
      say "the server exited during start" >&2
      stop_server "$run"
      exit 1
    fi
    if ((SECONDS - t0 >= timeout)); then
      tail -n 40 "$run/server.log" >&2
      say "not ready after $timeout s" >&2
      stop_server "$run"
      exit 1
    fi
    sleep 2
  done
  say "ready after $((SECONDS - t0)) s: $url"
}

# live_server_main ARGS...: the scripts' command line (`start`, `run` or `stop`, see their
# headers).
live_server_main() {
  local usage="$0 start|run RUN_DIR MODEL_DIR PORT [FLAG...]"
  case ${1:-} in
    run)
      (($# >= 4)) || { echo "usage: $usage" >&2; exit 2; }
      mkdir -p "$2"
      foreground=1 launch "${@:2}" ;;
    start)
      (($# >= 4)) || { echo "usage: $usage" >&2; exit 2; }
      local run=$2 model=$3 port=$4
      claim_run_dir "$run" "$port"
      launch "${@:2}"
      say "starting $(basename "$model") on $device, 127.0.0.1:$port" \
        "(pid $(cat "$run/server.pid"), log $run/server.log)"
      wait_until_ready "$run" "http://127.0.0.1:$port" "$start_timeout" ready ;;
    stop)
      (($# == 2)) || { echo "usage: $0 stop RUN_DIR" >&2; exit 2; }
      stop_server "$2" ;;
    *) echo "usage: $usage | stop RUN_DIR" >&2; exit 2 ;;
  esac
}
