"""Prometheus metrics for the server: requests by route and status; per model (label `model`): tokens, TTFT,
latency, queue depth, KV use, readiness, loads and unloads."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_M = ["model"]


class Metrics:
    """One registry per app, so several apps (tests) never share counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "quantserve_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter("quantserve_prompt_tokens", "Prompt tokens processed", _M, registry=r)
        self.completion_tokens = Counter(
            "quantserve_completion_tokens", "Completion tokens generated", _M, registry=r
        )
        self.ttft = Histogram(
            "quantserve_time_to_first_token_seconds",
            "Time to first token",
            _M,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "quantserve_request_latency_seconds",
            "End-to-end generation latency",
            _M,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "quantserve_queue_depth", "Requests waiting for a sequence served", _M, registry=r
        )
        self.running = Gauge("quantserve_running_sequences", "Sequences being generated", _M, registry=r)
        self.kv_cells_used = Gauge(
            "quantserve_kv_cells_used",
            "KV cells holding data, per llama.cpp (refreshed when idle)",
            _M,
            registry=r,
        )
        self.kv_cells_cached = Gauge(
            "quantserve_kv_cells_cached",
            "KV cells kept as prefix cache in free served_models (refreshed when idle)",
            _M,
            registry=r,
        )
        self.ready = Gauge("quantserve_model_ready", "1 while the model is loaded", _M, registry=r)
        self.loads = Counter(
            "quantserve_model_loads", "Model loads by outcome (ok, error)", ["model", "outcome"], registry=r
        )
        self.load_seconds = Histogram(
            "quantserve_model_load_seconds",
            "Time to load a model",
            _M,
            buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.steps = Gauge(
            "quantserve_engine_steps", "Engine steps run since the model loaded", _M, registry=r
        )
        self.rank_step = Gauge(
            "quantserve_rank_step_seconds",
            "Tensor parallel: each rank's time for the last engine step, its forward and collectives",
            ["model", "rank"],
            registry=r,
        )
        self.rank_step_total = Gauge(
            "quantserve_rank_step_seconds_total",
            "Tensor parallel: each rank's time in engine steps since the model loaded",
            ["model", "rank"],
            registry=r,
        )
        self.unloads = Counter(
            "quantserve_model_unloads",
            "Model unloads by reason (lru: room for another, keep_alive: idle, request: POST /models/unload)",
            ["model", "reason"],
            registry=r,
        )
