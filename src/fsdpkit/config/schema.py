"""The typed configuration schema. Every field carries a docstring right under it; `fsdpkit
config docs` prints them and the docs' config reference is generated from them.

YAML files under `conf/` layer values on top of these defaults (see compose.py); anything a
YAML file or an override sets that is not declared here is rejected when the config is
composed, before any process starts. The `checkpoint` group is the checkpoint library's own
settings class (fsdpkit.checkpoint.settings.CheckpointConfig), documented and validated there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdpkit.checkpoint.settings import CheckpointConfig

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
STATE_DICT_TYPES = ("sharded", "full")
MIXED_PRECISION_PRESETS = ("fp32", "bf16-mixed", "bf16-true")
PACKING = ("true", "false", "concat")
OVERLONG = ("truncate", "drop", "split")


@dataclass
class StrategyConfig:
    """How FSDP2 shards (model-agnostic; `conf/strategy/*.yaml`)."""

    sharding_strategy: str = "FULL_SHARD"
    """FULL_SHARD: shard params, grads, optimizer state, reshard after forward. SHARD_GRAD_OP: keep
    params unsharded between forward and backward (reshard_after_forward=False). NO_SHARD: replicate
    everything, all-reduce grads (a (world, 1) mesh). HYBRID_SHARD: shard within groups of
    `hsdp_shard_size` ranks, replicate across groups (2-D mesh)."""
    reshard_after_forward: bool | None = None
    """Override the strategy's reshard-after-forward choice for every wrapped unit; null derives it
    from `sharding_strategy` (true for FULL_SHARD/HYBRID_SHARD, false otherwise). The root is never
    resharded after forward (its params are needed first in backward)."""
    hsdp_shard_size: int = 0
    """HYBRID_SHARD only: ranks per shard group, usually the GPUs of one node. 0 means
    LOCAL_WORLD_SIZE. Must divide the world size."""
    cpu_offload: bool = False
    """Keep sharded params, grads and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy; the
    optimizer step runs on CPU). Pinned memory is used only when CUDA is available."""
    state_dict_type: str = "sharded"
    """How checkpoints store the state: `sharded` (default: each rank writes its own shards with DCP)
    or `full` (gathered to rank 0 in CPU memory with full_state_dict + cpu_offload and written as
    safetensors by rank 0; loaded on rank 0 and broadcast). Either kind resumes at any world size."""


@dataclass
class PolicyConfig:
    """Model-specific FSDP knobs, usually set by an experiment file."""

    auto_wrap_policy: list[str] = field(default_factory=lambda: ["auto"])
    """`auto` (the model's own block classes: those its `_no_split_modules` names, as Accelerate
    wraps them; the decoder layers) and/or dotted class paths; every module that is an instance of
    one becomes its own FSDP unit (`fully_shard`, bottom-up), then the root is sharded. A list that
    matches no module is an error; one that leaves most parameters in the root unit is a warning."""
    activation_checkpointing_policy: list[str] = field(default_factory=list)
    """`auto` (as for auto_wrap_policy) and/or dotted class paths whose modules recompute
    activations in backward (their forward runs under non-reentrant `torch.utils.checkpoint`, in
    place, so parameter names stay unchanged; with train.compile the checkpoint is compiled with the
    block). Empty: no activation checkpointing."""
    mixed_precision: Any = "fp32"
    """The one source of truth for dtypes: a preset name (`fp32`; `bf16-mixed`: bf16 params in
    forward/backward, fp32 gradient reduction, fp32 outputs and buffers, fp32 master weights;
    `bf16-true`: bf16 params and reduction) or a mapping with `_target_` naming a factory that
    returns a torch MixedPrecisionPolicy. There is no separate autocast option."""


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning through the `peft` library (model.kind=hf only)."""

    method: str = "none"
    """`none`: train every parameter. `lora`: freeze the model and train LoRA adapters injected
    into `target_modules` (sharded with the model by fully_shard; checkpoints hold the frozen base
    too, so they resume on their own). `fsdpkit ckpt export --adapter` writes the adapter for
    `peft.PeftModel.from_pretrained`, `--merge` the merged model."""
    r: int = 8
    """LoRA rank."""
    alpha: float = 16.0
    """LoRA alpha; the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Module names (last component) that get adapters, e.g. [q_proj, k_proj, v_proj, o_proj]."""


@dataclass
class ModelConfig:
    """The model to train (`conf/model/*.yaml`)."""

    kind: str = "llama"
    """`llama`: fsdpkit's reference Llama (Hugging Face LlamaForCausalLM parameter names).
    `hf`: any transformers causal LM, from a model folder (`path`) or from `hf_config` (needs the
    `hf` extra). `model=hf model.path=DIR` selects it."""
    path: str = ""
    """kind=hf: a Hugging Face model folder (`config.json` and safetensors weights, as
    `save_pretrained` writes them). The model is built from its `config.json` exactly as
    `AutoConfig.from_pretrained` reads it, on the meta device, and each rank loads only its own
    slices of the weights (see `pretrained`). The folder's tokenizer is the default
    `data.tokenizer`. The vocabulary, width and every other field come from the folder: the
    `vocab_size`, `hidden_size`, ... fields above do not apply."""
    pretrained: bool = True
    """With `path`: start from the folder's weights (fine-tuning). false: a random, seeded init of
    the folder's architecture (pretraining it from scratch); only its config.json is read."""
    attn_implementation: str = ""
    """kind=hf: the attention kernel transformers runs (`eager`, `sdpa`, `flex_attention`, ... as
    far as the architecture supports it). Empty: what transformers picks for that model."""
    vocab_size: int = 512
    """Vocabulary size (rows of the embedding and of lm_head)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 344
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int = 2
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """Query heads; must divide hidden_size."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA); must divide num_attention_heads."""
    max_position_embeddings: int = 2048
    """Longest sequence the RoPE tables are built for."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """Share one matrix between model.embed_tokens and lm_head."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of linear and embedding weights."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """kind=hf without `path`: keyword arguments of `transformers.AutoConfig.for_model` (must
    include `model_type`, e.g. `llama`). With `path`: fields that override the folder's
    config.json (`model.hf_config.rope_theta=1e6`), each one logged. A run records here the whole
    config it trained with: what its checkpoints and exports carry."""
    init_from: str = ""
    """`hf:<dir>`: start from the weights of a Hugging Face safetensors folder (model.safetensors
    or shards with an index) instead of a random init; each rank reads only the slices it owns,
    converted to the parameter dtype. The folder may be an fsspec URL (`hf:s3://bucket/model`;
    ranged GETs of each rank's rows, credentials as for checkpoint.dir). Keys and shapes must match the
    model. Ignored when the run resumes from a checkpoint. Empty: random init from seed."""
    resize_to_tokenizer: bool = False
    """data.kind=hf: when data.tokenizer has more tokens than the model's vocabulary, grow the
    embedding and lm_head to the tokenizer's size instead of refusing to start. New rows get the
    seeded init; with model.init_from the folder's rows are loaded into the first rows."""
    peft: PeftConfig = field(default_factory=PeftConfig)
    """Adapters (LoRA) instead of full fine-tuning."""


@dataclass
class DataConfig:
    """Training data (`conf/data/*.yaml`)."""

    kind: str = "synthetic"
    """`synthetic`: a built-in deterministic corpus with learnable structure (no download).
    `tokens`: a flat binary file of token ids (nanoGPT-style, read by numpy memmap).
    `text`: a UTF-8 text file, tokenized to bytes (vocabulary 256).
    `hf`: local jsonl/json/parquet/csv/text files through the `datasets` library, tokenized with
    `tokenizer` into a shared cache (needs the `hf` extra)."""
    path: str = ""
    """File to read for kind=tokens or kind=text."""
    files: list[str] = field(default_factory=list)
    """kind=hf: data files or globs (e.g. `[data/*.jsonl]`; one may be given alone: `chat.jsonl`),
    read in sorted order."""
    val_files: list[str] = field(default_factory=list)
    """kind=hf: validation files or globs; empty: the last `val_fraction` of the documents of `files`."""
    format: str = "auto"
    """kind=hf: `auto` (from the files' extension: .jsonl/.json, .parquet, .csv, .txt), `json`,
    `parquet`, `csv` or `text` (one document per line)."""
    tokenizer: str = ""
    """kind=hf: a folder holding a Hugging Face tokenizer (tokenizer.json, as `save_pretrained`
    writes it; read with no network access), or a hub id when the machine has network. Its size
    must not exceed the model's vocabulary. Empty with `model.path`: the model folder's tokenizer."""
    text_field: str = "text"
    """kind=hf: the column holding a document's text (`text` for format=text)."""
    messages_field: str = ""
    """kind=hf: the column holding a conversation (`[{"role": ..., "content": ...}, ...]`), for
    chat SFT: rendered with the tokenizer's chat template, loss on the assistant's tokens only.
    Empty: plain documents from `text_field`."""
    packing: str = "true"
    """kind=hf: `true`: whole documents packed into each sample (best fit, the same samples at any
    world size), each attending only to itself (positions restart at 0 per document), the rest
    padding; `false`: one document per sample, padded; `concat`: documents run one after another
    across samples and attend to those before them in a sample (pretraining on a text stream).
    Padding is never trained on."""
    overlong: str = "truncate"
    """kind=hf with packing=true or false: a document longer than seq_len + 1 tokens is cut
    (`truncate`), left out (`drop`) or cut into consecutive windows that each train on their own
    part (`split`); the counts are logged at start-up."""
    cache_dir: str = ""
    """kind=hf: where tokenized data is cached (keyed by the files' contents, the tokenizer and the
    options; reused by every rank and later runs). Must be shared by all ranks. Empty:
    ~/.cache/fsdpkit/data."""
    num_proc: int = 1
    """kind=hf: processes that tokenize in parallel when the cache is built (a fast tokenizer
    also uses threads of its own)."""
    token_dtype: str = "uint16"
    """kind=tokens: `uint16` or `uint32`, the dtype the file was written with."""
    seq_len: int = 64
    """Tokens per training sample (each sample reads seq_len + 1 tokens: inputs and shifted targets)."""
    num_samples: int = 4096
    """kind=synthetic: training samples per epoch."""
    val_fraction: float = 0.05
    """Share of samples held out for validation; never overlaps training data (for synthetic data,
    the held-out samples come from a separate stream of the same process)."""
    shuffle: bool = True
    """Shuffle the global sample order each epoch (from the seed and the epoch alone)."""


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not norms or biases)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 10
    """Linear warmup from 0 to `lr` over this many steps."""
    schedule: str = "cosine"
    """After warmup: `cosine` decay to lr * min_lr_ratio at train.max_steps, or `constant`."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` for the cosine schedule."""
    impl: str = "auto"
    """AdamW implementation: `auto` (fused on CUDA, foreach on CPU), `fused`, `foreach`, `for_loop`."""


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = 100
    """Optimizer steps to run."""
    global_batch_size: int = 16
    """Samples per optimizer step, summed over all ranks and micro-batches: the objective, the same at
    any world size (the loss is normalised by the global batch's trained tokens). Each rank takes a
    contiguous share (shares differ by at most one sample) in the same number of micro-batches as
    every other rank, ceil(ceil(global_batch_size / world_size) / micro_batch_size); the start-up log
    states the split. Any value of at least the world size works."""
    micro_batch_size: int = 4
    """The most samples per forward/backward on one rank (the memory bound); a rank's micro-batches
    differ by at most one sample, so some may hold fewer."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all shards) to this value; 0 disables clipping (the
    norm is still computed and logged)."""
    log_every: int = 1
    """Log a metrics line every this many steps (metrics.jsonl gets every step)."""
    eval_every: int = 0
    """Compute val_loss every this many steps (0: only at the end)."""
    eval_samples: int = 64
    """Held-out samples per evaluation (the same samples at any world size); 0: no evaluation."""
    chunked_loss: bool = True
    """Compute the output projection and cross-entropy a chunk of tokens at a time, so the
    [tokens, vocab] logits never exist whole (at a 128k vocabulary they take 0.5 MB per token in
    fp32); the architecture's own logit transforms (softcapping, logit scales) are applied, and every
    forward checks them against the model's own logits. false: the loss of the model's full logits."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the chunked loss; 0: as many as keep one chunk's fp32 logits within
    128 MiB (1,024 tokens at a 32k vocabulary, 256 at 128k)."""
    stop_at: int = 0
    """Stop after this step as an interruption would (the schedule still targets max_steps; a later
    run resumes from the last checkpoint). 0: run to max_steps."""
    compile: bool = False
    """torch.compile each decoder block (after activation checkpointing, before fully_shard)."""
    compile_backend: str = "inductor"
    """torch.compile backend with train.compile: inductor (generates kernels; the first run compiles
    for a while, later runs reuse its cache), or aot_eager / eager to run the traced graphs without
    code generation (to tell a compiler problem from a tracing one, or to start in seconds)."""
    progress: bool = True
    """Show a live progress bar on rank 0 when stderr is a terminal."""


@dataclass
class DistConfig:
    """The process group and the bounds on waiting for other ranks."""

    timeout_s: float = 600.0
    """Bound on every training collective (the default process group: the step's gradient
    reductions and all-reduce, evaluation, set-up) and on creating the process group: a dead or
    stopped rank fails the collective on every other rank after this long instead of hanging it.
    Saves and loads have checkpoint.timeout_s, the on_exception vote checkpoint.exception_timeout_s;
    a job with a stopped rank ends within the largest wait in flight plus the launcher's 30 s grace."""
    heartbeat_s: float = 1.0
    """Each rank publishes what it is doing (step, phase, background save) to the launcher's store
    this often; when a collective fails, the report names the rank whose heartbeat stopped. 0: off."""
    slow_step_factor: float = 10.0
    """The watchdog warns when the current step has taken this many times the median of the recent
    steps (and at least 30 s) AND some rank's heartbeat stopped; a slow step on live ranks is not
    reported. 0: no watchdog warnings (heartbeats stay on)."""


@dataclass
class DiagnosticsConfig:
    """What FSDP2 applied, setup checks, and memory per phase (rank 0 logs; diagnostics.json)."""

    enabled: bool = True
    """At the start, report what FSDP2 applied to the log and <run_dir>/diagnostics.json, run the
    setup checks, and record per-phase peak memory of the first steps."""
    memory_steps: int = 3
    """Steps whose peak memory per phase (batch start, forward, backward, optimizer step) is
    recorded: CUDA allocator figures on GPU, RSS on CPU. 0: off."""
    skew_warn_ratio: float = 1.25
    """Warn when the largest local parameter MiB of any rank exceeds the smallest by this ratio."""
    strict: bool = True
    """Setup-check errors stop the run (with the fix in the message); false: log them and go on."""


@dataclass
class LoggingConfig:
    """Where metrics go besides metrics.jsonl."""

    tensorboard: bool = False
    """Also write metrics and checkpoint/resume events as TensorBoard scalars (rank 0); needs
    `pip install tensorboard`."""
    tensorboard_dir: str = "${run_dir}/tensorboard"
    """Where the TensorBoard event files go."""


@dataclass
class ExportConfig:
    """Safetensors export of the final weights (what `fsdpkit ckpt export` does, at the end)."""

    on_finish: bool = False
    """When training reaches train.max_steps, export the final checkpoint's model weights (rank
    0, streaming, after the process group is torn down). Needs checkpoint.save_at_end. LoRA runs
    export the model with the adapters merged in (as `fsdpkit ckpt export --merge`)."""
    dir: str = "${run_dir}/export"
    """Where the export goes. An earlier fsdpkit export there is replaced; anything else (or a
    path that is, contains or lies in the checkpoints, or is the run directory) is refused. May be
    a URL (s3://bucket/out): exported to a local temporary directory, then uploaded with the index
    and config.json last (see docs/how-to/object-storage.md)."""
    dtype: str = "bf16"
    """`bf16`, `fp16` or `fp32`: the dtype of the exported floating tensors (training keeps fp32)."""
    format: str = "hf"
    """`hf`: a Hugging Face folder (config.json, model.safetensors or shards + index);
    `single`: one safetensors file."""
    max_shard_size: str = "5GB"
    """format=hf: the largest safetensors file before the export is split into shards."""


@dataclass
class Config:
    """Everything one run needs; composed from conf/config.yaml, its groups and overrides."""

    name: str = "default"
    """Run name; the default run directory is runs/<name>."""
    run_dir: str = "runs/${name}"
    """Where config.yaml, metrics.jsonl and (later) checkpoints are written."""
    seed: int = 1234
    """Seeds weight init, data order and every RNG; identical at any world size."""
    deterministic: bool = False
    """Deterministic algorithms and fixed seeds: two runs of one config give bit-identical losses."""
    device: str = "auto"
    """`auto` (CUDA if available), `cpu` or `cuda`."""
    backend: str = "auto"
    """Process-group backend: `auto` (NCCL on CUDA, gloo on CPU), `gloo` or `nccl`."""
    log_level: str = "INFO"
    """Log level of rank 0 (other ranks log warnings only)."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Process group timeouts, heartbeats and the stuck-rank watchdog."""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    """FSDP sharding strategy (model-agnostic)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Model-specific FSDP knobs: wrap policy, activation checkpointing, mixed precision."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The loop."""
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(dir="${run_dir}/checkpoints"))
    """Saving and resuming (the checkpoint library's own settings, fsdpkit.checkpoint.settings)."""
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    """Diagnostics of the FSDP set-up."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """Export at the end of training."""
