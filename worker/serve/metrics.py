"""The worker's counters in the Prometheus text exposition format (version 0.0.4), for /metrics:
requests, tokens and latency from the HTTP side, the expert cache's counters and state, and the
daemon's read bytes, errors and RAM tier as it last reported them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batching import ThreadTimes


@dataclass
class ServeCounters:
    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (endpoint, status code) -> count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    request_seconds_sum: float = 0.0
    request_seconds_count: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    in_flight: int = 0  # generation requests admitted: the one generating and those queued behind it

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1


def _line(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    if labels:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {value}"
    return f"{name} {value}"


# expertd's counters for this worker's own session (STATS "clients"), beside the daemon-wide ones
# that sum over every worker sharing it: (key, metric name, help).
CLIENT_COUNTERS = (
    ("keys", "expertpack_daemon_client_keys", "Experts this worker asked expertd for (this session)."),
    ("ram_hits", "expertpack_daemon_client_ram_hits",
     "This worker's keys expertd answered from its RAM tier without a read of their own (this session)."),
    ("ram_misses", "expertpack_daemon_client_ram_misses",
     "This worker's keys expertd read from the pack (this session)."),
    ("read_bytes", "expertpack_daemon_client_read_bytes", "Pack bytes expertd read for this worker (this session)."),
    ("served_bytes", "expertpack_daemon_client_served_bytes",
     "Expert bytes expertd handed this worker, from staging or its RAM tier (this session)."),
)


def render(serve: ServeCounters, cache: dict | None, daemon: dict | None, daemon_ram: dict | None = None,
           daemon_client: dict | None = None, thread: "ThreadTimes | None" = None) -> str:
    """cache: ExpertCache.stats()["cache"] (None without one); daemon: its counters (None when down);
    daemon_ram: its STATS "ram" section (None when down, or from an expertd without a RAM tier);
    daemon_client: this worker's entry of its STATS "clients" (None when down, between sessions, or
    from an expertd without per-client counters); thread: the generation thread's times."""
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[float, dict[str, str] | None]],
               suffix: str = "") -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(_line(name + suffix, v, labels) for v, labels in samples)

    metric("expertpack_requests", "counter", "HTTP requests answered, by endpoint and status code.",
           [(n, {"endpoint": e, "code": c}) for (e, c), n in sorted(serve.requests.items())], "_total")
    metric("expertpack_requests_in_flight", "gauge", "Generation requests admitted: generating or queued "
           "(at most 1 + --max-queue).", [(serve.in_flight, None)])
    metric("expertpack_prompt_tokens", "counter", "Prompt tokens prefilled.", [(serve.prompt_tokens, None)], "_total")
    metric("expertpack_completion_tokens", "counter", "Tokens generated.", [(serve.completion_tokens, None)], "_total")
    out.append("# HELP expertpack_request_seconds Wall time of generation requests, queueing included.")
    out.append("# TYPE expertpack_request_seconds summary")
    out.append(_line("expertpack_request_seconds_sum", serve.request_seconds_sum))
    out.append(_line("expertpack_request_seconds_count", serve.request_seconds_count))
    metric("expertpack_prefill_seconds", "counter", "Time spent in prefill.", [(serve.prefill_seconds, None)], "_total")
    metric("expertpack_decode_seconds", "counter", "Time spent decoding after the first token.",
           [(serve.decode_seconds, None)], "_total")
    if thread is not None:
        steps, step_seconds = dict(thread.steps), dict(thread.step_seconds)
        metric("expertpack_decode_steps", "counter", "Decode steps run, by the sequences (rows) they decoded together.",
               [(steps[rows], {"rows": str(rows)}) for rows in sorted(steps)], "_total")
        metric("expertpack_generation_thread_seconds", "counter",
               "The generation thread's time by part: decode steps (by rows, launch to logits ready), the "
               "tokens taken from their logits (sampling, stop checks, text to the streams), prompt passes.",
               [(step_seconds[rows], {"part": "decode_step", "rows": str(rows)}) for rows in sorted(step_seconds)]
               + [(thread.token_seconds, {"part": "tokens"}), (thread.prompt_seconds, {"part": "prompt"})], "_total")
        metric("expertpack_prompt_passes", "counter", "Passes of admitted prompts' pieces.",
               [(thread.prompt_passes, None)], "_total")
        metric("expertpack_prompt_pieces", "counter", "Prompt pieces those passes ran: several a pass where prompts "
               "wait together.", [(thread.prompt_pieces, None)], "_total")
    if cache is not None:
        for key, help_text in (("hits", "Unique experts of a step found in the cache."),
                               ("misses", "Unique experts of a step fetched from expertd."),
                               ("evictions", "Experts evicted to make room."),
                               ("h2d_bytes", "Expert bytes copied from the staging into the cache."),
                               ("stall_s", "Seconds the model waited for missing experts."),
                               ("prefetch_issued", "Experts fetched ahead of their layer (predicted misses)."),
                               ("prefetch_used", "Misses served by a prefetch, without a read of their own."),
                               ("prefetch_stale", "Prefetches cancelled because their layer ran without them.")):
            name = {"stall_s": "expertpack_cache_stall_seconds", "h2d_bytes": "expertpack_cache_h2d_bytes"}.get(
                key, f"expertpack_cache_{key}")
            metric(name, "counter", help_text, [(cache[key], None)], "_total")
        metric("expertpack_cache_prefetch_precision", "gauge", "Share of prefetched experts their layer used.",
               [(cache["prefetch_precision"], None)])
        metric("expertpack_cache_prefetch_recall", "gauge", "Share of the misses a prefetch had brought.",
               [(cache["prefetch_recall"], None)])
        metric("expertpack_cache_resident_bytes", "gauge", "Bytes of experts held in the cache.",
               [(cache["resident_bytes"], None)])
        metric("expertpack_cache_slots", "gauge", "Expert slots of the cache.", [(cache["slots"], None)])
        metric("expertpack_daemon_reconnects", "counter", "Times the worker reconnected to expertd.",
               [(cache["reconnects"], None)], "_total")
        metric("expertpack_daemon_refetched_keys", "counter",
               "Experts asked of expertd again (a failed or late answer, a lapsed session).",
               [(cache["refetched"], None)], "_total")
    metric("expertpack_daemon_up", "gauge", "1 when expertd answered the last STATS.", [(int(daemon is not None), None)])
    if daemon is not None:
        metric("expertpack_daemon_read_bytes", "counter", "Bytes expertd read from the pack (all clients).",
               [(daemon["pack_read_bytes"], None)], "_total")
        metric("expertpack_daemon_io_errors", "counter", "Pack reads that failed in expertd.",
               [(daemon["io_errors"], None)], "_total")
        metric("expertpack_daemon_failed", "counter", "Keys expertd answered with FAIL (errors, cancels).",
               [(daemon["failed"], None)], "_total")
        for key, help_text in (("ram_hits", "Keys expertd answered from its RAM tier, without a read (all clients)."),
                               ("ram_misses", "Keys expertd read from the pack (all clients)."),
                               ("ram_evictions", "Blocks expertd evicted from its RAM tier to admit another.")):
            if key in daemon:
                metric(f"expertpack_daemon_{key}", "counter", help_text, [(daemon[key], None)], "_total")
    if daemon_client is not None and "keys" in daemon_client:
        for key, name, help_text in CLIENT_COUNTERS:
            metric(name, "counter", help_text, [(daemon_client[key], None)], "_total")
        latency = daemon_client["demand_latency_us"]
        metric("expertpack_daemon_client_demand_latency_seconds", "gauge",
               "FETCH to READY of this worker's demand keys in expertd, by quantile (upper edge of a "
               "power-of-two bucket; this session).",
               [(latency["p50"] / 1e6, {"quantile": "0.5"}), (latency["p99"] / 1e6, {"quantile": "0.99"})])
    if daemon_ram is not None:
        metric("expertpack_daemon_ram_resident_bytes", "gauge", "Expert bytes resident in expertd's RAM tier.",
               [(daemon_ram["resident_bytes"], None)])
        metric("expertpack_daemon_ram_bytes", "gauge", "Size of expertd's RAM tier (0: none).",
               [(daemon_ram["size_bytes"], None)])
        metric("expertpack_daemon_ram_locked", "gauge", "1 when expertd's RAM tier is locked in memory (mlock).",
               [(int(bool(daemon_ram["locked"])), None)])
    return "\n".join(out) + "\n"
