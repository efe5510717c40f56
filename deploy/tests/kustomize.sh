#!/usr/bin/env bash
# Renders deploy/k8s base and overlays with `kubectl kustomize` and checks what they must contain.
#   kustomize.sh DEPLOY_DIR OUT_DIR
. "$(dirname "$0")/lib.sh"
deploy="$1"; out="$2/rendered"
render_overlays "$deploy" "$out"

count() { grep -c -E "$1" "$2" || true; }
expect() {  # expect FILE REGEX WHAT
  grep -q -E -e "$2" "$out/$1.yaml" || fail "$1: $3 (no match for /$2/)"
}
for f in "$out"/*.yaml; do
  n=$(basename "$f" .yaml)
  expect "$n" '^kind: Deployment$' "no Deployment"
  expect "$n" '^kind: PodDisruptionBudget$' "no PodDisruptionBudget"
  expect "$n" '^  clusterIP: None$' "no headless Service"
  expect "$n" '^  name: attnd-headless$' "headless Service is not attnd-headless"
  expect "$n" '^kind: ConfigMap$' "no flag ConfigMap"
  expect "$n" '--flagfile=/etc/attnd/attnd.flags' "attnd does not read the flag ConfigMap"
  expect "$n" '- --replica_id=\$\(POD_NAME\)$' "the replica id is not the pod name"
  grep -A3 -E '^ +- name: POD_NAME$' "$f" | grep -q -E '^ +fieldPath: metadata.name$' ||
    fail "$n: POD_NAME is not the pod's metadata.name"
  for p in startupProbe readinessProbe livenessProbe; do
    grep -A2 -E "^ +$p:" "$f" | grep -q -E '^ +grpc:' || fail "$n: $p is not a gRPC probe"
  done
  expect "$n" 'runAsNonRoot: true' "runAsNonRoot missing"
  expect "$n" 'readOnlyRootFilesystem: true' "readOnlyRootFilesystem missing"
  expect "$n" 'allowPrivilegeEscalation: false' "allowPrivilegeEscalation not false"
  grep -A2 -E '^ +capabilities:' "$f" | grep -q -- '- ALL' || fail "$n: capabilities do not drop ALL"
  # terminationGracePeriodSeconds must cover the preStop sleep, attnd's lame-duck period
  # (--drain_grace_s: NOT_SERVING but still answering) and its drain (--drain_timeout_s).
  grace=$(sed -n -E 's/^ +terminationGracePeriodSeconds: ([0-9]+)$/\1/p' "$f")
  drain=$(sed -n -E 's/^ +--drain_timeout_s=([0-9]+)$/\1/p' "$f")
  lame=$(sed -n -E 's/^ +--drain_grace_s=([0-9]+)$/\1/p' "$f")
  sleep_s=$(grep -A4 -E '^ +preStop:' "$f" | sed -n -E 's/^ +- "?([0-9]+)"?$/\1/p')
  [ -n "$grace" ] && [ -n "$drain" ] && [ -n "$lame" ] && [ -n "$sleep_s" ] ||
    fail "$n: grace period ($grace), --drain_grace_s ($lame), --drain_timeout_s ($drain) or preStop sleep ($sleep_s) not found"
  [ "$grace" -ge $((sleep_s + lame + drain)) ] ||
    fail "$n: terminationGracePeriodSeconds $grace < preStop $sleep_s s + drain_grace $lame s + drain $drain s"
  # With session hand-off (--handoff_peers) the sessions move first, within --drain_timeout_s.
  if grep -q -E '^ +--handoff_peers=' "$f"; then
    [ "$grace" -ge $((sleep_s + drain + lame + drain)) ] ||
      fail "$n: terminationGracePeriodSeconds $grace < preStop $sleep_s s + hand-off $drain s + drain_grace $lame s + drain $drain s"
  fi
  # Read-only root filesystem: the CUDA JIT cache must point into the /tmp emptyDir.
  expect "$n" '^ +- mountPath: /tmp$|^ +mountPath: /tmp$' "no /tmp mount"
  grep -A1 -E '^ +- name: CUDA_CACHE_PATH$' "$f" | grep -q -E '^ +value: /tmp/' ||
    fail "$n: CUDA_CACHE_PATH is not under the /tmp emptyDir"
  echo "$n: ok (grace ${grace}s >= preStop ${sleep_s}s + drain_grace ${lame}s + drain ${drain}s)"
done
# Base applies without prometheus-operator CRDs; the ServiceMonitor is opt-in.
for n in base gpu cpu; do
  [ "$(count '^kind: ServiceMonitor$' "$out/$n.yaml")" = 0 ] || fail "$n must not contain a ServiceMonitor"
  expect "$n" 'prometheus.io/scrape: "true"' "no prometheus.io/scrape annotation"
done
expect gpu-prometheus-operator '^kind: ServiceMonitor$' "no ServiceMonitor"
expect gpu-prometheus-operator 'prometheus.io/scrape: "false"' "annotation scrape not turned off"
for n in gpu gpu-prometheus-operator; do
  [ "$(count 'nvidia.com/gpu: 1$' "$out/$n.yaml")" = 2 ] || fail "$n: nvidia.com/gpu: 1 not in requests and limits"
  expect "$n" 'key: nvidia.com/gpu$' "no nvidia.com/gpu toleration"
  expect "$n" 'nvidia.com/gpu.present: "true"' "no GPU nodeSelector"
  expect "$n" '^kind: HorizontalPodAutoscaler$' "no HPA"
  expect "$n" 'name: attn_queue_duration_seconds_p90' "HPA does not use attn_queue_duration_seconds_p90"
  expect "$n" '--backend=cuda' "not on the CUDA backend"
  # The HPA owns the replica count: the Deployment must not pin it.
  [ "$(count '^  replicas:' "$out/$n.yaml")" = 0 ] || fail "$n: Deployment sets spec.replicas next to the HPA"
done
[ "$(count 'nvidia.com/gpu' "$out/cpu.yaml")" = 0 ] || fail "cpu overlay asks for GPUs"
expect cpu '--backend=cpu' "not on the CPU backend"
echo "kustomize: $(ls "$out" | wc -l) renderings ok in $out"
