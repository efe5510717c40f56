# For shell tests that run a real attnd (sourced): free loopback ports and a CPU-backend attnd.

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# start_cpu_attnd ATTND LOG THREADS: starts attnd (CPU backend) in the background on free
# loopback ports, output to LOG. Sets P (gRPC port), M (metrics port) and ATTND_PID.
start_cpu_attnd() {
  P=$(free_port); M=$(free_port)
  "$1" --listen="127.0.0.1:$P" --metrics_listen="127.0.0.1:$M" --backend=cpu --threads="$3" \
    >"$2" 2>&1 &
  ATTND_PID=$!
}

# attnd_healthy ATTNCTL: waits up to 30 s for the attnd on port P to report SERVING.
attnd_healthy() {
  for _ in $(seq 150); do
    "$1" --target "127.0.0.1:$P" health >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  return 1
}
