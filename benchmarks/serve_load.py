"""Load on the server: N concurrent clients asking questions of M stored contexts, on loopback only.

Starts ``criticalkv serve``'s application in this process on 127.0.0.1 (a free port), stores ``--contexts``
needle documents of ``--tokens`` tokens, then ``--clients`` threads send chat requests (each naming one context,
round robin) until ``--requests`` are sent or ``--seconds`` have passed, whichever comes first. Every request must
be answered (200) or refused with a clear status; anything else (a connection error, a 5xx) is counted as a failure.
Reports requests/s, p50 / p99 latency, statuses, the batch sizes the server decoded (requests answered together on
one context: ``--batch-window-ms``, ``--max-batch``, as ``criticalkv serve``'s), and the process's resident memory
sampled over the run.

    python benchmarks/serve_load.py --model smollm2-135m --contexts 4 --tokens 1024 --clients 4 --requests 48 \
        --seconds 300 --max-tokens 8 --out results/serve_load.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import uvicorn

from criticalkv.budget import Budget
from criticalkv.eval.needle import build_needle_sample
from criticalkv.models import load_model
from criticalkv.serve.app import ServerSettings, create_app
from criticalkv.serve.store import ContextStore


def resident_mib() -> float:
    """This process's resident memory (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="critical-snapkv")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-memory", type=float, default=1024.0, help="MiB of contexts held in memory")
    parser.add_argument("--batch-window-ms", type=float, default=10.0, help="as criticalkv serve's")
    parser.add_argument("--max-batch", type=int, default=8, help="as criticalkv serve's (1: every request alone)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: as criticalkv serve reads it)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, device="cpu", dtype=args.dtype)
    with tempfile.TemporaryDirectory() as folder:
        store = ContextStore(model, Path(folder), int(args.max_memory * (1 << 20)))
        settings = ServerSettings(
            model,
            tokenizer,
            args.model,
            store,
            args.method,
            Budget.parse(args.budget),
            batch_window=args.batch_window_ms / 1000,
            max_batch=args.max_batch,
        )
        app = create_app(settings)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        try:
            report = run_load(url, args, tokenizer)
        finally:
            server.should_exit = True
            thread.join(timeout=60)
        report.update(batch_report(app.state.metrics.batches))
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


def batch_report(batches: Counter[int]) -> dict[str, object]:
    """The server's decodes by their rows (chat requests answered together) and the mean rows per decode."""
    decodes = batches.total()
    return {
        "decodes_by_rows": {str(rows): n for rows, n in sorted(batches.items())},
        "rows_per_decode_mean": sum(rows * n for rows, n in batches.items()) / decodes if decodes else None,
    }


def run_load(url: str, args: argparse.Namespace, tokenizer) -> dict[str, object]:
    timeout = httpx.Timeout(args.seconds + 60)
    contexts, questions = [], []
    for seed in range(args.contexts):
        sample = build_needle_sample(tokenizer, args.tokens, seed=seed)
        response = httpx.post(f"{url}/v1/contexts", json={"document": sample.context}, timeout=timeout)
        response.raise_for_status()
        contexts.append(response.json()["id"])
        questions.append(sample.question)
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    lock = threading.Lock()
    sent = 0
    start = time.perf_counter()
    deadline = start + args.seconds
    rss = [resident_mib()]

    def client(index: int) -> None:
        nonlocal sent
        with httpx.Client(timeout=timeout) as http:
            while True:
                with lock:
                    if sent >= args.requests or time.perf_counter() >= deadline:
                        return
                    number, sent = sent, sent + 1
                which = number % len(contexts)
                body = {
                    "model": args.model,
                    "messages": [{"role": "user", "content": questions[which]}],
                    "max_tokens": args.max_tokens,
                    "context_id": contexts[which],
                }
                tick = time.perf_counter()
                try:
                    status = str(http.post(f"{url}/v1/chat/completions", json=body).status_code)
                except httpx.HTTPError as error:
                    status = f"failed: {type(error).__name__}"
                with lock:
                    statuses[status] += 1
                    if status == "200":
                        latencies.append(time.perf_counter() - tick)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        time.sleep(0.5)
        rss.append(resident_mib())
    elapsed = time.perf_counter() - start
    answered = statuses.get("200", 0)
    return {
        "model": args.model,
        "method": args.method,
        "budget": args.budget,
        "dtype": args.dtype,
        "contexts": args.contexts,
        "context_tokens": args.tokens,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "batch_window_ms": args.batch_window_ms,
        "max_batch": args.max_batch,
        "requests": sum(statuses.values()),
        "statuses": dict(statuses),
        "seconds": elapsed,
        "requests_per_second": answered / elapsed,
        "latency_p50_seconds": percentile(latencies, 0.5) if latencies else None,
        "latency_p99_seconds": percentile(latencies, 0.99) if latencies else None,
        "rss_mib_start": rss[0],
        "rss_mib_max": max(rss),
        "rss_mib_end": rss[-1],
    }


if __name__ == "__main__":
    main()
