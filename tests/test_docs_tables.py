"""What the docs' tables say runs or is refused is what the code's registries say (#63): a
type, family or format moved in the code without its row (or the other way round) fails
here, not in a user's hands."""

import re
from pathlib import Path

import pytest

from specft.quantized_checkpoints import CHECKPOINT_FORMATS
from specft.quantized_checkpoints.ggml_activations import VEC_DOT_TYPE

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS_MD = (ROOT / "docs" / "checkpoints.md").read_text()
README = (ROOT / "README.md").read_text()
GGML_TYPE = re.compile(r"\b(F32|F16|BF16|Q[2-8]_[01K]|Q[2-6]_K(?:_[SML])?|IQ[1-4]_(?:XXS|XS|S|M|NL)|MXFP4|NVFP4"
                       r"|TQ[12]_0)\b")


def _types(cell: str) -> set[str]:
    """ggml type names in a table cell, a range Q2_K-Q6_K expanded, a llama-quantize mix
    (Q4_K_M) read as its base type."""
    cell = re.sub(r"Q(\d)_K-Q(\d)_K", lambda m: " ".join(f"Q{i}_K" for i in range(int(m[1]), int(m[2]) + 1)), cell)
    return {re.sub(r"_K_[SML]$", "_K", t) for t in GGML_TYPE.findall(cell)}


def _gguf_rows() -> list[list[str]]:
    """docs/checkpoints.md's GGUF rows: from the family's first row to the next family."""
    lines = CHECKPOINTS_MD.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| GGUF (llama.cpp"))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("| |"))
    return [[c.strip() for c in r.strip("|").split("|")] for r in lines[start:end]]


# the activation type each GGUF row names -> ggml's vec_dot_type
ROW_ACTIVATIONS = {"F16 (BF16 for BF16 weights), or Q8_0 blocks of 32": {"F16", "BF16", "Q8_0"},
                   "Q8_1 blocks": {"Q8_1"}, "Q8_K superblocks": {"Q8_K"}}


def test_every_gguf_type_the_docs_say_runs_runs_with_the_activations_they_name():
    rows = _gguf_rows()
    running = [r for r in rows if "**runs**" in r[-1]]
    assert len(running) == 3, rows
    named = set()
    for row in running:
        types = _types(row[1])
        activations = next(v for k, v in ROW_ACTIVATIONS.items() if row[3].startswith(k))
        for t in types:
            assert t in VEC_DOT_TYPE, f"docs/checkpoints.md says {t} runs; the code has no activation path for it"
            assert VEC_DOT_TYPE[t] in activations, (t, VEC_DOT_TYPE[t], row[3])
        named |= types
    readme_row = next(ln for ln in README.splitlines() if ln.startswith("| GGUF (llama.cpp"))
    # README also lists F32 (float weights, float inputs: nothing to round)
    assert _types(readme_row.split("|")[2]) - {"F32"} == named, "README's GGUF row and docs/checkpoints.md's differ"
    # every type the code runs is in the docs (F32 is the norms', never a matmul weight's)
    assert set(VEC_DOT_TYPE) - {"F32"} <= named


def test_every_gguf_type_the_docs_call_refused_is_refused():
    refused_row = next(r for r in _gguf_rows() if "refused" in r[-1])
    # a type refused in one place only (an IQ4_XS token embedding) runs elsewhere
    refused = _types(re.sub(r"an? \w+ token embedding", "", refused_row[1])) | \
        ({"TQ1_0", "TQ2_0"} if "TQ types" in refused_row[1] else set())
    assert {"IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"} <= refused
    assert not refused & set(VEC_DOT_TYPE)
    readme = README[README.index("Recognized and refused in one line"):][:800]
    assert "the TQ and IQ1 GGUF types" in readme


# docs/checkpoints.md's family column (its start) -> the registry's name
FAMILY_ROWS = {"compressed-tensors": "compressed-tensors", "HF fine-grained FP8": "hf-fp8", "GPTQ": "gptq",
               "AWQ": "awq", "gpt-oss MXFP4": "gpt-oss-mxfp4", "NVIDIA ModelOpt": "modelopt",
               "msModelSlim": "msmodelslim", "GGUF": "gguf"}
REFUSED_FAMILIES = {"AutoRound's own format": "autoround", "bitsandbytes": "bitsandbytes", "HQQ": "hqq",
                    "Quark": "quark"}


def _family_cells() -> list[str]:
    return [ln.split("|")[1].strip() for ln in CHECKPOINTS_MD.splitlines()
            if ln.startswith("| ") and not ln.startswith("| |") and "|---" not in ln]


def test_the_docs_families_are_the_registered_ones_and_say_whether_they_run():
    cells = _family_cells()
    for prefix, name in FAMILY_ROWS.items():
        assert any(c.startswith(prefix) for c in cells), f"docs/checkpoints.md has no row for {prefix}"
        assert CHECKPOINT_FORMATS.get(name).supported, name
    refused = next(c for c in cells if c.startswith("AutoRound's own format"))
    for label, name in REFUSED_FAMILIES.items():
        assert label in refused
        assert not CHECKPOINT_FORMATS.get(name).supported, name
    assert set(CHECKPOINT_FORMATS.names) == set(FAMILY_ROWS.values()) | set(REFUSED_FAMILIES.values())


@pytest.mark.parametrize("name", sorted(FAMILY_ROWS))
def test_each_running_familys_row_says_runs(name):
    lines = CHECKPOINTS_MD.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {name}"))
    assert "**runs**" in lines[start], lines[start][:200]
