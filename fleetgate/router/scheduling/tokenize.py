"""A request's prompt as the engine's own token ids, so the router's blocks are its blocks.

The exact prefix view (:mod:`fleetgate.router.scheduling.kvindex`) keys blocks by
token ids; a request can only be matched against it once its prompt is token ids
the engine would compute. :func:`prompt_token_ids` does that for one request body:

* completions with a token-id prompt: the ids as sent (no tokenizer needed);
* completions with a text prompt: :meth:`Tokenizer.encode_text` (special tokens as
  the engine adds them: vLLM's ``add_special_tokens`` defaults to true here);
* chat: :meth:`Tokenizer.encode_chat` (the model's chat template, the generation
  prompt appended unless the body says otherwise; vLLM's chat default does not add
  special tokens again, the template already holds BOS).

A batch of prompts is placed by its first one (as the approximate view does).
Anything the tokenizer cannot render (image parts, a template error) gives None:
the request is then scored by the approximate view, never refused here (the
engine judges the body).

One implementation for real and emulated engines alike, :class:`HfTokenizer`: the
Hugging Face ``tokenizers`` library over a model's ``tokenizer.json`` plus its Jinja
chat template rendered the way transformers' ``apply_chat_template`` does for the
common case (files are read by ``fleetgate.router.tokenizer_files``, this class gets
their contents). The emulator ships its tokenizer in that format
(``fleetgate/sim/emulator-tokenizer/``, config ``kind: emulator``).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from fleetgate.router.scheduling.tokencache import Encoded, PrefixTokenCache

Messages = Sequence[Mapping[str, Any]]


class TokenizeError(ValueError):
    """The request's prompt cannot be rendered by this tokenizer (score it approximately)."""


class Tokenizer(Protocol):
    """A model's tokenizer and chat template, as its engine applies them."""

    kind: str
    off_loop: bool
    """Encoding releases the GIL, so a large prompt is worth tokenizing in a thread."""

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completions prompt."""
        ...

    def encode_chat(
        self,
        messages: Messages,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a chat conversation through the model's chat template."""
        ...


def prompt_token_ids(doc: Mapping[str, Any], tokenizer: Tokenizer | None) -> list[int] | None:
    """The engine's token ids of ``doc``'s prompt, or None (no tokenizer / cannot render)."""
    try:
        return _prompt_token_ids(doc, tokenizer)
    except (TokenizeError, TypeError, ValueError, KeyError, AttributeError):
        return None


def _bool(doc: Mapping[str, Any], key: str, default: bool) -> bool:
    value = doc.get(key, default)
    return value if isinstance(value, bool) else default


def _prompt_token_ids(doc: Mapping[str, Any], tokenizer: Tokenizer | None) -> list[int] | None:
    messages = doc.get("messages")
    if isinstance(messages, list):
        if tokenizer is None:
            return None
        if not all(isinstance(m, Mapping) for m in messages):
            return None
        return tokenizer.encode_chat(
            messages,
            tools=doc.get("tools"),
            add_generation_prompt=_bool(doc, "add_generation_prompt", True),
            continue_final_message=_bool(doc, "continue_final_message", False),
            add_special_tokens=_bool(doc, "add_special_tokens", False),
        )
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch: the first prompt decides placement
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return None
    if isinstance(prompt, str) and tokenizer is not None:
        return tokenizer.encode_text(
            prompt, add_special_tokens=_bool(doc, "add_special_tokens", True)
        )
    return None


# ------------------------------------------------------------- Hugging Face


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def chat_template_of(config: Mapping[str, Any], template_file: str | None) -> str | None:
    """The chat template: tokenizer_config.json's ``chat_template`` (a string, or a
    list of named templates: the ``default`` one) else ``chat_template.jinja``."""
    found = config.get("chat_template")
    if isinstance(found, str):
        return found
    if isinstance(found, list):
        for item in found:
            if isinstance(item, Mapping) and item.get("name") == "default":
                return str(item.get("template"))
    return template_file


class HfTokenizer:
    """``tokenizers`` over tokenizer.json + the Jinja chat template (see module doc).

    Rendering follows transformers' ``apply_chat_template`` for the common case: a
    sandboxed Jinja environment with ``trim_blocks`` / ``lstrip_blocks`` and the
    loop-controls extension, ``tojson``, ``raise_exception`` and ``strftime_now``
    (the injected ``now``);
    variables ``messages``, ``tools``, ``add_generation_prompt`` and the special
    tokens of tokenizer_config.json (``bos_token``, ``eos_token``, ...). Text content
    parts are joined with newlines (vLLM's "string" content format); any other part
    raises :class:`TokenizeError`.
    """

    kind = "hf"
    off_loop = True

    def __init__(
        self,
        tokenizer_json: str,
        config: Mapping[str, Any],
        chat_template: str | None,
        *,
        now: Callable[[], datetime] = datetime.now,
        prefix_cache: bool = True,
    ) -> None:
        import jinja2
        import jinja2.sandbox
        from tokenizers import Tokenizer as _HfTok

        self._tok = _HfTok.from_str(tokenizer_json)
        # Prompts share long prefixes: reuse their ids (tokencache.py). Not with
        # truncation or padding configured in the file: they act on the whole text.
        self.prefix_cache: PrefixTokenCache | None = None
        self._around: tuple[list[int], list[int]] | None = None
        if prefix_cache and self._tok.truncation is None and self._tok.padding is None:
            self.prefix_cache = PrefixTokenCache(self._encode_plain)
            self._around = self._specials_around()
        self.specials = {
            k: t
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (t := _token_text(config.get(k))) is not None
        }
        self.template_source = chat_template
        self._template: Any = None
        if chat_template is not None:

            def raise_exception(message: str) -> None:
                raise TokenizeError(f"chat template: {message}")

            def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
                return json.dumps(value, indent=indent, ensure_ascii=False)

            def strftime_now(fmt: str) -> str:
                return now().strftime(fmt)  # some templates print today's date

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            try:
                self._template = env.from_string(chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"the chat template does not parse: {e}") from None

    def _encode(self, text: str, add_special_tokens: bool) -> Any:
        # encode_batch releases the GIL while it encodes (encode does not), so a large
        # prompt tokenized in a thread leaves the event loop running
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def _encode_plain(self, text: str) -> Encoded:
        enc = self._encode(text, False)
        return enc.ids, enc.offsets, enc.word_ids

    def _specials_around(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor puts before and after a prompt's own ids when
        special tokens are added (e.g. BOS), or None when it does more than that."""
        probe = "fleet gate"
        plain = list(self._encode(probe, False).ids)
        full = list(self._encode(probe, True).ids)
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                return full[:i], full[i + len(plain) :]
        return None

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        cache = self.prefix_cache
        if cache is None or (add_special_tokens and self._around is None):
            return list(self._encode(text, add_special_tokens).ids)
        ids = cache.encode(text)
        if add_special_tokens and self._around is not None:
            before, after = self._around
            return [*before, *ids, *after]
        return ids

    def render_chat(
        self,
        messages: Messages,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The chat template's text for ``messages`` (what the engine then tokenizes)."""
        import jinja2

        if self._template is None:
            raise TokenizeError("this model has no chat template")
        clean = [{**m, "content": _hf_content(m.get("content"))} for m in messages]
        try:
            text = self._template.render(
                messages=clean,
                tools=tools,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **self.specials,
            )
        except jinja2.TemplateError as e:
            raise TokenizeError(f"chat template: {e}") from None
        if continue_final_message and clean and isinstance(clean[-1]["content"], str):
            # end the text at the last message's content, as transformers does
            last: str = clean[-1]["content"]
            cut = text.rfind(last.strip())
            if not last.strip() or cut < 0:
                raise TokenizeError("continue_final_message: the final message is not in the text")
            keep = len(last.lstrip()) if text[cut:].startswith(last.lstrip()) else len(last.strip())
            text = text[: cut + keep]
        return str(text)

    def encode_chat(
        self,
        messages: Messages,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return self.encode_text(text, add_special_tokens=add_special_tokens)


def _hf_content(content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise TokenizeError("only text content parts can be tokenized")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise TokenizeError("message content must be a string or a list of text parts")
