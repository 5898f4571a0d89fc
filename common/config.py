"""Job configuration: nested, validated dataclasses loaded from one TOML file.

Every process reads the same file. Single keys are overridden on the command
line with ``--set section.key=value`` (the value is parsed as a TOML value, so
``--set drafter.learning_rate=3e-4`` and ``--set data.bucket_lengths=[64,128]``
work). A ``[drafters.<id>]`` table holds per-drafter overrides of ``[drafter]``
so one file can describe several experiments sharing one target.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.protocol import NAME


class ConfigError(ValueError):
    """A user-fixable problem with the configuration (message names the key)."""


def _doc(text: str, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING):
    kwargs: dict[str, Any] = {"metadata": {"doc": text}}
    if default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = default_factory
    else:
        kwargs["default"] = default
    return field(**kwargs)


def _require(cond: bool, key: str, message: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key} {message}, got {value!r}")


@dataclass
class RunConfig:
    name: str = _doc("run name; everything the run writes goes to <root_dir>/<name>/", "demo")
    root_dir: str = _doc("directory holding run directories", "runs")

    def __post_init__(self) -> None:
        _require(bool(self.name) and "/" not in self.name, "run.name", "must be a non-empty name without '/'", self.name)

    @property
    def path(self) -> Path:
        return Path(self.root_dir) / self.name


@dataclass
class ControlConfig:
    address: str = _doc("ZeroMQ ROUTER address the target binds and drafters connect to", "tcp://127.0.0.1:5555")
    store_host: str = _doc("host of the TCPStore (hosted by the target) used to form data-plane pairs", "127.0.0.1")
    store_port: int = _doc("port of that TCPStore", 5556)
    heartbeat_interval_s: float = _doc("seconds between heartbeats, both directions", 1.0)
    heartbeat_timeout_s: float = _doc("silence after which a peer is declared dead", 15.0)
    handshake_timeout_s: float = _doc("how long a drafter waits for WELCOME before retrying", 30.0)
    reconnect_backoff_max_s: float = _doc("cap of the exponential backoff while the target is away", 5.0)
    max_message_bytes: int = _doc("control frames larger than this are refused", 1 << 20)
    max_drafters: int = _doc("registrations the target accepts at once (bounds what a HELLO flood can hold)", 64)
    ack_timeout_s: float = _doc("a registration holding batches this long without acknowledging any is dropped (they go to another drafter)", 900.0)
    replica_addresses: list[str] = _doc("control address of each target replica (target.replicas entries, e.g. one per host); empty = control.address with its port raised by replica * replica_port_step", default_factory=list)
    replica_port_step: int = _doc("replica r binds control.address's port and control.store_port, each + r * replica_port_step (when replica_addresses is empty)", 100)

    def __post_init__(self) -> None:
        _require(self.address.startswith(("tcp://", "ipc://")), "control.address", "must start with tcp:// or ipc://", self.address)
        _require(0 < self.store_port < 65536, "control.store_port", "must be a TCP port", self.store_port)
        _require(self.heartbeat_interval_s > 0, "control.heartbeat_interval_s", "must be > 0", self.heartbeat_interval_s)
        _require(
            self.heartbeat_timeout_s > 2 * self.heartbeat_interval_s,
            "control.heartbeat_timeout_s",
            "must exceed twice control.heartbeat_interval_s",
            self.heartbeat_timeout_s,
        )
        _require(self.handshake_timeout_s > 0, "control.handshake_timeout_s", "must be > 0", self.handshake_timeout_s)
        _require(self.max_drafters >= 1, "control.max_drafters", "must be >= 1", self.max_drafters)
        _require(self.ack_timeout_s > self.heartbeat_timeout_s, "control.ack_timeout_s", "must exceed control.heartbeat_timeout_s", self.ack_timeout_s)
        _require(self.max_message_bytes >= 4096, "control.max_message_bytes", "must be >= 4096", self.max_message_bytes)
        _require(all(a.startswith(("tcp://", "ipc://")) for a in self.replica_addresses), "control.replica_addresses",
                 "must each start with tcp:// or ipc://", self.replica_addresses)
        _require(self.replica_port_step >= 1, "control.replica_port_step", "must be >= 1", self.replica_port_step)


@dataclass
class SecurityConfig:
    curve_dir: str = _doc("directory of ZeroMQ CURVE keys (python -m common.sockets keys DIR); required to bind non-loopback addresses", "")
    curve_client: str = _doc("name of this host's client key in curve_dir (python -m common.sockets add-client DIR NAME)", "client")

    def __post_init__(self) -> None:
        if self.curve_dir:
            _require(Path(self.curve_dir).is_dir(), "security.curve_dir", "must be an existing directory of CURVE keys", self.curve_dir)


@dataclass
class TransportConfig:
    kind: str = _doc("data plane: 'auto' (nccl on CUDA, gloo on CPU), 'nccl', 'gloo' or 'shm' (same host, shared memory)", "auto")
    timeout_s: float = _doc("bound on every data-plane wait (pair formation, send, receive)", 60.0)
    shm_slots_per_bucket: int = _doc("shm: pool slots per length bucket beyond target.ready_batches, for batches drafters hold until their ACK (cover their credits together)", 4)

    def __post_init__(self) -> None:
        _require(self.kind in ("auto", "nccl", "gloo", "shm"), "transport.kind", "must be one of auto, nccl, gloo, shm", self.kind)
        _require(self.timeout_s > 0, "transport.timeout_s", "must be > 0", self.timeout_s)
        _require(self.shm_slots_per_bucket >= 1, "transport.shm_slots_per_bucket", "must be >= 1", self.shm_slots_per_bucket)

    def resolve(self, device: str) -> str:
        if self.kind != "auto":
            return self.kind
        return "nccl" if device.startswith("cuda") else "gloo"


@dataclass
class MetricsConfig:
    address: str = _doc("ZeroMQ PULL address of the metrics sidecar", "tcp://127.0.0.1:5557")
    log_every_steps: int = _doc("producers snapshot their device counters every this many steps", 5)
    window_s: float = _doc("the sidecar aggregates records over windows of this length", 2.0)
    # The W&B settings below: empty = the WANDB_* environment variable, else the default named.
    wandb_mode: str = _doc("W&B mode: offline, online or disabled; empty = $WANDB_MODE, else offline", "")
    wandb_project: str = _doc("W&B project; empty = $WANDB_PROJECT, else dflash", "")
    wandb_entity: str = _doc("W&B entity (team); empty = $WANDB_ENTITY, else your default entity", "")
    wandb_group: str = _doc("W&B group of the job's runs; empty = $WANDB_RUN_GROUP, else run.name", "")
    wandb_dir: str = _doc("directory W&B writes its wandb/ folder in; empty = $WANDB_DIR, else the run directory", "")
    wandb_max_drafter_runs: int = _doc("drafters that get a W&B run of their own (one wandb.init each); later ones log into the target run", 16)

    def __post_init__(self) -> None:
        _require(self.log_every_steps >= 1, "metrics.log_every_steps", "must be >= 1", self.log_every_steps)
        _require(self.window_s > 0, "metrics.window_s", "must be > 0", self.window_s)
        _require(self.wandb_mode in ("", "offline", "online", "disabled"), "metrics.wandb_mode", "must be offline, online, disabled or empty", self.wandb_mode)
        _require(self.wandb_max_drafter_runs >= 0, "metrics.wandb_max_drafter_runs", "must be >= 0", self.wandb_max_drafter_runs)


@dataclass
class TargetConfig:
    model: str = _doc("'smollm2' (the packaged GGUF), a .gguf file, a Hugging Face model directory, or a cached hub id", "smollm2")
    tokenizer: str = _doc("tokenizer source when the model directory has none; empty = same as model", "")
    device: str = _doc("device of the target forward pass: cpu or cuda[:N]", "cpu")
    dtype: str = _doc("dtype of the target forward and of the features sent: float32, bfloat16, float16, or auto = bfloat16 where the device computes it fast (a GPU, a CPU with AVX512-BF16 or AMX), else float32 (bf16 is emulated, 4x slower, on other CPUs)", "float32")
    num_captured_layers: int = _doc("how many target layers the drafter reads (DFlash rule picks which)", 5)
    target_layer_ids: list[int] = _doc("explicit layer ids to capture; empty = build_target_layer_ids rule", default_factory=list)
    mask_token_id: int = _doc("token id used for the masked block slots; -1 picks an unused special token", -1)
    threads: int = _doc("torch CPU threads for the target; 0 keeps torch's default", 0)
    ready_batches: int = _doc("captured-batch buffers per length bucket (how far the target may run ahead)", 3)
    feature_cache_gb: float = _doc("keep each training sample's captured features (on target.device) up to this many GB, so later epochs run no target forward; 0 = off", 0.0)
    feature_cache_keep_free_gb: float = _doc("the feature cache stops growing where it would leave less than this many GB of the device's memory free (on CPU: host RAM and any cgroup memory limit, shared with the drafters; on CUDA: the GPU's)", 2.0)
    stop_timeout_s: float = _doc("on SIGTERM, finish within this many seconds or exit hard (must exceed transport.timeout_s: a pair being formed cannot be interrupted)", 90.0)
    replicas: int = _doc("target processes serving the plan; replica r serves the plan indices i with i mod replicas == r (docs/architecture.md)", 1)
    replica: int = _doc("which replica this target process is (dflash-target --replica R)", 0)
    devices: list[str] = _doc("device of each replica (target.replicas entries, e.g. [\"cuda:0\", \"cuda:1\"]); empty = target.device for all", default_factory=list)

    def __post_init__(self) -> None:
        _require(bool(self.model), "target.model", "must be set", self.model)
        _require(1 <= self.replicas <= 1024, "target.replicas", "must be in [1, 1024]", self.replicas)
        _require(0 <= self.replica < self.replicas, "target.replica", f"must be in [0, target.replicas = {self.replicas})",
                 self.replica)
        _require(not self.devices or len(self.devices) == self.replicas, "target.devices",
                 f"must be empty or name target.replicas = {self.replicas} devices", self.devices)
        _require(self.dtype in ("float32", "bfloat16", "float16", "auto"), "target.dtype",
                 "must be float32, bfloat16, float16 or auto", self.dtype)
        _require(self.num_captured_layers >= 1, "target.num_captured_layers", "must be >= 1", self.num_captured_layers)
        _require(all(i >= 0 for i in self.target_layer_ids), "target.target_layer_ids", "must be non-negative", self.target_layer_ids)
        _require(self.threads >= 0, "target.threads", "must be >= 0", self.threads)
        _require(self.ready_batches >= 1, "target.ready_batches", "must be >= 1", self.ready_batches)
        _require(self.feature_cache_gb >= 0, "target.feature_cache_gb", "must be >= 0", self.feature_cache_gb)
        _require(self.feature_cache_keep_free_gb >= 0, "target.feature_cache_keep_free_gb", "must be >= 0",
                 self.feature_cache_keep_free_gb)
        _require(self.stop_timeout_s > 0, "target.stop_timeout_s", "must be > 0", self.stop_timeout_s)


@dataclass
class DataConfig:
    source: str = _doc("'pydoc' (Python's own reference text), a JSONL/JSON, parquet or arrow file, a directory of them or one saved by datasets' save_to_disk, or a dataset name in the local Hugging Face cache (never downloaded); see docs/data.md", "pydoc")
    format: str = _doc("record format: 'auto' (told from the first records), 'messages' ({messages: [{role, content}]}), 'conversations' (the same turns under conversations) or 'sharegpt' (conversations of {from, value})", "auto")
    chat_template_kwargs: dict[str, Any] = _doc("extra variables for every chat-template rendering, e.g. {enable_thinking = false}", default_factory=dict)
    num_proc: int = _doc("processes tokenizing the data; 0 = min(available cores, 8); the samples do not depend on it", 0)
    cache_dir: str = _doc("directory of the tokenized-data cache; empty = $DFLASH_DATA_CACHE_DIR or ~/.cache/dflash/tokenized; 'off' = no cache", "")
    max_seq_len: int = _doc("samples are truncated to this many tokens", 256)
    bucket_lengths: list[int] = _doc("fixed sequence lengths of the batch shapes", default_factory=lambda: [64, 128, 256])
    tokens_per_batch: int = _doc("batch size of a bucket = tokens_per_batch // its length", 1024)
    seed: int = _doc("seed of the shuffle and the held-out split", 0)
    heldout_fraction: float = _doc("fraction of conversations kept out of training for evaluation", 0.02)
    num_epochs: int = _doc("epochs to serve; 0 = unlimited", 0)
    max_samples: int = _doc("use only the first N training samples; 0 = all", 0)

    def __post_init__(self) -> None:
        _require(self.max_seq_len >= 8, "data.max_seq_len", "must be >= 8", self.max_seq_len)
        _require(len(self.bucket_lengths) >= 1, "data.bucket_lengths", "must not be empty", self.bucket_lengths)
        _require(self.bucket_lengths == sorted(set(self.bucket_lengths)), "data.bucket_lengths", "must be strictly increasing", self.bucket_lengths)
        _require(self.bucket_lengths[-1] >= self.max_seq_len, "data.bucket_lengths", f"must end at or above data.max_seq_len={self.max_seq_len}", self.bucket_lengths)
        _require(self.tokens_per_batch >= self.bucket_lengths[-1], "data.tokens_per_batch", "must be >= the largest bucket length", self.tokens_per_batch)
        _require(0.0 <= self.heldout_fraction < 1.0, "data.heldout_fraction", "must be in [0, 1)", self.heldout_fraction)
        _require(self.num_epochs >= 0, "data.num_epochs", "must be >= 0", self.num_epochs)
        _require(self.max_samples >= 0, "data.max_samples", "must be >= 0", self.max_samples)
        _require(self.format in DATA_FORMATS, "data.format", f"must be one of {', '.join(DATA_FORMATS)}", self.format)
        _require(self.num_proc >= 0, "data.num_proc", "must be >= 0", self.num_proc)
        reserved = sorted(set(self.chat_template_kwargs) & _RESERVED_TEMPLATE_KWARGS)
        _require(not reserved, "data.chat_template_kwargs", f"must not set {', '.join(reserved)} (the data loader sets it)", self.chat_template_kwargs)

    # Settings of this host only: drafters need not agree on them (left out of Config.shared_hash).
    LOCAL_KEYS = ("num_proc", "cache_dir")


DATA_FORMATS = ("auto", "messages", "conversations", "sharegpt")
# apply_chat_template's own arguments: a template variable of these names would clash.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                             "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


@dataclass
class DrafterConfig:
    id: str = _doc("drafter id (names its checkpoints and metrics series); under torchrun every rank trains this one drafter", "d0")
    device: str = _doc("training device: cpu or cuda[:N]", "cpu")
    devices: list[str] = _doc("device of each local rank under torchrun (LOCAL_RANK indexes it); empty = drafter.device, or cuda:LOCAL_RANK when that is 'cuda'", default_factory=list)
    threads: int = _doc("torch CPU threads; 0 keeps torch's default", 0)
    threads_while_capturing: int = _doc("torch CPU threads while the batches come from the target's forward pass, drafter.threads once they come from its feature cache: a target on the same CPU computes meanwhile, and more threads than cores slow both processes (make quality: 1 beside a 1-thread target on 2 cores); 0 = drafter.threads throughout", 0)
    matmul_precision: str = _doc("torch.set_float32_matmul_precision for the drafter: 'highest' (fp32), 'high' (TF32 on CUDA), 'medium' (bf16 passes on CUDA; a CPU's fp32 matmuls ignore it, drafter.autocast gives them bf16)", "highest")
    autocast: str = _doc("the training step's forward and backward under torch.autocast in this dtype, the weights, gradients and optimizer state staying float32: bfloat16, auto (bfloat16 where the device computes it fast: a GPU, a CPU with AVX512-BF16 or AMX) or '' (float32 throughout)", "")
    num_layers: int = _doc("decoder layers of the drafter", 1)
    block_size: int = _doc("tokens predicted per block (slot 0 is the anchor)", 16)
    num_key_value_heads: int = _doc("key/value heads of the drafter's attention (a divisor of the target's attention heads); 0 = the target's", 0)
    anchors_per_sequence: int = _doc("blocks trained per sequence per step", 4)
    steps_per_batch: int = _doc("optimizer steps on each received batch, each on freshly sampled anchors (the target's forward is the costly part: a drafter that would wait for the next batch trains this one again)", 1)
    draft_vocab_size: int = _doc("score only the K target tokens the training answers use most (their ids come from the target at WELCOME); 0 = the whole vocabulary (the published DFlash layout)", 0)
    train_draft_head: bool = _doc("the drafter trains its own LM head over the draft vocabulary (EAGLE-3's), starting from the target's rows; the soft-target loss still scores the target on the target's rows. Needs draft_vocab_size > 0; the head is saved with the drafter as `draft_head`", False)
    layer_types: list[str] = _doc("attention type of each drafter layer, 'full_attention' or 'sliding_attention' (num_layers entries); empty = all sliding_attention when sliding_window > 0, else all full_attention", default_factory=list)
    sliding_window: int = _doc("positions a sliding_attention layer sees: a slot at position p attends to keys at |p - k| < sliding_window (0 = no sliding layers; at least block_size)", 0)
    init_from: str = _doc("start a fresh drafter from this exported or published DFlash drafter directory (config.json + model.safetensors; its architecture replaces num_layers/layer_types/sliding_window/draft_vocab_size); ignored when the drafter resumes its own checkpoint", "")
    init_target_layers: list[int] = _doc("start a fresh drafter's layers as copies of these target decoder layers (layer j from the j-th id; the rest stay random), its fc reading the captured layer just below the first one when target.target_layer_ids has it; the drafter loads target.model on its own host for them, once. Empty = a random start", default_factory=list)
    loss_gamma: float = _doc("slot k weight is exp(-(k-1)/gamma)", 7.0)
    reveal_fraction: float = _doc("fraction of training blocks that show the true tokens of a random prefix of their draft slots (1..block_size-2 of them) and learn only the slots after it: what a later denoising pass sees (drafter.denoise_passes)", 0.0)
    denoise_passes: int = _doc("drafting passes a block takes when decoding (saved in the drafter's config; dflash-eval --denoise-passes overrides it): pass i fixes draft slot i + 1 and shows it to the next pass, the last pass drafts all the slots left. 1 is DFlash's single parallel pass; more pays only for a drafter trained with drafter.reveal_fraction > 0", 1)
    causal_passes: bool = _doc("draft each block causally in block_size - 1 passes (a slot sees the slots up to itself; pass k fixes slot k) and train every pass of every block at once (each block laid out as its shown true tokens plus one mask per slot: 2 x block_size - 2 query slots); needs denoise_passes = block_size - 1 and reveal_fraction = 0. Saved in the drafter's config; engines that do not know it draft in one parallel pass", False)
    distill_weight: float = _doc("weight of the soft-target loss against the target's own next-token distribution (knowledge distillation; 0 = hard labels only): loss = (1 - w) * hard + w * soft. Needs the target to capture its last layer (target.target_layer_ids ending with it)", 0.0)
    loss_impl: str = _doc("LM-head loss implementation: auto (Triton on CUDA for up to 2,048 scored rows a call, else chunked), triton, chunked (vocabulary chunks, no [N, V] logits) or torch (the plain reference)", "auto")
    learning_rate: float = _doc("peak AdamW learning rate", 6e-4)
    min_lr_ratio: float = _doc("cosine decays to learning_rate * min_lr_ratio", 0.1)
    weight_decay: float = _doc("AdamW weight decay (matrices only; the published DFlash recipe uses none)", 0.0)
    adam_beta1: float = _doc("AdamW beta1", 0.9)
    adam_beta2: float = _doc("AdamW beta2", 0.999)
    feature_scale_init: bool = _doc("scale the fresh drafter's fc columns by 1/RMS of each feature dimension in the first batch (tames the target's massive-activation dimensions)", True)
    logit_std_init: float = _doc("the final norm starts scaled so the initial draft logits have this standard deviation over the vocabulary (measured on the target's LM head; 0 = no rescale)", 1.0)
    warmup_steps: int = _doc("linear warm-up steps", 10)
    max_steps: int = _doc("stop after this many optimizer steps; 0 = until the data ends or a signal", 100)
    decay_steps: int = _doc("length of the cosine schedule; 0 = max_steps, or with max_steps 0 the plan length the target announces (its batches over data.num_epochs)", 0)
    decay_minutes: float = _doc("length of the cosine in minutes of training instead of steps, for a run bound by wall-clock time (make quality), where how many steps the minutes hold depends on the machine: the drafter's clock from its first step, kept across restarts in its checkpoints (rank 0's for a torchrun group); 0 = by steps (decay_steps)", 0.0)
    grad_clip: float = _doc("gradient norm clipping threshold", 1.0)
    credits: int = _doc("batches a drafter keeps in flight (>= 2 overlaps receive and compute)", 2)
    checkpoint_every_steps: int = _doc("checkpoint period in optimizer steps (also at shutdown)", 50)
    keep_checkpoints: int = _doc("how many step-N checkpoints to keep", 2)
    seed: int = _doc("seed of the drafter's initialisation and anchor sampling", 0)
    stop_timeout_s: float = _doc("on SIGTERM, finish within this many seconds (must exceed transport.timeout_s: a pair being formed cannot be interrupted)", 90.0)

    def __post_init__(self) -> None:
        # The control plane's name rule: a HELLO with any other id is refused.
        _require(NAME.fullmatch(self.id) is not None, "drafter.id", "must be 1-64 characters of A-Z a-z 0-9 _ . -", self.id)
        _require(self.num_layers >= 1, "drafter.num_layers", "must be >= 1", self.num_layers)
        _require(self.matmul_precision in ("highest", "high", "medium"), "drafter.matmul_precision",
                 "must be highest, high or medium", self.matmul_precision)
        _require(self.autocast in ("", "auto", "bfloat16"), "drafter.autocast", "must be '', 'auto' or 'bfloat16'",
                 self.autocast)
        _require(self.block_size >= 2, "drafter.block_size", "must be >= 2", self.block_size)
        _require(0.0 <= self.reveal_fraction <= 1.0, "drafter.reveal_fraction", "must be in [0, 1]", self.reveal_fraction)
        _require(1 <= self.denoise_passes <= max(1, self.block_size - 1), "drafter.denoise_passes",
                 f"must be in 1..block_size - 1 = {self.block_size - 1}", self.denoise_passes)
        _require(not self.causal_passes or (self.denoise_passes == self.block_size - 1 and not self.reveal_fraction),
                 "drafter.causal_passes", f"needs denoise_passes = block_size - 1 = {self.block_size - 1} and "
                 "reveal_fraction = 0 (it trains every pass itself)", self.causal_passes)
        _require(0.0 <= self.distill_weight <= 1.0, "drafter.distill_weight", "must be in [0, 1]", self.distill_weight)
        _require(self.num_key_value_heads >= 0, "drafter.num_key_value_heads", "must be >= 0", self.num_key_value_heads)
        _require(self.anchors_per_sequence >= 1, "drafter.anchors_per_sequence", "must be >= 1", self.anchors_per_sequence)
        _require(self.threads >= 0, "drafter.threads", "must be >= 0", self.threads)
        _require(self.threads_while_capturing >= 0, "drafter.threads_while_capturing", "must be >= 0",
                 self.threads_while_capturing)
        _require(1 <= self.steps_per_batch <= 64, "drafter.steps_per_batch", "must be in [1, 64]", self.steps_per_batch)
        _require(self.draft_vocab_size >= 0, "drafter.draft_vocab_size", "must be >= 0", self.draft_vocab_size)
        _require(not self.train_draft_head or self.draft_vocab_size > 0, "drafter.train_draft_head",
                 "needs drafter.draft_vocab_size > 0 (the head it trains is the draft vocabulary's)",
                 self.train_draft_head)
        self._check_attention_layers()
        _require(all(type(i) is int and i >= 0 for i in self.init_target_layers), "drafter.init_target_layers",
                 "must hold target layer indices >= 0", self.init_target_layers)
        _require(len(self.init_target_layers) <= self.num_layers, "drafter.init_target_layers",
                 f"names more layers than drafter.num_layers = {self.num_layers}", self.init_target_layers)
        _require(not (self.init_target_layers and self.init_from), "drafter.init_target_layers",
                 "and drafter.init_from are two starting points: set one of them", self.init_target_layers)
        _require(self.loss_gamma > 0, "drafter.loss_gamma", "must be > 0", self.loss_gamma)
        _require(self.loss_impl in ("auto", "triton", "chunked", "torch"), "drafter.loss_impl",
                 "must be auto, triton, chunked or torch", self.loss_impl)
        _require(self.learning_rate > 0, "drafter.learning_rate", "must be > 0", self.learning_rate)
        _require(self.weight_decay >= 0, "drafter.weight_decay", "must be >= 0", self.weight_decay)
        _require(0 <= self.adam_beta1 < 1, "drafter.adam_beta1", "must be in [0, 1)", self.adam_beta1)
        _require(0 <= self.adam_beta2 < 1, "drafter.adam_beta2", "must be in [0, 1)", self.adam_beta2)
        _require(self.logit_std_init >= 0, "drafter.logit_std_init", "must be >= 0", self.logit_std_init)
        _require(0 <= self.min_lr_ratio <= 1, "drafter.min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        _require(self.warmup_steps >= 0, "drafter.warmup_steps", "must be >= 0", self.warmup_steps)
        _require(self.max_steps >= 0, "drafter.max_steps", "must be >= 0", self.max_steps)
        _require(self.decay_steps >= 0, "drafter.decay_steps", "must be >= 0", self.decay_steps)
        _require(math.isfinite(self.decay_minutes) and self.decay_minutes >= 0, "drafter.decay_minutes",
                 "must be a finite number >= 0", self.decay_minutes)
        _require(not (self.decay_minutes and self.decay_steps), "drafter.decay_minutes",
                 "and drafter.decay_steps are two lengths for one schedule: set one of them", self.decay_minutes)
        _require(self.grad_clip > 0, "drafter.grad_clip", "must be > 0", self.grad_clip)
        _require(1 <= self.credits <= 64, "drafter.credits", "must be in [1, 64]", self.credits)
        _require(self.checkpoint_every_steps >= 1, "drafter.checkpoint_every_steps", "must be >= 1", self.checkpoint_every_steps)
        _require(self.keep_checkpoints >= 1, "drafter.keep_checkpoints", "must be >= 1", self.keep_checkpoints)
        _require(self.stop_timeout_s > 0, "drafter.stop_timeout_s", "must be > 0", self.stop_timeout_s)

    def _check_attention_layers(self) -> None:
        kinds = ("full_attention", "sliding_attention")
        _require(all(t in kinds for t in self.layer_types), "drafter.layer_types",
                 f"may hold only {' and '.join(repr(k) for k in kinds)}", self.layer_types)
        _require(not self.layer_types or len(self.layer_types) == self.num_layers, "drafter.layer_types",
                 f"must name all drafter.num_layers = {self.num_layers} layers (or be empty)", self.layer_types)
        _require(self.sliding_window >= 0, "drafter.sliding_window", "must be >= 0", self.sliding_window)
        sliding = "sliding_attention" in self.layer_types or (not self.layer_types and self.sliding_window > 0)
        if sliding:
            # A narrower window would hide slots of one block from each other, where
            # implementations of the sliding window disagree.
            _require(self.sliding_window >= self.block_size, "drafter.sliding_window",
                     f"must be >= drafter.block_size = {self.block_size} with sliding_attention layers",
                     self.sliding_window)
        else:
            _require(self.sliding_window == 0, "drafter.sliding_window",
                     "must be 0 when drafter.layer_types has no sliding_attention layer", self.sliding_window)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)

    def __post_init__(self) -> None:
        # A stop must outlast the longest wait it cannot interrupt (pair formation, a receive),
        # or the watchdog kills a process that was about to stop cleanly.
        for section in ("target", "drafter"):
            stop = getattr(self, section).stop_timeout_s
            _require(stop >= self.transport.timeout_s + 10, f"{section}.stop_timeout_s",
                     f"must be at least transport.timeout_s + 10 = {self.transport.timeout_s + 10:g}", stop)
        addresses = self.control.replica_addresses
        _require(not addresses or len(addresses) == self.target.replicas, "control.replica_addresses",
                 f"must be empty or name target.replicas = {self.target.replicas} addresses", addresses)

    # ---- replicas and ranks (docs/architecture.md, "Scale-out")
    def replica_address(self, replica: int) -> str:
        """The control address of target replica ``replica``."""
        if self.control.replica_addresses:
            return self.control.replica_addresses[replica]
        return _with_port_offset(self.control.address, replica * self.control.replica_port_step)

    def for_replica(self, replica: int) -> "Config":
        """This config as target replica ``replica`` sees it: its address, store port and device."""
        target = dataclasses.replace(self.target, replica=replica,
                                     device=self.target.devices[replica] if self.target.devices else self.target.device)
        control = dataclasses.replace(self.control, address=self.replica_address(replica),
                                      store_port=self.control.store_port + replica * self.control.replica_port_step)
        return dataclasses.replace(self, target=target, control=control)

    def for_local_rank(self, local_rank: int) -> "Config":
        """This config as the drafter rank with LOCAL_RANK ``local_rank`` sees it: its device."""
        d = self.drafter
        if d.devices:
            if local_rank >= len(d.devices):
                raise ConfigError(f"drafter.devices names {len(d.devices)} devices, LOCAL_RANK is {local_rank}")
            device = d.devices[local_rank]
        else:
            device = f"cuda:{local_rank}" if d.device == "cuda" else d.device
        return dataclasses.replace(self, drafter=dataclasses.replace(d, device=device))

    def shared_hash(self) -> str:
        """Hash of what target and drafters must agree on (data, captured layers, dtype)."""
        shared = {
            "data": {k: v for k, v in dataclasses.asdict(self.data).items() if k not in DataConfig.LOCAL_KEYS},
            "target": {k: getattr(self.target, k) for k in ("model", "dtype", "num_captured_layers", "target_layer_ids", "mask_token_id", "replicas")},
        }
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]

    def to_toml(self) -> str:
        lines: list[str] = []
        for section in dataclasses.fields(self):
            lines.append(f"[{section.name}]")
            for key, value in dataclasses.asdict(getattr(self, section.name)).items():
                lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_string(text: str) -> str:
    """A TOML basic string in plain ASCII. (json.dumps is not TOML: it writes
    characters beyond the BMP as surrogate pairs, which TOML refuses.)"""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def _plain_toml(value: Any) -> bool:
    if isinstance(value, list):
        return all(_plain_toml(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_toml(v) for k, v in value.items())
    return isinstance(value, (bool, int, float, str))


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check a raw TOML value against a field's annotated type."""
    origin = typing.get_origin(hint)
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    if origin is dict:  # a TOML table of plain values (e.g. data.chat_template_kwargs)
        if not isinstance(value, dict) or not all(_plain_toml(v) for v in value.values()):
            raise ConfigError(f"{key} must be a table of strings, numbers, booleans, lists or tables, got {value!r}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {hint!r} for {key}")


def _build_section(name: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{name}] must be a table, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"unknown config key {name}.{key} (known: {', '.join(sorted(known))})")
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``section.key=value``; the value is read as TOML, falling back to a bare string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw_value = text.split("=", 1)
    key = key.strip()
    if key.count(".") < 1:
        raise ConfigError(f"override key {key!r} must name a section and a key, e.g. drafter.learning_rate")
    try:
        value = tomllib.loads(f"v = {raw_value}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw_value
    return key, value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot override {key}: {part} is not a table")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load and validate the job config; ``overrides`` are ``section.key=value`` strings."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    parsed = [parse_override(o) for o in overrides]
    for key, value in parsed:
        _set_dotted(raw, key, value)
    # Per-drafter tables sit between the shared [drafter] table and the command line.
    per_drafter = raw.pop("drafters", {})
    if not isinstance(per_drafter, dict):
        raise ConfigError("[drafters] must hold one table per drafter id, e.g. [drafters.d1]")
    drafter_raw = raw.setdefault("drafter", {})
    if not isinstance(drafter_raw, dict):
        raise ConfigError(f"[drafter] must be a table, got {drafter_raw!r}")
    drafter_id = drafter_raw.get("id", DrafterConfig.id)
    if isinstance(drafter_id, str) and drafter_id in per_drafter:
        specific = per_drafter[drafter_id]
        if not isinstance(specific, dict):
            raise ConfigError(f"[drafters.{drafter_id}] must be a table")
        cli_keys = {k.split(".", 1)[1] for k, _ in parsed if k.startswith("drafter.")}
        for key, value in specific.items():
            if key not in cli_keys:
                drafter_raw[key] = value
    sections = {f.name: f for f in dataclasses.fields(Config)}
    kwargs = {}
    for name, value in raw.items():
        if name not in sections:
            raise ConfigError(f"unknown config section [{name}] (known: {', '.join(sections)}, drafters)")
        kwargs[name] = _build_section(name, typing.get_type_hints(Config)[name], value)
    return Config(**kwargs)


def _with_port_offset(address: str, offset: int) -> str:
    """``tcp://host:port`` with ``offset`` added to the port (ipc:// paths get a suffix)."""
    if offset == 0:
        return address
    if address.startswith("ipc://"):
        return f"{address}.{offset}"
    head, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 < int(port) + offset < 65536:
        raise ConfigError(f"control.address {address!r}: cannot derive a replica's port from it; "
                          "set control.replica_addresses")
    return f"{head}:{int(port) + offset}"


def drafter_ids_in(path: str | Path) -> list[str]:
    """The drafter ids a config file names in its [drafters.<id>] tables (used by launchers)."""
    raw = tomllib.loads(Path(path).read_text())
    return list(raw.get("drafters", {}).keys())
