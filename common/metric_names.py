"""Every metric series name, in one place.

The producers (drafter_worker/trainer.py and worker.py, target_server/server.py,
tools/eval.py), the sidecar (metrics_sidecar/) and the readers (tools/report.py,
tools/status.py, tools/eval.py) name a series only through this module, and
the catalog in docs/metrics.md lists exactly the names defined here
(tests/common/test_metric_names.py checks both, so a new bare literal or an
undocumented series fails CI).

A record has a ``source`` (``TARGET_SOURCE``, ``DRAFTER_SOURCE(id)``) and
``values`` keyed by the names of that source's group: ``Drafter`` and, for the
records ``dflash-eval --watch`` pushes as the drafter, ``Eval``; ``Target``. In
metrics.jsonl and the target's W&B run a series is ``f"{source}/{key}"``
(``drafter/d0/loss``); a drafter's own W&B run uses the key alone. The sidecar's
own series (``Pipeline``, ``Ranks``, ``Sidecar``) are full names already.

A name with a parameter is a :class:`Family`: ``Drafter.ACC_POS(3) ==
"acc/pos_3"``, ``Drafter.ACC_POS.parse("acc/pos_3") == "3"``.

These strings are what the wire, metrics.jsonl and W&B hold: renaming one
renames the series (and breaks comparisons with earlier runs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """Names made of a fixed prefix and one parameter."""

    prefix: str
    param: str  # the parameter as docs/metrics.md writes it, e.g. "<k>"
    pattern: str = r"\d+"  # what a parameter may be (a regular expression)

    def __call__(self, param: int | str) -> str:
        return f"{self.prefix}{param}"

    def parse(self, name: str) -> str | None:
        """The parameter of ``name`` when it belongs to the family, else None."""
        if not name.startswith(self.prefix):
            return None
        param = name[len(self.prefix):]
        return param if re.fullmatch(self.pattern, param) else None

    @property
    def catalog_name(self) -> str:
        """As the catalog lists it: ``acc/pos_<k>``."""
        return self.prefix + self.param


# ---------------------------------------------------------------- sources
TARGET_SOURCE = "target"
TARGET_REPLICA_SOURCE = Family("target/", "<r>")  # replica r of several (target.replicas > 1): "target/1"
DRAFTER_SOURCE = Family("drafter/", "<id>", r"[^/]+")  # DRAFTER_SOURCE("d0") == "drafter/d0"
# Rank k of a drafter trained by several ranks (torchrun): "rank/d0.1"; the sidecar composes
# the drafter's own series from its ranks.
RANK_SOURCE = Family("rank/", "<id>.<k>", r"[^/]+\.\d+")


def target_source(replica: int, replicas: int) -> str:
    return TARGET_SOURCE if replicas == 1 else TARGET_REPLICA_SOURCE(replica)


def drafter_source(drafter_id: str, rank: int, world_size: int) -> str:
    return DRAFTER_SOURCE(drafter_id) if world_size == 1 else RANK_SOURCE(f"{drafter_id}.{rank}")

# Written by the sidecar itself; a producer may not claim them (common/metrics_client.py).
PIPELINE_SOURCE = "pipeline"
SIDECAR_SOURCE = "sidecar"
PIPELINE_PREFIX = PIPELINE_SOURCE + "/"
SIDECAR_PREFIX = SIDECAR_SOURCE + "/"
EVAL_PREFIX = "eval/"  # a record holding only these keys is an evaluation (it never moves the drafter's step)
# In the sidecar's window row of every source: the step of its latest record (an
# evaluation's goes to Eval.STEP instead).
STEP = "step"


# ---------------------------------------------------------------- series
class Drafter:
    """Keys of a drafter's records (source ``drafter/<id>``)."""

    STEP = STEP  # optimizer step
    LOSS = "loss"
    ACC_POS = Family("acc/pos_", "<k>")
    EAL = "eal"
    LR = "lr"
    TOKENS_PER_S = "tokens_per_s"
    SAMPLES_PER_S = "samples_per_s"
    DATA_WAIT_FRAC = "data_wait_frac"
    COMPUTE_MS = "compute_ms"
    GRAD_NORM = "grad_norm"
    GRAD_NORM_MAX = "grad_norm_max"
    CLIP_RATE = "clip_rate"
    LABEL_TOKENS = "label_tokens"
    TOKENS_TRAINED = "tokens_trained"
    CHECKPOINT_STEP = "checkpoint_step"
    NONFINITE_STEPS = "nonfinite_steps"
    MEM_ALLOCATED_GB = "mem_allocated_gb"
    MEM_PEAK_GB = "mem_peak_gb"
    CUDA_ONLY = (MEM_ALLOCATED_GB, MEM_PEAK_GB)  # sent by a drafter on CUDA only


class Eval:
    """Keys of the records ``dflash-eval --watch`` pushes as ``drafter/<id>`` (all under EVAL_PREFIX)."""

    STEP = "eval/step"  # the evaluated checkpoint's step, added to the window row by the sidecar
    TAU = "eval/tau"
    TAU_MIN = "eval/tau_min"
    TAU_STDERR = "eval/tau_stderr"
    ACCEPT_POS = Family("eval/accept/pos_", "<k>")
    TOKENS_PER_S = "eval/tokens_per_s"
    SPEEDUP = "eval/speedup"


class Target:
    """Keys of the target's records (source ``target``)."""

    STEP = STEP  # batches captured
    TOKENS_PER_S = "tokens_per_s"
    BATCHES_PER_S = "batches_per_s"
    FORWARD_MS = "forward_ms"
    CACHE_HIT_FRAC = "cache_hit_frac"
    FEATURE_CACHE_GB = "feature_cache_gb"
    PADDING_FRAC = "padding_frac"
    QUEUE_DEPTH = "queue_depth"
    BUCKET_DEPTH = Family("bucket_depth/", "<i>")
    BACKPRESSURE_FRAC = "backpressure_frac"
    SEND_GBPS = "send_gbps"
    BYTES_SENT = "bytes_sent"
    TOKENS_TOTAL = "tokens_total"
    DRAFTERS_CONNECTED = "drafters_connected"


class Pipeline:
    """Full names of the sidecar's aggregates across drafters (and across target replicas)."""

    NUM_DRAFTERS = "pipeline/num_drafters"
    LOSS_MEAN = "pipeline/loss_mean"
    LOSS_MIN = "pipeline/loss_min"
    LOSS_MAX = "pipeline/loss_max"
    STEP_SKEW = "pipeline/step_skew"
    SLOWEST_DRAFTER_STEP = "pipeline/slowest_drafter_step"
    DRAFTER_TOKENS_PER_S = "pipeline/drafter_tokens_per_s"
    # Across the live target sources (TARGET_SOURCE, or TARGET_REPLICA_SOURCE(r) per replica): sums.
    NUM_TARGETS = "pipeline/num_targets"
    TARGET_TOKENS_PER_S = "pipeline/target_tokens_per_s"
    TARGET_BATCHES_PER_S = "pipeline/target_batches_per_s"
    TARGET_QUEUE_DEPTH = "pipeline/target_queue_depth"
    TARGET_SEND_GBPS = "pipeline/target_send_gbps"
    # TARGET_TOKENS_PER_S / DRAFTER_TOKENS_PER_S: > 1 the drafters are the bottleneck, < 1 the targets' supply.
    SUPPLY_RATIO = "pipeline/supply_ratio"


class Ranks:
    """Full names of the sidecar's series about a drafter trained by several ranks (sources
    ``RANK_SOURCE("<id>.<k>")``); a one-process drafter has none."""

    SKEW = Family("pipeline/rank_skew/", "<id>", r"[^/]+")  # max - min step over the drafter's live ranks


class Sidecar:
    """Full names of the sidecar's own counters."""

    WINDOW = "sidecar/window"  # x axis of pipeline/* and sidecar/*
    RECORDS_RECEIVED = "sidecar/records_received"
    RECORDS_MALFORMED = "sidecar/records_malformed"
    RECORDS_REFUSED = "sidecar/records_refused"
    SOURCES_TRACKED = "sidecar/sources_tracked"
    RECORDS_DROPPED_BY_PRODUCERS = "sidecar/records_dropped_by_producers"
    WANDB_CALLS = "sidecar/wandb_calls"
    WANDB_LOG_MS = "sidecar/wandb_log_ms"
    UPLOAD_BACKLOG = "sidecar/upload_backlog"
    WINDOWS_DROPPED = "sidecar/windows_dropped"
    WANDB_RUNS = "sidecar/wandb_runs"


GROUPS = (Drafter, Eval, Target, Pipeline, Sidecar, Ranks)


def members(group: type) -> tuple[str | Family, ...]:
    """The names and families ``group`` defines, in order."""
    return tuple(v for k, v in vars(group).items() if k.isupper() and isinstance(v, (str, Family)))
