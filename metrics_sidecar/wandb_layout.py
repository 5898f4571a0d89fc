"""Which W&B run each series goes to, and the run ids a run directory keeps.

Pure bookkeeping (a JSON file, no W&B calls), so it is tested on its own.

A job logs into one W&B group (`metrics.wandb_group`, default run.name) made of:
- one run per drafter, `<job>/<id>`, job_type "drafter": the drafter's series
  under their own names (`loss`, `acc/pos_1`, `eval/tau`, `step`, ...) so the
  runs of a group compare key by key, with `step` (its optimizer step) as x
  axis and `eval/step` (the evaluated checkpoint's step) for `eval/*`; a
  drafter trained by several ranks logs there its own series (composed by the
  sidecar from its ranks') and each rank's `rank/<id>.<k>` series as
  `rank/<k>/<key>`, on the axis `rank/<k>/step`;
- one run `<job>/target`, job_type "target": `target/*` (or `target/<r>/*` per
  target replica), `pipeline/*`, `sidecar/*` and every other source's series
  under `<source>/`, including the drafters beyond
  `metrics.wandb_max_drafter_runs` (and their ranks).
Every run logs window N as W&B step N (`_step`): the window counter never
goes back, across restarts too, so a resumed run only ever appends.

The run ids live in `<run dir>/wandb_runs.json`, written durably before a run
is first opened, so a restarted sidecar resumes the same runs; the file also
keeps each drafter's last `eval/*` values, put back into the summary of a
resumed run (its last measured tau).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from common.durable_io import replace_durably
from common.metric_names import DRAFTER_SOURCE, EVAL_PREFIX, RANK_SOURCE, STEP, TARGET_SOURCE, Eval
from common.metrics_client import Number
from metrics_sidecar.aggregate import Window
from metrics_sidecar.ranks import rank_of

logger = logging.getLogger(__name__)

RUNS_FILE = "wandb_runs.json"
LEGACY_RUN_ID_FILE = "wandb_run_id"  # the single run of earlier sidecars: continued as the target run
# Run key (and job type) of the target/pipeline run: the target's source, as a
# drafter's run key is its source, drafter/<id>.
TARGET_RUN = TARGET_SOURCE
WANDB_MODES = ("offline", "online", "disabled")
_MODE_ALIASES = {"dryrun": "offline", "run": "online"}  # W&B's older names, still accepted in WANDB_MODE
_MAX_SUMMARY_KEYS = 256  # eval/* values remembered per drafter run
_ID_SLUG = re.compile(r"[^A-Za-z0-9_-]+")


class WandbSettingsError(ValueError):
    """A W&B setting (config key or WANDB_* variable) has a value the sidecar cannot use."""


@dataclass(frozen=True)
class WandbSettings:
    """Where and how the job's runs are logged, after config > environment > default."""

    mode: str  # offline, online or disabled
    project: str
    entity: str | None  # None: the API key's default entity
    dir: Path  # W&B writes <dir>/wandb/
    group: str


def resolve_wandb_settings(
    *,
    run_dir: str | Path,
    job_name: str,
    mode: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    dir: str | Path | None = None,
    group: str | None = None,
    env: Mapping[str, str] | None = None,
) -> WandbSettings:
    """Each setting: the value given (from the config or a flag) if not empty, else its
    WANDB_* environment variable if set, else the default (offline, dflash, the default
    entity, the run directory, the job name)."""
    env = os.environ if env is None else env

    def pick(value: Any, var: str, default: Any) -> tuple[Any, str]:
        if value not in (None, ""):
            return value, "the config"
        if env.get(var):
            return env[var], var
        return default, "the default"

    raw_mode, where = pick(mode, "WANDB_MODE", "offline")
    resolved_mode = _MODE_ALIASES.get(raw_mode, raw_mode)
    if resolved_mode not in WANDB_MODES:
        what = "metrics.wandb_mode" if where == "the config" else where
        raise WandbSettingsError(f"{what} must be one of {', '.join(WANDB_MODES)}, got {raw_mode!r}")
    return WandbSettings(
        mode=resolved_mode,
        project=pick(project, "WANDB_PROJECT", "dflash")[0],
        entity=pick(entity, "WANDB_ENTITY", None)[0],
        dir=Path(pick(dir, "WANDB_DIR", run_dir)[0]),
        group=pick(group, "WANDB_RUN_GROUP", job_name)[0],
    )


def drafter_id_of(source: str) -> str | None:
    """The drafter id of a `drafter/<id>` source that can have a run of its own, else None."""
    return DRAFTER_SOURCE.parse(source)


def rank_key(rank: int, key: str) -> str:
    """The name of a rank's series in its drafter's run: `rank/<k>/<key>`."""
    return f"{RANK_SOURCE.prefix}{rank}/{key}"


def parse_rank_key(key: str) -> tuple[int, str] | None:
    """(rank, key) of a `rank/<k>/<key>` series of a drafter run, else None."""
    if not key.startswith(RANK_SOURCE.prefix):
        return None
    rank, sep, rest = key[len(RANK_SOURCE.prefix):].partition("/")
    return (int(rank), rest) if sep and rank.isdigit() and rest else None


def run_of(source: str) -> tuple[str, int | None] | None:
    """(run key, rank) of a source that belongs to a drafter's run: `drafter/<id>` itself (rank
    None) and its ranks `rank/<id>.<k>`; None for every other source (the target run's)."""
    if drafter_id_of(source) is not None:
        return source, None
    parsed = rank_of(source)
    return None if parsed is None else (DRAFTER_SOURCE(parsed[0]), parsed[1])


def drafter_step_metric(key: str) -> str | None:
    """The x axis of a series in a drafter run: `step`, `eval/step` for eval/*, `rank/<k>/step`
    for a rank's series, none for the axes."""
    if key in (STEP, Eval.STEP):
        return None
    ranked = parse_rank_key(key)
    if ranked is not None:
        return None if ranked[1] == STEP else rank_key(ranked[0], STEP)
    return Eval.STEP if key.startswith(EVAL_PREFIX) else STEP


def new_run_id(label: str) -> str:
    """A fresh W&B run id: readable label + random suffix (a new run directory never resumes an old run)."""
    slug = _ID_SLUG.sub("-", label).strip("-")[:48] or "run"
    return f"{slug}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class RunSpec:
    """One W&B run of the job."""

    key: str  # TARGET_RUN or the drafter's source
    run_id: str
    name: str  # <job>/target, <job>/<drafter id>
    job_type: str  # "target" or "drafter"
    drafter_id: str | None
    summary: dict[str, Number] = field(default_factory=dict)  # to put back into a resumed run's summary


@dataclass
class WindowRows:
    """One window split by run: each run's row, and the sources folded into the target run."""

    rows: dict[str, dict[str, Number]]  # run key -> row; TARGET_RUN always present, last
    folded: list[str]  # sources logged in the target run under f"{source}/"


def split_window(window: Window, has_own_run: Callable[[str], bool]) -> WindowRows:
    """Route each source of the window to its drafter's run (if `has_own_run(run key)`: a drafter's
    series under their keys, its ranks' as `rank/<k>/<key>`) or to the target run."""
    rows: dict[str, dict[str, Number]] = {}
    job: dict[str, Number] = {}
    folded = []
    for source, values in window.sources.items():
        owner = run_of(source)
        if owner is not None and has_own_run(owner[0]):
            run_key, rank = owner
            row = rows.setdefault(run_key, {})
            row.update(values if rank is None else {rank_key(rank, key): value for key, value in values.items()})
        else:
            folded.append(source)
            job.update({f"{source}/{key}": value for key, value in values.items()})
    job.update(window.job)
    rows[TARGET_RUN] = job
    return WindowRows(rows=rows, folded=folded)


class RunRegistry:
    """The job's run ids, persisted in `<run dir>/wandb_runs.json`.

    At most `max_drafter_runs` drafters ever get a run (ids once given are kept,
    also across restarts): W&B runs are heavy, and a stream of fresh drafter
    names must not open runs without bound. One owner thread; `ids` may be
    read from any.
    """

    def __init__(self, run_dir: str | Path, job_name: str, settings: WandbSettings, max_drafter_runs: int = 16) -> None:
        if max_drafter_runs < 0:
            raise ValueError(f"max_drafter_runs must be >= 0, got {max_drafter_runs}")
        self.path = Path(run_dir) / RUNS_FILE
        self.job_name = job_name
        self.settings = settings
        self.max_drafter_runs = max_drafter_runs
        self._runs: dict[str, dict[str, Any]] = self._load()
        self._ids = {key: entry["id"] for key, entry in self._runs.items()}

    @property
    def ids(self) -> dict[str, str]:
        """Run key -> run id, for every run this job has (a snapshot: safe to read from another thread)."""
        return self._ids

    def has_room(self) -> bool:
        return sum(key != TARGET_RUN for key in self._runs) < self.max_drafter_runs

    def spec(self, key: str) -> RunSpec | None:
        """The run for `key` (TARGET_RUN or a drafter source), its id persisted first; None if the
        key cannot have a run of its own (not a drafter source, or over max_drafter_runs)."""
        drafter = None if key == TARGET_RUN else drafter_id_of(key)
        if key != TARGET_RUN and drafter is None:
            return None
        name = f"{self.job_name}/{drafter or TARGET_RUN}"
        entry = self._runs.get(key)
        if entry is None:
            if drafter is not None and not self.has_room():
                return None
            entry = self._runs[key] = {"id": new_run_id(name.replace("/", "-")), "name": name}
            self._ids = {**self._ids, key: entry["id"]}
            self.save()
        return RunSpec(
            key=key,
            run_id=entry["id"],
            name=name,
            job_type="drafter" if drafter is not None else TARGET_RUN,
            drafter_id=drafter,
            summary=dict(entry.get("summary", {})),
        )

    def remember_summary(self, key: str, values: Mapping[str, Number]) -> None:
        """Keep a drafter run's latest eval/* values (persisted only when they change)."""
        entry = self._runs.get(key)
        if entry is None:
            return
        summary = dict(entry.get("summary", {}))
        for name, value in values.items():
            if name in summary or len(summary) < _MAX_SUMMARY_KEYS:
                summary[name] = value
        if summary != entry.get("summary"):
            entry["summary"] = summary
            self.save()

    def save(self) -> None:
        """Replace the file atomically and durably."""
        body = {
            "group": self.settings.group,
            "project": self.settings.project,
            "wandb_dir": str(Path(self.settings.dir).resolve() / "wandb"),
            "runs": self._runs,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_durably(self.path, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode(),
                        tmp=self.path.with_suffix(".tmp"))

    def _load(self) -> dict[str, dict[str, Any]]:
        if self.path.exists():
            try:
                runs = json.loads(self.path.read_text(encoding="utf-8"))["runs"]
                if not isinstance(runs, dict) or not all(isinstance(e, dict) and isinstance(e.get("id"), str)
                                                         for e in runs.values()):
                    raise ValueError("'runs' must map run keys to {'id': ...}")
                return runs
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("ignoring unreadable %s (%s); the job's W&B runs start afresh", self.path, exc)
                return {}
        legacy = self.path.parent / LEGACY_RUN_ID_FILE
        if legacy.exists():
            run_id = legacy.read_text(encoding="utf-8").strip()
            if run_id:
                return {TARGET_RUN: {"id": run_id, "name": f"{self.job_name}/{TARGET_RUN}"}}
        return {}


def read_runs_file(run_dir: str | Path) -> dict[str, Any] | None:
    """The parsed `wandb_runs.json` of a run directory, or None if it has none."""
    path = Path(run_dir) / RUNS_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
