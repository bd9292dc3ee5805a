#!/usr/bin/env python3
"""Error-rate detectors on fault-noisy's statistics, simulated (no Envoy, no agents).

One pod's requests finish at RATE per second (Poisson), each failing with the rate the scenario
gives it: a background, a burst for BURST s every BURST x PODS s (one pod of PODS at a time),
and from the fault on FAULT. Two detectors:
- the agents' windowed rate (what the filter trips on today): failures / requests over the last
  W s, judged every DT s, at threshold T with at least MIN_REQ requests in the window; T 0.25 is
  the static `agentErrorRate`, 0.295 what `adaptiveThresholds` makes of it at an 8 % background;
- CUSUM (Page 1954) over the same outcomes: S = max(0, S + k ln(p1/p0) + (n - k) ln((1-p1)/(1-p0)))
  per DT with n requests and k failures; trips at S >= h. Only post-change outcomes add
  evidence, where the window dilutes a fault's first seconds with the successes before it.
False trips: trips per pod in 45 s of noise alone (after the window fills); detection: time
from the fault to the first trip (a pod that had 20 s of noise first), median over TRIALS.
Ratios are against the static windowed rate. Run: python3 detectors_sim.py (about 1 min).
"""
import math
import random
import statistics as st

RATE, DT, W, PODS, BURST, MIN_REQ, COOL, TRIALS = 5.2, 0.1, 5.0, 8, 3.0, 10, 5.0, 300


def poisson(rng, lam):
    n, limit, p = 0, math.exp(-lam), 1.0
    while True:
        p *= rng.random()
        if p < limit:
            return n
        n += 1


def outcomes(rng, dur, rate_at):
    """(requests, failures) per DT step."""
    steps, t = [], 0.0
    while t < dur:
        n = poisson(rng, RATE * DT)
        p = rate_at(t)
        steps.append((n, sum(rng.random() < p for _ in range(n))))
        t += DT
    return steps


def windowed(steps, T):
    trips, win, sn, sk, last = [], [], 0, 0, -1e9
    for i, (n, k) in enumerate(steps):
        win.append((n, k))
        sn, sk = sn + n, sk + k
        if len(win) > int(W / DT):
            a, b = win.pop(0)
            sn, sk = sn - a, sk - b
        t = i * DT
        if sn >= MIN_REQ and sk / sn >= T and t - last >= COOL:
            trips.append(t)
            last = t
    return trips


def cusum(steps, p0, p1, h):
    a, b = math.log(p1 / p0), math.log((1 - p1) / (1 - p0))
    s, trips, last = 0.0, [], -1e9
    for i, (n, k) in enumerate(steps):
        s = max(0.0, s + k * a + (n - k) * b)
        t = i * DT
        if s >= h and t - last >= COOL:
            trips.append(t)
            last, s = t, 0.0
    return trips


def noise(bg, burst, phase):
    return lambda t: burst if ((t + phase) % (BURST * PODS)) < BURST else bg


def run(detect, bg=0.08, burst=0.2, fault=0.5, seed=1):
    rng = random.Random(seed)
    false = 0
    for _ in range(TRIALS):
        steps = outcomes(rng, 45, noise(bg, burst, rng.random() * BURST * PODS))
        false += len([t for t in detect(steps) if t >= W])
    delays = []
    for _ in range(TRIALS):
        nz = noise(bg, burst, rng.random() * BURST * PODS)
        steps = outcomes(rng, 40, lambda t: nz(t) if t < 20 else fault)
        after = [t for t in detect(steps) if t >= 20]
        delays.append(after[0] - 20 if after else 20)
    return false / TRIALS, st.median(delays)


def main():
    rows = [("windowed, T 0.25 (static)", lambda s: windowed(s, 0.25)),
            ("windowed, T 0.295 (adaptive at 8 %)", lambda s: windowed(s, 0.295)),
            ("windowed, T 0.325 (the +30 % cap)", lambda s: windowed(s, 0.325))]
    for p0, p1, h in [(0.2, 0.5, 2.5), (0.2, 0.5, 3.0), (0.2, 0.5, 3.5), (0.25, 0.5, 2.0),
                      (0.25, 0.5, 2.5), (0.15, 0.5, 3.5)]:
        rows.append((f"CUSUM p0 {p0} p1 {p1} h {h}",
                     (lambda p0, p1, h: lambda s: cusum(s, p0, p1, h))(p0, p1, h)))
    base = None
    print("| detector | false trips per pod, 45 s | ratio | detection, median s | ratio |")
    print("|---|---|---|---|---|")
    for name, detect in rows:
        false, delay = run(detect)
        base = base or (false, delay)
        print(f"| {name} | {false:.3f} | {false / base[0]:.2f}x | {delay:.2f} | "
              f"{delay / base[1]:.2f}x |")


if __name__ == "__main__":
    main()
