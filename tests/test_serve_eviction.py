"""lp.serve's prefix cache under eviction, and the cache and speculative-decoding counters
of /metrics, through the real ``openai`` client on SmolLM2.

A server whose pool (``server.kv_tokens=512``: 64 blocks of 8) caches about two of these
chats at once serves multi-turn chats over three different system prompts, one after the
other and coming back to the first: cached blocks are evicted (``lp_prefix_cache_evicted_blocks``
moves) while later turns still hit (``cached_tokens`` > 0). Every answer equals a cold
server's (``server.prefix_cache=false``) and transformers' greedy ``generate`` on the same
chat-templated ids.

Then /metrics against what the engine reported per request: prefix-cache queries == the
prompt tokens sent, hits == the sum of ``usage.prompt_tokens_details.cached_tokens``;
accepted draft tokens == sum of (completion tokens - steps) over the responses (every
decode step publishes its own token plus the accepted ones), accepted <= draft tokens,
accepted per position non-increasing with the position and summing to the accepted total;
the cold server counts no query.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import hf_greedy

pytestmark = pytest.mark.slow
M = 12
BASE = ("You are the assistant of a {shop}. It opens at {hour} in the morning and closes in the evening, "
        "every day except {day}. Answer in one short sentence, politely, never invent products, and when "
        "you do not know, say so and suggest calling the shop. ")
SYSTEMS = [BASE.format(shop=s, hour=h, day=d) * 3 for s, h, d in
           (("small bakery", "seven", "Monday"), ("hardware store", "eight", "Sunday"),
            ("flower shop", "nine", "Tuesday"))]
TURNS = ["When do you open?", "Are you open on Sunday?"]
CHATS = [0, 1, 2, 0, 1]  # the third system prompt evicts older blocks; coming back to 0 and 1 hits what is left


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from tests.test_serve import start

    common = ["server.kv_tokens=512", "server.max_batch=2"]
    warm = start(tmp_path_factory, "evict_warm", 1, ["server.prefix_cache=true", *common])
    try:
        cold = start(tmp_path_factory, "evict_cold", 1, ["server.prefix_cache=false", *common])
    except BaseException:
        warm.stop()
        raise
    yield warm, cold
    warm.stop()
    cold.stop()


def _ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _per_pos(m: dict) -> list[float]:
    pos = {int(re.search(r'position="(\d+)"', k).group(1)): v for k, v in m.items()
           if k.startswith("lp_spec_decode_num_accepted_tokens_per_pos_total{")}
    return [pos[i] for i in range(len(pos))]


def test_eviction_while_hits_are_served_and_metrics_match_the_engine(servers, smollm2):
    from lp.generate import eos_ids

    warm, cold = servers
    model, tok = smollm2
    eos = eos_ids(model, tok)
    w0, c0 = warm.metrics(), cold.metrics()
    prompt_tokens = cached = accepted = 0
    hit_turns = 0
    for chat, sysi in enumerate(CHATS):
        messages = [{"role": "system", "content": SYSTEMS[sysi]}]
        for turn, text in enumerate(TURNS):
            messages.append({"role": "user", "content": text})
            ids = _ids(tok, messages)
            ref = tok.decode(hf_greedy(model, ids, M, eos_token_id=eos), skip_special_tokens=True)
            w, c = (s.client().chat.completions.create(model="smollm2", messages=messages, max_tokens=M,
                                                       temperature=0) for s in (warm, cold))
            got = w.choices[0].message.content
            assert got == c.choices[0].message.content == ref, f"chat {chat} turn {turn}: warm vs cold vs generate"
            assert w.usage.prompt_tokens == len(ids)
            hit = w.usage.prompt_tokens_details.cached_tokens
            assert c.usage.prompt_tokens_details is None or not c.usage.prompt_tokens_details.cached_tokens
            hit_turns += hit > 0
            prompt_tokens += len(ids)
            cached += hit
            accepted += w.usage.completion_tokens - w.model_extra["lookahead"]["steps"]
            messages.append({"role": "assistant", "content": got})
    m = warm.metrics()
    evicted = m["lp_prefix_cache_evicted_blocks_total"] - w0.get("lp_prefix_cache_evicted_blocks_total", 0)
    assert evicted > 0, "the pool should have evicted cached blocks"
    assert hit_turns >= len(CHATS), f"only {hit_turns} turns hit the cache"  # every second turn, and returns
    # prefix cache: queries and hits in tokens, as the responses reported them
    assert m["lp_prefix_cache_queries_total"] - w0.get("lp_prefix_cache_queries_total", 0) == prompt_tokens
    assert m["lp_prefix_cache_hits_total"] - w0.get("lp_prefix_cache_hits_total", 0) == cached > 0
    assert cold.metrics().get("lp_prefix_cache_queries_total", 0) == c0.get("lp_prefix_cache_queries_total", 0)
    # speculative decoding: the module's first request is this test's, so totals are this test's
    drafts = m["lp_spec_decode_num_drafts_total"] - w0.get("lp_spec_decode_num_drafts_total", 0)
    draft_tokens = m["lp_spec_decode_num_draft_tokens_total"] - w0.get("lp_spec_decode_num_draft_tokens_total", 0)
    acc = m["lp_spec_decode_num_accepted_tokens_total"] - w0.get("lp_spec_decode_num_accepted_tokens_total", 0)
    assert acc == accepted > 0, (acc, accepted)
    assert 0 < drafts <= draft_tokens and acc <= draft_tokens
    per_pos = [a - b for a, b in zip(_per_pos(m), _per_pos(w0) + [0.0] * len(_per_pos(m)))]
    assert per_pos and all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert sum(per_pos) == acc and per_pos[0] <= drafts
