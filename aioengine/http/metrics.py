"""Prometheus metrics named like vLLM's (prefix `aioengine:`), fed by engine listeners, plus loop lag.

Each app owns its CollectorRegistry, so several apps (tests) can watch one engine side by side.
Listeners run inside the engine step, so they only bump counters and dicts: no I/O, no locks held long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from aioengine.engine.client import EngineClient, RequestInfo
from aioengine.engine.pool import ModelPool, PooledModel
from aioengine.outputs import RequestOutput
from aioengine.sched.output import EngineCoreOutput, SchedulerStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class Totals:
    """Plain running totals, read by the periodic stats log line."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


class _RankCollector:
    """Per tensor-parallel rank, read at scrape time: steps run and seconds its worker spent in them (their
    rates' ratio is the rank's step time; one device: rank 0 alone)."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def _families(self) -> tuple[CounterMetricFamily, CounterMetricFamily]:
        labels = ["model_name", "rank"]
        return (
            CounterMetricFamily(
                "aioengine:rank_steps", "Steps each tensor-parallel rank ran.", labels=labels
            ),
            CounterMetricFamily(
                "aioengine:rank_step_seconds", "Seconds each rank's worker spent in steps.", labels=labels
            ),
        )

    def describe(self) -> Any:
        return self._families()

    def collect(self) -> Any:
        steps, seconds = self._families()
        for s in self.engine.rank_stats():
            steps.add_metric([self.model_name, str(s.rank)], s.calls)
            seconds.add_metric([self.model_name, str(s.rank)], s.busy_s)
        return steps, seconds


class _LoRACollector:
    """vLLM's ``lora_requests_info``, read at scrape time: the adapters of the running and waiting requests
    as labels (comma-separated), and the slots; its value is the time it was read. Absent without LoRA."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def _family(self) -> GaugeMetricFamily:
        labels = ["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"]
        return GaugeMetricFamily(
            "aioengine:lora_requests_info", "LoRA adapters of running and waiting requests.", labels=labels
        )

    def describe(self) -> Any:
        return [self._family()]

    def collect(self) -> Any:
        s = self.engine.stats()
        if not s.max_loras:
            return []
        family = self._family()
        labels = [self.model_name, ",".join(s.running_loras), ",".join(s.waiting_loras), str(s.max_loras)]
        family.add_metric(labels, time.time())
        return [family]


class EngineMetrics:
    def __init__(
        self, engine: EngineClient, model_name: str, registry: CollectorRegistry | None = None
    ) -> None:
        self.engine = engine
        self.registry = registry if registry is not None else CollectorRegistry()
        self.totals = Totals()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(f"aioengine:{name}", doc, labels, registry=r).labels(model_name).set_function(fn)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"aioengine:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"aioengine:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        # Read at scrape time: exact even when no step runs (after aborts, when idle).
        gauge(
            "num_requests_running",
            "Number of requests in model execution batches.",
            lambda: engine.stats().num_running,
        )
        gauge(
            "num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda: engine.stats().num_waiting,
        )
        gauge(
            "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda: engine.stats().kv_cache_usage,
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in number of queried tokens."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in number of cached tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.offload_stored = counter(
            "kv_offload_stored_blocks", "KV blocks the cache evicted into the host tier."
        )
        self.offload_host_hits = counter(
            "kv_offload_host_hits",
            "Prompt tokens whose KV was loaded back from the host tier (disk reads included).",
        )
        self.offload_disk_reads = counter(
            "kv_offload_disk_reads", "KV blocks read back from the disk tier (one per KV cache group)."
        )
        self.offload_disk_failures = counter(
            "kv_offload_disk_failures",
            "Disk-tier block files found missing or corrupt (their tokens recomputed).",
        )
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = Counter(
            "aioengine:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "position"],
            registry=r,
        )
        self._spec_per_pos = lambda pos: per_pos.labels(model_name, str(pos))
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "aioengine:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in ("stop", "length", "abort")}
        self._success_family = success
        self.lora_requests = Counter(
            "aioengine:lora_requests",
            "Finished completions per LoRA adapter.",
            ["model_name", "lora_name"],
            registry=r,
        )
        self._model_name = model_name
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _E2E_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent waiting before first scheduled, in seconds.",
            _E2E_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of tokens per engine step.", _TOKEN_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens per request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens per request.", _TOKEN_BUCKETS
        )
        self.loop_lag = histogram(
            "event_loop_lag_seconds",
            "How late the event loop woke a periodic timer: the delay every request "
            "coroutine on the loop sees.",
            _LAG_BUCKETS,
        )
        r.register(_RankCollector(engine, model_name))
        r.register(_LoRACollector(engine, model_name))
        self._live: dict[str, list] = {}  # request_id -> [last token time, generated tokens]
        self._queued: set[str] = set()  # request ids whose queue time is observed
        engine.stat_listeners.append(self.on_step)
        engine.request_listeners.append(self.on_output)

    def close(self) -> None:
        if self.on_step in self.engine.stat_listeners:
            self.engine.stat_listeners.remove(self.on_step)
        if self.on_output in self.engine.request_listeners:
            self.engine.request_listeners.remove(self.on_output)

    # ---- engine listeners (inside the step: keep them cheap) --------------------------------------------
    def on_step(self, stats: SchedulerStats, outputs: list[EngineCoreOutput]) -> None:
        t = self.totals
        if stats.prefix_cache_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries)
            t.prefix_queries += stats.prefix_cache_queries
        if stats.prefix_cache_hits:
            self.prefix_hits.inc(stats.prefix_cache_hits)
            t.prefix_hits += stats.prefix_cache_hits
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        for metric, n in (
            (self.offload_stored, stats.kv_offload_stored_blocks),
            (self.offload_host_hits, stats.kv_offload_host_hits),
            (self.offload_disk_reads, stats.kv_offload_disk_reads),
            (self.offload_disk_failures, stats.kv_offload_disk_failures),
        ):
            if n:
                metric.inc(n)
        if stats.num_scheduled_tokens:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        if stats.spec_num_drafts:
            self.spec_drafts.inc(stats.spec_num_drafts)
            self.spec_draft_tokens.inc(stats.spec_num_draft_tokens)
            self.spec_accepted.inc(stats.spec_num_accepted_tokens)
            for pos, n in enumerate(stats.spec_accepted_per_pos):
                if n:
                    self._spec_per_pos(pos).inc(n)

    def on_output(self, out: RequestOutput, state: RequestInfo) -> None:
        now = time.monotonic()
        scheduled = state.first_scheduled_time
        if scheduled is not None and out.request_id not in self._queued:  # its first output since then
            self._queued.add(out.request_id)
            self.queue_time.observe(max(0.0, scheduled - state.arrival_time))
        live = self._live.get(out.request_id)
        n_new = 0
        for c in out.outputs:
            n_new += len(c.token_ids)
            if c.finish_reason is not None:
                if state.lora is not None:  # per adapter (lora_requests_info names, it does not count)
                    self.lora_requests.labels(self._model_name, state.lora).inc()
                counter = self.success.get(c.finish_reason)
                if counter is None:
                    counter = self.success[c.finish_reason] = self._success_family.labels(
                        self._model_name, c.finish_reason
                    )
                counter.inc()
        if n_new:
            self.generation_tokens.inc(n_new)
            self.totals.generation_tokens += n_new
            if live is None:
                live = self._live[out.request_id] = [now, 0]
                num_prompt = len(out.prompt_token_ids)
                self.prompt_tokens.inc(num_prompt)
                self.totals.prompt_tokens += num_prompt
                self.request_prompt_tokens.observe(num_prompt)
                first = state.first_token_time if state.first_token_time is not None else now
                self.ttft.observe(max(0.0, first - state.arrival_time))
            else:
                self.itl.observe(now - live[0])
                live[0] = now
            live[1] += n_new
        if out.finished:
            self.e2e.observe(max(0.0, now - state.arrival_time))
            self.request_generation_tokens.observe(live[1] if live is not None else 0)
            self._live.pop(out.request_id, None)
            self._queued.discard(out.request_id)

    # ---- the event loop's own health -------------------------------------------------------------------
    async def watch_loop_lag(self, interval: float = 0.05) -> None:
        """Sleep `interval` over and over; how late each wake-up comes is the loop's lag."""
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(interval)
            self.loop_lag.observe(max(0.0, loop.time() - t0 - interval))


class PoolMetrics:
    """``/metrics`` with several models: each loaded model's EngineMetrics (its own ``model_name`` label)
    merged family by family, and the pool's own gauges and load times."""

    def __init__(self, pool: ModelPool) -> None:
        self.registry = CollectorRegistry()
        Gauge("aioengine:models_loaded", "Number of models loaded now.", registry=self.registry).set_function(
            lambda: len(pool.loaded())
        )
        self.load_seconds = Histogram(
            "aioengine:model_load_seconds",
            "Seconds each model load took (engine start included).",
            ["model_name"],
            buckets=(0.5, 1, 2, 5, 10, 20, 60, 120, 300),
            registry=self.registry,
        )
        self.engines: dict[str, EngineMetrics] = {}
        self._pool = pool
        pool.listeners.append(self.on_pool)

    def on_pool(self, event: str, model: PooledModel) -> None:
        if event == "load" and model.engine is not None:
            self.engines[model.name] = EngineMetrics(model.engine, model.name)
            self.load_seconds.labels(model.name).observe(model.load_seconds or 0.0)
        elif event == "unload" and model.name in self.engines:
            self.engines.pop(model.name).close()

    def close(self) -> None:
        if self.on_pool in self._pool.listeners:
            self._pool.listeners.remove(self.on_pool)
        for metrics in self.engines.values():
            metrics.close()
        self.engines.clear()

    def collect(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        for registry in (self.registry, *(m.registry for m in self.engines.values())):
            for family in registry.collect():
                name = family.name
                if name not in merged:
                    merged[name] = Metric(name, family.documentation, family.type, family.unit)
                merged[name].samples.extend(family.samples)
        return list(merged.values())


class StatsLogger:
    """vLLM's periodic one-line summary: throughput over the interval, queue sizes, KV and prefix cache."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        t = metrics.totals
        self.last = Totals(t.prompt_tokens, t.generation_tokens, t.prefix_queries, t.prefix_hits)
        self.last_time = time.monotonic()
        self.was_idle = False

    def line(self) -> str | None:
        """The line for the interval just ended, or None when the engine was idle then and still is."""
        m, engine = self.metrics, self.metrics.engine
        now, t = time.monotonic(), m.totals
        dt = max(now - self.last_time, 1e-9)
        prompt_tps = (t.prompt_tokens - self.last.prompt_tokens) / dt
        gen_tps = (t.generation_tokens - self.last.generation_tokens) / dt
        queries = t.prefix_queries - self.last.prefix_queries
        hits = t.prefix_hits - self.last.prefix_hits
        snap = engine.stats()
        running, waiting = snap.num_running, snap.num_waiting
        self.last = Totals(t.prompt_tokens, t.generation_tokens, t.prefix_queries, t.prefix_hits)
        self.last_time = now
        idle = not (prompt_tps or gen_tps or running or waiting)
        if idle and self.was_idle:
            return None
        self.was_idle = idle
        return (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} "
            f"tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: "
            f"{snap.kv_cache_usage * 100:.1f}%, Prefix cache hit rate: "
            f"{(hits / queries * 100) if queries else 0.0:.1f}%"
        )
