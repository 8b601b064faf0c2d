"""Dataclass schemas for every config group (validation: specft/commands/validate.py).

This module imports no stage of specft, so every stage can import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from specft.quant.config import QuantConfig

MODEL_SOURCES = ("hf", "gguf", "tiny", "smollm2_package")
MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
DTYPES = ("float32", "float64", "bfloat16", "float16")  # model.dtype also takes "auto"
EVAL_DTYPES = ("float32", "float64", "bfloat16")  # eval.dtype also takes "auto"
CACHE_DTYPES = ("bf16", "fp16", "fp32", "fp8")
# fp32; bf16: DeepSpeed's bf16 mode (bf16 weights, fp32 master copies in the optimizer);
# amp_bf16: float32 weights, the draft's forward under bf16 autocast (fast only where the
# device computes bf16 natively: device.native_bf16).
PRECISIONS = ("fp32", "bf16", "amp_bf16")
GSM8K_ANSWERS = ("clean",)  # data.gsm8k_answers (null: as written)
VAL_DATA = ("split", "heldout")
VOCAB_FILLS = ("seen", "prior")
DRAFT_INITS = ("random", "target_layer")


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
    # auto: bfloat16 where the device computes it natively, else float32 (specft/device.py);
    # resolved when the config is read, so caches, keys and run configs hold what ran.
    dtype: str = "float32"
    # quant=checkpoint: "dense" dequantizes every quantized layer when the checkpoint loads;
    # "packed" keeps each at its stored width (codes and scales, ~1 byte per parameter for
    # FP8, ~0.5 for INT4) and dequantizes one layer at a time in the forward: the same
    # numbers, bit for bit, in a fraction of the memory, at some speed.
    checkpoint_weights: str = "dense"


@dataclass
class AnswerServerConfig:
    """data.regenerate.engine=server: an OpenAI-compatible server (llama-server, vLLM,
    SGLang) serving the checkpoint answers the prompts (engines/openai_server.py)."""
    url: str | None = None  # http://HOST:PORT, the server's /v1 routes below it
    model: str | None = None  # the served model's name; null: the first /v1/models lists
    concurrency: int = 8  # requests in flight (the server batches them)
    timeout_s: float = 600.0  # one answer
    connect_timeout_s: float = 30.0  # the first call (/v1/models): a server that is not up
    retries: int = 3  # per request, on a dropped connection or a 429/5xx; waits 1, 2, 4 s
    api_key_env: str | None = None  # the environment variable holding the API key, if any


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
    # The share of conversations the target answers (a seeded choice); the rest keep the
    # dataset's fixed text, cached at teacher-forced speed. null: all of them.
    fraction: float | None = None
    # Reuse answers that other caches in cache.root made for the same questions under the
    # same target and generation settings (data/answer_store.py); false answers afresh.
    reuse: bool = True
    # Who answers (engines/: an engine with the answers role): specft's own engine over the loaded target, or
    # a server serving the checkpoint (data.regenerate.server).
    engine: str = "specft"
    server: AnswerServerConfig = field(default_factory=AnswerServerConfig)


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
    # name=gsm8k: null keeps the reference solutions as written; clean drops their
    # <<48/2=24>> calculator notes and writes the closing "#### 72" as "The answer is 72."
    # (text a chat model would write, for training on fixed text).
    gsm8k_answers: str | None = None
    # A data.mix member's: its conversations keep their text as written when data.regenerate
    # is on, while the target answers the other members' (fixed text beside the target's
    # own answers, at stage-1 speed). Only a member sets it.
    keep_text: bool = False
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
    # A cache another specft process is building: false refuses in one line naming it;
    # true waits for that process to end, then reads the cache (or finishes it).
    wait: bool = False
    # What computes the features (engines/: an engine with the features role): torch (specft's emulation of the
    # served target) or llamacpp (llama.cpp itself on a GGUF target, through its probe).
    engine: str = "torch"


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
    ttt_steps: int = 3  # measured best of 3 / 5 / 7 (docs/results.md, part 4)
    step_weight_decay: float = 0.8  # TTT step k's loss weight: decay ** k ...
    step_weights: list[float] | None = None  # ... unless given explicitly, one per step
    qk_norm: bool | None = None  # null: follow the target family (Qwen3: yes)
    # random, or target_layer: the decoder layer starts from the target's layer init_layer
    # (null: its last), read from the target's 16-bit checkpoint (drafts/init.py).
    init: str = "random"
    init_layer: int | None = None
    # Quantization-aware training of the draft: the name of a conf/quant config whose
    # weight and activation specs the draft's linear layers are trained through (STE).
    quant: str | None = None
    # The architecture's own settings (e.g. peagle's mask_token_id); each architecture
    # names and checks its keys (DraftArch.options).
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class LossConfig:
    name: str = "kl"
    # Weighted mixture {loss: weight}; empty (or null): {name: 1.0}. Names: kl, lk, tv,
    # ce, hidden. Empty by default: Hydra cannot merge a dict override into a null field.
    terms: dict[str, float] | None = field(default_factory=dict)
    # On-policy: step j's loss counts only where the draft's proposals at steps 0..j-1
    # from the same position were verified by the target (its argmax): the positions a
    # round of decoding reaches. Off: every position at every step (plain TTT).
    on_policy: bool = False


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
    # Multi-node without ssh: the same command on every node, each with its node_rank
    # (0..num_nodes-1) and node 0's address; each starts its own nproc ranks (DeepSpeed's
    # --no_ssh). Node 0 holds the locks and writes the run config. See docs/scale.md.
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int = 29500
    # How long the ranks wait for each other at node 0 (master_addr:master_port) before
    # one line says which address failed; the collective timeout after that is DeepSpeed's.
    rendezvous_timeout_s: float = 300.0
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
    # Where the target's features come from: cache (stage 1 writes them to disk, stage 2
    # reads them) or online (the served target runs inside training and computes them
    # as steps read them; nothing is cached). See train/online.py.
    features: str = "cache"
    # Online only: the target answers the prompts again for every epoch (sampled, with
    # data.regenerate's temperature and a seed per epoch), so each epoch trains on new
    # answers. Epoch 0's are the usual ones.
    regenerate_every_epoch: bool = False
    # A rotated target (QuaRot): train the draft in the unrotated basis (stage 2 reads its
    # features, embedding and head times R1^T) and write drafts with R1 folded in, so they
    # read the served states. "target": R1 from the quant config's rotation or the
    # checkpoint's saved matrix; else a .safetensors file with R1. See train/unrotate.py.
    unrotate: str | None = None


# pipeline.FEATURES' names, for validate.py, which must not import the stages.
FEATURE_SOURCES = ("cache", "online")


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
    # auto: the target's dtype (model.dtype); float64 makes greedy decoding exact against
    # the reference
    dtype: str = "auto"
    out_dir: str | None = None  # null: <run_dir>/eval
    seed: int = 0
    device: str = "auto"  # auto (an NPU, else a GPU, else the CPU) | cpu | cuda | npu


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
    # Cache or online (trainer.features): the cache's size for data sets of these many
    # samples of tokens_per_sample tokens (null: data.max_seq_len) against what training
    # online adds: the target's forward over every step's tokens.
    samples: list[int] = field(default_factory=lambda: [10_000, 100_000, 1_000_000])
    tokens_per_sample: int | None = None


@dataclass
class DistanceConfig:
    """`specft distance`: how far the served target (model + quant) is from its 16-bit
    model, on held-out conversations of `data`, teacher-forced."""
    reference: str | None = None  # the 16-bit model's checkpoint directory (required)
    sequences: int = 32  # held-out conversations (data's validation side), each cut to data.max_seq_len
    out: str | None = None  # a directory for distance.json (null: print only)
    # an existing draft (checkpoint folder or run dir): its acceptance at k against each of
    # the two targets, on eval's prompts (eval.num_prompts, eval.max_new_tokens, greedy)
    draft: str | None = None
    k: int = 3


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
    distance: DistanceConfig = field(default_factory=DistanceConfig)
    run_dir: str = MISSING
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # git SHA, command: written at launch


SCHEMA_NAME = "specft_schema"


def register_schema() -> None:
    """Make the schema the base of conf/config.yaml: every field exists (overridable
    without '+') and is type-checked as Hydra composes."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RootConfig)
    if not OmegaConf.has_resolver("specft_dirname"):
        OmegaConf.register_new_resolver("specft_dirname", job_dir_name)
    if not OmegaConf.has_resolver("specft_model_name"):
        OmegaConf.register_new_resolver("specft_model_name", model_name_from_path)


def model_name_from_path(path: str | None) -> str:
    """model=hf's name: the checkpoint folder's name, or a .gguf file's stem (runs/ and
    cache/ are named by it)."""
    from pathlib import Path

    if not path:
        return "hf"
    path = Path(str(path)).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


JOB_DIR_MAX_CHARS = 96


def job_dir_name(overrides: str) -> str:
    """A multirun job's folder name from its overrides ("data.path=/a/b.jsonl,quant=fp8"):
    one folder, not one per '/' of a path (a path keeps its last two parts), and a long
    name cut with a hash of the whole, so two jobs never share a folder."""
    import hashlib

    if not overrides:
        return "job"
    items = []
    for item in overrides.split(","):
        key, eq, value = item.partition("=")
        if "/" in value:
            value = "_".join(p for p in value.rstrip("/").split("/")[-2:] if p)
        items.append(f"{key}{eq}{value}")
    name = ",".join(items).lstrip(".")
    if len(name) > JOB_DIR_MAX_CHARS or name != overrides:
        digest = hashlib.sha256(overrides.encode()).hexdigest()[:8]
        name = f"{name[: JOB_DIR_MAX_CHARS - 9]}-{digest}"
    return name


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [1, num_layers // 2 - 1, num_layers - 4]


def aux_layer_ids(model: ModelConfig) -> list[int]:
    return list(model.aux_layer_ids) if model.aux_layer_ids is not None else default_aux_layer_ids(model.num_layers)
