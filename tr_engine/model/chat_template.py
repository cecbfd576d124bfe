"""Chat templates: the Jinja `chat_template` of tokenizer_config.json, rendered the way Hugging Face renders it,
or a built-in Vicuna v1.1 template for Vicuna folders that ship none.
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tr_engine.errors import UserError

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
# FastChat's "vicuna_v1.1": "SYSTEM USER: hi ASSISTANT: hello</s>USER: …" (a space after the system prompt and
# after each user turn, "</s>" after each assistant turn).
VICUNA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% set turns = messages[1:] %}"
    '{% else %}{{ "' + VICUNA_SYSTEM + '" }}{% set turns = messages %}{% endif %}{{ " " }}'
    "{% for m in turns %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# For base models with no template: plain "User:/Assistant:" turns.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # Jinja text
    name: str  # "model", "vicuna_v1.1" or "plain"
    bos_token: str
    eos_token: str

    @classmethod
    def from_config(cls, folder: Path, tokenizer_config: dict, bos: str, eos: str) -> "ChatTemplate":
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):  # some folders ship [{"name": "default", "template": …}, …]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if not template and jinja_file.is_file():
            template = jinja_file.read_text()
        if template:
            return cls(template, "model", bos, eos)
        if "vicuna" in _model_identity(folder):
            return cls(VICUNA_TEMPLATE, "vicuna_v1.1", bos, eos)
        return cls(PLAIN_TEMPLATE, "plain", bos, eos)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return _compile(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except UserError:  # the template's own raise_exception
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            raise UserError(f"the model's chat template cannot render this conversation ({type(e).__name__}: {e}); "
                            "fix tokenizer_config.json's chat_template or pass --no-template")


def _raise_exception(message):
    raise UserError(f"the chat template refused the conversation: {message}")


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    """Compile a template once (every chat turn renders it), in Hugging Face's sandboxed environment."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def _model_identity(folder: Path) -> str:
    """Lower-cased folder name and config `_name_or_path`: enough to recognise a Vicuna checkpoint."""
    name = folder.resolve().name.lower()
    try:
        name += " " + str(json.loads((folder / "config.json").read_text()).get("_name_or_path", "")).lower()
    except (OSError, json.JSONDecodeError):
        pass
    return name
