"""Chat templates: the GGUF's ``tokenizer.chat_template`` (a Jinja2 template, as Hugging Face
ships it) rendered as transformers renders it: jinja2's ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` / ``lstrip_blocks`` and the loop-controls extension, the ``tojson`` filter without
HTML escaping, and the ``raise_exception`` / ``strftime_now`` globals."""
from __future__ import annotations

import json
from datetime import datetime

from .errors import bad_request


class ChatTemplateError(ValueError):
    """A template that does not compile (the server refuses to start with it)."""


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = ""):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict], *, tools=None, add_generation_prompt: bool = True) -> str:
        """The prompt text; a template error (e.g. its own ``raise_exception`` on roles that do
        not alternate) or a sandbox violation is a 400."""
        import jinja2
        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.exceptions.SecurityError as e:
            raise bad_request(f"the chat template refused these messages (sandbox): {e}",
                              "messages", "chat_template_error") from None
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError,
                AttributeError, IndexError) as e:
            raise bad_request(f"the chat template failed on these messages: {e}", "messages",
                              "chat_template_error") from None
        except RecursionError:
            raise bad_request("the chat template failed on these messages: too deeply nested",
                              "messages", "chat_template_error") from None


def model_template(engine, override: str | None = None) -> ChatTemplate | None:
    """The engine's chat template (``override``: a template text that replaces it), or None
    when the model has none."""
    source = override if override is not None else engine.gguf.metadata.get("tokenizer.chat_template")
    if not source:
        return None
    if not isinstance(source, str):
        raise ChatTemplateError("tokenizer.chat_template is not a string")
    tok = engine.tokenizer

    def text(i):
        if i is None or not 0 <= i < len(tok.tokens):
            return ""
        return tok.tokens[i]
    return ChatTemplate(source, bos_token=text(tok.bos_id), eos_token=text(tok.eos_id))
