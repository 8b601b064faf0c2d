"""Dataclass schemas for every config group, and validation that runs before any model
loads. A bad value raises ConfigError with one line naming the field and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specft.errors import ConfigError
from specft.quant.fake_quant import MX_SCALE_RULES, SCHEMES, TensorQuantSpec
from specft.quant.formats import ELEMENT_FORMATS, FloatFormat, IntFormat
from specft.quant.spec import QuantConfig

MODEL_SOURCES = ("hf", "gguf", "tiny", "smollm2_package")
MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
DTYPES = ("float32", "float64", "bfloat16", "float16")
CACHE_DTYPES = ("bf16", "fp16", "fp32", "fp8")
PRECISIONS = ("fp32", "bf16")
VAL_DATA = ("split", "heldout")
VOCAB_FILLS = ("seen", "prior")


@dataclass
class ModelConfig:
    name: str = MISSING
    source: str = "hf"  # see MODEL_SOURCES
    path: str | None = None  # local HF directory or hub id (source=hf)
    gguf_file: str | None = None  # file name inside `path`, or an absolute path
    family: str = "llama"
    num_layers: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    head_dim: int | None = None
    vocab_size: int = MISSING
    num_experts: int = 0
    experts_top_k: int = 0
    tie_word_embeddings: bool = False
    # 0-based decoder layers whose outputs feed the draft; null: EAGLE-3's 1, N//2-1, N-4.
    aux_layer_ids: list[int] | None = None
    dtype: str = "float32"


@dataclass
class RegenerateConfig:
    """Replace assistant turns with the (quantized) target's own answers, the text the
    draft will have to predict at serving time."""
    enabled: bool = False
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    batch_size: int = 8
    seed: int = 0


@dataclass
class DataConfig:
    name: str = "synthetic"
    path: str | None = None  # file, or a dataset id for name=hf
    num_samples: int = 256  # cap after filtering and splitting
    max_seq_len: int = 512
    overlength: str = "truncate"  # truncate | drop
    seed: int = 0  # shuffle and train/validation assignment
    system_prompt: str | None = None
    # Qwen3-style templates: null leaves the template's default; true/false sets enable_thinking.
    thinking: bool | None = None
    # Record fields (jsonl and hf sources): an OpenAI-style messages list, or a prompt/response pair.
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    hf_split: str = "train"  # name=hf: the dataset's own split
    hf_config: str | None = None
    # Which part of the seeded train/validation split to use: all | train | validation.
    split: str = "all"
    val_fraction: float = 0.05
    dedup: bool = True  # drop conversations whose text repeats an earlier one
    min_turns: int = 2  # messages, system excluded
    max_turns: int | None = None
    min_response_chars: int = 1
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    # name=mix: several sources in one run, each a dict of the fields above that differ
    # (name, path, num_samples, max_turns, ...); each is selected on its own, then joined.
    mix: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class CacheConfig:
    root: str = "cache"
    dir: str | None = None  # null: <root>/<model>-<quant>-<provenance hash>
    dtype: str = "bf16"
    samples_per_shard: int = 64
    batch_size: int = 8
    # How the target is laid out across ranks (target/sharding.py): none | zero3 | tp | device_map.
    sharding: str = "none"
    tp_size: int | None = None  # sharding=tp: ranks per model group (null: all ranks)


@dataclass
class DraftConfig:
    name: str = "eagle3"
    vocab_size: int = 32000
    # When the training answers hold fewer distinct tokens than vocab_size: seen shrinks
    # the vocabulary to them; prior fills the free slots with the tokens the target itself
    # rates most likely over the cached text (train/vocab_prior.py).
    vocab_fill: str = "seen"
    num_layers: int = 1  # eagle3: decoder layers (the first reads 2H); mtp: 1
    intermediate_size: int | None = None  # null: the target's
    # null: the target's. An eagle3 draft of another width reads the target's features
    # through fc (3 x target hidden -> hidden) and learns its own token embedding.
    hidden_size: int | None = None
    # Attention shape; null: the target's.
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    ttt_steps: int = 7
    step_weight_decay: float = 0.8  # TTT step k's loss weight: decay ** k ...
    step_weights: list[float] | None = None  # ... unless given explicitly, one per step
    qk_norm: bool | None = None  # null: follow the target family (Qwen3: yes)
    # Quantization-aware training of the draft: the name of a conf/quant config whose
    # weight and activation specs the draft's linear layers are trained through (STE).
    quant: str | None = None


@dataclass
class LossConfig:
    name: str = "kl"
    # Weighted mixture {loss: weight}; empty (or null): {name: 1.0}. Names: kl, lk, tv,
    # ce, hidden. Empty by default: Hydra cannot merge a dict override into a null field.
    terms: dict[str, float] | None = field(default_factory=dict)


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    micro_batch_size: int = 4
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    zero_stage: int = 0
    precision: str = "fp32"
    nproc: int = 1  # ranks per node
    # Multi-node: a DeepSpeed hostfile ("host slots=N" per line); nproc ranks on each of
    # num_nodes hosts (null: every host in the file). See docs/scale.md.
    hostfile: str | None = None
    num_nodes: int | None = None
    save_every: int = 100
    keep_last: int = 2
    log_every: int = 1
    resume: bool = True
    # What validation reads. split: a share val_fraction of the training cache. heldout:
    # val_samples conversations from the data's validation side (needs data.split=train),
    # answers regenerated by the target, in a cache of their own: the validation replays
    # greedy decoding on them at eval.k and predicts what `specft eval` counts.
    val_data: str = "split"
    val_fraction: float = 0.05  # val_data=split: share of cached samples held out
    val_samples: int = 32  # val_data=heldout: held-out conversations
    val_every: int = 0  # steps between validations; 0: only at the end
    val_batches: int = 8  # micro-batches per validation
    # Target logits are recomputed a chunk of vocabulary rows at a time (large vocabularies:
    # Qwen's 152k never materialize [B, T, V]); smaller chunks, less memory.
    vocab_chunk: int = 65536
    # The frozen target lm_head: whole on every rank ("replicated"), or 1/nranks of its rows
    # per rank ("sharded"; for large vocabularies, see specft/train/target_head.py).
    target_head: str = "replicated"
    # Robustness studies. feature_noise: Gaussian noise, relative to each token's feature
    # RMS, added to the cached features while training. mix_quant: a second quant config
    # whose target's cache supplies a share mix_fraction of the training samples (e.g.
    # bf16 features mixed into mxfp4 training).
    feature_noise: float = 0.0
    mix_quant: str | None = None
    mix_fraction: float = 0.5


@dataclass
class LoggerConfig:
    name: str = "jsonl"
    project: str = "specft"
    mode: str | None = None  # wandb mode; null: online with an API key, else offline


@dataclass
class EvalConfig:
    """`specft eval`: decode prompts from `data` with the quantized target, alone and with
    each draft, for every k and batch size."""
    drafts: list[str] = field(default_factory=list)  # checkpoint dirs; empty: this run's final draft
    labels: list[str] | None = None  # one per draft; null: the folder names
    target_alone: bool = True
    k: list[int] = field(default_factory=lambda: [3, 4, 5])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    num_prompts: int = 16
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    min_confidence: float = 0.0  # > 0: a row stops drafting when the draft's top-1 falls below
    dtype: str = "float32"  # float64 makes greedy decoding exact against the reference
    out_dir: str | None = None  # null: <run_dir>/eval
    seed: int = 0


@dataclass
class PlanConfig:
    """`specft plan`: memory per rank and cache write rate for stage 1, from the config."""
    devices: list[int] = field(default_factory=lambda: [8, 16, 32])
    strategy: str = "zero3"  # zero3 | tp
    device_memory_gb: float = 64.0  # Ascend 910B: 64; H100: 80; H200: 141
    headroom: float = 0.9  # share of device memory a plan may use
    device_tflops: float = 300.0  # dense bf16 FLOP/s the forward reaches before MFU
    mfu: float = 0.4
    with_kv: bool = False  # count a KV cache (regeneration); capture runs without one


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    run_dir: str = MISSING
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # git SHA, command: written at launch


SCHEMA_NAME = "specft_schema"


def register_schema() -> None:
    """Make the schema the base of conf/config.yaml: every field exists (overridable
    without '+') and is type-checked as Hydra composes."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RootConfig)


def to_schema(cfg: DictConfig | dict) -> RootConfig:
    """Merge a composed config onto the schema (type-checks every field) and validate."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), cfg)
        root: RootConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        msg = str(err).splitlines()[0]
        raise ConfigError(f"{key}: {msg}" if key else msg) from None
    validate(root)
    return root


def _choice(value: Any, allowed, field_name: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{field_name}: {value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")


def _positive(value: int | float, field_name: str) -> None:
    if value <= 0:
        raise ConfigError(f"{field_name}: must be > 0, got {value}")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [1, num_layers // 2 - 1, num_layers - 4]


def aux_layer_ids(model: ModelConfig) -> list[int]:
    return list(model.aux_layer_ids) if model.aux_layer_ids is not None else default_aux_layer_ids(model.num_layers)


def validate_model(m: ModelConfig) -> None:
    _choice(m.source, MODEL_SOURCES, "model.source")
    _choice(m.family, MODEL_FAMILIES, "model.family")
    _choice(m.dtype, DTYPES, "model.dtype")
    for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size"):
        _positive(getattr(m, name), f"model.{name}")
    if m.source == "hf" and not m.path:
        raise ConfigError("model.path: required for model.source=hf (a local directory or a hub id)")
    ids = aux_layer_ids(m)
    if len(ids) != 3:
        raise ConfigError(f"model.aux_layer_ids: EAGLE-3 fuses 3 layers, got {len(ids)}: {ids}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"model.aux_layer_ids: each layer once; got {ids} (three distinct layers, "
                          f"e.g. {default_aux_layer_ids(m.num_layers)})")
    for i in ids:
        if not 0 <= i < m.num_layers:
            raise ConfigError(f"model.aux_layer_ids: layer {i} is past the model's depth; "
                              f"allowed: 0..{m.num_layers - 1} ({m.name} has {m.num_layers} layers)")


# Hardware block formats need whole blocks along the reduction dim; group and block
# scales pad a partial last group, as serving kernels do.
HARDWARE_BLOCK_SCHEMES = ("mx", "nvfp4")


def _validate_tensor_spec(spec: TensorQuantSpec, prefix: str, model: ModelConfig) -> None:
    _choice(spec.format, sorted(ELEMENT_FORMATS), f"{prefix}.format")
    _choice(spec.scheme, SCHEMES, f"{prefix}.scheme")
    fmt = ELEMENT_FORMATS[spec.format]
    if spec.scheme == "mx":
        _choice(spec.scale_rule, MX_SCALE_RULES, f"{prefix}.scale_rule")
        if not isinstance(fmt, FloatFormat):
            raise ConfigError(f"{prefix}.format: MX blocks need e4m3, e5m2 or e2m1, got {spec.format!r}")
    if spec.scheme == "nvfp4" and spec.format != "e2m1":
        raise ConfigError(f"{prefix}.format: nvfp4 uses e2m1 elements, got {spec.format!r}")
    if not spec.symmetric and not isinstance(fmt, IntFormat):
        raise ConfigError(f"{prefix}.symmetric: asymmetric (zero point) needs int4 or int8, got {spec.format!r}")
    if not spec.dynamic and spec.scheme != "tensor":
        raise ConfigError(f"{prefix}.dynamic: static scales are per tensor; set scheme=tensor, got {spec.scheme!r}")
    _positive(spec.block_size, f"{prefix}.block_size")
    if spec.scheme in HARDWARE_BLOCK_SCHEMES:
        for dim_name in ("hidden_size", "intermediate_size"):
            dim = getattr(model, dim_name)
            if dim % spec.block_size:
                raise ConfigError(f"{prefix}.block_size must divide {dim_name}={dim}, got {spec.block_size}")


def validate(cfg: RootConfig) -> None:
    validate_model(cfg.model)
    if cfg.quant.weight is not None:
        _validate_tensor_spec(cfg.quant.weight, "quant.weight", cfg.model)
    if cfg.quant.activation is not None:
        _validate_tensor_spec(cfg.quant.activation, "quant.activation", cfg.model)
        if cfg.quant.activation.scheme == "block":
            raise ConfigError("quant.activation.scheme: block (B x B) scales are for weights; "
                              "use group for activations")
    if cfg.quant.kv is not None:
        _validate_tensor_spec(cfg.quant.kv, "quant.kv", cfg.model)
        _choice(cfg.quant.kv.scheme, ("tensor", "token"), "quant.kv.scheme")
    _choice(cfg.cache.dtype, CACHE_DTYPES, "cache.dtype")
    _positive(cfg.cache.samples_per_shard, "cache.samples_per_shard")
    _positive(cfg.cache.batch_size, "cache.batch_size")
    from specft.target.sharding import SHARDINGS

    SHARDINGS.get(cfg.cache.sharding, "cache.sharding")
    if cfg.cache.tp_size is not None:
        _positive(cfg.cache.tp_size, "cache.tp_size")
    _positive(cfg.data.num_samples, "data.num_samples")
    _positive(cfg.data.max_seq_len, "data.max_seq_len")
    _positive(cfg.draft.vocab_size, "draft.vocab_size")
    _positive(cfg.draft.ttt_steps, "draft.ttt_steps")
    _positive(cfg.trainer.vocab_chunk, "trainer.vocab_chunk")
    from specft.train.target_head import HEAD_PLACEMENTS

    _choice(cfg.trainer.target_head, HEAD_PLACEMENTS, "trainer.target_head")
    if cfg.trainer.hostfile is not None:
        from pathlib import Path

        if not Path(cfg.trainer.hostfile).is_file():
            raise ConfigError(f"trainer.hostfile: no such file: {cfg.trainer.hostfile}")
    if cfg.trainer.num_nodes is not None:
        _positive(cfg.trainer.num_nodes, "trainer.num_nodes")
    _positive(cfg.draft.num_layers, "draft.num_layers")
    if cfg.draft.name == "mtp" and cfg.draft.hidden_size not in (None, cfg.model.hidden_size):
        raise ConfigError(f"draft.hidden_size: an mtp module shares the target's head, so its width is "
                          f"the target's ({cfg.model.hidden_size}); got {cfg.draft.hidden_size}")
    if cfg.draft.name == "mtp" and cfg.draft.num_layers != 1:
        raise ConfigError(f"draft.num_layers: an mtp module has one decoder layer; allowed: 1, "
                          f"got {cfg.draft.num_layers}")
    heads = cfg.draft.num_heads or cfg.model.num_heads
    kv = cfg.draft.num_kv_heads or (cfg.model.num_kv_heads if not cfg.draft.num_heads else heads)
    if heads % kv:
        raise ConfigError(f"draft.num_kv_heads: must divide num_heads={heads}, got {kv}")
    t = cfg.trainer
    for name in ("max_steps", "micro_batch_size", "grad_accum", "lr", "nproc", "save_every", "keep_last", "log_every"):
        _positive(getattr(t, name), f"trainer.{name}")
    _choice(t.zero_stage, (0, 1, 2, 3), "trainer.zero_stage")
    _choice(t.precision, PRECISIONS, "trainer.precision")
    _choice(cfg.logger.name, ("jsonl", "wandb"), "logger.name")
    # Registries are checked late-bound so config.py does not import the heavy stages.
    from specft.draft import DRAFT_HEADS
    from specft.train.losses import LOSSES

    DRAFT_HEADS.get(cfg.draft.name, "draft.name")
    for name in (cfg.loss.terms or {cfg.loss.name: 1.0}):
        LOSSES.get(name, "loss.terms" if cfg.loss.terms else "loss.name")
    if not 0.0 <= t.val_fraction < 1.0:
        raise ConfigError(f"trainer.val_fraction: must be in [0, 1), got {t.val_fraction}")
    _choice(t.val_data, VAL_DATA, "trainer.val_data")
    _choice(cfg.draft.vocab_fill, VOCAB_FILLS, "draft.vocab_fill")
    _positive(t.val_samples, "trainer.val_samples")
    if t.val_data == "heldout" and cfg.data.split != "train":
        raise ConfigError(f"trainer.val_data=heldout validates on the data's validation side, which "
                          f"data.split={cfg.data.split} trains on; set data.split=train")
    if cfg.draft.step_weights is not None and len(cfg.draft.step_weights) != cfg.draft.ttt_steps:
        raise ConfigError(f"draft.step_weights: one weight per TTT step; draft.ttt_steps="
                          f"{cfg.draft.ttt_steps}, got {len(cfg.draft.step_weights)}")
    if t.feature_noise < 0:
        raise ConfigError(f"trainer.feature_noise: must be >= 0, got {t.feature_noise}")
    if not 0.0 < t.mix_fraction < 1.0:
        raise ConfigError(f"trainer.mix_fraction: must be in (0, 1), got {t.mix_fraction}")
    from specft.quant.spec import load_quant_config

    if cfg.draft.quant is not None:
        load_quant_config(cfg.draft.quant, "draft.quant")
    if t.mix_quant is not None:
        load_quant_config(t.mix_quant, "trainer.mix_quant")
    _validate_data(cfg.data)
    _validate_eval(cfg.eval)
    _choice(cfg.plan.strategy, ("zero3", "tp"), "plan.strategy")
    for n in cfg.plan.devices:
        _positive(n, "plan.devices")


def _validate_eval(e: EvalConfig) -> None:
    for k in e.k:
        if not 1 <= k <= 16:
            raise ConfigError(f"eval.k: draft lengths must be in 1..16, got {k}")
    for b in e.batch_sizes:
        _positive(b, "eval.batch_sizes")
    _positive(e.num_prompts, "eval.num_prompts")
    _positive(e.max_new_tokens, "eval.max_new_tokens")
    _choice(e.dtype, ("float32", "float64", "bfloat16"), "eval.dtype")
    if e.labels is not None and len(e.labels) != len(e.drafts):
        raise ConfigError(f"eval.labels: one label per draft; {len(e.drafts)} drafts, {len(e.labels)} labels")
    if e.temperature < 0 or not 0 < e.top_p <= 1 or e.top_k < 0:
        raise ConfigError(f"eval: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                          f"{e.temperature}, {e.top_p}, {e.top_k}")
    if not 0 <= e.min_confidence < 1:
        raise ConfigError(f"eval.min_confidence: must be in [0, 1), got {e.min_confidence}")


SPLITS = ("all", "train", "validation")


def _validate_data(d: DataConfig) -> None:
    from specft.data import mix_members
    from specft.data.sources import DATA_SOURCES

    if d.name == "mix":
        for member in mix_members(d):
            _validate_data(member)
        return
    DATA_SOURCES.get(d.name, "data.name")
    if d.name != "synthetic" and not d.path:
        raise ConfigError(f"data.path: required for data.name={d.name}")
    _choice(d.split, SPLITS, "data.split")
    _choice(d.overlength, ("truncate", "drop"), "data.overlength")
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in [0, 1), got {d.val_fraction}")
    if d.split == "validation" and d.val_fraction == 0:
        raise ConfigError("data.split=validation needs data.val_fraction > 0")
    _positive(d.min_turns, "data.min_turns")
    r = d.regenerate
    _positive(r.max_new_tokens, "data.regenerate.max_new_tokens")
    _positive(r.batch_size, "data.regenerate.batch_size")
    if r.temperature < 0 or not 0 < r.top_p <= 1 or r.top_k < 0:
        raise ConfigError(f"data.regenerate: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                          f"{r.temperature}, {r.top_p}, {r.top_k}")
