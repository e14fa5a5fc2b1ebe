"""scripts/regenerate-data against a real HTTP server on 127.0.0.1: a small OpenAI-compatible
endpoint (GET /v1/models, POST /v1/chat/completions, vLLM's POST /tokenize) that serves a tiny
random Qwen3 model with the tiny chat tokenizer of tokens_tiny_tokenizer (nothing downloaded).

The server renders the messages with the tokenizer's chat template (add_generation_prompt,
chat_template_kwargs), generates with transformers' generate (greedy at temperature 0, sampled
otherwise, seeded by the request's seed), stops at <|end|> or max_tokens, and answers the text,
finish_reason and usage. Faults are set per test: every k-th chat request dropped (the
connection closed without an answer, or HTTP 500, in turn), chosen requests stalled past the
client's --timeout, a delay per request. The greedy replies are checked against the tiny
target's own greedy continuation, computed here without the server's code path (a plain
argmax loop over full forwards, no cache, no generate()).
"""
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import h5py
import pytest
import torch
from transformers import AutoTokenizer

import tokens_tiny_tokenizer as tt
from conftest import BINARY_DIR, CLI, SOURCE_DIR
from hf_models import make_model

REGENERATE = SOURCE_DIR / "scripts" / "regenerate-data"
MODEL = "tiny-target"
MAX_TOKENS = 16
# Another template: the same turns written as "### role: content", so every probe has
# another token count.
OTHER_TEMPLATE = ("{{ bos_token }}{% for m in messages %}### {{ m.role }}: {{ m.content }}<|end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}### assistant:{% endif %}")
OTHER_CORPUS = ["speculative decoding drafts tokens", "a target verifies every block",
                "regenerated replies are the target's own text", "numbers 12345 and 678 add up"]


# --- the tiny target ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """{"tok": folder, "other_template": folder, "other_vocab": folder, "model": model}."""
    folder = tmp_path_factory.mktemp("regenerate")
    tok_dir = tt.make_tokenizer(folder / "target", tt.PLAIN)
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    torch.manual_seed(0)
    model = make_model(folder / "target", "qwen3", seed=3, embedding_std=0.5, initializer_range=0.2,
                       vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    saved = tt.CORPUS
    try:
        tt.CORPUS = OTHER_CORPUS  # make_tokenizer trains on tt.CORPUS
        other_vocab = tt.make_tokenizer(folder / "other_vocab", tt.PLAIN)
    finally:
        tt.CORPUS = saved
    return {"tok": tok_dir, "other_template": tt.make_tokenizer(folder / "other_template", OTHER_TEMPLATE),
            "other_vocab": other_vocab, "model": model, "tokenizer": tok}


def render_ids(tok, messages, **kwargs):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def greedy(target, messages, max_tokens=MAX_TOKENS):
    """The tiny target's own greedy reply: (text, finish_reason, tokens generated), by an argmax
    loop over full forwards, decoded up to the end-of-turn token."""
    tok, model = target["tokenizer"], target["model"]
    ids, new = render_ids(tok, messages), []
    with torch.no_grad():
        for _ in range(max_tokens):
            t = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if t == tok.eos_token_id:
                return tok.decode(new, skip_special_tokens=True), "stop", len(new) + 1
            new.append(t)
    return tok.decode(new, skip_special_tokens=True), "length", len(new)


# --- the server -------------------------------------------------------------------------------
class Server:
    """An OpenAI-compatible endpoint in a thread; faults and records per instance."""

    generate_lock = threading.Lock()  # one generation at a time: 2 cores

    def __init__(self, tokenizer_dir, model, tokenize=True, name=MODEL):
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        self.model, self.tokenize, self.name = model, tokenize, name
        self.drop_every, self.stall, self.stall_s, self.delay = 0, set(), 0.0, 0.0
        self.calls = 0               # chat requests received
        self.answered = []           # (request body, answer) of chat requests answered
        self.inflight = self.max_inflight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def reply(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    if self.path == "/v1/chat/completions":
                        server.chat(self, body)
                    elif self.path == "/tokenize" and server.tokenize:
                        self.reply(200, server.tokenize_answer(body))
                    else:
                        self.reply(404, {"error": f"no {self.path}"})
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def tokenize_answer(self, body):
        if "messages" in body:
            ids = render_ids(self.tok, body["messages"], **(body.get("chat_template_kwargs") or {}))
        else:
            ids = self.tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        return {"tokens": ids, "count": len(ids), "max_model_len": 256}

    def chat(self, handler, body):
        with self.lock:
            self.calls += 1
            n = self.calls
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.drop_every and n % self.drop_every == 0:
                if (n // self.drop_every) % 2:
                    handler.close_connection = True  # no answer at all
                else:
                    handler.reply(500, {"error": "injected fault"})
                return
            if n in self.stall:
                time.sleep(self.stall_s)  # the client has given up by now
                handler.close_connection = True
                return
            time.sleep(self.delay)
            try:
                ids = render_ids(self.tok, body["messages"], **(body.get("chat_template_kwargs") or {}))
            except Exception as e:  # the template refuses the conversation
                handler.reply(400, {"error": {"message": f"{type(e).__name__}: {e}"}})
                return
            answer = self.generate(ids, body)
            with self.lock:
                self.answered.append((body, answer))
            handler.reply(200, answer)
        finally:
            with self.lock:
                self.inflight -= 1

    def generate(self, ids, body):
        temperature = body.get("temperature", 1.0)
        eos = self.tok.eos_token_id
        with self.generate_lock, torch.no_grad():
            sampling = dict(do_sample=False)
            if temperature > 0:
                torch.manual_seed(body.get("seed", 0))
                sampling = dict(do_sample=True, temperature=temperature, top_p=body.get("top_p", 1.0), top_k=0)
            out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=body["max_tokens"], eos_token_id=eos, pad_token_id=eos,
                                      **sampling)
        new = out[0, len(ids):].tolist()
        finish = "stop" if new and new[-1] == eos else "length"
        text = self.tok.decode(new[:-1] if finish == "stop" else new, skip_special_tokens=True)
        return {"id": f"chatcmpl-{self.calls}", "object": "chat.completion", "model": self.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)}}


@pytest.fixture
def servers(target):
    made = []

    def make(tokenizer="tok", **kw):
        s = Server(target[tokenizer], target["model"], **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


# --- the client ---------------------------------------------------------------------------------
def regenerate(server, data, out, *extra, check=None):
    """Runs scripts/regenerate-data (greedy, short replies unless extra says otherwise)."""
    args = [sys.executable, str(REGENERATE), "--server", server.url, "--model", MODEL, "--input", str(data),
            "--out", str(out), "--max-tokens", str(MAX_TOKENS), "--backoff", "0.02", *map(str, extra)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if check is not None:
        assert p.returncode == check, f"regenerate-data exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p


def write_lines(path, lines):
    """Writes objects (or raw strings) one a line; returns the bytes of each line."""
    raws = [(o if isinstance(o, str) else json.dumps(o)).encode() for o in lines]
    path.write_bytes(b"".join(r + b"\n" for r in raws))
    return raws


def hash_id(raw):
    return hashlib.sha256(raw.rstrip()).hexdigest()[:16]


def read_out(out):
    return [json.loads(line) for line in out.read_bytes().split(b"\n")[:-1]]


def replies_of(messages):
    """The number of replies a conversation gets: its assistant turns, one more after a last user turn."""
    return sum(m["role"] == "assistant" for m in messages) + (messages[-1]["role"] == "user")


def check_greedy(target, record, thinking=None):
    """Each assistant turn of a written line is the target's greedy reply to the turns before it."""
    messages = record["messages"]
    turns = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(turns) == len(record["finish_reasons"]) == len(record["completion_tokens"])
    for t, j in enumerate(turns):
        text, finish, count = greedy(target, messages[:j])
        assert messages[j]["content"] == text, (record["id"], j, messages[j]["content"], text)
        assert record["finish_reasons"][t] == finish and record["completion_tokens"][t] == count, (record["id"], j)


def summary_value(stdout, prefix):
    line = next((x for x in stdout.splitlines() if x.startswith(f"regenerate-data: {prefix}")), None)
    assert line is not None, f"no '{prefix}' line in:\n{stdout}"
    return line


# (line, reason) in file order; reason None: a conversation. ORIGINAL replies must never be sent.
LINES = [
    (tt.openai(("system", "you are a fox"), ("user", "hello world"), ("assistant", "ORIGINAL fox")), None),
    (tt.sharegpt(("human", "tell me a story"), ("gpt", "ORIGINAL story"), ("human", "and then?"),
                 ("gpt", "ORIGINAL then")), None),
    ("{\"messages\": [", "bad JSON"),
    (tt.openai(("user", "what is two plus two?")), None),                      # last turn user: one reply
    (tt.openai(("user", "write a poem"), ("assistant", "ORIGINAL poem"), ("user", "about rain")), None),
    ({"text": "hello"}, "unknown shape"),
    ({"id": "conv-7", **tt.openai(("user", "the quick brown fox"), ("assistant", "ORIGINAL dog"))}, None),
    (tt.openai(("assistant", "I start"), ("user", "hello")), "assistant turn not after a user turn"),
    (tt.openai(("system", "you are a fox"), ("user", "hello world"), ("assistant", "ORIGINAL fox")), "duplicate id"),
    ("", "blank line"),
    (tt.sharegpt(("system", "be brief"), ("human", "how are you"), ("gpt", "ORIGINAL fine")), None),
]


def test_regenerate_greedy_multiturn_concurrent(target, servers, tmp_path):
    """Concurrency 4 against a checked server: every good line once, replies equal to the target's
    greedy text, later turns asked with the regenerated replies, bad lines reported, and the
    output goes through prepare-data."""
    server = servers()
    data, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    raws = write_lines(data, [o for o, _ in LINES])
    p = regenerate(server, data, out, "--target", target["tok"], "--concurrency", 4, "--thinking", "off", check=0)
    assert "server check against --target" in p.stderr and "/tokenize gives the folder's" in p.stderr, p.stderr
    assert "3 probe conversations equal (ids and prompt token counts)" in p.stderr, p.stderr

    # Bad lines: their numbers and reasons on stderr and in OUT.skipped.tsv.
    planted = {n: r for n, (_, r) in enumerate(LINES, start=1) if r}
    reported = {}
    for line in p.stderr.splitlines():
        head = f"regenerate-data: {data}:"
        if line.startswith(head) and ": skipped (" in line:
            number, rest = line[len(head):].split(": skipped (", 1)
            reported[int(number)] = rest.split(")", 1)[0]
    assert reported == planted, p.stderr
    rows = [r.split("\t") for r in (tmp_path / "out.jsonl.skipped.tsv").read_text().splitlines()[1:]]
    assert {int(r[0]): r[2] for r in rows} == planted

    # One line per good conversation, ids as documented, the metadata.
    good = {n: o for n, (o, r) in enumerate(LINES, start=1) if r is None}
    records = read_out(out)
    want_ids = {n: (o.get("id") or hash_id(raws[n - 1])) for n, o in good.items()}
    assert sorted(r["id"] for r in records) == sorted(want_ids.values())
    responses = 0
    for r in records:
        n = r["source_line"]
        assert r["id"] == want_ids[n]
        source = tt.messages_of(good[n])
        assert [m["role"] for m in r["messages"]] == [m["role"] for m in source] + (
            ["assistant"] if source[-1]["role"] == "user" else [])
        for got, orig in zip(r["messages"], source):
            if orig["role"] != "assistant":
                assert got == orig
        assert (r["model"], r["temperature"], r["top_p"], r["max_tokens"], r["thinking"], r["sample"]) == \
            (MODEL, 0.0, 1.0, MAX_TOKENS, False, 0)
        check_greedy(target, r)
        responses += replies_of(source)

    # What the server received: each turn asked with the regenerated replies before it (never an
    # original one), the sampling settings and enable_thinking; several requests at once.
    probes = [body for body, _ in server.answered if body["max_tokens"] == 1]
    asked = [body for body, _ in server.answered if body["max_tokens"] != 1]
    assert len(probes) == 3 and len(asked) == responses
    for body in asked:
        assert "ORIGINAL" not in json.dumps(body["messages"])
        assert body["temperature"] == 0 and body["max_tokens"] == MAX_TOKENS and body["model"] == MODEL
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
    for r in records:
        for j, m in enumerate(r["messages"]):
            if m["role"] == "assistant":
                assert any(body["messages"] == r["messages"][:j] for body in asked), (r["id"], j)
    assert sum(len(r["finish_reasons"]) for r in records) == responses
    multi = [r for r in records if len(r["finish_reasons"]) > 1]
    assert len(multi) == 2
    assert server.max_inflight >= 2, "the requests never overlapped"

    # The summary.
    assert f"wrote {len(good)} conversations ({responses} responses)" in p.stdout, p.stdout
    assert "skipped: 5 bad input lines, 0 already done, 0 failed" in p.stdout, p.stdout
    truncated = sum(f == "length" for r in records for f in r["finish_reasons"])
    assert f"truncated at max tokens: {truncated} of {responses} responses" in p.stdout, p.stdout
    counts = [c for r in records for c in r["completion_tokens"]]
    assert f"mean response length: {sum(counts) / len(counts):.2f} tokens" in p.stdout, p.stdout

    # A rerun finds everything done and asks nothing.
    before = server.calls
    p = regenerate(server, data, out, "--concurrency", 4, "--thinking", "off", check=0)
    assert f"skipped: 5 bad input lines, {len(good)} already done, 0 failed" in p.stdout, p.stdout
    assert server.calls == before and read_out(out) == records

    # prepare-data reads the output as it is.
    shards = tmp_path / "shards"
    q = tt.prepare_data("--tokenizer", target["tok"], "--input", out, "--out", shards)
    assert f"wrote {len(good)} conversations in 1 shard" in q.stdout, q.stdout
    with h5py.File(shards / "shard-00000.h5", "r") as f:
        assert len(f["offsets"]) == len(good) + 1 and f["loss_mask"][()].sum() > 0


def test_retries_dropped_and_stalled(target, servers, tmp_path):
    """Every third chat request dropped (connection closed or HTTP 500), one stalled past --timeout:
    each conversation still ends as one correct line."""
    server = servers()
    server.drop_every, server.stall, server.stall_s = 3, {2}, 3.0
    data, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    good = [o for o, r in LINES if r is None]
    write_lines(data, good)
    p = regenerate(server, data, out, "--concurrency", 2, "--timeout", 1.5, "--retries", 4, check=0)
    records = read_out(out)
    assert len(records) == len(good) == len({r["id"] for r in records})
    for r in records:
        check_greedy(target, r)
    retried = summary_value(p.stdout, "retried ")
    for reason in ("timeout: 1", "HTTP 500", "connection"):
        assert reason in retried, retried
    assert server.calls > len(server.answered) == sum(replies_of(tt.messages_of(o)) for o in good)
    assert "warning: no --target" in p.stderr


def test_failures_are_counted_and_rerun(target, servers, tmp_path):
    """Retries exhausted: nothing written, exit 1, listed; the rerun does them. An HTTP 400 is not
    retried. A server down for good stops the run early."""
    server = servers()
    server.drop_every = 1
    data, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    lines = [tt.openai(("user", "hello world")), tt.openai(("user", "a red fox")),
             tt.openai(("user", "hello"), ("system", "late"), ("user", "again"))]  # the template refuses it
    write_lines(data, lines)
    p = regenerate(server, data, out, "--retries", 1, "--concurrency", 1, check=1)
    assert out.read_text() == ""
    assert "skipped: 0 bad input lines, 0 already done, 3 failed" in p.stdout, p.stdout
    failed = [r.split("\t") for r in (tmp_path / "out.jsonl.skipped.tsv").read_text().splitlines()[1:]]
    assert sorted(int(r[0]) for r in failed) == [1, 2, 3] and all(r[2].startswith("failed: ") for r in failed)
    assert f"{data}:1: failed (" in p.stderr and "rerun to do them again" in p.stderr, p.stderr

    server.drop_every = 0
    calls = server.calls
    p = regenerate(server, data, out, "--retries", 1, check=1)
    assert "skipped: 0 bad input lines, 0 already done, 1 failed" in p.stdout, p.stdout
    assert "failed: HTTP 400: 1 (line 3)" in p.stdout, p.stdout
    assert server.calls - calls == 3  # two answered, the 400 asked once
    assert sorted(r["source_line"] for r in read_out(out)) == [1, 2]

    # Down for good: after max(10, 2 x concurrency) failures in a row the run stops.
    server.drop_every = 1
    many = tmp_path / "many.jsonl"
    write_lines(many, [tt.openai(("user", f"question {i}")) for i in range(14)])
    calls = server.calls
    p = regenerate(server, many, tmp_path / "many.out.jsonl", "--retries", 0, "--concurrency", 1, check=1)
    assert "stopped early: the last 10 conversations all failed" in p.stderr, p.stderr
    assert server.calls - calls == 10


def test_resume_after_sigkill(target, servers, tmp_path):
    """kill -9 mid-run, a torn last line, a rerun: one line per conversation, none twice, none lost."""
    server = servers()
    server.delay = 0.15
    data, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    convs = [tt.openai(("user", f"tell me a story about {w}")) for w in ("a fox", "a cat", "rain", "a bird")] + \
        [tt.openai(("user", f"hello {w}"), ("assistant", "ORIGINAL"), ("user", "and then?")) for w in ("you", "world")] \
        + [tt.sharegpt(("human", "two plus two?"), ("gpt", "ORIGINAL")), tt.openai(("user", "write a poem"))]
    raws = write_lines(data, convs)
    args = [sys.executable, str(REGENERATE), "--server", server.url, "--model", MODEL, "--input", str(data),
            "--out", str(out), "--max-tokens", str(MAX_TOKENS), "--concurrency", "2"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the client finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    deadline = time.monotonic() + 10
    while server.inflight and time.monotonic() < deadline:  # requests of the killed client end
        time.sleep(0.01)
    first = out.read_bytes()
    written = first.count(b"\n")
    assert 2 <= written < len(convs) and first.endswith(b"\n")
    done = {json.loads(x)["id"] for x in first.split(b"\n")[:-1]}
    out.write_bytes(first + b'{"id": "torn", "messages": [{"role": "us')  # a write the kill cut short

    server.delay = 0.0
    asked = len(server.answered)
    p = regenerate(server, data, out, "--concurrency", 2, check=0)
    assert "cut off a truncated last line" in p.stderr, p.stderr
    assert f"{written} already done, 0 failed" in p.stdout, p.stdout
    text = out.read_bytes()
    assert text.startswith(first)
    records = read_out(out)
    assert sorted(r["id"] for r in records) == sorted(hash_id(r) for r in raws)
    for r in records:
        check_greedy(target, r)
    # The rerun asked only for the conversations not written before the kill.
    rest = [c for c, raw in zip(convs, raws) if hash_id(raw) not in done]
    assert len(server.answered) - asked == sum(replies_of(tt.messages_of(c)) for c in rest)


def test_samples_seeds_and_settings(target, servers, tmp_path):
    """--n samples with their own ids and seeds; a larger --n adds samples; other settings refused."""
    server = servers()
    data, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    raws = write_lines(data, [{"id": 41, **tt.openai(("user", "hello world"))},
                              tt.openai(("user", "a red fox"), ("assistant", "ORIGINAL"), ("user", "and?"))])
    sampling = ("--temperature", 1.0, "--top-p", 0.9, "--seed", 7)
    regenerate(server, data, out, "--n", 2, *sampling, check=0)
    records = read_out(out)
    base = ["41", hash_id(raws[1])]
    assert sorted(r["id"] for r in records) == sorted([base[0], base[0] + "#1", base[1], base[1] + "#1"])
    for b in base:
        pair = sorted((r for r in records if r["id"].split("#")[0] == b), key=lambda r: r["sample"])
        assert [r["sample"] for r in pair] == [0, 1] and pair[0]["messages"] != pair[1]["messages"]
    assert all((r["temperature"], r["top_p"], r["seed"]) == (1.0, 0.9, 7) for r in records)
    seeds = [body["seed"] for body, _ in server.answered]
    assert len(seeds) == len(set(seeds)) == 2 + 4  # one per sample and turn

    p = regenerate(server, data, out, "--n", 3, *sampling, check=0)
    assert "4 already done" in p.stdout and "wrote 2 conversations" in p.stdout, p.stdout
    assert {r["id"] for r in read_out(out)} >= {base[0] + "#2", base[1] + "#2"}

    p = regenerate(server, data, out, "--n", 3, "--temperature", 0.5, check=2)
    assert "was written with temperature 1.0, and this run asks for 0.5" in p.stderr, p.stderr


@pytest.mark.parametrize("server_kind,tokenize,expect", [
    ("other_template", True, "the server's chat template is not the one in --target"),
    ("other_template", False, "prompt tokens on the server (usage.prompt_tokens) and"),
    ("other_vocab", True, "the server's tokenizer is not the one in --target"),
], ids=["other-template-tokenize", "other-template-counts-only", "other-vocabulary"])
def test_server_check_refuses_another_tokenizer(target, servers, tmp_path, server_kind, tokenize, expect):
    server = servers(server_kind, tokenize=tokenize)
    data, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    write_lines(data, [tt.openai(("user", "hello world"))])
    p = regenerate(server, data, out, "--target", target["tok"], check=2)
    assert expect in p.stderr, p.stderr
    assert "first difference at position" in p.stderr or not tokenize, p.stderr
    assert not out.exists() or out.read_text() == ""
    assert all(body["max_tokens"] == 1 for body, _ in server.answered)  # only probes were asked


def test_server_check_model_and_arguments(target, servers, tmp_path):
    server = servers()
    data, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    write_lines(data, [tt.openai(("user", "hello world"))])
    p = subprocess.run([sys.executable, str(REGENERATE), "--server", server.url + "/v1", "--model", "another",
                        "--input", str(data), "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and f"serves {MODEL}, not --model another" in p.stderr, p.stderr
    assert server.calls == 0

    bad = [
        (["--server", "localhost:8000"], "is not an http:// or https:// URL"),
        (["--top-p", "0"], "--top-p 0.0 is outside (0, 1]"),
        (["--n", "0"], "--n 0 is not a positive number"),
        (["--concurrency", "0"], "--concurrency 0 is not a positive number"),
        (["--temperature", "-1"], "--temperature -1.0 is negative"),
        (["--target", str(tmp_path / "none")], "is not a folder"),
        (["--input", str(tmp_path / "none.jsonl")], "is not a file"),
        (["--out", str(data)], "is the --input file"),
        (["--thinking", "maybe"], "invalid choice"),
    ]
    for extra, message in bad:
        p = subprocess.run([sys.executable, str(REGENERATE), "--server", server.url, "--model", MODEL,
                            "--input", str(data), "--out", str(out), *extra], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2 and message in p.stderr, (extra, p.stderr)
    assert server.calls == 0


# --- the recipe end to end: regenerate, prepare, train, served tau -----------------------------
TRAIN = """
[run]
name = "{name}"
seed = 0
steps = {steps}
device = "cpu"
dtype = "float32"
out = "{out}"
print_every = 1000
[attention]
kernels = ["flash_cpu"]
[optimizer]
lr = 5e-3
warmup_steps = 10
[target]
plugin = "hf"
path = "{target}"
[drafter]
plugin = "dflash"
layers = 1
heads = 4
kv_heads = 2
block_size = 8
anchors = 8
labels = "data"
init = "{init}"
[dataset]
plugin = "tokens"
path = "{data}"
seq_len = 64
batch_size = 4
eval_sequences = 16
[mask]
plugin = "dflash"
[eval]
enabled = {evaluate}
every = 0
"""


def test_regenerated_data_trains_a_drafter_a_server_accepts_more(target, servers, tmp_path):
    """Human-written replies against the same conversations regenerated by the target: each goes
    through prepare-data and trains the same drafter (same steps, seed and keys, data labels),
    and both are validated by the target on the same held-out prompts (served tau: the target
    writes the responses). The drafter trained on the target's own text is accepted more."""
    import random

    rng = random.Random(5)
    convs = [tt.openai(("user", rng.choice(tt.CORPUS)), ("assistant", rng.choice(tt.CORPUS)),
                       ("user", rng.choice(tt.CORPUS)), ("assistant", rng.choice(tt.CORPUS))) for _ in range(60)]
    original, regenerated = tmp_path / "original.jsonl", tmp_path / "regenerated.jsonl"
    write_lines(original, convs)
    regenerate(servers(), original, regenerated, "--concurrency", 4, "--max-tokens", 24, check=0)
    for name in ("original", "regenerated"):
        tt.prepare_data("--tokenizer", target["tok"], "--input", tmp_path / f"{name}.jsonl", "--out",
                        tmp_path / f"data_{name}")
    taus = {}
    for name in ("original", "regenerated"):
        exp = tmp_path / f"train_{name}.toml"
        exp.write_text(TRAIN.format(name=name, steps=600, out=tmp_path / name, target=target["tok"],
                                    data=tmp_path / f"data_{name}", init="", evaluate="false"))
        p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True,
                           text=True, timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr
    for name in ("original", "regenerated"):
        # One validation of each drafter on the original data's held-out prompts, by the target.
        exp = tmp_path / f"eval_{name}.toml"
        exp.write_text(TRAIN.format(name=f"eval_{name}", steps=1, out=tmp_path / f"eval_{name}",
                                    target=target["tok"], data=tmp_path / "data_original",
                                    init=tmp_path / name / f"{name}.hf", evaluate="true"))
        p = subprocess.run([str(BINARY_DIR / "bin" / "eval_blocks"), str(exp),
                            str(tmp_path / f"eval_{name}.safetensors")], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        line = p.stdout.strip().splitlines()[-1]
        assert "target (greedy)" in line, line
        taus[name] = float(line.split("tau_served ")[1].split()[0])
    print(f"served tau on the same held-out prompts: trained on the original replies {taus['original']:.3f}, "
          f"on the target's regenerated replies {taus['regenerated']:.3f}")
    assert taus["regenerated"] > taus["original"]
