"""A bounded load run of ``llmcore serve``: concurrent streaming clients on loopback.

Exports the tiny nanoGPT (random weights; a chat template is added beside it), starts the
server as a subprocess, and runs ``--clients`` threads of ``--requests`` streamed chat
completions each through the ``openai`` package. Prints throughput, time to first token and
request latency (p50 / p99) and the server's peak RSS, and fails unless every request
completed within ``--time-limit`` seconds and the server's greedy reply to one more request is
the one ``llmcore.load(...).chat`` gives on the same program in this process. ``--pte`` serves
a program already written (its tokenizer and chat template beside it) instead of the tiny
one: a large model's serving cost. Run nothing else beside it.

    .venv/bin/python benchmarks/bench_serve.py
    .venv/bin/python benchmarks/bench_serve.py --clients 16 --requests 4 --max-tokens 32 --parallel 2
    .venv/bin/python benchmarks/bench_serve.py --pte llama-3.1-8b.pte --clients 2 --requests 1 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_decode import machine_header  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
# the request whose greedy reply is checked against the program run in this process
CHECK_MESSAGES = [{"role": "user", "content": "Name three colours."}]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=1, help="the server's program instances")
    parser.add_argument("--time-limit", type=float, default=300.0)
    parser.add_argument("--pte", help="serve this program (default: export the tiny nanoGPT)")
    args = parser.parse_args()
    import openai

    if args.pte:
        pte = Path(args.pte).resolve()
    else:
        work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
        pte = work / "tiny.pte"
        subprocess.run([sys.executable, "-m", "llmcore", "export", "--model", "nanogpt", "--config", "tiny",
                        "--plugins", "xnnpack", "--quiet", "-o", str(pte)], check=True, stdout=subprocess.DEVNULL)
        (work / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    model = pte.stem
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "llmcore", "serve", str(pte), "--port", str(port),
                               "--parallel", str(args.parallel), "--max-queue", str(args.clients)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        results, errors = [], []
        lock = threading.Lock()

        def client(index: int) -> None:
            api = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=args.time_limit)
            for r in range(args.requests):
                start = time.perf_counter()
                first, tokens = None, 0
                try:
                    stream = api.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": f"client {index} request {r}"}],
                        max_tokens=args.max_tokens, temperature=0, stream=True,
                        stream_options={"include_usage": True})
                    for chunk in stream:
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter() - start
                        if chunk.usage is not None:
                            tokens = chunk.usage.completion_tokens
                except Exception as exc:  # noqa: BLE001 - every failure is counted and printed
                    with lock:
                        errors.append(f"client {index} request {r}: {exc}")
                    continue
                with lock:
                    results.append((first if first is not None else time.perf_counter() - start,
                                    time.perf_counter() - start, tokens))

        began = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(1.0, args.time_limit - (time.perf_counter() - began)))
        wall = time.perf_counter() - began
        metrics = json.loads(urllib.request.urlopen(base + "/metrics").read())
        api = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=args.time_limit)
        served = api.chat.completions.create(model=model, messages=CHECK_MESSAGES, max_tokens=args.max_tokens,
                                             temperature=0).choices[0].message.content
        server_peak_mib = peak_rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    import llmcore  # the same program in this process, once the server has given its memory back

    expected_reply = llmcore.load(pte).chat(CHECK_MESSAGES, max_new_tokens=args.max_tokens).text

    expected = args.clients * args.requests
    print(machine_header())
    print(f"# llmcore serve, {model}, {args.parallel} instance(s); {args.clients} clients x {args.requests} "
          f"streamed requests, {args.max_tokens} tokens max each, loopback")
    if results:
        ttft = [r[0] for r in results]
        latency = [r[1] for r in results]
        tokens = sum(r[2] for r in results)
        print(f"completed {len(results)}/{expected} in {wall:.2f} s: {len(results) / wall:.1f} requests/s, "
              f"{tokens / wall:.0f} generated tokens/s")
        print(f"time to first token  p50 {1000 * statistics.median(ttft):.1f} ms, "
              f"p99 {1000 * percentile(ttft, 0.99):.1f} ms")
        print(f"request latency      p50 {1000 * statistics.median(latency):.1f} ms, "
              f"p99 {1000 * percentile(latency, 0.99):.1f} ms")
    print(f"server peak RSS {server_peak_mib:.0f} MiB; program {pte.stat().st_size / 2**20:.1f} MiB")
    print(f"server metrics: {json.dumps(metrics)}")
    for e in errors[:10]:
        print("error:", e)
    same = served == expected_reply
    print(f"greedy reply {'the same as' if same else 'NOT the same as'} llmcore.load().chat's: {served!r}"
          + ("" if same else f" against {expected_reply!r}"))
    ok = len(results) == expected and not errors and wall <= args.time_limit and same
    print("every request completed" if ok else f"FAILED: {len(results)}/{expected} completed, {len(errors)} errors"
          + ("" if same else ", the served reply differs"))
    return 0 if ok else 1


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), or NaN where /proc has none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


if __name__ == "__main__":
    sys.exit(main())
