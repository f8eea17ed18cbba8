"""Run a draft in llama.cpp's server and compare its greedy text with the server's without it.

    python tools/llama_server_check.py --server build/bin/llama-server \
        --target demo.gguf --draft dspark.gguf --spec-type draft-dspark \
        --prompts ds4tools/data/demo/prompts.json --count 4 --tokens 48

For each prompt it starts the server twice (plain, then with ``-md DRAFT --spec-type ...``), sends
one /completion request (temperature 0, top_k 1, ``n_predict`` tokens, the prompt as token ids so
both runs see the same tokens) and prints whether the texts are identical and the server's draft
acceptance. Exit 0 when every text matches, 1 when one differs, 2 on bad usage or a server that
does not start (its log's last lines are printed: an abort such as llama.cpp's ``layer input
tensor is null`` shows there).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """llama-server in a child process, stopped on exit; its log goes to a temporary file."""

    def __init__(self, binary: str, target: str, extra: list[str], threads: int):
        self.port = _free_port()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [binary, "-m", target, "--port", str(self.port), "--host", "127.0.0.1",
               "-t", str(threads), "-c", "2048", "-np", "1", "--no-repack", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120.0) -> bool:
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.3)
        return False

    def tail(self, n: int = 6) -> str:
        """The log's assertion / error lines (an abort's backtrace buries them), else its end."""
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            lines = f.readlines()
        key = [ln for ln in lines if "GGML_ASSERT" in ln or "error" in ln.lower()]
        return "".join(key[-n:] or lines[-n:])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


def complete(server: Server, tokens: list[int], n: int) -> dict:
    body = {"prompt": tokens, "n_predict": n, "temperature": 0.0, "top_k": 1, "seed": 0,
            "cache_prompt": False, "return_tokens": True}
    return _post(server.port, "/completion", body, timeout=600)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="the llama-server binary")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--spec-type", default="draft-dspark")
    ap.add_argument("--prompts", required=True,
                    help="a JSON list of strings or of objects with 'prompt' or 'text'")
    ap.add_argument("--count", type=int, default=4, help="prompts used (the first N)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per prompt")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    for p in (args.server, args.target, args.draft, args.prompts):
        if not os.path.isfile(p):
            print(f"llama_server_check: {p}: no such file", file=sys.stderr)
            return 2
    with open(args.prompts) as f:
        prompts = [p.get("prompt", p.get("text")) if isinstance(p, dict) else p
                   for p in json.load(f)][:args.count]

    from ds4tools.engine.tokenizer import GGUFTokenizer  # the target's own, as ds4tools runs it
    from ds4tools.gguf_io.reader import open_gguf
    tok = GGUFTokenizer(open_gguf(args.target).metadata)
    ids = [tok.encode(p) for p in prompts]

    results = {}
    for label, extra in (("plain", []), ("draft", ["-md", args.draft, "--spec-type", args.spec_type])):
        with Server(args.server, args.target, extra, args.threads) as srv:
            if not srv.wait_ready():
                print(f"llama_server_check: llama-server ({label}) did not start; its log ends:\n"
                      f"{srv.tail()}", file=sys.stderr)
                return 2
            results[label] = []
            for t in ids:
                try:
                    results[label].append(complete(srv, t, args.tokens))
                except (urllib.error.URLError, ConnectionError, OSError) as e:
                    print(f"llama_server_check: llama-server ({label}) failed a request ({e}); "
                          f"its log ends:\n{srv.tail()}", file=sys.stderr)
                    return 2
    same = 0
    for i, (a, b) in enumerate(zip(results["plain"], results["draft"])):
        ok = a["content"] == b["content"]
        same += ok
        tim = b.get("timings", {})
        acc = (f"draft accepted {tim.get('draft_n_accepted')}/{tim.get('draft_n')}"
               if "draft_n" in tim else "no draft figures in the reply")
        print(f"prompt {i}: {'identical' if ok else 'DIFFERENT'} greedy text "
              f"({len(a.get('tokens', []))} tokens; {acc}; "
              f"{b.get('timings', {}).get('predicted_per_second', 0):.1f} t/s with the draft, "
              f"{a.get('timings', {}).get('predicted_per_second', 0):.1f} without)")
        if not ok:
            print(f"  plain: {a['content']!r}\n  draft: {b['content']!r}")
    print(f"{same}/{len(ids)} prompts identical with and without {os.path.basename(args.draft)}")
    return 0 if same == len(ids) else 1


if __name__ == "__main__":
    sys.exit(main())
