"""``ds4tools serve``: a real server on 127.0.0.1 (in this process on a free port, and once as the
``ds4tools serve`` command) talked to with the official ``openai`` client and raw HTTP.

Greedy answers equal ``ds4tools run`` / the Engine on the same prompt, with and without drafting
(--dspark, --mtp, --lookup on the demo's support files); a bounded load test; disconnects that
leave no slot busy; every bad input's status and error body; the API key; a full queue's 503."""
import http.client
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

import pytest

import ds4tools

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

DEMO = Path(ds4tools.__file__).parent / "data" / "demo"
pytestmark = pytest.mark.skipif(
    not (DEMO / "target" / "model.safetensors").exists() or not (DEMO / "dspark" / "model.safetensors").exists(),
    reason="the demo model (ds4tools/data/demo) is not installed")

PROMPTS = [p["text"] for p in json.loads((DEMO / "prompts.json").read_text())][:5]
TEMPLATE = ("{% if messages[0]['role'] != 'system' and messages[0]['role'] != 'user' %}"
            "{{ raise_exception('the first message must be from the system or the user') }}{% endif %}"
            "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}def {% endif %}")
KEY = "sekret-key-123"


# --- servers ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's GGUFs in a private cache: target, MTP head, DSpark draft."""
    from ds4tools.demo import demo_model_path, demo_support_path
    old = os.environ.get("DS4TOOLS_CACHE")
    cache = tmp_path_factory.mktemp("demo-cache")
    os.environ["DS4TOOLS_CACHE"] = str(cache)
    try:
        files = {"target": demo_model_path(progress=False), "cache": cache}
        for kind in ("mtp", "dspark"):
            files[kind] = demo_support_path(kind, progress=False)
    finally:
        if old is None:
            os.environ.pop("DS4TOOLS_CACHE")
        else:
            os.environ["DS4TOOLS_CACHE"] = old
    return files


@pytest.fixture(scope="module")
def ref(demo):
    """Plain greedy decoding with the Engine: (text, token count) of a prompt."""
    from ds4tools.engine import Engine
    eng = Engine(str(demo["target"]))
    memo = {}

    def greedy(prompt, n, **kw):
        key = (prompt, n, tuple(sorted(kw.items())))
        if key not in memo:
            toks = list(eng.generate(prompt, n, **{"temperature": 0.0, **kw}))
            memo[key] = ("".join(t.text for t in toks), len(toks))
        return memo[key]
    return greedy


class Server:
    """The app under uvicorn in a thread of this process, on a free port."""

    def __init__(self, **options):
        import uvicorn

        from ds4tools.serve import ServeOptions, build_app, load_state
        from ds4tools.serve.server import bind
        self.state = load_state(ServeOptions(**options))
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.state), log_level="error",
                                                    lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)

    def client(self, key="none", **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.state.pool.close()
        self.sock.close()


@pytest.fixture(scope="module")
def plain(demo, tmp_path_factory):
    tpl = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    tpl.write_text(TEMPLATE)
    s = Server(model=str(demo["target"]), parallel=4, queue=64, chat_template_file=str(tpl))
    yield s
    s.stop()


def _spec(kind, demo):
    from ds4tools.engine.speculative.config import SpecConfig
    return {"dspark": SpecConfig(mtp_file=str(demo["dspark"]), dspark=True),
            "mtp": SpecConfig(mtp_file=str(demo["mtp"]), mtp_draft=3),
            "lookup": SpecConfig(lookup=4)}[kind]


@pytest.fixture(scope="module", params=["dspark", "mtp", "lookup"])
def spec_server(request, demo):
    s = Server(model=str(demo["target"]), parallel=2, queue=8, spec=_spec(request.param, demo))
    s.kind = request.param
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cli_server(demo):
    """``ds4tools serve`` itself: an API key, one slot, no queue."""
    env = dict(os.environ, DS4TOOLS_CACHE=str(demo["cache"]))
    proc = subprocess.Popen([sys.executable, "-m", "ds4tools.cli", "serve", "-m", str(demo["target"]),
                             "--port", "0", "--api-key", KEY, "--parallel", "1", "--queue", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url, lines = None, []
    deadline = time.time() + 120
    while url is None and time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            url = m.group(1)
    assert url, "ds4tools serve did not start:\n" + "".join(lines)
    drain = threading.Thread(target=proc.stderr.read, daemon=True)  # keep the pipe drained
    drain.start()
    yield url
    proc.terminate()
    try:
        assert proc.wait(15) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        drain.join(5)
        proc.stderr.close()


class Reply:
    def __init__(self, status, headers, body: bytes):
        self.status_code, self.headers, self.content = status, headers, body
        self.text = body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)


def _http(method, url, *, json_body=None, content=None, headers=None, timeout=30) -> Reply:
    """One raw HTTP request (the standard library's client)."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    path = "/" + url.split("//", 1)[1].split("/", 1)[1] if url.count("/") > 2 else "/"
    if json_body is not None:
        content = json.dumps(json_body).encode()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=content, headers=headers or {})
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def _health(url):
    return _http("GET", url + "/health").json()


def _metric(url, name, key=None, label=""):
    """The sum of a metric's samples (those whose labels hold ``label``)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = _http("GET", url + "/metrics", headers=headers).text
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(f"ds4tools_{name}{{") or line.startswith(f"ds4tools_{name} ")) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_idle(url, timeout=10.0):
    deadline = time.time() + timeout
    while True:
        h = _health(url)
        if h["slots_busy"] == 0 and h["queue_waiting"] == 0:
            return h
        assert time.time() < deadline, f"slots still busy: {h}"
        time.sleep(0.05)


def _complete(client, prompt, n, stream=False, **kw):
    """(text, completion_tokens, finish_reason, ds4tools extension) of one completion."""
    MODEL = client.models.list().data[0].id
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **kw)
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason, r.model_extra["ds4tools"]
    text, usage, finish, ext, done = [], None, None, None, 0
    for ch in client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                        stream=True, stream_options={"include_usage": True}, **kw):
        if ch.choices:
            text.append(ch.choices[0].text)
            if ch.choices[0].finish_reason:
                finish, ext = ch.choices[0].finish_reason, ch.model_extra["ds4tools"]
                done += 1
        else:
            usage = ch.usage
    assert done == 1 and usage is not None
    return "".join(text), usage.completion_tokens, finish, ext


# --- greedy equals run -----------------------------------------------------------------------------

def test_models_and_health(plain):
    models = plain.client().models.list()
    assert [m.id for m in models.data] == [Path(plain.state.pool.engines[0].path).stem]
    h = _health(plain.url)
    assert (h["status"], h["slots_total"], h["slots_busy"]) == ("ok", 4, 0)


def test_completion_equals_run(plain, demo):
    from ds4tools.engine.run import run
    out = BytesIO()
    with open(os.devnull, "w") as err:
        assert run(model=str(demo["target"]), prompt=PROMPTS[0], n_predict=40, temp=0, as_json=True,
                   stdout=out, stderr=err) == 0
    doc = json.loads(out.getvalue())
    client = plain.client()
    name = client.models.list().data[0].id
    for stream in (False, True):
        r = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                      stream=stream)
        if stream:
            text = "".join(c.choices[0].text for c in r if c.choices)
        else:
            text = r.choices[0].text
            assert r.usage.completion_tokens == len(doc["tokens"])
            assert r.usage.prompt_tokens == doc["stats"]["prompt_tokens"]
            assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
            assert r.model_extra["ds4tools"]["speculative"] is None
        assert text == doc["text"]


def test_chat_equals_engine(plain, ref):
    import jinja2
    messages = [{"role": "system", "content": "Python"}, {"role": "user", "content": "a parser"}]
    rendered = jinja2.Environment().from_string(TEMPLATE).render(messages=messages, add_generation_prompt=True)
    want, n = ref(rendered, 32)
    client = plain.client()
    r = client.chat.completions.create(model=client.models.list().data[0].id,
                                       messages=messages, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == n
    parts, roles, usage = [], [], None
    for ch in client.chat.completions.create(model=r.model, messages=messages, max_tokens=32, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            d = ch.choices[0].delta
            roles.append(d.role)
            parts.append(d.content or "")
        else:
            usage = ch.usage
    assert "".join(parts) == want and roles[0] == "assistant" and usage.completion_tokens == n


def test_stop_and_seed(plain, ref, demo):
    client = plain.client()
    want, _ = ref(PROMPTS[1], 48)
    stop = want[10:13]
    for stream in (False, True):
        text, _, finish, ext = _complete(client, PROMPTS[1], 48, stream=stream, stop=[stop, "@@never@@"])
        assert text == want[:want.index(stop)] and finish == "stop"
        assert ext["stop_reason"] == "stop_sequence"
    # sampling with a seed: repeatable, and the Engine's own draw with the same settings
    from ds4tools.engine import Engine
    eng = Engine(str(demo["target"]))
    want = "".join(t.text for t in eng.generate(PROMPTS[2], 24, temperature=0.9, top_k=0, top_p=0.9,
                                                min_p=0.0, seed=1234))
    got = [client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[2],
                                     max_tokens=24, temperature=0.9, top_p=0.9, seed=1234).choices[0].text
           for _ in range(2)]
    assert got == [want, want]


def test_speculative_equals_plain(spec_server, ref):
    client = spec_server.client()
    drafted = accepted = 0
    for i, prompt in enumerate(PROMPTS[:3]):
        want, n = ref(prompt, 48)
        text, count, finish, ext = _complete(client, prompt, 48, stream=bool(i % 2))
        assert (text, count) == (want, n)
        sp = ext["speculative"]
        assert sp["method"] and sp["drafted"] >= sp["accepted"] >= 0 and sp["tau"] >= 1.0
        drafted += sp["drafted"]
        accepted += sp["accepted"]
    assert drafted > 0 and accepted > 0
    assert _metric(spec_server.url, "speculative_accepted_tokens_total") >= accepted
    assert 0 < _metric(spec_server.url, "speculative_acceptance_ratio") <= 1


def test_engine_clone(demo, ref):
    """Engine.clone: the same weights and tokenizer, its own cache and drafter; clones
    interleaved token by token give each what it gives alone."""
    from ds4tools.engine import Engine
    eng = Engine(str(demo["target"]), spec=_spec("mtp", demo))
    other = eng.clone()
    assert other.weights is eng.weights and other.tokenizer is eng.tokenizer
    assert other.model is not eng.model and other.cache is not eng.cache
    assert other.drafter is not eng.drafter and other.drafter.name == eng.drafter.name
    a = eng.generate(PROMPTS[0], 40, temperature=0)
    b = other.generate(PROMPTS[1], 40, temperature=0)
    ta, tb = [], []
    for x, y in itertools.zip_longest(a, b):  # turn by turn
        ta.append(x.text if x else "")
        tb.append(y.text if y else "")
    assert "".join(ta) == ref(PROMPTS[0], 40)[0] and "".join(tb) == ref(PROMPTS[1], 40)[0]
    other.close()
    assert list(eng.generate(PROMPTS[0], 4, temperature=0))  # the original still runs
    eng.close()


# --- load, disconnects ---------------------------------------------------------------------------

def test_load_16_clients(plain, ref):
    """16 clients x 5 requests at once (4 slots): every answer complete, each equal to the same
    request served alone and to plain greedy decoding."""
    client = plain.client()
    reqs = [(PROMPTS[i % 5], 12 + 4 * (i % 3), bool(i % 2)) for i in range(15)]
    alone = {r: _complete(client, *r)[:3] for r in reqs}
    for (prompt, n, _), (text, count, _) in alone.items():
        assert (text, count) == ref(prompt, n)

    def worker(c):
        cl = plain.client()
        return [(r, _complete(cl, *r)[:3]) for r in (reqs[(c + j) % len(reqs)] for j in range(5))]

    t0 = time.time()
    with ThreadPoolExecutor(16) as ex:
        results = [x for batch in ex.map(worker, range(16)) for x in batch]
    assert len(results) == 80
    for r, got in results:
        assert got == alone[r]
        assert got[2] in ("length", "stop")
    assert time.time() - t0 < 60
    _wait_idle(plain.url)


def test_disconnect_frees_slots(plain):
    url = plain.url
    before = _metric(url, "generated_tokens_total")
    cancelled = _metric(url, "generations_total", label='end="cancelled"')
    n = 900
    streams = []
    for i in range(6):  # more than the 4 slots: two wait in the queue, then go away too
        s = plain.client().completions.create(model=plain.state.model_id, prompt=PROMPTS[i % 5],
                                              max_tokens=n, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
        streams.append(s)
    for s in streams[:4]:
        next(iter(s))  # generating
    for s in streams:
        s.close()
    _wait_idle(url)
    time.sleep(0.3)
    assert _metric(url, "generations_total", label='end="cancelled"') == cancelled + 6
    assert _metric(url, "generated_tokens_total") - before < 4 * n / 2  # stopped early
    # the slots work afterwards
    text, _, _, _ = _complete(plain.client(), PROMPTS[0], 8)
    assert text


def test_non_stream_disconnect(plain):
    """A plain (non-streaming) request whose client times out is cancelled too."""
    url = plain.url
    before = _metric(url, "generated_tokens_total")
    cancelled = _metric(url, "generations_total", label='end="cancelled"')
    with pytest.raises(TimeoutError):
        _http("POST", url + "/v1/completions", json_body={"prompt": PROMPTS[0], "max_tokens": 900,
                                                          "ignore_eos": True, "temperature": 0}, timeout=0.3)
    _wait_idle(url)
    assert _metric(url, "generations_total", label='end="cancelled"') == cancelled + 1
    assert _metric(url, "generated_tokens_total") - before < 900


# --- bad input -----------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", b"{bad json", None, "invalid_json"),
    ("/v1/completions", b"", None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", None, "invalid_json"),
    ("/v1/completions", b"\xff\xfe", None, "invalid_json"),
    ("/v1/completions", {"max_tokens": 4}, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": 5}, "prompt", "invalid_type"),
    ("/v1/completions", b'{"prompt": "a \\ud800 b"}', None, "invalid_value"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature", "invalid_value"),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, None, "invalid_json"),
    ("/v1/completions", {"prompt": [1, 2, 3]}, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": ""}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x " * 1500, "max_tokens": 4}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": "1"}, "seed", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "seed": -5}, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "model": 7}, "model", "invalid_type"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": []}, "messages", "invalid_value"),
    ("/v1/chat/completions", {}, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "hi"}]}, "messages",
     "chat_template_error"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9999},
     "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 1500}]}, "messages",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("path,body,param,code", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input(plain, path, body, param, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json_body": body}
    r = _http("POST", plain.url + path, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert (err["param"], err["code"]) == (param, code)


def test_bad_input_leaves_server_up(plain):
    r = _http("GET", plain.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = _http("GET", plain.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.BadRequestError) as e:
        plain.client().completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.status_code == 400 and e.value.code == "model_not_found"
    assert _health(plain.url)["status"] == "ok"
    assert _complete(plain.client(), PROMPTS[0], 4)[0]


# --- the command: API key, no template, full queue ---------------------------------------------

def test_api_key(cli_server):
    url = cli_server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Bearer {KEY}x"}):
        r = _http("POST", url + "/v1/completions", json_body={"prompt": "x", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert _http("GET", url + "/v1/models").status_code == 401
    assert _http("GET", url + "/metrics").status_code == 401
    assert _health(url)["status"] == "ok"  # no key needed
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id
    assert client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[0],
                                     max_tokens=4, temperature=0).usage.completion_tokens == 4
    # the demo has no chat template: a clear 400
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=client.models.list().data[0].id,
                                       messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "no_chat_template" and "chat template" in str(e.value)


def test_full_queue_503(cli_server):
    url = cli_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    s = client.completions.create(model=client.models.list().data[0].id,
                                  prompt=PROMPTS[0], max_tokens=900, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(s))  # the one slot is generating; the queue holds none
    r = _http("POST", url + "/v1/completions", json_body={"prompt": "x", "max_tokens": 2},
              headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "server_busy"
    s.close()
    _wait_idle(url)
    assert _metric(url, "requests_rejected_total", KEY) == 1
    r = _http("POST", url + "/v1/completions", json_body={"prompt": "x", "max_tokens": 2},
              headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# --- pieces --------------------------------------------------------------------------------------

def test_stop_scanner_holds_back_partial_stops():
    from ds4tools.serve.slots import StopScanner
    s = StopScanner(["END", "xyz"])
    shown = [s.feed(t) for t in ["ab", "cE", "N", "x", "Q", "E", "ND"]]
    assert shown == ["ab", "c", "", "EN", "xQ", "", ""] and s.hit
    s = StopScanner(["END"])
    assert "".join(s.feed(t) for t in ["a", "EN"]) + s.flush() == "aEN" and not s.hit
    assert StopScanner([]).feed("END") == "END"


def test_strict_server_refuses_sampling():
    from ds4tools.serve.errors import APIError
    from ds4tools.serve.requests import parse_completion

    class Server:
        model_id, model_names, n_ctx, template, greedy_only = "m", {"m"}, 64, None, True

        def count_tokens(self, text):
            return len(text.split())

    assert parse_completion({"prompt": "a b", "temperature": 0}, Server()).max_tokens == 16
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "a b"}, Server())  # OpenAI's default temperature is 1
    assert e.value.status == 400 and e.value.param == "temperature"
