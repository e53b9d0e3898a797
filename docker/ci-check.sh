#!/usr/bin/env bash
# The deploy path on a real Docker engine, as a user takes it: builds the
# image (docker/Dockerfile; stand-in base images from docker/build-bases.sh
# where the engine cannot pull), then
#   1. runs it under a 2 GiB memory limit: healthy, tier sizes from the limit,
#      a Python client round trip over a published loopback port, /metrics,
#      a clean stop on SIGTERM;
#   2. runs it with docker/kvtier.secure.toml (tokens and TLS; the test
#      certificates of crates/kvtier-client/tests/tls): healthy through the
#      TLS health check, a round trip with a tenant token over TLS, /metrics
#      over TLS refused without an admin token and served with one;
#   3. `compose up` of compose.yaml's kvtier and Prometheus (Grafana is not
#      packaged anywhere this machine reaches: left out), a decode workload,
#      then every dashboard query against that Prometheus;
#   4. `compose up` of compose.cluster.yaml (3 etcd members, 3 kvtier nodes):
#      all nodes serving in `kvtier cluster status`, a round trip through
#      kvtier.Cluster that reaches every node, then `kvtier cluster drain`
#      of kvtier3 between the containers: its container stops by itself,
#      and its sequence reads back bit-exact from another node.
# Lines starting "docker:" are the record. Needs the Python package in
# $PYTHON's environment (python/test.sh makes target/python-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-target/python-venv/bin/python}
"$python" -c "import kvtier" || { echo "docker: $python cannot import kvtier (run python/test.sh)" >&2; exit 1; }

compose() {
  if docker compose version >/dev/null 2>&1; then docker compose "$@"; else docker-compose "$@"; fi
}
work=$(mktemp -d)
cleanup() {
  docker rm -f -v kvtier-ci kvtier-ci-secure >/dev/null 2>&1 || true
  compose -p kvtier-ci-metrics -f docker/compose.yaml -f docker/compose.ci.yaml down -v >/dev/null 2>&1 || true
  compose -p kvtier-ci-cluster -f docker/compose.cluster.yaml down -v >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
cleanup
work=$(mktemp -d)

# Waits for a container's health check to pass; its log on failure.
wait_healthy() {
  local id=$1 name=$2 status
  for _ in $(seq 1 120); do
    status=$(docker inspect -f '{{.State.Health.Status}}' "$id")
    if [ "$status" = healthy ]; then
      echo "docker: $name healthy"
      return 0
    fi
    if [ "$(docker inspect -f '{{.State.Running}}' "$id")" != true ]; then
      break
    fi
    sleep 1
  done
  echo "docker: $name not healthy ($status); its log:" >&2
  docker logs "$id" 2>&1 | tail -30 >&2
  docker inspect -f '{{json .State.Health}}' "$id" >&2
  return 1
}

# Stops a container with SIGTERM and checks it exited 0 after its last log line.
stop_cleanly() {
  local id=$1 name=$2 code
  docker stop -t 30 "$id" >/dev/null
  code=$(docker inspect -f '{{.State.ExitCode}}' "$id")
  if [ "$code" != 0 ] || ! docker logs "$id" 2>&1 | grep -q 'kvtier.v1 stopped'; then
    echo "docker: $name did not stop cleanly (exit $code); its log:" >&2
    docker logs "$id" 2>&1 | tail -20 >&2
    return 1
  fi
  echo "docker: $name stopped cleanly on SIGTERM (exit 0)"
}

published() { docker port "$1" "$2" | awk -F: 'NR == 1 { print $NF }'; }

# Loopback ports nothing listens on now, for the compose files' published
# ports (their defaults, 2379 and 50051.., may be taken on a CI machine).
free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export KVTIER_PORT KVTIER_PORT_1 KVTIER_PORT_2 KVTIER_PORT_3 KVTIER_ETCD_PORT PROMETHEUS_PORT
KVTIER_PORT=$(free_port) PROMETHEUS_PORT=$(free_port) KVTIER_ETCD_PORT=$(free_port)
KVTIER_PORT_1=$(free_port) KVTIER_PORT_2=$(free_port) KVTIER_PORT_3=$(free_port)

# The one container of a compose service, running or not.
service_id() {
  local id
  id=$(compose "$@" 2>/dev/null | awk 'NR == 1')
  [ -n "$id" ] || { echo "docker: no container for: compose $*" >&2; return 1; }
  echo "$id"
}

echo "docker: engine $(docker version --format '{{.Server.Version}}'), $(compose version | awk 'NR == 1')"
bash docker/build-bases.sh
start=$(date +%s)
if ! DOCKER_BUILDKIT=0 docker build -f docker/Dockerfile -t kvtier . >"$work/build.log" 2>&1; then
  tail -40 "$work/build.log" >&2
  exit 1
fi
size=$(docker image inspect -f '{{.Size}}' kvtier)
echo "docker: image kvtier built in $(($(date +%s) - start)) s, $((size / 1000000)) MB"

echo "::: docker 1: the image's own configuration, under a 2 GiB memory limit"
docker run -d --name kvtier-ci -m 2g -p 127.0.0.1::50051 -p 127.0.0.1::9464 kvtier >/dev/null
wait_healthy kvtier-ci kvtier-ci
sized=$(docker logs kvtier-ci 2>&1 | grep -o 'device=[0-9.]* [KMG]iB\|host=[0-9.]* [KMG]iB' | paste -sd ' ' || true)
echo "docker: tiers sized under -m 2g: ${sized:-(no startup line found)}"
# A quarter of what the cgroup leaves (at most 512 MiB), where a quarter of
# this machine's available memory would be more: the limit, not the host.
host_quarter_mib=$(awk '/MemAvailable/ { print int($2 / 1024 / 4) }' /proc/meminfo)
if [ "$host_quarter_mib" -le 512 ]; then
  echo "docker: this machine has too little memory to tell the cgroup limit from its own" >&2
  exit 1
fi
echo "$sized" | grep -q 'host=\(5[01][0-9]\|[1-4][0-9][0-9]\)\.[0-9] MiB' || {
  echo "docker: the host tier does not follow the 2 GiB limit (a quarter of the host would be $host_quarter_mib MiB)" >&2
  exit 1
}
"$python" docker/roundtrip.py server "http://127.0.0.1:$(published kvtier-ci 50051)" | sed 's/^/docker: /'
series=$(curl -sf "http://127.0.0.1:$(published kvtier-ci 9464)/metrics" | grep -c '^kvtier_' || true)
[ "${series:-0}" -gt 0 ] || { echo "docker: /metrics served no kvtier_ sample" >&2; exit 1; }
echo "docker: /metrics served $series kvtier_ samples"
stop_cleanly kvtier-ci kvtier-ci

echo "::: docker 2: docker/kvtier.secure.toml (tokens and TLS)"
mkdir -p "$work/secure"
cp crates/kvtier-client/tests/tls/{ca.pem,server.pem,server.key} "$work/secure/"
cp docker/kvtier.secure.toml "$work/secure/kvtier.toml"
chmod -R a+rX "$work/secure"
docker run -d --name kvtier-ci-secure -p 127.0.0.1::50051 -p 127.0.0.1::9464 \
  -v "$work/secure:/etc/kvtier:ro" kvtier >/dev/null
wait_healthy kvtier-ci-secure "kvtier-ci-secure (health check over TLS)"
"$python" docker/roundtrip.py server "https://127.0.0.1:$(published kvtier-ci-secure 50051)" \
  --token replace-me-tenant-a-0123456789 --ca "$work/secure/ca.pem" | sed 's/^/docker: /'
metrics="https://127.0.0.1:$(published kvtier-ci-secure 9464)/metrics"
code() { curl -s -o /dev/null -w '%{http_code}' --cacert "$work/secure/ca.pem" "$@" "$metrics"; }
none=$(code)
tenant=$(code -H 'authorization: Bearer replace-me-tenant-a-0123456789')
admin=$(code -H 'authorization: Bearer replace-me-operator-0123456789')
echo "docker: /metrics over TLS: no token $none, tenant token $tenant, admin token $admin"
[ "$none/$tenant/$admin" = 401/403/200 ] || { echo "docker: expected 401/403/200" >&2; exit 1; }
stop_cleanly kvtier-ci-secure kvtier-ci-secure

echo "::: docker 3: compose.yaml's kvtier and Prometheus; every dashboard query"
metrics_project=(-p kvtier-ci-metrics -f docker/compose.yaml -f docker/compose.ci.yaml)
compose "${metrics_project[@]}" up -d kvtier prometheus 2>&1 | sed 's/^/compose: /'
kvtier_id=$(service_id "${metrics_project[@]}" ps -a -q kvtier)
wait_healthy "$kvtier_id" "compose kvtier"
"$python" - <<'PY'
import json, os, time, urllib.request
for _ in range(120):
    try:
        up = json.load(urllib.request.urlopen(f"http://127.0.0.1:{os.environ['PROMETHEUS_PORT']}/api/v1/query?query=up", timeout=2))
        if any(r["value"][1] == "1" for r in up["data"]["result"]):
            print("docker: Prometheus scrapes kvtier (up == 1)")
            break
    except OSError:
        pass
    time.sleep(1)
else:
    raise SystemExit("docker: Prometheus never scraped kvtier")
PY
workload="kvtier bench decode --addr http://127.0.0.1:50051 --context 4096 --steps 384 --prefetch-pages 4"
docker exec "$kvtier_id" $workload --out /tmp/bench >/dev/null
echo "docker: workload in the container: $workload"
# Two scrapes (every 5 s) after the workload, so every rate has its samples.
sleep 12
"$python" bench/dashboard_queries.py "http://127.0.0.1:$PROMETHEUS_PORT" | sed 's/^/docker: /'
compose "${metrics_project[@]}" down -v >/dev/null 2>&1

echo "::: docker 4: compose.cluster.yaml (3 etcd members, 3 kvtier nodes)"
cluster_project=(-p kvtier-ci-cluster -f docker/compose.cluster.yaml)
compose "${cluster_project[@]}" up -d 2>&1 | sed 's/^/compose: /'
for node in kvtier1 kvtier2 kvtier3; do
  wait_healthy "$(service_id "${cluster_project[@]}" ps -a -q $node)" "cluster $node"
done
etcd=http://etcd1:2379,http://etcd2:2379,http://etcd3:2379
docker exec "$(service_id "${cluster_project[@]}" ps -a -q kvtier1)" kvtier cluster status --etcd "$etcd" --json >"$work/status.json"
"$python" - "$work/status.json" <<'PY'
import json, sys
status = json.load(open(sys.argv[1]))
nodes = {n["node_id"]: n["state"] for n in status["nodes"]}
healthy = [e["endpoint"] for e in status["etcd"] if not e.get("error")]
print(f"docker: cluster status: nodes {nodes}, etcd endpoints healthy {len(healthy)} of {len(status['etcd'])}")
if sorted(nodes) != ["kvtier1", "kvtier2", "kvtier3"] or set(nodes.values()) != {"serving"} or len(healthy) != 3:
    raise SystemExit("docker: the cluster is not three serving nodes over three healthy etcd members")
PY
"$python" docker/roundtrip.py cluster "http://127.0.0.1:$KVTIER_PORT_1" 3 --keep | tee "$work/kept.txt" | sed 's/^/docker: /'
kept=$(sed -n 's/.*(kept \(.*\))$/\1/p' "$work/kept.txt" | tr -d ',')
node3=$(service_id "${cluster_project[@]}" ps -a -q kvtier3)
docker exec "$(service_id "${cluster_project[@]}" ps -a -q kvtier1)" kvtier cluster drain kvtier3 --etcd "$etcd" | sed 's/^/docker: drain: /'
for _ in $(seq 1 60); do [ "$(docker inspect -f '{{.State.Running}}' "$node3")" = false ] && break; sleep 1; done
[ "$(docker inspect -f '{{.State.Running}} {{.State.ExitCode}}' "$node3")" = "false 0" ] \
  || { docker logs "$node3" 2>&1 | tail -20; echo "docker: kvtier3 did not stop cleanly after its drain" >&2; exit 1; }
echo "docker: kvtier3's container stopped by itself (exit 0) after its drain"
# shellcheck disable=SC2086 # one argument per kept node:sequence
"$python" docker/roundtrip.py moved "http://127.0.0.1:$KVTIER_PORT_1" kvtier3 $kept
compose "${cluster_project[@]}" down -v >/dev/null 2>&1
echo "docker: ok"
