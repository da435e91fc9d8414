#!/usr/bin/env bash
# A 1P1D pdserve cluster across three network namespaces on this machine, as if on three hosts.
#
#   sudo scripts/netns-cluster.sh [up] [--model-path M] [--backend mooncake|nixl] [--subnet N]
#   sudo scripts/netns-cluster.sh down
#
# up: namespaces pdns-A (prefill, 10.77.N.1), pdns-B (decode, 10.77.N.2) and pdns-C (router,
# 10.77.N.3), each plugged by a veth into a bridge in namespace pdns-br; this shell's namespace
# gets 10.77.N.254 on the same bridge to reach them. Servers bind their namespace's address, so
# the KV crosses the veth links. Prints the router URL; logs and pids in /tmp/pdns/.
# Try faults: `ip -n pdns-br link set h0 down` (unplug the prefill; `up` to restore),
# `ip netns exec pdns-A tc qdisc replace dev eth0 root tbf rate 1mbit burst 32kbit latency 500ms`.
# down: stops the servers and removes the namespaces and the veth.
# Needs root and iproute2. N defaults to 0; the default backend is mooncake (TCP).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STATE=/tmp/pdns
MODEL=""
BACKEND=mooncake
SUBNET=0
CMD=up
while [ $# -gt 0 ]; do
  case "$1" in
    up|down) CMD=$1 ;;
    --model-path) MODEL=$2; shift ;;
    --backend) BACKEND=$2; shift ;;
    --subnet) SUBNET=$2; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

down() {
  for ns in pdns-A pdns-B pdns-C pdns-br; do
    if ip netns list | grep -q "^$ns\b"; then
      for pid in $(ip netns pids "$ns"); do kill "$pid" 2>/dev/null || true; done
    fi
  done
  sleep 2
  for ns in pdns-A pdns-B pdns-C pdns-br; do
    if ip netns list | grep -q "^$ns\b"; then
      for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns delete "$ns"
    fi
  done
  ip link delete pdns0 2>/dev/null || true
  echo "netns cluster removed"
}

if [ "$CMD" = down ]; then down; exit 0; fi

[ "$(id -u)" = 0 ] || { echo "netns-cluster.sh: needs root (ip netns add)" >&2; exit 1; }
command -v ip >/dev/null || { echo "netns-cluster.sh: ip not found: apt-get install -y iproute2" >&2; exit 1; }
ip netns list | grep -q "^pdns-" && { echo "netns-cluster.sh: already up; run '$0 down' first" >&2; exit 1; }
NET=10.77.$SUBNET
mkdir -p "$STATE"
trap 'echo "failed; cleaning up" >&2; down' ERR

ip netns add pdns-br
ip -n pdns-br link add br0 type bridge
ip -n pdns-br link set br0 up
i=0
for h in A B C; do
  i=$((i + 1))
  ip netns add "pdns-$h"
  ip -n pdns-br link add "h$((i - 1))" type veth peer name eth0 netns "pdns-$h"
  ip -n pdns-br link set "h$((i - 1))" master br0 up
  ip -n "pdns-$h" addr add "$NET.$i/24" dev eth0
  ip -n "pdns-$h" link set eth0 up
  ip -n "pdns-$h" link set lo up
done
ip link add pdns0 type veth peer name client netns pdns-br
ip -n pdns-br link set client master br0 up
ip addr add "$NET.254/24" dev pdns0
ip link set pdns0 up

if [ -z "$MODEL" ]; then
  MODEL=$($PY -c "from pdserve.models.demo import ensure_demo_model; print(ensure_demo_model())")
fi
ENV=(env OMP_NUM_THREADS=1 UCX_TLS=tcp UCX_NET_DEVICES=eth0)
COMMON=(--model-path "$MODEL" --disaggregation-transfer-backend "$BACKEND" --torch-num-threads 1)
ip netns exec pdns-A "${ENV[@]}" "$PY" -m pdserve.cli serve "${COMMON[@]}" --host "$NET.1" --port 30000 \
  --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 >"$STATE/prefill.log" 2>&1 &
ip netns exec pdns-B "${ENV[@]}" "$PY" -m pdserve.cli serve "${COMMON[@]}" --host "$NET.2" --port 30001 \
  --disaggregation-mode decode >"$STATE/decode.log" 2>&1 &

wait_health() {  # url name
  for _ in $(seq 600); do
    if "$PY" -c "import httpx,sys; sys.exit(httpx.get('$1/health', timeout=2).status_code != 200)" 2>/dev/null; then
      return 0
    fi
    sleep 1
  done
  echo "$2 not healthy at $1 after 600 s; see $STATE/$2.log" >&2
  return 1
}
wait_health "http://$NET.1:30000" prefill
wait_health "http://$NET.2:30001" decode
ip netns exec pdns-C "$PY" -m pdserve.cli router --host "$NET.3" --port 8000 \
  --prefill "http://$NET.1:30000" 8998 --decode "http://$NET.2:30001" >"$STATE/router.log" 2>&1 &
wait_health "http://$NET.3:8000" router
trap - ERR
echo "router: http://$NET.3:8000   (prefill $NET.1:30000 in pdns-A, decode $NET.2:30001 in pdns-B, backend $BACKEND)"
echo "stop with: $0 down"
