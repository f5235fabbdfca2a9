"""Text <-> token ids for the server: chat template, prompt encoding, EOS ids, token strings."""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer

from moe_serve.engine.gguf import tokenizer_source
from moe_serve.server.errors import bad_request

# Used when the checkpoint's tokenizer_config.json has no chat_template: one turn per message,
# each "<|role|>\n...\n", then an open assistant turn. Documented in the README section.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    def __init__(self, model_dir: str, trust_remote_code: bool = False, *, tokenizer_dir: str | None = None,
                 chat_template: str | None = None) -> None:
        """tokenizer_dir: where the tokenizer files are when not in model_dir (--tokenizer); either may
        be a GGUF file, whose metadata holds its tokenizer (converted once, then read from the cache:
        gguf/tokenizer_cache.py); chat_template: template text replacing the checkpoint's (--chat-template)."""
        folder, kwargs = tokenizer_source(tokenizer_dir or model_dir)
        self.hf = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **kwargs)
        if chat_template is not None:
            self.hf.chat_template = chat_template
        self.eos_token_ids = _eos_token_ids(self.hf, Path(model_dir))
        self._token_texts: dict[int, str] = {}  # token_text's answers: at most one per vocabulary entry
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        # names apply_chat_template and the template's render already use: not for chat_template_kwargs
        self._template_names = (set(inspect.signature(self.hf.apply_chat_template).parameters)
                                | {"messages"} | set(self.hf.special_tokens_map))
        # transformers clears a truncation setting from tokenizer.json on the first encode, a write that
        # would race the decodes of other requests if it first happened on a worker thread.
        self.encode("")

    def chat_prompt_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                        tools: list[dict] | None = None) -> list[int]:
        """template_kwargs: more variables for the template (chat_template_kwargs: enable_thinking, ...);
        tools: OpenAI tool objects for the template to render."""
        template = None if self.has_chat_template else FALLBACK_CHAT_TEMPLATE
        taken = sorted(set(template_kwargs or {}) & self._template_names)
        if taken:
            raise bad_request(f"chat_template_kwargs may not set '{taken[0]}'", "chat_template_kwargs")
        try:
            text = self.hf.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message, **(template_kwargs or {}))
        except TemplateError as exc:  # e.g. a template that insists on alternating roles
            raise bad_request(f"the model's chat template rejected these messages: {exc}", "messages") from exc
        except ValueError as exc:  # continue_final_message: the rendered prompt does not end with the message
            raise bad_request(f"cannot continue the final message: {exc}", "continue_final_message") from exc
        # The template already wrote BOS and friends where the model wants them.
        return self.encode(text, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    @property
    def backend(self):
        """The Rust tokenizer behind a fast tokenizer (incremental decoding runs in it), else None."""
        return getattr(self.hf, "backend_tokenizer", None)

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs show it (bytes of a split character become U+FFFD).

        Kept once computed: with top_logprobs=5 every generated token asks for six, the same few
        thousand over and over, and each decode through transformers costs several microseconds of
        the event loop that every stream shares."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.hf.decode([token_id], skip_special_tokens=False,
                                                                 clean_up_tokenization_spaces=False)
        return text


def _eos_token_ids(hf, model_dir: Path) -> tuple[int, ...]:
    """EOS from the tokenizer plus generation_config.json's list (chat models end turns with several)."""
    ids = {hf.eos_token_id} if hf.eos_token_id is not None else set()
    gen_config = model_dir / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))
