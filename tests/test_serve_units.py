"""lp.server pieces without a server: request packing for the LP channel, incremental
detokenization (streamed deltas concatenate to the content, stop sequences cut), request
validation into DecodingConfig, ServerConfig checks, and the Hydra config composing."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from lp.config import DecodingConfig
from lp.server.config import ServeConfig, ServerConfig
from lp.server.engine import pack_request, unpack_request
from lp.server.protocol import ApiError, ChatRequest, CompletionRequest, ServingContext, parse, prepare

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "d",
    [
        DecodingConfig(max_new_tokens=7),
        DecodingConfig(W=3, N=2, G=0, max_new_tokens=1, do_sample=True, temperature=0.37, top_k=5, top_p=0.91,
                       seed=-(2**63), stop_strings=["\n\n", "é😀 stop", "x"], window_policy="always", prompt_pool=False),
        DecodingConfig(W=15, N=5, G=15, seed=2**63 - 1, window_policy="with_candidates"),
        DecodingConfig(repetition_penalty=1.3, frequency_penalty=-0.7, presence_penalty=1.9, min_p=0.05,
                       logit_bias={0: -100.0, 49151: 0.25, 7: 3.5}, do_sample=True),
    ],
)
def test_pack_unpack_roundtrip(d):
    prompt = [1, 0, 49151, 5, 5]
    fields, payload = pack_request(prompt, d)
    assert all(isinstance(x, int) and -(2**63) <= x < 2**63 for x in fields + payload)
    from lp.parallel.dist import RequestChannel

    assert len(fields) <= RequestChannel.FIELDS
    got_prompt, got = unpack_request(fields, payload, DecodingConfig(max_new_tokens=99, prompt_pool=True))
    assert got_prompt == prompt
    assert got == d


@pytest.fixture(scope="module")
def tok():

    from lp.model.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2", None))


TEXTS = [
    "Hello, world! Multi-byte: café, naïve, 東京, 😀👍🏽 and code:\n    return x ** 2\n",
    "Stop here. Then more text after the STOP marker, and 🙂 emoji.",
]


@pytest.mark.parametrize("stop", [[], ["STOP"], ["ore te", "\n"], ["😀"]])
def test_detokenizer_deltas_concatenate_to_content(tok, stop):
    from lp.server.detok import Detokenizer

    rng = random.Random(0)
    for text in TEXTS:
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        full = tok.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (full.find(s) for s in stop) if i >= 0), default=len(full))
        for _ in range(5):
            d = Detokenizer(tok, stop)
            parts, i = [], 0
            while i < len(ids):
                n = rng.randint(1, 4)
                parts.append(d.push(ids[i : i + n]))
                i += n
                assert "\ufffd" not in "".join(parts)  # never half a character
                assert not any(s in "".join(parts) for s in stop)  # never any part of a stop beyond the cut
            parts.append(d.finish())
            assert "".join(parts) == full[:cut] == d.content()


def test_detokenizer_push_decodes_a_window(tok):
    """A push decodes a few recent tokens, not the whole completion: over 1,500 tokens pushed
    one at a time, the ids decoded per push stay bounded, and the deltas still concatenate to
    the whole decode."""
    from lp.server.detok import Detokenizer

    class Counting:
        def __init__(self, inner):
            self.inner, self.seen = inner, []

        def decode(self, ids, **kw):
            self.seen.append(len(ids))
            return self.inner.decode(ids, **kw)

    ids = tok(" ".join(TEXTS) * 40)["input_ids"][:1500]
    counting = Counting(tok)
    d = Detokenizer(counting, ["STOP!"])
    parts = [d.push([t]) for t in ids]
    assert len(ids) == 1500 and max(counting.seen) <= 16, max(counting.seen)
    parts.append(d.finish())
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=True)


def _ctx(tok, **limits):
    return ServingContext("smollm2", tok, 49152, 2048, DecodingConfig(max_new_tokens=100),
                          dataclasses.replace(ServerConfig(), **limits))


def test_prepare_maps_fields_to_decoding(tok):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 12, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3, "stop": "x",
            "lookahead": {"W": 2, "N": 3, "G": 1}, "stream": True, "stream_options": {"include_usage": True},
            "user": "ignored-extra-field"}
    p = prepare(parse(ChatRequest, json.dumps(body).encode()), _ctx(tok))
    d = p.decoding
    assert (d.max_new_tokens, d.do_sample, d.temperature, d.top_p, d.top_k, d.seed) == (12, True, 0.5, 0.9, 4, 3)
    assert (d.W, d.N, d.G, d.stop_strings) == (2, 3, 1, ["x"])
    assert p.stream and p.include_usage
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    assert p.prompt_ids == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    # defaults from the decoding group; temperature 0 is greedy; no max_tokens: what the context leaves
    p = prepare(parse(CompletionRequest, b'{"prompt": "abc", "temperature": 0}'), _ctx(tok))
    assert p.decoding.do_sample is False and p.decoding.max_new_tokens == 100 and not p.stream
    ctx = dataclasses.replace(_ctx(tok), max_positions=len(tok("abc")["input_ids"]) + 5)
    assert prepare(parse(CompletionRequest, b'{"prompt": "abc"}'), ctx).decoding.max_new_tokens == 5
    with pytest.raises(ApiError) as e:
        prepare(parse(CompletionRequest, b'{"prompt": "abc", "max_tokens": 6}'), ctx)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "a", "temperature": float("inf")}, "temperature"),
        ({"prompt": "a", "top_k": -1}, "top_k"),
        ({"prompt": "a", "lookahead": {"W": 0}}, "lookahead.W"),
        ({"prompt": "a", "lookahead": {"G": 33}}, "lookahead.G"),
        ({"prompt": "a", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"prompt": [1, 2, 49152]}, "prompt"),
        ({"prompt": None}, "prompt"),
    ],
)
def test_prepare_rejects(tok, body, param):
    with pytest.raises(ApiError) as e:
        prepare(parse(CompletionRequest, json.dumps(body).encode()), _ctx(tok))
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body,kind", [({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "chat"),
                                       ({"prompt": "a", "logprobs": 2}, "completions")])
def test_logprobs_served_under_lp(tok, body, kind):
    """Logprobs under 2 LP workers (the verifying worker's ride the step's exchange): a request asking
    for them is prepared as in one process (tests/test_serve.py compares the answers)."""
    cls = ChatRequest if kind == "chat" else CompletionRequest
    raw = json.dumps(body).encode()
    one = prepare(parse(cls, raw), _ctx(tok))
    lp = prepare(parse(cls, raw), dataclasses.replace(_ctx(tok), workers=2))
    assert one.decoding.logprobs is True and lp.decoding == one.decoding
    assert lp.decoding.top_logprobs == (2 if kind == "completions" else 0)
    no = dict(body, logprobs=False if kind == "chat" else None)
    assert prepare(parse(cls, json.dumps(no).encode()), dataclasses.replace(_ctx(tok), workers=2)).decoding.logprobs \
        is False


def test_non_streaming_disconnect_is_polled_while_tokens_arrive():
    """lp.server.app: a non-streaming handler notices that its client went away
    (request.is_disconnected) within about KEEPALIVE_S even while the job's tokens arrive
    far more often than that (a fast step); it cancels the job and answers 499."""
    import asyncio
    import types

    from lp.server.app import KEEPALIVE_S, _Completions
    from lp.server.engine import Job

    class GoneRequest:
        async def is_disconnected(self):
            return True

    async def scenario():
        job = Job("chat", [1], DecodingConfig(), loop=asyncio.get_running_loop(), events=asyncio.Queue())

        async def produce():  # a token every 20 ms for 3 KEEPALIVE_S
            for _ in range(int(3 * KEEPALIVE_S / 0.02)):
                job.events.put_nowait(("tokens", [5]))
                await asyncio.sleep(0.02)

        producer = asyncio.create_task(produce())
        resp = await _Completions(None, None, None, 1)._whole(GoneRequest(), job, "chat", "id",
                                                               types.SimpleNamespace(ids=[]), None)
        still_producing = not producer.done()
        producer.cancel()
        return resp, still_producing, job.cancelled

    resp, still_producing, cancelled = asyncio.run(scenario())
    assert resp.status_code == 499 and cancelled
    assert still_producing, "the disconnect was noticed only once the tokens stopped"


def test_server_config_validation():
    ServerConfig().validate()
    for kw, field in [(dict(port=70000), "server.port"), (dict(max_queue=-1), "server.max_queue"),
                      (dict(max_N=1), "server.max_N"), (dict(heartbeat_s=0), "server.heartbeat_s"),
                      (dict(draft_store="yes"), "server.draft_store"), (dict(log_level="loud"), "server.log_level")]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            ServerConfig(**kw).validate()
    with pytest.raises(ValueError, match="decoding.mode"):
        ServeConfig(decoding=DecodingConfig(mode="hf")).validate()
    ServeConfig(decoding=DecodingConfig(mode="ar")).validate()  # lp's own one-token steps
    from lp.config import GenerateConfig, ModelConfig, ParallelConfig

    for cls in (ServeConfig, GenerateConfig):  # a compiled step over tensor-parallel shards (tests/test_tp.py)
        cls(model=ModelConfig(compile="on"), parallel=ParallelConfig(tp=2)).validate()
        cls(model=ModelConfig(compile="on")).validate()


def test_server_draft_store_is_one_shared_store():
    from lp.serve import _draft_store
    from lp.drafts.suffix import DraftStore

    assert _draft_store(ServeConfig()) is None
    cfg = ServeConfig(decoding=DecodingConfig(draft_store_tokens=128), server=ServerConfig(draft_store=True))
    store = _draft_store(cfg.validate())
    assert isinstance(store, DraftStore)
    store.add(list(range(300)))
    assert len(store) <= 128


def test_hydra_serve_config_composes():
    from hydra import compose, initialize_config_dir

    from lp import cli
    from lp.serve import SCHEMAS

    cli.register(SCHEMAS)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = cli.to_config(compose("serve", overrides=["server.port=9001", "server.max_queue=3", "decoding.W=4"]))
    assert isinstance(cfg, ServeConfig) and isinstance(cfg.server, ServerConfig)
    assert (cfg.server.port, cfg.server.max_queue, cfg.server.host, cfg.decoding.W) == (9001, 3, "127.0.0.1", 4)
    assert cfg.validate() is cfg


def test_lp_run_module_flag():
    import sys

    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import lp_run
    finally:
        sys.path.pop(0)
    cmd, _ = lp_run.build_command(["--module", "lp.serve", "parallel.workers=2", "server.port=9"])
    assert cmd[cmd.index("-m", 2) + 1] == "lp.serve" and cmd[-2:] == ["parallel.workers=2", "server.port=9"]
    cmd, _ = lp_run.build_command(["parallel.workers=2"])
    assert "lp.generate" in cmd
    with pytest.raises(SystemExit):
        lp_run.build_command(["--module=os", "parallel.workers=2"])
