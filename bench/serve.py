"""Serving under load: a bounded load generator against `kvserve serve` on loopback, next to the offline engine.

At each concurrency (1, 8, 32) it keeps that many streaming completions in flight and records output
tokens/s, p50/p99 TTFT and inter-token latency. The offline engine's throughput at batch 1 and at the highest
concurrency is measured in this same run, on prompts alike; the last lines are the server's share of each (issue
16: one client should stream as fast as the offline engine decodes). One client and the offline engine at batch 1
take turns, `--rounds` times (both loaded, the idle one waiting): the machine's slow spells fall on both alike, and
the ratio is the median of the turns' ratios (medians taken apart could pair one's slow turn with the other's fast one).
Each line also gives the CPU a token took in the load generator and in the server's HTTP process (its engine runs in a
child process; on 2 cores both share the cores the engine computes on). `--stream-interval 1,4` runs a server for each
interval (`kvserve serve --stream-interval`: a request's tokens sent every N steps, merged), side by side in the
turns; ITL is then the gap between the events a client gets.

    python bench/serve.py [--concurrency 1,8,32] [--prompt-len 64] [--new-tokens 64] [--rounds 3] [--stream-interval 1]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import socket
import statistics
import subprocess
import sys
import time

import httpx

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_description


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


class Stream:
    """One streaming completion on a socket, parsed only as far as needed: an event with choices is an arrival (a
    step's tokens, or N steps' at a stream interval of N); only the last event, the usage, is decoded as JSON. On a
    2-core machine the load generator shares the cores the engine computes on: httpx's streaming took 350-410 us of
    CPU a token here, an asyncio connection that read chunk by chunk and decoded every event 190-256 us, this 123-164."""

    def __init__(self, host: str, port: int, prompt: list[int], new_tokens: int):
        body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        self.start, self.arrivals, self.usage, self.head, self.pending = time.perf_counter(), [], b"", None, b""
        self.sock = socket.create_connection((host, port))
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (host.encode(), len(body), body))

    def receive(self) -> bool:
        """Read what arrived (the socket is readable); False at the end of the response."""
        data = self.sock.recv(65536)
        now, self.pending = time.perf_counter(), self.pending + data
        if self.head is None:
            if b"\r\n\r\n" not in self.pending and data:
                return True
            self.head, _, self.pending = self.pending.partition(b"\r\n\r\n")
            if b" 200 " not in self.head.split(b"\r\n", 1)[0] or b"transfer-encoding: chunked" not in self.head.lower():
                raise SystemExit(f"the server answered {self.head.decode(errors='replace')!r}")
        *events, self.pending = self.pending.split(b"\n\n")  # an SSE event an HTTP chunk (the server sends them so)
        for event in events:
            event = event[event.find(b"data: {"):]  # past the chunk's size line
            if event.startswith(b"data: {"):
                if b'"choices": []' in event:
                    self.usage = event
                else:
                    self.arrivals.append(now)
        return bool(data)

    def result(self) -> tuple[float, list[float], int]:
        """TTFT, the gaps between tokens, and the tokens the usage counts."""
        self.sock.close()
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        return self.arrivals[0] - self.start, gaps, json.loads(self.usage[6:])["usage"]["completion_tokens"] if self.usage else 0


def run_streams(host: str, port: int, prompts: list[list[int]], new_tokens: int, concurrency: int) -> list[tuple]:
    """Each prompt's Stream result, `concurrency` streams at a time, all read on this thread as data arrives."""
    selector, waiting, results = selectors.DefaultSelector(), iter(prompts), []

    def open_next() -> None:
        if (prompt := next(waiting, None)) is not None:
            stream = Stream(host, port, prompt, new_tokens)
            selector.register(stream.sock, selectors.EVENT_READ, stream)
    for _ in range(concurrency):
        open_next()
    while selector.get_map():
        for key, _ in selector.select():
            if not key.data.receive():
                selector.unregister(key.fileobj)
                results.append(key.data.result())
                open_next()
    return results


def process_cpu(pid: int) -> float:
    """Seconds of CPU a process has used (Linux's /proc; NaN elsewhere)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def load(host: str, port: int, prompts: list[list[int]], new_tokens: int, concurrency: int, server_pid: int) -> dict:
    start, cpu, http = time.perf_counter(), time.process_time(), process_cpu(server_pid)
    results = run_streams(host, port, prompts, new_tokens, concurrency)
    seconds, cpu, http = time.perf_counter() - start, time.process_time() - cpu, process_cpu(server_pid) - http
    ttft = [r[0] for r in results]
    itl = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    return {"tokens_per_s": tokens / seconds, "ttft": ttft, "itl": itl, "client_us": cpu / max(tokens, 1) * 1e6,
            "http_us": http / max(tokens, 1) * 1e6}


def start_server(model: str, max_num_seqs: int, stream_interval: int) -> tuple[subprocess.Popen, int]:
    """A `kvserve serve` process on a free loopback port, once it answers; and the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--model", model, "--port", str(port),
                             "--max-num-seqs", str(max_num_seqs), "--stream-interval", str(stream_interval),
                             "--log-level", "warning"])
    deadline = time.time() + 900  # on a fresh install the server first compiles the kernels: minutes on 2 cores
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc, port
        except httpx.TransportError:
            time.sleep(0.5)
    if proc.poll() is None:
        proc.terminate()  # the server stops its engine process; a kill would leave it loading
        proc.wait()
    raise SystemExit(f"the server did not start (exit code {proc.returncode})")


def num_requests(concurrency: int) -> int:
    """Requests a run at this concurrency (or offline batch) sends: two rounds, at least four."""
    return max(4, 2 * concurrency)


def offline_rate(llm: LLM, prompts: list[list[int]], batch: int, new_tokens: int, warmup: list[int]) -> tuple[float, float]:
    """The offline engine's output tok/s on `prompts`, and the median gap between a request's outputs. Batch 1: one
    request at a time, streamed (as the server's one client gets them); else all at once. The warm-up prompt is none of
    `prompts`, as the server's is not: warmed on the first of them, the engine served that prompt from its prefix cache,
    and one request of each turn skipped its prefill."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([warmup], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start, gaps = time.perf_counter(), []
    if batch > 1:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start), float("nan")
    for prompt in prompts:
        arrivals = [time.perf_counter() for _ in llm.stream(prompt, params)]
        gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
    return len(prompts) * new_tokens / (time.perf_counter() - start), percentile(gaps, .5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream-interval", default="1", help="a server for each, e.g. 1,4")
    args = parser.parse_args()
    levels, intervals = [int(c) for c in args.concurrency.split(",")], [int(n) for n in args.stream_interval.split(",")]
    rng = random.Random(0)
    make = lambda n: [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(n)]  # noqa: E731

    top = max(levels)
    servers = {n: start_server(args.model, top, n) for n in intervals}
    llm = LLM(args.model, max_num_seqs=top)
    rows, offline, turns = [], {}, []  # rows: (interval, concurrency, requests, load's figures)
    serve = lambda n, prompts, c: load("127.0.0.1", servers[n][1], prompts, args.new_tokens, c, servers[n][0].pid)  # noqa: E731
    warmup = make(1)  # the same for both: a prompt none of the measured ones shares blocks with
    try:
        for n in intervals:
            serve(n, warmup, 1)  # warm-up, as the offline engine gets
        for c in levels:
            if c != 1:
                prompts = make(num_requests(c))
                rows += [(n, c, len(prompts), serve(n, prompts, c)) for n in intervals]
                continue
            for _ in range(args.rounds):  # one client and the offline engine at batch 1, in turns, on the same prompts
                prompts = make(num_requests(1))
                turns.append(({n: serve(n, prompts, 1) for n in intervals}, offline_rate(llm, prompts, 1, args.new_tokens, warmup[0])))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    if turns:
        rows[:0] = [(n, 1, num_requests(1), sorted((t[0][n] for t in turns), key=lambda r: r["tokens_per_s"])[len(turns) // 2])
                    for n in intervals]
        offline[1] = sorted((t[1] for t in turns), key=lambda o: o[0])[len(turns) // 2]
    if top not in offline:
        offline[top] = offline_rate(llm, make(num_requests(top)), top, args.new_tokens, warmup[0])

    print(f"\nprompts {args.prompt_len} tokens, {args.new_tokens} new tokens, streaming completions on loopback")
    print(f"CPU: {cpu_description()}")
    for n, c, k, r in rows:
        print(f"  stream interval {n}, concurrency {c:3d} ({k:3d} requests): {r['tokens_per_s']:7.1f} output tok/s   "
              f"TTFT p50 {percentile(r['ttft'], .5) * 1000:7.0f} ms  p99 {percentile(r['ttft'], .99) * 1000:7.0f} ms   "
              f"ITL p50 {percentile(r['itl'], .5) * 1000:6.2f} ms  p99 {percentile(r['itl'], .99) * 1000:6.2f} ms   "
              f"CPU a token: client {r['client_us']:4.0f} us, HTTP process {r['http_us']:4.0f} us")
    for batch, (rate, itl) in offline.items():
        streamed = f"   ITL p50 {itl * 1000:6.2f} ms" if batch == 1 else ""
        print(f"  offline engine, batch {batch:3d} ({num_requests(batch):3d} requests): {rate:7.1f} output tok/s{streamed}")
    for n in intervals if turns else []:
        print(f"  stream interval {n}: one client / offline batch 1, each of {len(turns)} turns: "
              + " ".join(f"{t[0][n]['tokens_per_s'] / t[1][0]:.2f}" for t in turns) + " (the lines above: medians)")
    for n, c, _, r in rows:
        if c == 1 and turns:
            rate = statistics.median(t[0][n]["tokens_per_s"] / t[1][0] for t in turns)
            itl = statistics.median(percentile(t[0][n]["itl"], .5) / t[1][1] for t in turns)
            print(f"ratio server (stream interval {n}) @ concurrency 1 / offline batch 1, median of the turns: {rate:.2f} tok/s, "
                  f"{itl:.2f} ITL p50")
        elif c in offline:
            print(f"ratio server (stream interval {n}) @ concurrency {c} / offline batch {c}: "
                  f"{r['tokens_per_s'] / offline[c][0]:.2f} tok/s")


if __name__ == "__main__":
    main()
