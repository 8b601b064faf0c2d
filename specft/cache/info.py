"""`specft info CACHE_DIR`: what a cache holds, finished or not."""

from __future__ import annotations

from pathlib import Path

from specft.cache.integrity import Damage, find_damage
from specft.cache.manifest import MANIFEST, read_json
from specft.common.errors import SpecftError
from specft.quant.fake_quant import SCHEMES


def describe(cache_dir: str | Path, verify: bool = False) -> tuple[str, list[Damage]]:
    """(the description, the damaged files of a complete cache): sizes always, checksums
    of a random sample of shards, or of every file with ``verify``."""
    d = Path(cache_dir)
    manifest = d / MANIFEST
    progress = sorted(d.glob("progress-r*.json"))
    damage: list[Damage] = []
    if manifest.exists():
        m = read_json(manifest)
        if not isinstance(m, dict) or "shards" not in m:
            raise SpecftError(f"info: {manifest} is not a specft manifest; `specft cache` with the same settings "
                              "rebuilds it")
        damage = find_damage(d, m, verify=verify) if m.get("complete") else []
        state = "complete" if m.get("complete") else "incomplete"
        if damage:
            state = f"DAMAGED: {len(damage)} file(s)"
        elif verify and m.get("complete"):
            state = "complete, every checksum verified"
        shards, prov = m["shards"], m["provenance"]
    elif progress:
        parts = [read_json(p) for p in progress]
        state, prov = f"in progress ({len(parts)} rank(s) started)", parts[0]["provenance"]
        shards = [s for p in parts for s in p["shards"]]
    else:
        raise SpecftError(f"info: {d} holds no specft cache (no {MANIFEST} or progress files)")
    samples = sum(s["num_samples"] for s in shards)
    tokens = sum(s["num_tokens"] for s in shards)
    on_disk = sum((d / s["file"]).stat().st_size for s in shards if (d / s["file"]).exists())
    q = prov["quant"]
    lines = [
        f"cache      {d} ({state})",
        f"model      {prov['model']['name']} ({prov['model']['family']}, {prov['model']['num_layers']} layers, "
        f"hidden {prov['model']['hidden_size']}, vocab {prov['model']['vocab_size']})",
        _quant_line(d, q),
        f"layers     aux {prov['aux_layer_ids']} + final post-norm hidden",
        f"data       {prov['data']['name']} {prov['data']['path'] or ''} (num_samples {prov['data']['num_samples']}, "
        f"max_seq_len {prov['data']['max_seq_len']}, seed {prov['data']['seed']})",
        f"storage    {prov['dtype']}, {len(shards)} shards, {on_disk / 1e6:.1f} MB, "
        f"{on_disk / max(tokens, 1):.0f} bytes/token",
        f"contents   {samples} samples, {tokens} tokens",
        *(f"damaged    {x.file}: {x.why}" for x in damage),
    ]
    return "\n".join(lines), damage


def _quant_line(d: Path, q: dict) -> str:
    """The emulated specs, or (quant=checkpoint) the checkpoint's family and schemes as
    the build recorded them in quant_report.json."""
    report = d / "quant_report.json"
    checkpoint = read_json(report).get("checkpoint") if report.exists() else None
    if checkpoint:
        return (f"quant      {q['name']}: {checkpoint['family']} ({checkpoint['summary']}), "
                f"{len(checkpoint['layers'])} layers quantized, ignored {checkpoint['ignored'] or 'none'}")
    rotation = q.get("rotation")
    order = ("residual", "head", "online_qk", "online_down")  # R1..R4 (the manifest sorts its keys)
    rotated = ", rotated: " + ", ".join(f"{k} {rotation[k]}" for k in order if rotation.get(k)) if rotation else ""
    return (f"quant      {q['name']} (weight {_spec(q['weight'])}, activation {_spec(q['activation'])}, "
            f"kv {_spec(q.get('kv'))}{rotated})")


def _spec(spec: dict | None) -> str:
    if not spec:
        return "none"
    scheme = SCHEMES.get(spec["scheme"])
    extra = f"/{spec['block_size']}" if scheme is not None and scheme.blocked else ""
    return f"{spec['format']} {spec['scheme']}{extra}"
