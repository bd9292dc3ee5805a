#!/usr/bin/env python3
"""What one scrape of a vLLM-like /metrics page costs the model server's Python process.

The agent's default sample interval decides how often it scrapes the model server. vLLM
renders /metrics with prometheus_client in its API-server process, so a scrape costs that
process CPU. This builds a registry shaped like vLLM's (the metric names and bucket counts of
vLLM 0.8-0.10: 4 finished reasons, 13 histograms, gauges and counters, one model, plus the
default process/GC collectors) and times `generate_latest`, the call behind /metrics.

Usage: python3 tests/bench/scrape_cost.py [--models N] [--iterations N]
Needs: pip install prometheus_client
"""

import argparse
import statistics
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import gc_collector, platform_collector, process_collector

LAT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
       7.5, 10.0, 20.0, 40.0, 80.0]
TOK = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]


def registry(models):
    r = CollectorRegistry()
    process_collector.ProcessCollector(registry=r)
    platform_collector.PlatformCollector(registry=r)
    gc_collector.GCCollector(registry=r)
    lab = ["model_name"]
    gauges = ["num_requests_running", "num_requests_waiting", "gpu_cache_usage_perc",
              "kv_cache_usage_perc", "lora_requests_info", "num_requests_swapped"]
    counters = ["num_preemptions", "prompt_tokens", "generation_tokens",
                "prefix_cache_queries", "prefix_cache_hits"]
    hists = {"time_to_first_token_seconds": LAT, "time_per_output_token_seconds": LAT,
             "inter_token_latency_seconds": LAT, "e2e_request_latency_seconds": LAT,
             "request_queue_time_seconds": LAT, "request_inference_time_seconds": LAT,
             "request_prefill_time_seconds": LAT, "request_decode_time_seconds": LAT,
             "request_prompt_tokens": TOK, "request_generation_tokens": TOK,
             "iteration_tokens_total": TOK, "request_params_n": [1, 2, 5, 10, 20],
             "request_params_max_tokens": TOK}
    g = [Gauge(f"vllm:{n}", n, lab, registry=r) for n in gauges]
    c = [Counter(f"vllm:{n}", n, lab, registry=r) for n in counters]
    ok = Counter("vllm:request_success", "finished", lab + ["finished_reason"], registry=r)
    h = [Histogram(f"vllm:{n}", n, lab, buckets=b, registry=r) for n, b in hists.items()]
    info = Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks"],
                 registry=r)
    info.labels("16", "8192").set(1)
    for m in range(models):
        name = f"model-{m}"
        for x in g:
            x.labels(name).set(3)
        for x in c:
            x.labels(name).inc(1000)
        for reason in ["stop", "length", "abort", "error"]:
            ok.labels(name, reason).inc(10)
        for x in h:
            for v in (0.01, 0.3, 2.0, 15.0):
                x.labels(name).observe(v)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=2000)
    a = ap.parse_args()
    r = registry(a.models)
    page = generate_latest(r)
    for _ in range(50):
        generate_latest(r)
    times = []
    for _ in range(a.iterations):
        t0 = time.perf_counter()
        generate_latest(r)
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    p50 = statistics.median(times)
    p99 = times[int(len(times) * 0.99) - 1]
    print(f"page {len(page)} bytes, {a.models} model(s); generate_latest p50 {p50:.0f} us, "
          f"p99 {p99:.0f} us")
    for interval_ms in (10, 50, 100, 500):
        share = p50 / (interval_ms * 1000) * 100
        print(f"  one scraper every {interval_ms:>3} ms: {share:.2f} % of one core")


if __name__ == "__main__":
    main()
