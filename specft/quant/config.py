"""One quant config: weight, activation and KV-cache specs, and which modules they cover."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from specft.quant.fake_quant import TensorQuantSpec
from specft.quant.rotation import RotationSpec


@dataclass
class QuantConfig:
    name: str = MISSING
    weight: TensorQuantSpec | None = None
    activation: TensorQuantSpec | None = None
    kv: TensorQuantSpec | None = None  # the target's KV cache (keys after RoPE, values)
    # QuaRot-style rotations folded into (and run inside) the target before it is quantized.
    rotation: RotationSpec | None = None
    # Module-name globs kept in high precision (lm_head, embeddings, MoE router).
    exclude: list[str] = field(default_factory=lambda: ["lm_head", "*embed_tokens*", "*.mlp.gate"])
    # Samples run through the model to calibrate static (dynamic: false) activation scales.
    calibration_samples: int = 16
    # quant=checkpoint: nothing is emulated; the target runs as its quantized checkpoint
    # (model.path) says it is served (specft/quantized_checkpoints/).
    from_checkpoint: bool = False

    @property
    def needs_calibration(self) -> bool:
        return any(s is not None and not s.dynamic for s in (self.activation, self.kv))


def load_quant_config(name: str, field: str = "quant") -> QuantConfig:
    """A config from conf/quant/ by name (the draft's QAT spec names one)."""
    from omegaconf import OmegaConf

    from specft.common.errors import ConfigError
    from specft.common.paths import conf_dir

    path = conf_dir() / "quant" / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ConfigError(f"{field}: unknown quant config {name!r}; allowed: {known}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), OmegaConf.load(path)))
