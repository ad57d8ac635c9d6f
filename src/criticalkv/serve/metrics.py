"""The server's counters, rendered in Prometheus' text format for ``GET /metrics``."""

from __future__ import annotations

import threading
from collections import Counter

#: upper bounds of the batch-size histogram's buckets (rows per decode)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Metrics:
    """Requests by route, errors by status, time to first token (a summary: sum and count), rows per decode (a
    histogram: how many chat requests were answered together)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.errors: Counter[int] = Counter()
        self.first_token_sum = 0.0
        self.first_token_count = 0
        self.batches: Counter[int] = Counter()  # decodes by their rows

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[route] += 1
            if status >= 400:
                self.errors[status] += 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.first_token_sum += seconds
            self.first_token_count += 1

    def batch(self, rows: int) -> None:
        with self._lock:
            self.batches[rows] += 1

    def render(self, held_bytes: int, held_contexts: int) -> str:
        with self._lock:
            lines = [
                "# HELP criticalkv_requests_total HTTP requests answered, by route.",
                "# TYPE criticalkv_requests_total counter",
            ]
            lines += [f'criticalkv_requests_total{{route="{route}"}} {n}' for route, n in sorted(self.requests.items())]
            lines += [
                "# HELP criticalkv_errors_total HTTP responses with an error status.",
                "# TYPE criticalkv_errors_total counter",
            ]
            lines += [f'criticalkv_errors_total{{status="{status}"}} {n}' for status, n in sorted(self.errors.items())]
            lines += [
                "# HELP criticalkv_time_to_first_token_seconds From a chat request's arrival to its first token.",
                "# TYPE criticalkv_time_to_first_token_seconds summary",
                f"criticalkv_time_to_first_token_seconds_sum {self.first_token_sum}",
                f"criticalkv_time_to_first_token_seconds_count {self.first_token_count}",
                "# HELP criticalkv_batch_rows Chat requests answered together in one decode.",
                "# TYPE criticalkv_batch_rows histogram",
            ]
            for bound in BATCH_BUCKETS:
                below = sum(n for rows, n in self.batches.items() if rows <= bound)
                lines.append(f'criticalkv_batch_rows_bucket{{le="{bound}"}} {below}')
            lines += [
                f'criticalkv_batch_rows_bucket{{le="+Inf"}} {self.batches.total()}',
                f"criticalkv_batch_rows_sum {sum(rows * n for rows, n in self.batches.items())}",
                f"criticalkv_batch_rows_count {self.batches.total()}",
            ]
        lines += [
            "# HELP criticalkv_context_bytes_held Key/value bytes of the compressed contexts held in memory.",
            "# TYPE criticalkv_context_bytes_held gauge",
            f"criticalkv_context_bytes_held {held_bytes}",
            "# HELP criticalkv_contexts_held Compressed contexts held in memory.",
            "# TYPE criticalkv_contexts_held gauge",
            f"criticalkv_contexts_held {held_contexts}",
        ]
        return "\n".join(lines) + "\n"
