"""A tiny chat tokenizer made inside the tests (nothing downloaded), conversations in
both JSONL shapes, and scripts/prepare-data run on them: shared by
test_prepare_data.py and test_tokens_dataset.py.

The tokenizer is a byte-level BPE trained here on a few lines, wrapped as a
PreTrainedTokenizerFast with special tokens and a chat template, saved with
save_pretrained. Two templates render the same text: PLAIN has no {% generation %}
tags (prepare-data diffs prefixes), GENERATION marks each reply and its <|end|>.
"""
import contextlib
import importlib.machinery
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import SOURCE_DIR

PREPARE_DATA = SOURCE_DIR / "scripts" / "prepare-data"
END = "<|end|>"
SPECIAL = ["<unk>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", END]

# System messages only first: the template refuses others (a "chat template error").
_HEAD = ("{{ bos_token }}{% for m in messages %}"
         "{% if m.role == 'system' and not loop.first %}{{ raise_exception('a system message must come first') }}"
         "{% endif %}<|{{ m.role }}|>\n")
PLAIN = (_HEAD + "{{ m.content }}<|end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GENERATION = (_HEAD + "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
              "{% else %}{{ m.content }}<|end|>{% endif %}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Marks the last message: the rendering of a prefix is not a prefix of the whole.
UNSTABLE = (_HEAD + "{{ m.content }}{% if loop.last %} (last){% endif %}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

CORPUS = [
    "hello world how are you today",
    "I am fine thanks and you",
    "the quick brown fox jumps over the lazy dog",
    "tell me a story about a red fox and a blue bird",
    "once upon a time there was a small cat",
    "what is two plus two? it is four.",
    "write a poem about rain, please",
]


def make_tokenizer(folder: Path, template: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token=END)
    fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


def openai(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def sharegpt(*turns):
    return {"conversations": [{"from": r, "value": c} for r, c in turns]}


# (line text, reason) in file order; reason None: a conversation to write.
LINES = [
    (openai(("system", "you are a fox"), ("user", "hello world"), ("assistant", "I am fine thanks")), None),
    (sharegpt(("human", "tell me a story"), ("gpt", "once upon a time"), ("human", "and then?"),
              ("gpt", "there was a small cat")), None),
    ("{\"messages\": [", "bad JSON"),
    # The reply repeats words of the question: spans must be found after it.
    (openai(("user", "what is two plus two?"), ("assistant", "two plus two? it is four."),
            ("user", "write a poem"), ("assistant", "rain, please")), None),
    ({"text": "hello"}, "unknown shape"),
    ({"messages": [{"role": "user"}]}, "missing field"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, "wrong role"),
    ({"messages": []}, "empty conversation"),
    (openai(("user", "hello world")), "no assistant turn"),
    (openai(("user", "hello"), ("system", "late"), ("assistant", "fine")), "chat template error"),
    ("", "blank line"),
    (sharegpt(("system", "be brief"), ("human", "how are you"), ("gpt", "fine, and you")), None),
    ({"messages": [{"role": "user", "content": ["a", "list"]}, {"role": "assistant", "content": "x"}]},
     "wrong type"),
    ([1, 2], "not a JSON object"),
    (openai(("user", "the quick brown fox"), ("assistant", "jumps over the lazy dog")), None),
    (sharegpt(("human", "a red fox"), ("gpt", "and a blue bird"), ("human", "a cat?"), ("gpt", "")), None),
    (openai(("user", "rain"), ("assistant", "a poem about rain, and about you, today and tomorrow")), None),
]


def write_jsonl(path: Path, lines=LINES) -> Path:
    with open(path, "w") as f:
        for obj, _ in lines:
            f.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    return path


def messages_of(obj):
    """The OpenAI form of a line's conversation (as prepare-data reads it)."""
    if "messages" in obj:
        return obj["messages"]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in obj["conversations"]]


_PREPARE_DATA_MODULE = None


def _prepare_data_module():
    """scripts/prepare-data as a module, loaded once per test process."""
    global _PREPARE_DATA_MODULE
    if _PREPARE_DATA_MODULE is None:
        loader = importlib.machinery.SourceFileLoader("flashdraft_prepare_data", str(PREPARE_DATA))
        spec = importlib.util.spec_from_loader(loader.name, loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        _PREPARE_DATA_MODULE = module
    return _PREPARE_DATA_MODULE


def prepare_data(*args, check=True, subprocess_run=False):
    """Runs scripts/prepare-data; returns a CompletedProcess (returncode, stdout, stderr).
    By default its main(argv) runs in this process, which has imported transformers already
    (a process per call spent ~2.5 s importing it, 16 calls in the suite); subprocess_run=True
    starts the script as a user does (test_prepare_data keeps one such test)."""
    if subprocess_run:
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        p = subprocess.run([sys.executable, str(PREPARE_DATA), *map(str, args)], capture_output=True, text=True,
                           env=env, timeout=300)
    else:
        argv = [str(a) for a in args]
        out, err, code = io.StringIO(), io.StringIO(), 0
        offline = os.environ.get("HF_HUB_OFFLINE")
        os.environ["HF_HUB_OFFLINE"] = "1"
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = _prepare_data_module().main(argv) or 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if not isinstance(e.code, int) and e.code is not None:
                        print(e.code, file=sys.stderr)
        finally:
            if offline is None:
                os.environ.pop("HF_HUB_OFFLINE", None)
            else:
                os.environ["HF_HUB_OFFLINE"] = offline
        p = subprocess.CompletedProcess([str(PREPARE_DATA), *argv], code, out.getvalue(), err.getvalue())
    if check:
        assert p.returncode == 0, f"prepare-data exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p
