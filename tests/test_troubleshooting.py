"""docs/troubleshooting.md lists every refusal the code can print (issue 33): each
SpecftError / ConfigError message in specft/ is found there by its longest fixed part."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_RAISE = re.compile(r'(?:SpecftError|ConfigError)\(((?:\s*f?"(?:[^"\\]|\\.)*"\s*(?:\+\s*)?)+)', re.S)
_STRING = re.compile(r'f?"((?:[^"\\]|\\.)*)"')
_FIELD = re.compile(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")  # an f-string's {...}, one level nested


def refusal_messages() -> list[tuple[str, str]]:
    """(file, message with each {...} as '…') for every error raised with a literal text."""
    out = []
    for path in sorted((REPO / "specft").rglob("*.py")):
        for m in _RAISE.finditer(path.read_text()):
            text = "".join(_STRING.findall(m.group(1)))
            out.append((str(path.relative_to(REPO)), _FIELD.sub("…", text)))
    return out


def _fixed_part(message: str) -> str:
    return max((p.strip(" ;:,(") for p in message.split("…")), key=len)


def test_the_extraction_finds_the_refusals():
    messages = refusal_messages()
    assert len(messages) > 90
    assert ("specft/common/paths.py",
            "SPECFT_HOME: set but empty; unset it (default ~/.cache/specft) or give a directory") in messages


def test_every_refusal_is_in_troubleshooting():
    doc = (REPO / "docs" / "troubleshooting.md").read_text()
    missing = [f"{file}: {msg}" for file, msg in refusal_messages()
               if len(_fixed_part(msg)) >= 12 and _fixed_part(msg) not in doc]
    assert not missing, "not in docs/troubleshooting.md:\n" + "\n".join(missing)
