"""Processor artifacts (tokenizer, feature/image/video preprocessor configs, chat template).

Every variant gets them so ``AutoTokenizer.from_pretrained(out)`` (and ``AutoProcessor`` where
torchvision allows) resolves from the output alone. The hub ships the chat template
processor-level in ``chat_template.json``; ``AutoTokenizer`` only auto-loads
``chat_template.jinja``, so we unpack it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omni_extract.errors import ExtractError

# Copied verbatim when present in the source directory.
ARTIFACT_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
)
# At least one of these must exist, or the output could not be tokenised.
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "vocab.json")


def copy_processor_artifacts(src: Path, dst: Path) -> list[str]:
    """Copy the artifacts of ``src`` into ``dst`` and unpack the chat template; return file names."""
    if not any((src / f).is_file() for f in TOKENIZER_FILES):
        raise ExtractError(
            f"{src}: no tokenizer files ({' or '.join(TOKENIZER_FILES)}); the output would not "
            "resolve with AutoTokenizer"
        )
    written = []
    for name in ARTIFACT_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            written.append(name)
    packed = src / "chat_template.json"
    if packed.is_file() and not (src / "chat_template.jinja").is_file():
        try:
            template = json.loads(packed.read_text())["chat_template"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ExtractError(
                f"{packed}: expected an object with key 'chat_template' ({exc})"
            ) from exc
        if not isinstance(template, str):
            raise ExtractError(
                f"{packed}: 'chat_template' is {type(template).__name__}, expected a string"
            )
        (dst / "chat_template.jinja").write_text(template)
        written.append("chat_template.jinja")
    return written
