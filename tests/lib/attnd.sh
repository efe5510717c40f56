# For shell tests that run a real attnd (sourced): a CPU-backend attnd on loopback ports the
# kernel picks, and free ports for other servers.
#
# attnd listens on port 0 and logs the ports it got: a port picked beforehand (bind to 0, close,
# pass it on) can be taken in between by another test's outgoing connection on a busy host.

# free_port: a port free now, for servers that cannot report the port they bound (Prometheus):
# their callers start them again on another port if the first one was taken.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# attnd_ports LOG PID: waits up to 30 s for attnd's "serving attn.v1 on port ..." line in LOG and
# sets P (gRPC port) and M (metrics port; empty when metrics are off). Fails, with LOG's end on
# stderr, when attnd exits first or the time runs out.
attnd_ports() {
  local log=$1 pid=$2 line
  for _ in $(seq 150); do
    line=$(grep -m1 -o 'serving attn.v1 on port [0-9]*\(, metrics on port [0-9]*\)\?' "$log" 2>/dev/null || true)
    if [ -n "$line" ]; then
      P=$(sed -E 's/^serving attn.v1 on port ([0-9]+).*/\1/' <<<"$line")
      M=$(sed -n -E 's/.*, metrics on port ([0-9]+)$/\1/p' <<<"$line")
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  echo "attnd (pid $pid) did not report its ports; the end of $log:" >&2
  tail -n 20 "$log" >&2
  return 1
}

# start_cpu_attnd ATTND LOG THREADS [FLAG...]: starts attnd (CPU backend, metrics on) in the
# background, output to LOG, and waits for its ports. Sets P, M and ATTND_PID.
start_cpu_attnd() {
  local bin=$1 log=$2 threads=$3
  shift 3
  "$bin" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --backend=cpu --threads="$threads" "$@" \
    >"$log" 2>&1 &
  ATTND_PID=$!
  attnd_ports "$log" "$ATTND_PID" || { kill "$ATTND_PID" 2>/dev/null; return 1; }
}

# attnd_healthy ATTNCTL: waits up to 30 s for the attnd on port P to report SERVING.
attnd_healthy() {
  for _ in $(seq 150); do
    "$1" --target "127.0.0.1:$P" health >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  return 1
}
