#!/usr/bin/env bash
# kvtier's fetch path against the obvious alternative: each page one Redis
# value, a step's pages fetched with one MGET. All serve the same pages (a
# decode run's selections, recorded with `kvtier bench decode --trace`), same
# sizes, same order, from memory, each server its own process on loopback,
# back to back in one run: kvtier inline (bytes in the gRPC messages), kvtier
# over its shared-memory data plane (called over gRPC, and over the region's
# own socket), Redis MGET, and a bare tonic unary echo as the floor of any
# gRPC call, empty and answering each fetch's bytes. Selection is kvtier's in all, so this
# compares the serving paths only. Writes bench/results/redis-compare.md and
# .jsonl.
# Usage: bench/redis-compare.sh [path/to/kvtier]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${KVTIER_REALKV:-}" ] || data/realkv/make.sh
bin=${1:-}
if ! command -v redis-server >/dev/null; then
  echo "installing redis-server (Debian package)"
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q redis-server >/dev/null; else sudo apt-get install -y -q redis-server >/dev/null; fi
fi
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
work=$(mktemp -d)
redis_port=$((20000 + RANDOM % 10000))
kvtier_port=$((redis_port + 1))
# Placement: a server's round trip depends on where it runs (waking a
# thread on the client's own CPU costs less than waking one across; on
# these VMs the difference is most of an empty call), so the three servers
# share the same CPUs and the client runs on another: CPU 0 for the client,
# the rest for the servers. On one core all share it.
cores=$(nproc)
if [ "$cores" -ge 2 ]; then client_cpus=0; server_cpus=1-$((cores - 1)); else client_cpus=0; server_cpus=0; fi
cleanup() {
  exec 3>&- 2>/dev/null || true
  redis-cli -p "$redis_port" shutdown nosave >/dev/null 2>&1 || true
  for pid in ${kvtier_pid:-} ${echo_pid:-}; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
taskset -c "$server_cpus" redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --dir "$work" --logfile "$work/redis.log" --pidfile "$work/redis.pid"
taskset -c "$server_cpus" "$bin" serve --listen "127.0.0.1:$kvtier_port" --metrics-listen off --data-dir "$work/kvtier" \
  --device-bytes 0 --host-bytes 4GiB --nvme-bytes 0 2> "$work/kvtier.log" &
kvtier_pid=$!
# The echo serves until its stdin closes: a pipe held open here.
mkfifo "$work/echo.in"
taskset -c "$server_cpus" "$bin" bench echo < "$work/echo.in" > "$work/echo.out" &
echo_pid=$!
exec 3> "$work/echo.in"
for _ in $(seq 50); do
  redis-cli -p "$redis_port" ping >/dev/null 2>&1 && grep -q "serving kvtier" "$work/kvtier.log" \
    && grep -q "listening on" "$work/echo.out" && break
  sleep 0.2
done
echo_addr=$(sed -n 's/^listening on //p' "$work/echo.out")

out=bench/results
# REDIS_COMPARE_NAME: another name for the results (an experiment beside the record).
name_out=${REDIS_COMPARE_NAME:-redis-compare}
jsonl=$out/$name_out.jsonl
: > "$jsonl"
declare -A decode=(
  [llama3-8b]="--preset llama3-8b --context 8192 --steps 64 --budget-pages 32"
  [smollm2-realkv]="--preset smollm2-135m --queries realkv:${KVTIER_REALKV:-data/realkv/small} --context 1536 --steps 128 --budget-pages 16"
)
for name in llama3-8b smollm2-realkv; do
  echo "== $name: recording the selections"
  "$bin" bench decode ${decode[$name]} --out "$work/decode-$name" --trace "$work/$name.trace" > /dev/null
  echo "== $name: replaying them through kvtier and Redis"
  taskset -c "$client_cpus" "$bin" bench fetch --trace "$work/$name.trace" --addr "http://127.0.0.1:$kvtier_port" \
    --shm-socket "$work/kvtier/shm.sock" --redis "127.0.0.1:$redis_port" --echo "$echo_addr" --json \
    | python3 -c "import json,sys; r=json.load(sys.stdin); r['workload']='$name'; r['decode']='${decode[$name]}'; print(json.dumps(r))" >> "$jsonl"
done

{
  echo "# kvtier FetchPages vs Redis MGET, same pages"
  echo
  echo "- command: \`bench/redis-compare.sh\`: per workload, \`kvtier bench decode <args> --trace T\` records"
  echo "  every selection; \`kvtier bench fetch --trace T --addr <kvtier serve> --shm-socket <its socket> --redis <redis-server>\`"
  echo "  loads every page into both, then fetches each selection's pages one at a time, timing each: kvtier inline"
  echo "  (one FetchPages with per-head lists, bytes in the messages), kvtier shm (the same FetchPages naming a window"
  echo "  of a registered shared-memory region: bytes written there), kvtier local (the same call over the region's own"
  echo "  socket, \`Client::fetch_local\`: no gRPC; sleeping on each reply (\`ShmRegion::set_spin(0)\`), and again"
  echo "  polling for it for up to 100 µs first while replies come within that, the client's default), Redis (one MGET"
  echo "  of one key per (layer, KV head, page))."
  echo "- servers: \`kvtier serve --device-bytes 0 --host-bytes 4GiB --nvme-bytes 0\` (pages in host memory)"
  echo "  and \`redis-server --save '' --appendonly no\` ($(redis-server --version | awk '{print $3}')), each its own process on loopback."
  echo "  Clients run on one thread (a decode worker's loop); the echo floor is a bare tonic server (default settings,"
  echo "  its own process, \`kvtier bench echo\`, as the kvtier server is) answering \`kvtier.bench.v1.Echo\` through a"
  echo "  tonic channel with kvtier's client's HTTP/2 settings (\`Client::endpoint\`); the sized echo asks it for each"
  echo "  fetch's bytes (\`reply_bytes\`: slices of one written buffer, so one copy, into the message), right after"
  echo "  the inline fetches: what any tonic call answering those bytes pays here."
  echo "- placement (\`taskset\`): the three servers on CPUs $server_cpus, the client on CPU $client_cpus. Unplaced, the echo"
  echo "  (started by the client) tended to share the client's CPU while kvtier did not, and the empty-call ratio swung"
  echo "  between 1.0 and 2.3 from run to run with the same binaries."
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/{print $2" GiB"}'); $(uname -r)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo "- guest halt polling (\`/sys/module/haltpoll/parameters/guest_halt_poll_ns\`, how long an idle vCPU polls before it halts;"
  echo "  every wake-up of a halted one costs a trip through the host): $(cat /sys/module/haltpoll/parameters/guest_halt_poll_ns 2>/dev/null || echo 'not a haltpoll guest') ns"
  echo "- empty call: the smallest round trip each offers (kvtier a FetchPages of no pages, alternating call by call with"
  echo "  the echo; the same over the region's socket; Redis PING), the fixed cost inside every fetch."
  echo
  echo "| workload | page | fetches | MB per fetch | inline p50 / p99 / p99.9 µs | shm p50 / p99 / p99.9 µs | local sleeping p50 / p99 / p99.9 µs | local polling (default) p50 / p99 / p99.9 µs | Redis p50 / p99 / p99.9 µs | Redis/inline p50 | p99 | Redis/shm p50 | p99 | Redis/sleeping p50 | p99 | Redis/polling p50 | p99 | empty call kvtier / sleeping / polling / echo / Redis PING p50 µs | kvtier empty / echo | sized echo p50 / p99 / p99.9 µs | Redis/sized echo p50 | inline/sized echo p50 |"
  echo "|---|---:|---:|---:|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|"
  python3 - "$jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); k, m, l, q, d, e = r["kvtier"], r["kvtier_shm"], r["kvtier_local"], r["kvtier_local_polling"], r["redis"], r["echo_sized"]
    print(f"| {r['workload']} (`{r['decode']}`) | {r['page_bytes']} B | {r['fetches']} | {k['bytes']/k['fetches']/1e6:.2f} | "
          f"{k['p50_us']} / {k['p99_us']} / {k['p999_us']} | {m['p50_us']} / {m['p99_us']} / {m['p999_us']} | "
          f"{l['p50_us']} / {l['p99_us']} / {l['p999_us']} | {q['p50_us']} / {q['p99_us']} / {q['p999_us']} | "
          f"{d['p50_us']} / {d['p99_us']} / {d['p999_us']} | "
          f"{r['ratio_p50']:.2f} | {r['ratio_p99']:.2f} | {r['shm_ratio_p50']:.2f} | {r['shm_ratio_p99']:.2f} | "
          f"{r['local_ratio_p50']:.2f} | {r['local_ratio_p99']:.2f} | {r['polling_ratio_p50']:.2f} | {r['polling_ratio_p99']:.2f} | "
          f"{k['floor_p50_us']} / {l['floor_p50_us']} / {q['floor_p50_us']} / {r['echo_p50_us']} / {d['floor_p50_us']} | {r['empty_over_echo_p50']:.2f} | "
          f"{e['p50_us']} / {e['p99_us']} / {e['p999_us']} | {r['echo_sized_ratio_p50']:.2f} | {r['inline_over_echo_sized_p50']:.2f} |")
PY
  echo
  echo "A ratio above 1 means kvtier is faster (inline/sized echo: above 1, kvtier inline is slower than the echo of its bytes)."
} > "$out/$name_out.md"
