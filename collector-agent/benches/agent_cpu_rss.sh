#!/usr/bin/env bash
# Agent CPU and memory against a fake pod with 8 simulated GPUs (sim + model-server sources),
# at the agent's default sampling (model server every 50 ms, GPUs every 20 ms) unless
# SAMPLE_INTERVAL is given. Run by hand:
#   cargo build --release -p ai-lb-agent -p ai-lb-fake-pod
#   collector-agent/benches/agent_cpu_rss.sh [TARGET_DIR] [SECONDS] [PROFILE: release|debug] [SAMPLE_INTERVAL]
# Prints the agent's CPU use (% of one core) over the run and its RSS (current and peak).
set -euo pipefail
target=${1:-${CARGO_TARGET_DIR:-target}}
secs=${2:-30}
profile=${3:-release}
interval=${4:-50ms}
bin=$target/$profile
tmp=$(mktemp -d)
cleanup() { kill "${agent_pid:-}" "${pod_pid:-}" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

"$bin/ai-lb-fake-pod" --listen 127.0.0.1:0 --num-gpus 8 >"$tmp/pod.out" 2>"$tmp/pod.err" &
pod_pid=$!
for _ in $(seq 100); do grep -q LISTENING "$tmp/pod.out" && break; sleep 0.1; done
pod=$(awk '/LISTENING http/ {print $3}' "$tmp/pod.out")
"$bin/ai-lb-agent" --serving-address "$pod" --gpu-source sim --sim-url "http://$pod" \
    --model-server-url "http://$pod" --sample-interval "$interval" \
    --grpc-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$tmp/agent.out" 2>"$tmp/agent.err" &
agent_pid=$!
for _ in $(seq 100); do grep -q "LISTENING http" "$tmp/agent.out" && break; sleep 0.1; done
sleep 5 # warm-up: windows fill, connections pooled
ticks() { awk '{print $14 + $15}' "/proc/$agent_pid/stat"; }
hz=$(getconf CLK_TCK)
t0=$(ticks)
sleep "$secs"
t1=$(ticks)
rss=$(awk '/VmRSS/ {print $2}' "/proc/$agent_pid/status")
hwm=$(awk '/VmHWM/ {print $2}' "/proc/$agent_pid/status")
http=$(awk '/LISTENING http/ {print $3}' "$tmp/agent.out")
samples=$(exec 3<>"/dev/tcp/${http%:*}/${http#*:}"; printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3; grep '^ai_lb_agent_samples_total' <&3 | awk '{print $2}')
echo "agent sampling every $interval (GPUs every 20 ms or less), 8 simulated GPUs + model-server, ${secs}s:" \
    "CPU $(awk -v d=$((t1 - t0)) -v hz="$hz" -v s="$secs" 'BEGIN {printf "%.2f", d / hz / s * 100}')% of one core," \
    "RSS ${rss} KiB (peak ${hwm} KiB), samples_total ${samples}, load1 $(cut -d" " -f1 /proc/loadavg)"
