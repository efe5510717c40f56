# Shared by the service benchmarks: start and stop attnd on loopback.
# Needs: bin (folder of attnd/attnctl/attn-bench), out (log folder), port.
# ATTND_FLAGS (optional): flags added to every attnd start, e.g. --streams=4.

start_attnd() {  # flags...; sets pid
  # shellcheck disable=SC2086
  "$bin/attnd" --listen=127.0.0.1:$port --metrics_listen= ${ATTND_FLAGS:-} "$@" \
    >>"$out/attnd.log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do
    "$bin/attnctl" --target 127.0.0.1:$port health >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "attnd did not become healthy" >&2
  return 1
}

stop_attnd() { kill -TERM "$pid"; wait "$pid"; }
