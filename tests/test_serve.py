"""lp.serve end to end: real servers on localhost driven by the real ``openai`` client.

One server in one process and one with 2 gloo workers under torchrun, each started once
per module as a subprocess (and killed at teardown). Checks: greedy chat and completions,
streamed and not, equal transformers greedy ``generate`` on the same chat-templated ids
token for token (and the offline CLI's ``lp.generate.run``); streamed deltas concatenate
to the non-streamed content; stop strings (cut before the stop, finish_reason "stop");
usage; OpenAI-style 400s for bad input with the server still serving; a client that
disconnects mid-stream cancels its generation; a full queue answers 429 with Retry-After;
/health, /v1/models, /metrics; a clean shutdown; under LP (continuous batching too),
3 concurrent requests equal generate and a killed worker ends the whole server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import hf_greedy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent

M = 32  # new tokens per greedy check
CHAT = [
    "List three uses of a hash map, one line each.",
    "What is the capital of France? Answer in one sentence.",
]
RAW = 'def running_mean(xs):\n    """Return the running mean of the list xs."""\n'
KEY = "unused"  # server.api_key of the one-process server (the openai clients send it)
AUTH = {"authorization": f"Bearer {KEY}"}
BATCH = 3  # server.max_batch of the one-process server
SERVER_ARGS = ["model.dtype=float32", "server.max_tokens=8192", "server.max_W=8", "server.log_level=warning"]


# ---------------------------------------------------------------------------
# servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cmd: list[str], port: int, workdir: Path, env: dict):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "w")
        # own session: teardown signals the whole tree (torchrun and its workers)
        self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float = 300) -> None:
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            assert self.proc.poll() is None, f"server exited ({self.proc.returncode}):\n{self.log()[-3000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"server not healthy within {timeout} s:\n{self.log()[-3000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        try:  # anything left in the session (a worker torchrun did not reap)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        return self.proc.returncode

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300, **kw)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


def start(tmp_path_factory, name: str, workers: int, extra: list[str], torchrun_args: tuple = ()) -> Server:
    port = free_port()
    workdir = tmp_path_factory.mktemp(name)
    env = dict(os.environ, OMP_NUM_THREADS="1" if workers > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
               PYTHONPATH=str(ROOT))
    args = [f"server.port={port}", *SERVER_ARGS, *extra]
    if workers == 1:
        cmd = [sys.executable, "-m", "lp.serve", "model.threads=2", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
               *torchrun_args, "-m", "lp.serve", f"parallel.workers={workers}", "model.threads=1", *args]
    server = Server(cmd, port, workdir, env)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    # continuous batching, 3 at a time; the key is the one the tests' openai clients send
    server = start(tmp_path_factory, "serve1", 1, ["server.max_queue=1", f"server.max_batch={BATCH}",
                                                   "server.kv_tokens=8192", f"server.api_key={KEY}"])
    yield server
    server.stop()


LP_TIMEOUT_S = 20  # parallel.timeout_s of the LP server


@pytest.fixture(scope="module")
def lp2(tmp_path_factory):
    # torchrun polls its workers every 5 s (not 0.1 s): when a worker dies, rank 0's own
    # detection (a failed collective) must end the server, not torchrun's SIGTERM
    server = start(tmp_path_factory, "serve_lp2", 2, [f"parallel.timeout_s={LP_TIMEOUT_S}", "server.heartbeat_s=2"],
                   torchrun_args=("--monitor-interval=5",))
    yield server
    server.stop()


# ---------------------------------------------------------------------------
# references: transformers greedy generate on the same ids


@pytest.fixture(scope="module")
def refs(smollm2):
    from lp.generate import eos_ids

    model, tok = smollm2
    eos = eos_ids(model, tok)
    out = {}
    for text in CHAT:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out[text] = (ids, hf_greedy(model, ids, M, eos_token_id=eos))
    ids = tok(RAW)["input_ids"]
    out[RAW] = (ids, hf_greedy(model, ids, M, eos_token_id=eos))
    return out, tok, eos


def expected(refs, text):
    table, tok, eos = refs
    ids, new = table[text]
    finish = "stop" if new and new[-1] in eos else "length"
    return ids, new, tok.decode(new, skip_special_tokens=True), finish


def chat_create(server, text, **kw):
    kw.setdefault("max_tokens", M)
    kw.setdefault("temperature", 0)
    return server.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": text}], **kw)


def stream_chat(server, text, **kw):
    """(concatenated content, finish_reason, usage, lookahead, number of content chunks)."""
    kw.setdefault("max_tokens", M)
    kw.setdefault("temperature", 0)
    stream = server.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": text}], stream=True,
        stream_options={"include_usage": True}, **kw)
    parts, finish, use, la, n = [], None, None, None, 0
    for ch in stream:
        if ch.usage is not None:
            use = ch.usage
        if ch.choices:
            c = ch.choices[0]
            if c.delta.content:
                parts.append(c.delta.content)
                n += 1
            if c.finish_reason:
                finish = c.finish_reason
                la = (ch.model_extra or {}).get("lookahead")
    return "".join(parts), finish, use, la, n


# ---------------------------------------------------------------------------
# one process


def test_health_models_and_offline_cli(one, refs, smollm2):
    h = httpx.get(one.url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["workers"] == 1
    models = one.client().models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    # the offline CLI's run() gives the same greedy tokens as generate (and as the server, below)
    from lp.config import DecodingConfig, GenerateConfig, ModelConfig
    from lp.generate import run

    ids, new, text, _ = expected(refs, CHAT[0])
    res = run(GenerateConfig(model=ModelConfig(dtype="float32"), decoding=DecodingConfig(max_new_tokens=M),
                             prompt=CHAT[0], stream=False))
    assert res["prompt_ids"] == ids
    assert res["output_ids"] == new
    assert res["text"] == text
    # decoding.mode=ar: lp's own step, one token and one row a step; hf: transformers generate
    for mode in ("ar", "hf"):
        res = run(GenerateConfig(model=ModelConfig(dtype="float32"), prompt=CHAT[0], stream=False,
                                 decoding=DecodingConfig(max_new_tokens=M, mode=mode)))
        assert res["output_ids"] == new and res["mode"] == mode, mode
        if mode == "ar":
            assert res["steps"] == len(new) and res["mean_rows"] == 1.0, res


@pytest.mark.parametrize("i", range(len(CHAT)))
def test_chat_greedy_equals_generate(one, refs, i):
    ids, new, text, finish = expected(refs, CHAT[i])
    r = chat_create(one, CHAT[i], extra_body={"lookahead": {"return_token_ids": True}})
    la = r.model_extra["lookahead"]
    assert la["output_ids"] == new  # exact tokens
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(new),
                                                                                        len(ids) + len(new))
    assert r.model == "smollm2" and r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert la["steps"] >= 1 and la["steps"] <= len(new)
    assert la["compression_ratio"] == pytest.approx(len(new) / la["steps"], abs=1e-3)
    assert la["decode_time_s"] > 0 and la["workers"] == 1


def test_chat_stream_equals_non_stream(one, refs):
    ids, new, text, finish = expected(refs, CHAT[0])
    content, fin, use, la, n = stream_chat(one, CHAT[0])
    assert content == text
    assert fin == finish
    assert n > 1  # really streamed, not one final blob
    assert (use.prompt_tokens, use.completion_tokens) == (len(ids), len(new))
    assert la["steps"] >= 1


def test_completions_greedy_stream_and_not(one, refs):
    ids, new, text, finish = expected(refs, RAW)
    c = one.client()
    r = c.completions.create(model="smollm2", prompt=RAW, max_tokens=M, temperature=0,
                             extra_body={"lookahead": {"return_token_ids": True}})
    assert r.model_extra["lookahead"]["output_ids"] == new
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(new))
    parts, fin = [], None
    for ch in c.completions.create(model="smollm2", prompt=RAW, max_tokens=M, temperature=0, stream=True):
        parts.append(ch.choices[0].text)
        fin = ch.choices[0].finish_reason or fin
    assert "".join(parts) == text and fin == finish
    # token-id prompts are accepted too
    r2 = c.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == expected_prefix(refs, RAW, 8)


def greedy_text(smollm2, text, k):
    """transformers greedy generate's text for a chat prompt (k new tokens, the model's eos)."""
    from lp.generate import eos_ids

    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tok.decode(hf_greedy(model, ids, k, eos_token_id=eos_ids(model, tok)), skip_special_tokens=True)


def expected_prefix(refs, text, k):
    table, tok, _ = refs
    return tok.decode(table[text][1][:k], skip_special_tokens=True)


def test_stop_strings(one, refs):
    ids, new, text, _ = expected(refs, CHAT[0])
    words = re.findall(r"[A-Za-z]{4,}", text)
    stop = words[len(words) // 2]  # a word in the middle of the greedy text
    want = text[: text.find(stop)]
    r = chat_create(one, CHAT[0], stop=[stop, "\u2603never"])
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < len(new)
    content, fin, _, _, _ = stream_chat(one, CHAT[0], stop=stop)
    assert (content, fin) == (want, "stop")


SAMPLED_SHAPE = {"W": 4, "N": 4, "G": 4}  # explicit: the paper's pool, as the CLI's decoding.W/N/G give


def cli_sample(text: str, raw: bool, max_new: int, **sampling) -> list[int]:
    """The offline CLI's (lp.generate.run) tokens for one sampled prompt, one process."""
    from lp.config import DecodingConfig, GenerateConfig, ModelConfig
    from lp.generate import run

    dec = DecodingConfig(max_new_tokens=max_new, do_sample=True, **SAMPLED_SHAPE, **sampling)
    return run(GenerateConfig(model=ModelConfig(dtype="float32"), decoding=dec, prompt=text, raw_prompt=raw,
                              stream=False))["output_ids"]


def test_sampling_honours_seed_temperature_top_p_and_equals_the_cli(one, refs):
    k = 12  # new tokens per sampled request
    greedy = expected_prefix(refs, CHAT[1], k)
    la = dict(SAMPLED_SHAPE, return_token_ids=True)

    def sample(seed, top_k=None, **kw):
        kw.setdefault("temperature", 1.0)
        body = {"lookahead": la} if top_k is None else {"lookahead": la, "top_k": top_k}
        r = chat_create(one, CHAT[1], seed=seed, max_tokens=k, extra_body=body, **kw)
        return r.choices[0].message.content, r.model_extra["lookahead"]["output_ids"]

    free = [sample(s) for s in (1, 2, 3)]
    assert len({text for text, _ in free}) >= 2, free  # the seed is used
    assert free[0][0] != greedy, free[0]  # and sampling is on
    assert sample(1) == free[0]  # reproducible
    # the same seed with a near-zero temperature, or a top_p that keeps only the top token: greedy
    assert sample(1, temperature=0.05)[0] == greedy
    assert sample(1, top_p=0.01)[0] == greedy
    # the same seed and settings as the offline CLI: the same tokens
    got = sample(7, temperature=0.9, top_p=0.95, top_k=50)[1]
    assert got == cli_sample(CHAT[1], False, k, temperature=0.9, top_p=0.95, top_k=50, seed=7)


def _chat_body(**kw):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(kw)
    return body


BAD = [
    ("invalid_json", b'{"model": "smollm2", "messages": [', None),
    ("not_an_object", b"[1, 2]", None),
    ("unknown_model", _chat_body(model="gpt-4"), "model"),
    ("empty_messages", _chat_body(messages=[]), "messages"),
    ("missing_messages", {"model": "smollm2"}, "messages"),
    ("max_tokens_zero", _chat_body(max_tokens=0), "max_tokens"),
    ("max_completion_tokens_negative", _chat_body(max_completion_tokens=-3), "max_completion_tokens"),
    ("temperature_negative", _chat_body(temperature=-0.5), "temperature"),
    ("top_p_zero", _chat_body(top_p=0), "top_p"),
    ("top_p_above_one", _chat_body(top_p=1.5), "top_p"),
    ("n_too_many", _chat_body(n=9), "n"),  # above server.max_n (n > 1: tests/test_serve_n.py)
    ("W_over_limit", _chat_body(lookahead={"W": 9}), "lookahead.W"),
    ("N_below_two", _chat_body(lookahead={"N": 1}), "lookahead.N"),
    ("G_over_limit", _chat_body(lookahead={"G": 999}), "lookahead.G"),
    ("lookahead_unknown_key", _chat_body(lookahead={"X": 1}), "lookahead.X"),
    ("context_exceeded", _chat_body(max_tokens=8192), "max_tokens"),
    ("type_temperature_string", _chat_body(temperature="hot"), "temperature"),
    ("type_max_tokens_float", _chat_body(max_tokens=1.5), "max_tokens"),
    ("type_max_tokens_bool", _chat_body(max_tokens=True), "max_tokens"),
    ("type_stream_string", _chat_body(stream="yes"), "stream"),
    ("type_messages_string", _chat_body(messages="hi"), "messages"),
    ("type_stop_int", _chat_body(stop=5), "stop"),
    ("type_W_string", _chat_body(lookahead={"W": "3"}), "lookahead.W"),
    ("bad_role", _chat_body(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
    ("lone_surrogate_stop", b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', None),
    ("empty_stop", _chat_body(stop=[""]), "stop"),
    ("too_many_stops", _chat_body(stop=["a", "b", "c", "d", "e"]), "stop"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_chat_request_is_400(one, name, body, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(one.url + "/v1/chat/completions", content=data,
                   headers={"content-type": "application/json", **AUTH}, timeout=30)
    assert r.status_code == 400, (name, r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, (name, err)


def test_bad_completion_requests_and_openai_client_errors(one):
    import openai

    for body, param in [({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                        ({"prompt": [1, -4]}, "prompt"), ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
                        ({"prompt": "x", "seed": 2**70}, "seed"), ({"prompt": "x", "temperature": 3}, "temperature"),
                        ({"prompt": "x\ud800"}, None)]:
        r = httpx.post(one.url + "/v1/completions", content=json.dumps(body).encode(),
                       headers={"content-type": "application/json", **AUTH}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    with pytest.raises(openai.BadRequestError) as e:
        chat_create(one, "hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    # still healthy and serving
    assert httpx.get(one.url + "/health", timeout=10).status_code == 200
    assert chat_create(one, "hi", max_tokens=2).usage.completion_tokens >= 1


def test_client_disconnect_cancels_generation(one, refs):
    before = one.metrics().get('lp_requests_total{endpoint="chat",outcome="cancelled"}', 0.0)
    stream = one.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        max_tokens=2000, temperature=0, stream=True)
    got = 0
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            got += 1
            if got == 3:
                break
    stream.close()  # the client goes away mid-stream
    t = time.monotonic()
    while one.metrics().get('lp_requests_total{endpoint="chat",outcome="cancelled"}', 0.0) < before + 1:
        assert time.monotonic() - t < 30, "the generation was not cancelled"
        time.sleep(0.2)
    m = one.metrics()
    assert m["lp_running_requests"] == 0 and m["lp_kv_blocks_in_use"] == 0  # its blocks are free
    # the next request starts and matches the reference
    _, new, text, _ = expected(refs, CHAT[1])
    assert chat_create(one, CHAT[1]).choices[0].message.content == text


def test_non_streaming_client_disconnect_cancels_generation(one):
    """A non-streaming client that goes away (its read timeout) cancels its generation within
    seconds, not after max_tokens; its K/V blocks are free."""
    key = 'lp_requests_total{endpoint="chat",outcome="cancelled"}'
    before = one.metrics().get(key, 0.0)
    body = _chat_body(messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
                      max_tokens=2000, temperature=0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(one.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=httpx.Timeout(30, read=3))
    t = time.monotonic()
    while one.metrics().get(key, 0.0) < before + 1:
        assert time.monotonic() - t < 20, "the generation of a client that went away was not cancelled"
        time.sleep(0.2)
    m = one.metrics()
    assert m["lp_running_requests"] == 0 and m["lp_kv_blocks_in_use"] == 0


def test_full_queue_is_429_with_retry_after(one, smollm2):
    import openai

    c = one.client()
    long_streams = []
    for _ in range(BATCH):  # a full running batch
        long_stream = c.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
            max_tokens=2000, temperature=0, stream=True)
        it = iter(long_stream)
        while True:  # running once its first tokens arrive
            ch = next(it)
            if ch.choices and ch.choices[0].delta.content:
                break
        long_streams.append(long_stream)
    queued: dict = {}

    def waiting_request():
        queued["r"] = chat_create(one, "Say OK.", max_tokens=3)

    want = greedy_text(smollm2, "Say OK.", 3)

    th = threading.Thread(target=waiting_request)
    th.start()
    t = time.monotonic()
    while httpx.get(one.url + "/health", timeout=10).json()["queue_depth"] < 1:
        assert time.monotonic() - t < 30
        time.sleep(0.1)
    r = httpx.post(one.url + "/v1/chat/completions", json=_chat_body(), headers=AUTH, timeout=30)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        chat_create(one, "hi", max_tokens=2)
    for long_stream in long_streams:
        long_stream.close()  # cancels the long ones; the queued request runs next
    th.join(120)
    assert not th.is_alive() and queued["r"].choices[0].message.content == want
    assert httpx.get(one.url + "/health", timeout=10).json()["queue_depth"] == 0
    t = time.monotonic()  # the gauges move at the step boundary after the last answer
    while (m := one.metrics())["lp_batch_running"] > 0:
        assert time.monotonic() - t < 30, "the batch did not drain"
        time.sleep(0.2)
    assert m["lp_kv_blocks_in_use"] == 0  # the 3 cancelled streams and the queued request left no block


def test_concurrent_requests_equal_generate(one, refs):
    """Chat and completion requests at once, streamed and not, in one running batch: each
    equals transformers greedy generate of its own prompt, token for token."""
    from concurrent.futures import ThreadPoolExecutor

    t = time.monotonic()  # the previous test's cancelled streams leave within a step or two
    while one.metrics()["lp_batch_running"] > 0 or one.metrics()["lp_queue_depth"] > 0:
        assert time.monotonic() - t < 60, "the batch did not drain"
        time.sleep(0.2)

    def chat(text):
        return chat_create(one, text, extra_body={"lookahead": {"return_token_ids": True}})

    def completion():
        return one.client().completions.create(model="smollm2", prompt=RAW, max_tokens=M, temperature=0,
                                               extra_body={"lookahead": {"return_token_ids": True}})

    before = one.metrics()
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(chat, CHAT[0]), pool.submit(chat, CHAT[1]), pool.submit(completion),
                pool.submit(stream_chat, one, CHAT[1])]
        got = [f.result(300) for f in futs]
    for text, r in zip(CHAT, got[:2]):
        _, new, content, finish = expected(refs, text)
        assert r.model_extra["lookahead"]["output_ids"] == new and r.choices[0].message.content == content
    _, new, content, _ = expected(refs, RAW)
    assert got[2].model_extra["lookahead"]["output_ids"] == new and got[2].choices[0].text == content
    assert got[3][0] == expected(refs, CHAT[1])[2]
    t = time.monotonic()  # the gauges move right after the step that answered the last one
    while (m := one.metrics())["lp_batch_running"] > 0 or m["lp_kv_blocks_in_use"] > 0:
        assert time.monotonic() - t < 30, "the batch did not drain"
        time.sleep(0.2)
    assert m["lp_kv_blocks_total"] == 8192 // 8  # server.kv_block: 8 slots a block
    steps = m["lp_step_rows_count"] - before.get("lp_step_rows_count", 0)  # batched steps the engine ran
    per_request = m["lp_decode_steps_total"] - before.get("lp_decode_steps_total", 0)  # each request's steps
    assert 0 < steps < per_request, (steps, per_request)  # the requests shared steps


def test_api_key_and_kv_bound(one):
    """Without the key (or with a wrong one) a /v1 request is a 401, /health stays open; a
    request that can never fit server.kv_tokens is a 400 at once, the server keeps serving."""
    import openai

    r = httpx.post(one.url + "/v1/chat/completions", json=_chat_body(), timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for path, body in (("/v1/chat/completions", _chat_body()), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
        r = httpx.post(one.url + path, json=body, headers={"authorization": f"Bearer {KEY}x"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=one.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(one.url + "/health", timeout=10).status_code == 200
    assert httpx.get(one.url + "/v1/models", headers=AUTH, timeout=10).status_code == 200
    with pytest.raises(openai.BadRequestError) as e:
        chat_create(one, "hi", max_tokens=8150)  # fits the model's context, not the K/V pool
    assert e.value.status_code == 400 and "kv_tokens" in e.value.body["message"]
    assert chat_create(one, "hi", max_tokens=2).usage.completion_tokens >= 1


def test_metrics_count_this_tests_requests(one):
    """Stands alone: the counters move by what this test sends."""
    before = one.metrics()
    invalid, length = 'lp_requests_total{endpoint="chat",outcome="invalid"}', \
        'lp_requests_total{endpoint="chat",outcome="length"}'
    assert httpx.post(one.url + "/v1/chat/completions", json=_chat_body(top_p=0), headers=AUTH,
                      timeout=30).status_code == 400
    r = chat_create(one, CHAT[0], max_tokens=6)
    assert r.choices[0].finish_reason == "length"
    m = one.metrics()
    assert m[invalid] - before.get(invalid, 0) == 1
    assert m[length] - before.get(length, 0) == 1
    assert m["lp_completion_tokens_total"] - before.get("lp_completion_tokens_total", 0) == 6
    assert m["lp_decode_steps_total"] - before.get("lp_decode_steps_total", 0) >= 1
    assert m["lp_time_to_first_token_seconds_count"] - before.get("lp_time_to_first_token_seconds_count", 0) == 1
    assert m["lp_tokens_per_second_count"] - before.get("lp_tokens_per_second_count", 0) == 1
    assert m["lp_compression_ratio_count"] - before.get("lp_compression_ratio_count", 0) == 1
    assert m["lp_queue_depth"] == 0 and m["lp_workers"] == 1
    assert httpx.get(one.url + "/health", timeout=10).status_code == 200


def test_lp_structured_and_tool_calls_equal_one_process(one, lp2):
    """Structured output under 2 LP workers (every rank holds the request's grammar, sent through the
    request channel, and masks its own rows): a json_schema answer (greedy with the default drafts,
    the grammar's forced ones among them; sampled with a seed) and a tool_choice "required" call equal
    the one-process server's token for token; the forced drafts were accepted under LP."""
    from tests.test_structured_serve import ASK, DIGITS, PROMPTS, SCHEMAS, TOOLS, assert_same_structured_answer

    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS["person"], "strict": True}}
    person = [{"role": "user", "content": PROMPTS["person"]}]
    pool = {"lookahead": dict(SAMPLED_SHAPE, return_token_ids=True)}  # the pool: the same trees on 1 and 2 workers
    cases = [
        # digits where the free model writes words: a rank verifying its rows without the grammar errs here
        dict(messages=[{"role": "user", "content": CHAT[0]}], temperature=0, extra_body={
            "structured_outputs": {"regex": DIGITS}, **pool}),
        dict(messages=person, response_format=rf, temperature=0, extra_body={"lookahead": {"return_token_ids": True}}),
        dict(messages=person, response_format=rf, temperature=0.8, top_p=0.95, seed=3, extra_body=pool),
        dict(messages=[{"role": "user", "content": ASK}], tools=TOOLS, tool_choice="required", temperature=0,
             extra_body={"lookahead": {"return_token_ids": True}}),
    ]
    for kw in cases:
        a, b = (s.client().chat.completions.create(model="smollm2", max_tokens=48, **kw) for s in (one, lp2))
        la_a, la_b = assert_same_structured_answer(kw, a, b)
        assert (la_a["workers"], la_b["workers"]) == (1, 2)
        if kw.get("response_format") and kw["temperature"] == 0 and "W" not in kw["extra_body"]["lookahead"]:
            assert la_b["forced_tokens"] > 0, la_b  # the grammar's forced drafts (suffix mode), verified under LP


# ---------------------------------------------------------------------------
# Lookahead Parallelism: 2 gloo workers behind the server


def test_lp_chat_greedy_equals_generate(lp2, refs):
    for text_in in CHAT:
        ids, new, text, finish = expected(refs, text_in)
        r = chat_create(lp2, text_in, extra_body={"lookahead": {"return_token_ids": True, "W": 4, "N": 4, "G": 4}})
        la = r.model_extra["lookahead"]
        assert la["output_ids"] == new
        assert r.choices[0].message.content == text and r.choices[0].finish_reason == finish
        assert la["workers"] == 2 and (la["W"], la["N"], la["G"]) == (4, 4, 4)
        assert r.usage.completion_tokens == len(new)
    content, fin, use, la, _ = stream_chat(lp2, CHAT[0])
    ids, new, text, finish = expected(refs, CHAT[0])
    assert (content, fin, use.completion_tokens) == (text, finish, len(new))


def test_lp_completion_stop_and_bad_input(lp2, refs):
    ids, new, text, _ = expected(refs, RAW)
    r = lp2.client().completions.create(model="smollm2", prompt=RAW, max_tokens=M, temperature=0)
    assert r.choices[0].text == text
    stop = re.findall(r"[A-Za-z]{4,}", text)[1]
    r = lp2.client().completions.create(model="smollm2", prompt=RAW, max_tokens=M, temperature=0, stop=stop)
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"
    bad = httpx.post(lp2.url + "/v1/completions", json={"prompt": "x", "top_p": 0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
    # sampled requests carry temperature/top_p/seed to every rank: the tokens one process draws
    # (the offline CLI) for the same seed, and another seed draws others
    la = {"lookahead": dict(SAMPLED_SHAPE, return_token_ids=True)}
    a = lp2.client().completions.create(model="smollm2", prompt=RAW, max_tokens=12, temperature=0.8, top_p=0.9, seed=3,
                                        extra_body=la)
    assert a.model_extra["lookahead"]["output_ids"] == cli_sample(RAW, True, 12, temperature=0.8, top_p=0.9, seed=3)
    others = {lp2.client().completions.create(model="smollm2", prompt=RAW, max_tokens=12, temperature=0.8, top_p=0.9,
                                              seed=s).choices[0].text for s in (4, 5)}
    assert others - {a.choices[0].text}, "other seeds draw the same text"


def _close_top(got: list, want: list) -> None:
    """Chat ``top_logprobs`` entries: the same tokens in order, values to 1e-4."""
    assert [t.token for t in got] == [t.token for t in want]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-4)


COUNT = "Count from 1 to 40, separated by commas."


def test_lp_logprobs_equal_one_process(one, lp2):
    """Logprobs on 2 LP workers (each token's from the worker that verified it, carried by the step's
    exchange; the prompt's from the prefill every worker runs) == the one-process server's: chat
    greedy and sampled (same seed) with top_logprobs, streamed too; completions with echo + logprobs
    (the prompt's logprobs first) and echo with max_tokens 0 (the prompt scored only)."""
    sampled = dict(temperature=0.8, top_p=0.9, seed=3, top_logprobs=2,  # the same trees: the same draws
                   extra_body={"lookahead": SAMPLED_SHAPE})
    # the pool on a counting prompt: long hits, verified on either worker (taking rank 0's fails here)
    pool = dict(temperature=0, top_logprobs=3, extra_body={"lookahead": SAMPLED_SHAPE})
    for text, kw in ((CHAT[0], dict(temperature=0, top_logprobs=3)), (COUNT, pool), (CHAT[0], sampled)):
        a, b = (chat_create(s, text, max_tokens=24, logprobs=True, **kw) for s in (one, lp2))
        assert b.choices[0].message.content == a.choices[0].message.content, kw
        want, got = a.choices[0].logprobs.content, b.choices[0].logprobs.content
        assert len(got) == len(want) > 0 and all(len(x.top_logprobs) == kw["top_logprobs"] for x in got)
        _close_top(got, want)
        for x, y in zip(got, want):
            _close_top(x.top_logprobs, y.top_logprobs)
    stream = lp2.client().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": CHAT[0]}],
                                                  max_tokens=24, temperature=0, logprobs=True, top_logprobs=3,
                                                  stream=True)
    streamed = [x for ch in stream if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    want = chat_create(one, CHAT[0], max_tokens=24, temperature=0, logprobs=True, top_logprobs=3)
    _close_top(streamed, want.choices[0].logprobs.content)
    for prompt, max_tokens, la in ((RAW, 12, {}), (RAW, 0, {}), ("1, 2, 3, 4, 5, 6, 7, 8,", 24, SAMPLED_SHAPE)):
        a, b = (s.client().completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              echo=True, logprobs=2, extra_body={"lookahead": la}) for s in (one, lp2))
        assert b.choices[0].text == a.choices[0].text and a.choices[0].text.startswith(prompt)
        want, got = a.choices[0].logprobs, b.choices[0].logprobs
        assert got.tokens == want.tokens and got.text_offset == want.text_offset
        assert got.token_logprobs[0] is None and want.token_logprobs[0] is None
        assert got.token_logprobs[1:] == pytest.approx(want.token_logprobs[1:], abs=1e-4)
        assert len(got.top_logprobs) == len(want.top_logprobs)
        for x, y in zip(got.top_logprobs[1:], want.top_logprobs[1:]):
            assert list(x) == list(y) and list(x.values()) == pytest.approx(list(y.values()), abs=1e-4)


def test_lp_disconnect_then_next_request(lp2, refs):
    stream = lp2.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        max_tokens=2000, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    t = time.monotonic()
    while lp2.metrics().get('lp_requests_total{endpoint="chat",outcome="cancelled"}', 0.0) < 1:
        assert time.monotonic() - t < 30, "the LP generation was not cancelled"
        time.sleep(0.2)
    ids, new, text, _ = expected(refs, CHAT[1])
    assert chat_create(lp2, CHAT[1]).choices[0].message.content == text  # ranks still in step


def test_lp_concurrent_requests_equal_generate(lp2, refs):
    """The issue's must-show: 3 requests at once (openai clients in threads) into one running
    batch on 2 LP workers; each answer equals greedy generate (= the one-process server's)
    token for token; the batch drained and its blocks are free."""
    from concurrent.futures import ThreadPoolExecutor

    la = {"lookahead": {"return_token_ids": True}}

    def chat(text):
        return chat_create(lp2, text, extra_body=la)

    def completion():
        return lp2.client().completions.create(model="smollm2", prompt=RAW, max_tokens=M, temperature=0,
                                               extra_body=la)

    before = lp2.metrics()
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(chat, CHAT[0]), pool.submit(chat, CHAT[1]), pool.submit(completion)]
        got = [f.result(600) for f in futs]
    for text, r in zip(CHAT, got[:2]):
        _, new, content, finish = expected(refs, text)
        assert r.model_extra["lookahead"]["output_ids"] == new and r.choices[0].message.content == content
        assert r.choices[0].finish_reason == finish and r.model_extra["lookahead"]["workers"] == 2
    _, new, content, _ = expected(refs, RAW)
    assert got[2].model_extra["lookahead"]["output_ids"] == new and got[2].choices[0].text == content
    t = time.monotonic()  # the gauges move right after the step that answered the last one
    while (m := lp2.metrics())["lp_batch_running"] > 0 or m["lp_kv_blocks_in_use"] > 0:
        assert time.monotonic() - t < 30, "the batch did not drain"
        time.sleep(0.2)
    assert m["lp_workers"] == 2
    steps = m["lp_step_rows_count"] - before.get("lp_step_rows_count", 0)  # batched steps the engine ran
    per_request = m["lp_decode_steps_total"] - before.get("lp_decode_steps_total", 0)  # each request's steps
    assert 0 < steps < per_request, (steps, per_request)  # the requests shared steps


def rank_pids(server) -> dict[int, int]:
    """{global rank: pid} of an LP server's torchrun children."""
    kids = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(server.proc.pid)], capture_output=True,
                          text=True).stdout.splitlines()
    pids = [int(line.split()[0]) for line in kids if "lp.serve" in line]
    assert len(pids) == 2, kids
    ranks = {}
    for pid in pids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks[next(int(e.split(b"=")[1]) for e in env if e.startswith(b"RANK="))] = pid
    return ranks


def test_lp_shutdown_is_clean(tmp_path_factory):
    """SIGTERM to rank 0 of an LP server that served a request: every rank exits 0."""
    server = start(tmp_path_factory, "serve_lp2_clean", 2, ["parallel.timeout_s=20", "server.heartbeat_s=2",
                                                             "server.max_batch=2"])
    try:
        assert chat_create(server, CHAT[1], max_tokens=4).usage.completion_tokens >= 1
        os.kill(rank_pids(server)[0], signal.SIGTERM)
        rc = server.proc.wait(60)
    finally:
        server.stop(signal.SIGKILL)
    assert rc == 0, server.log()[-3000:]
    assert "[lp.serve] stopped" in server.log() and "shutdown from rank 0" in server.log()


def test_lp_idle_past_the_timeout_then_a_request(lp2, refs):
    """Idle for 1.5 x parallel.timeout_s: rank 0's heartbeats keep the waiting worker from
    timing out; the next request is served by both workers, == generate."""
    t = time.monotonic()
    while (m := lp2.metrics())["lp_batch_running"] > 0 or m["lp_queue_depth"] > 0:
        assert time.monotonic() - t < 60, "the batch did not drain"
        time.sleep(0.2)
    time.sleep(1.5 * LP_TIMEOUT_S)
    assert lp2.proc.poll() is None, lp2.log()[-3000:]
    ids, new, text, _ = expected(refs, CHAT[1])
    r = chat_create(lp2, CHAT[1], extra_body={"lookahead": {"return_token_ids": True}})
    assert r.model_extra["lookahead"]["output_ids"] == new and r.model_extra["lookahead"]["workers"] == 2
    assert "worker failure" not in lp2.log()


def test_lp_killed_worker_ends_the_server(lp2):
    """A worker killed while a request decodes: rank 0's own detection (not torchrun's, which
    polls every 5 s here) fails the request with a 503, /health never says ok again, and the
    whole server exits non-zero within parallel.timeout_s."""
    ranks = rank_pids(lp2)
    pids = list(ranks.values())
    answer, health, stop = {}, [], threading.Event()

    def long_request():
        body = _chat_body(messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
                          max_tokens=2000, temperature=0)
        answer["r"] = httpx.post(lp2.url + "/v1/chat/completions", json=body, timeout=120)

    def poll_health():
        while not stop.is_set():
            try:
                health.append(httpx.get(lp2.url + "/health", timeout=5).status_code)
            except httpx.HTTPError:
                health.append(None)  # the server is gone
            time.sleep(0.02)

    th = threading.Thread(target=long_request)
    th.start()
    t = time.monotonic()
    while lp2.metrics()["lp_running_requests"] < 1:  # decoding on both workers
        assert time.monotonic() - t < 60, "the request did not start"
        time.sleep(0.1)
    poller = threading.Thread(target=poll_health)
    poller.start()
    while not health:
        time.sleep(0.05)
    os.kill(ranks[1], signal.SIGKILL)
    try:
        lp2.proc.wait(LP_TIMEOUT_S + 30)  # rank 0's timeout at worst, plus torchrun's own shutdown
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not stop after a worker died:\n" + lp2.log()[-3000:])
    finally:
        stop.set()
        poller.join(30)
        th.join(60)
    assert lp2.proc.returncode != 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    log = lp2.log()
    assert "[lp.serve] worker failure" in log, log[-3000:]  # rank 0 found it, not torchrun's SIGTERM
    r = answer["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
    assert "worker failure" in r.json()["error"]["message"], r.text
    # /health: ok until the failure; from its first other answer on never ok again: 503 while
    # the engine is failed, then no answer once the process is gone
    codes = health
    first_bad = next(i for i, c in enumerate(codes) if c != 200)
    assert 0 < first_bad and set(codes[first_bad:]) <= {503, None} and codes[-1] is None, codes


# Last: it stops the one-process server every test above shares.
def test_sigterm_during_a_long_stream_is_clean(one):
    """SIGTERM while a long generation streams: the stream gets the server's 503 error event
    (type server_error) and [DONE] instead of hanging or a torn connection, and the server
    exits 0."""
    body = _chat_body(messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
                      max_tokens=2000, temperature=0, stream=True)
    events, rc = [], None
    with httpx.stream("POST", one.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 4:  # streaming: role chunk, then content
                os.kill(one.proc.pid, signal.SIGTERM)
    rc = one.stop(signal.SIGTERM, timeout=60)
    assert rc == 0, one.log()[-3000:]
    assert "[lp.serve] stopped" in one.log()
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["code"] in ("unavailable", "cancelled"), err
    assert "shutting down" in err["message"], err
    assert any(json.loads(e).get("choices", [{}])[0].get("delta", {}).get("content") for e in events[:-2])
