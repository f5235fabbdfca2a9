"""Text <-> token ids for the server: chat template, prompt encoding, EOS ids, token strings."""
from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from transformers import AutoTokenizer

from server.errors import bad_request

# Used when the checkpoint's tokenizer_config.json has no chat_template: one turn per message,
# each "<|role|>\n...\n", then an open assistant turn. Documented in the README section.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    def __init__(self, model_dir: str, trust_remote_code: bool = False) -> None:
        self.hf = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        self.eos_token_ids = _eos_token_ids(self.hf, Path(model_dir))
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        # transformers clears a truncation setting from tokenizer.json on the first encode, a write that
        # would race the decodes of other requests if it first happened on a worker thread.
        self.encode("")

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        template = None if self.has_chat_template else FALLBACK_CHAT_TEMPLATE
        try:
            text = self.hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                               add_generation_prompt=True)
        except TemplateError as exc:  # e.g. a template that insists on alternating roles
            raise bad_request(f"the model's chat template rejected these messages: {exc}", "messages") from exc
        # The template already wrote BOS and friends where the model wants them.
        return self.encode(text, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs show it (bytes of a split character become U+FFFD)."""
        return self.hf.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _eos_token_ids(hf, model_dir: Path) -> tuple[int, ...]:
    """EOS from the tokenizer plus generation_config.json's list (chat models end turns with several)."""
    ids = {hf.eos_token_id} if hf.eos_token_id is not None else set()
    gen_config = model_dir / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))
