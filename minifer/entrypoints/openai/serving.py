"""Request bodies to validated engine sequences, on the request side: parse, check, template, tokenize.

Everything a request costs before it can run happens here, in a worker thread of its own
(``Preprocessor.run``), never on the engine thread (whose every millisecond delays every stream) nor on the
event loop (whose every millisecond delays every connection). What this produces is a list of ``Request``s
that ``LLM.make_sequence`` validated, that the scheduler has checked would fit the KV cache, and whose explicit
``max_tokens`` fits the context: the engine thread only queues them.

Two bounds keep one request from costing more than the longest prompt the model accepts:

- ``max_prompt_chars``: a text longer than this cannot tokenize into fewer than ``max_model_len`` tokens, so it
  is refused before any of it is tokenized. Each token stands for at most ``L`` characters, ``L`` the longest
  token string of the vocabulary (its byte-level or SentencePiece form is never shorter than the text it decodes
  to; special tokens such as ``<|endoftext|>`` count with their full text), so ``t`` tokens cover at most
  ``t * L`` characters. A tokenizer with a normalizer may fold several characters into one (Unicode
  composition), so the bound is four times looser there.
- ``max_body_bytes``: the longest such prompt in JSON (up to 12 bytes a character, as a client that escapes
  non-ASCII writes an astral character as a ``\\uXXXX`` pair), plus 1 MiB for the rest of a request (token-id
  prompts, a scoring harness's windows, the other fields).

The tokenizer here is a copy of the model's, used by one worker thread: a Hugging Face fast tokenizer refuses
("Already borrowed") to be used from two threads when one of them changes its settings, and the engine thread
decodes with the original.
"""

from __future__ import annotations

import asyncio
import copy
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from minifer.entrypoints.openai.protocol import (
    Echo,
    RequestError,
    bool_field,
    chat_messages,
    check_room,
    completion_prompts,
    echo_mode,
    engine_error_param,
    ignored_fields,
    max_tokens_field,
    sampling_params,
    stream_flags,
)
from minifer.model_loader import chat_token_ids
from minifer.request import Request

# Completions per HTTP request (n times the prompts): the engine thread, which serves every client, creates them
# all at once, so a request for 100,000 would stall everyone else (offline, LLM.generate has no such limit).
MAX_COMPLETIONS_PER_REQUEST = 256


def max_token_chars(tokenizer) -> int:
    """``L``: the most characters one token can stand for (module docstring), 4x with a normalizer."""
    longest = max(len(t) for t in tokenizer.get_vocab())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest * (4 if backend is None or backend.normalizer is not None else 1)


@dataclass
class Prepared:
    """A completions or chat request, ready for the engine: its sequences and how to answer."""

    request_id: str
    model: str
    chat: bool
    seqs: list[Request]
    n: int
    stream: bool
    include_usage: bool
    echo: Echo | None
    echoed: dict[str, dict[str, str]] = field(default_factory=dict)  # engine id -> the prompt's text and first token
    top_logprobs: int = 0
    ignored: list[str] = field(default_factory=list)  # unknown fields the request carried

    @property
    def ids(self) -> list[str]:
        return [s.request_id for s in self.seqs]


class Preprocessor:
    """Turns request bodies into ``Prepared`` requests for ``llm``, which serves under ``served_names``."""

    def __init__(self, llm, served_names: list[str], chat_template: str | None = None) -> None:
        self.tokenizer = copy.deepcopy(llm.tokenizer) if llm.tokenizer is not None else None
        if chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("a chat template needs a tokenizer, and this model has none")
            self.tokenizer.chat_template = chat_template
        self.served_names = list(served_names)
        self.max_model_len, self.max_num_seqs = llm.max_model_len, llm.max_num_seqs
        self.max_prompt_chars = (max_token_chars(self.tokenizer) * self.max_model_len if self.tokenizer is not None
                                 else 0)
        self.max_body_bytes = 12 * self.max_prompt_chars + 2**20
        self._make_sequence = llm.make_sequence
        self._check_fits = llm.engine.scheduler.check_fits  # reads the cache's size and the config only
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minifer-preprocess")

    async def run(self, fn, *args):
        """``fn(*args)`` on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- parsing ------------------------------------------------------------------------------------------

    @staticmethod
    def parse(raw: bytes) -> dict[str, Any]:
        """A JSON object from a body. Python's parser recurses per nesting level and refuses integers of more than
        4,300 digits; both are the client's error (400), not the server's."""
        if not raw.strip():
            raise RequestError("the body is empty: send a JSON object")
        try:
            body = json.loads(raw)
        except RecursionError:
            raise RequestError("the body is not valid JSON: nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:  # ValueError covers the digit limit of int()
            raise RequestError(f"the body is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def check_model(self, body: dict[str, Any], required: bool = True) -> str:
        if "model" not in body or body["model"] is None:
            if required:
                raise RequestError("missing field 'model'", "model")
            return self.served_names[0]
        if not isinstance(body["model"], str):
            raise RequestError("model must be a string: the name of a served model", "model")
        if body["model"] not in self.served_names:
            raise RequestError(f"model {body['model'][:100]!r} is not served here; this server serves "
                               f"{', '.join(map(repr, self.served_names))}", "model", HTTPStatus.NOT_FOUND)
        return body["model"]

    # --- tokenizing -----------------------------------------------------------------------------------------

    def _check_text(self, text: str, where: str, param: str) -> None:
        """Refuse, before tokenizing, a text that is not Unicode (a lone surrogate, which JSON's ``\\ud800`` can
        write) or that cannot tokenize into fewer than ``max_model_len`` tokens."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{where} is not valid Unicode: {e.reason} at character {e.start}", param) from None
        if len(text) > self.max_prompt_chars:
            raise RequestError(f"{where} has {len(text):,} characters: more than any text of at most max_model_len="
                               f"{self.max_model_len} tokens can have ({self.max_prompt_chars:,} characters with this "
                               "tokenizer)", param)

    def encode(self, text: str, where: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"{where} is text but this model has no tokenizer (dummy weights?): send token ids",
                               param)
        self._check_text(text, where, param)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions, or start the "
                               "server with --chat-template", "messages")
        for i, m in enumerate(messages):
            self._check_text(m["content"], f"messages[{i}].content", "messages")
        if sum(len(m["content"]) for m in messages) > self.max_prompt_chars:
            raise RequestError(f"the messages have more than {self.max_prompt_chars:,} characters in all: more than "
                               f"max_model_len={self.max_model_len} tokens can hold", "messages")
        try:
            return chat_token_ids(self.tokenizer, messages)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages (jinja raises its own)
            raise RequestError(f"the chat template failed on these messages: {e}", "messages") from None

    # --- the routes' work ---------------------------------------------------------------------------------------

    def completion(self, raw: bytes, chat: bool, request_id: str, arrival: float) -> Prepared:
        """A /v1/completions or /v1/chat/completions body, parsed, checked and tokenized."""
        body = self.parse(raw)
        model = self.check_model(body)
        echo = echo_mode(body, chat=chat)
        params = sampling_params(body, chat=chat, echo=echo)
        prompts = [None] if chat else completion_prompts(body)
        messages = chat_messages(body) if chat else None
        if params.n > self.max_num_seqs:
            raise RequestError(f"n={params.n} is more than max_num_seqs={self.max_num_seqs}, the sequences this server "
                               "runs at once (and while other requests wait, one request's completions run in at most "
                               "half of them)", "n")
        if params.n * len(prompts) > MAX_COMPLETIONS_PER_REQUEST:
            raise RequestError(f"n={params.n} for {len(prompts)} prompt(s) asks for {params.n * len(prompts)} "
                               f"completions; this server makes at most {MAX_COMPLETIONS_PER_REQUEST} per request", "n")
        stream, include_usage = stream_flags(body)
        prompt_field = "messages" if chat else "prompt"
        mt_field = max_tokens_field(body)
        logprobs_field = "top_logprobs" if chat and body.get("top_logprobs") else "logprobs"
        out = Prepared(request_id, model, chat, [], params.n, stream, include_usage, echo,
                       top_logprobs=params.logprobs or 0, ignored=ignored_fields(body))
        for i, prompt in enumerate(prompts):
            rid = f"{request_id}-{i}"
            if chat:
                text, ids = None, self.encode_chat(messages)
            elif isinstance(prompt, str):
                text, ids = prompt, self.encode(prompt, f"prompt {i}", "prompt")
                if not ids:
                    raise RequestError(f"prompt {i} is empty: it tokenizes to no tokens (this tokenizer adds no BOS "
                                       "token)", "prompt")
            else:
                text, ids = None, prompt["prompt_token_ids"]
            try:
                seq = self._make_sequence(i, {"prompt_token_ids": ids, "prompt": text}, params, request_id=rid)
            except (ValueError, TypeError) as e:
                raise RequestError(str(e), engine_error_param(str(e), prompt_field, logprobs_field)) from None
            seq.metrics.arrival_time = arrival
            if mt_field is not None:
                check_room(seq, mt_field)
            try:
                self._check_fits(seq)
            except ValueError as e:
                raise RequestError(f"prompt {i}: {e}", mt_field or prompt_field) from None
            if echo is not None:
                out.echoed[rid] = self._echoed(text, ids)
            out.seqs.append(seq)
        return out

    def _echoed(self, text: str | None, ids: list[int]) -> dict[str, str]:
        """What echoing a prompt needs decoded: its text (a text prompt as sent, token ids decoded, BOS included,
        as vLLM echoes them) and its first token's text (the one no logprob covers)."""
        if self.tokenizer is None:
            return {"text": text or "", "first": str(ids[0])}
        first = self.tokenizer.decode(ids[:1])
        return {"text": text if text is not None else self.tokenizer.decode(ids), "first": first}

    def tokenize(self, raw: bytes) -> dict[str, Any]:
        """vLLM's /tokenize: ``prompt`` (with ``add_special_tokens``, default true) or chat ``messages``."""
        body = self.parse(raw)
        self.check_model(body, required=False)
        if "messages" in body:
            ids = self.encode_chat(chat_messages(body))
        elif isinstance(body.get("prompt"), str):
            special = bool_field(body, "add_special_tokens", True)
            ids = self.encode(body["prompt"], "prompt", "prompt", add_special_tokens=special)
        else:
            raise RequestError("send 'prompt' (a string) or 'messages'", "prompt")
        strs = None
        if bool_field(body, "return_token_strs", False):
            strs = self.tokenizer.convert_ids_to_tokens(ids)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, raw: bytes) -> dict[str, Any]:
        """vLLM's /detokenize: ``tokens`` (token ids) to text."""
        body = self.parse(raw)
        self.check_model(body, required=False)
        ids = body.get("tokens")
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer (dummy weights?)", "tokens")
        vocab = len(self.tokenizer)
        if not isinstance(ids, list) or len(ids) > self.max_model_len or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise RequestError(f"tokens must be a list of at most {self.max_model_len} token ids in [0, {vocab})",
                               "tokens")
        return {"prompt": self.tokenizer.decode(ids)}

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the arguments the tokenizer was built with (its config: special tokens,
        ``model_max_length`` ...), less its files' paths, with ``tokenizer_class`` and the chat template in use."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer (dummy weights?)", status=HTTPStatus.NOT_FOUND)
        config = {k: v for k, v in self.tokenizer.init_kwargs.items() if k not in ("vocab_file", "merges_file")}
        config = json.loads(json.dumps(config, default=lambda v: getattr(v, "content", str(v))))  # AddedToken: text
        template = getattr(self.tokenizer, "chat_template", None)
        return {**config, "tokenizer_class": type(self.tokenizer).__name__, **({"chat_template": template}
                                                                                 if template else {})}


__all__ = ["MAX_COMPLETIONS_PER_REQUEST", "Prepared", "Preprocessor", "max_token_chars"]
