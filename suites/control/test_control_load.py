"""Control plane under load: 32 concurrent streaming clients across 20 consecutive updates, per pause mode.

Reports p50/p99 pause-to-resume latency (the trainer's /pause -> four-phase push -> /resume, measured at
the trainer) and end-to-end tokens/s before, during and after the updates, and checks correctness in
the same run (nccl-tests style #wrong): no request lost, per-token versions never go backwards, no
request spans two versions under abort or wait, and the engine ends on the last version bit for bit.

    pytest suites/control/test_control_load.py -m slow -s        # writes reports/control_load.json

Throughput windows end on token counts, not on timers: a phase lasts until the clients received
PHASE_TOKENS more tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from harness.checks import assert_bitwise_equal
from suites.control.helpers import request, version_runs, weights_for

pytestmark = pytest.mark.slow

N_CLIENTS = 32
N_UPDATES = 20
REQUEST_TOKENS = 16
PHASE_TOKENS = 1000
REPORT = Path(__file__).resolve().parents[2] / "reports" / "control_load.json"


class Load:
    """N client threads, each streaming one request after another until stopped; counts tokens as they
    arrive and keeps every completion for the checks."""

    def __init__(self, client, n_clients: int, max_tokens: int):
        self.client = client
        self.max_tokens = max_tokens
        self.cond = threading.Condition()
        self.tokens = 0
        self.sent = 0
        self.completions = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(n_clients)
        ]

    def _worker(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                stream = self.client.submit(request(self.max_tokens, f"load{i}"))
                with self.cond:
                    self.sent += 1
                for event in stream:
                    if event.token_id is not None:
                        with self.cond:
                            self.tokens += 1
                            self.cond.notify_all()
                completion = stream.result(60)
                with self.cond:
                    self.completions.append(completion)
                    if stream.error is not None:
                        self.errors.append(f"{completion.request_id}: {stream.error!r}")
            except Exception as exc:  # noqa: BLE001 - a load client records and stops
                with self.cond:
                    self.errors.append(f"client {i}: {exc!r}")
                return

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def count(self) -> int:
        with self.cond:
            return self.tokens

    def wait_for(self, total: int, timeout: float = 300.0) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: self.tokens >= total or bool(self.errors), timeout)
        assert ok and not self.errors, (
            f"load stalled at {self.tokens}/{total} tokens; errors {self.errors[:3]}"
        )


def tokens_per_s(load: Load, n_tokens: int) -> float:
    """Throughput over the time the clients take to receive n_tokens more tokens."""
    start, t0 = load.count(), time.perf_counter()
    load.wait_for(start + n_tokens)
    return (load.count() - start) / (time.perf_counter() - t0)


@dataclasses.dataclass
class Figures:
    mode: str
    pause_to_resume_s: list[float]
    phases_s: dict[str, list[float]]  # pause (the /pause call), push (four phases), resume
    tokens_per_s: dict[str, float]
    sent: int
    completed: int
    aborted: int
    spanning: int
    wrong: int
    problems: list[str]

    @staticmethod
    def percentiles_ms(samples: list[float]) -> dict[str, float]:
        q = statistics.quantiles(sorted(samples), n=100, method="inclusive")
        return {
            "p50": round(statistics.median(samples) * 1e3, 1),
            "p99": round(q[98] * 1e3, 1),
            "max": round(max(samples) * 1e3, 1),
        }

    def summary(self) -> dict:
        return {
            "clients": N_CLIENTS,
            "updates": N_UPDATES,
            "request_tokens": REQUEST_TOKENS,
            "pause_to_resume_ms": self.percentiles_ms(self.pause_to_resume_s),
            "phase_ms": {name: self.percentiles_ms(v) for name, v in self.phases_s.items()},
            "tokens_per_s": {k: round(v, 1) for k, v in self.tokens_per_s.items()},
            "requests": {
                "sent": self.sent,
                "completed": self.completed,
                "aborted": self.aborted,
                "spanning_versions": self.spanning,
            },
            "wrong": self.wrong,
            "problems": self.problems[:10],
        }


def run_load(served, mode: str) -> Figures:
    load = Load(served.client, N_CLIENTS, REQUEST_TOKENS)
    load.start()
    try:
        load.wait_for(PHASE_TOKENS)  # warm-up: every client connected, pools and caches grown
        before = tokens_per_s(load, PHASE_TOKENS)
        latencies, phases, last = [], {"pause": [], "push": [], "resume": []}, None
        start, t0 = load.count(), time.perf_counter()
        for version in range(1, N_UPDATES + 1):
            last = weights_for(served.engine, seed=version)
            began = time.perf_counter()
            served.client.pause(mode)
            paused = time.perf_counter()
            served.push(version, last)
            pushed = time.perf_counter()
            served.client.resume()
            resumed = time.perf_counter()
            latencies.append(resumed - began)
            for name, seconds in (
                ("pause", paused - began),
                ("push", pushed - paused),
                ("resume", resumed - pushed),
            ):
                phases[name].append(seconds)
        during = (load.count() - start) / (time.perf_counter() - t0)
        after = tokens_per_s(load, PHASE_TOKENS)
    finally:
        load.stop()
    problems = list(load.errors)
    spanning = 0
    for c in load.completions:
        runs = version_runs(c.token_versions)
        versions = [v for v, _ in runs]
        if versions != sorted(versions):
            problems.append(f"{c.request_id}: versions go backwards {runs}")
        if len(runs) > 1:
            spanning += 1
            if mode != "keep":
                problems.append(f"{c.request_id}: spans {runs} under {mode}")
    completed = sum(c.finish_reason in ("length", "stop") for c in load.completions)
    aborted = sum(c.finish_reason == "abort" for c in load.completions)
    if load.sent != completed + aborted:
        problems.append(f"requests lost: sent {load.sent} != completed {completed} + aborted {aborted}")
    stats = served.client.stats()
    if (stats["submitted"], stats["in_flight"]) != (load.sent, 0):
        problems.append(f"server counted {stats}, clients sent {load.sent}")
    if served.engine.weight_version != N_UPDATES:
        problems.append(f"engine ends on version {served.engine.weight_version}, expected {N_UPDATES}")
    assert_bitwise_equal(last, served.engine.read_weights(), f"after {N_UPDATES} updates under load ({mode})")
    return Figures(
        mode,
        latencies,
        phases,
        {"before": before, "during": during, "after": after},
        load.sent,
        completed,
        aborted,
        spanning,
        len(problems),
        problems,
    )


def write_report(figures: Figures) -> None:
    data = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    data.update(
        {
            "benchmark": "control plane under load",
            "command": "pytest suites/control/test_control_load.py -m slow",
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "loadavg_1m_at_write": round(
                    os.getloadavg()[0], 2
                ),  # the machine is shared: context for the figures
            },
        }
    )
    data.setdefault("modes", {})[figures.mode] = {
        **figures.summary(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(data, indent=2, sort_keys=True))


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_updates_under_32_streaming_clients(make_served, benchmark, mode, record_property):
    served = make_served(max_batch=N_CLIENTS)
    figures = benchmark.pedantic(run_load, args=(served, mode), rounds=1, iterations=1)
    summary = figures.summary()
    benchmark.extra_info.update(summary)
    record_property("control_load", summary)
    write_report(figures)
    lat, tps, ph = summary["pause_to_resume_ms"], summary["tokens_per_s"], summary["phase_ms"]
    print(
        f"\n{mode:>5}: pause->resume p50 {lat['p50']} ms p99 {lat['p99']} ms (p50 pause {ph['pause']['p50']} "
        f"push {ph['push']['p50']} resume {ph['resume']['p50']}) | tokens/s before {tps['before']} "
        f"during {tps['during']} after {tps['after']} | requests {summary['requests']} | #wrong {figures.wrong}"
    )
    assert figures.wrong == 0, f"{figures.wrong} problem(s) under {mode}: {figures.problems[:5]}"
