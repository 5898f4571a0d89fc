"""One name per series: common/metric_names.py defines them, the catalog lists them, the code uses them.

Guards against a series renamed or added in one place only (the trainer emits
it, the sidecar or eval looks for the old spelling, docs/metrics.md lists
neither): the catalog must list exactly the names the module defines, and the
producers and consumers must not spell a defined name as a string literal.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from common import metric_names as names
from common.metric_names import Drafter, Eval, Family, Pipeline, Ranks, Sidecar, Target
from tests.conftest import ROOT
from tests.integration.catalog import catalog_tables

# Every module that emits or reads series by name.
PRODUCERS_AND_CONSUMERS = (
    "drafter_worker/model/device_metrics.py",
    "common/metrics_client.py",
    "drafter_worker/trainer.py",
    "drafter_worker/worker.py",
    "target_server/server.py",
    "metrics_sidecar/__main__.py",
    "metrics_sidecar/aggregate.py",
    "metrics_sidecar/jsonl_log.py",
    "metrics_sidecar/ranks.py",
    "metrics_sidecar/sidecar.py",
    "metrics_sidecar/wandb_layout.py",
    "metrics_sidecar/wandb_reader.py",
    "metrics_sidecar/wandb_uploader.py",
    "tools/eval.py",
    "tools/report.py",
    "tools/status.py",
)
# Literals equal to a defined name that mean something else.
NOT_SERIES = {
    # The record's own field (wire, metrics.jsonl), eval reports and checkpoint state all
    # have a "step"; the series Drafter.STEP / Target.STEP is that same number.
    ("*", "step"),
    ("drafter_worker/trainer.py", "lr"),  # torch's param-group key
    ("tools/eval.py", "target"),  # the eval report's target model
}


def _catalog_form(group: type, strip: str = "") -> list[str]:
    return [(m.catalog_name if isinstance(m, Family) else m).removeprefix(strip) for m in names.members(group)]


@pytest.mark.parametrize("section, group, strip", [
    ("Per drafter", Drafter, ""),
    ("Evaluation", Eval, ""),
    ("Target", Target, ""),
    ("Pipeline", Pipeline, names.PIPELINE_PREFIX),
    ("The sidecar", Sidecar, names.SIDECAR_PREFIX),
])
def test_catalog_lists_exactly_the_defined_names(section, group, strip):
    listed = catalog_tables()[section]
    defined = _catalog_form(group, strip)
    assert len(listed) == len(set(listed)), f"docs/metrics.md lists a series twice in {section!r}"
    assert set(listed) - set(defined) == set(), f"in docs/metrics.md ({section!r}) but not in common/metric_names.py"
    assert set(defined) - set(listed) == set(), f"in common/metric_names.py but not in docs/metrics.md ({section!r})"


def _section_table(title: str) -> list[str]:
    """The series the table of the docs/metrics.md section whose heading starts with `title` lists."""
    listed: list[str] = []
    inside = False
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("## "):
            inside = line[3:].startswith(title)
        elif inside and line.startswith("| `"):
            listed.extend(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return listed


def test_catalog_lists_the_multi_rank_series():
    # A section of its own: a job of one-process drafters (tests/integration) never logs these.
    listed = _section_table("Drafters trained by several ranks")
    assert listed and sorted(listed) == sorted(_catalog_form(Ranks))


def test_names_are_distinct_within_a_group_and_full_names_carry_their_prefix():
    for group in names.GROUPS:
        spelled = _catalog_form(group)
        assert len(spelled) == len(set(spelled)), group.__name__
    assert all(n.startswith(names.EVAL_PREFIX) for n in _catalog_form(Eval))
    assert all(n.startswith(names.PIPELINE_PREFIX) for n in _catalog_form(Pipeline))
    assert all(n.startswith(names.SIDECAR_PREFIX) for n in _catalog_form(Sidecar))
    assert all(n.startswith(names.PIPELINE_PREFIX) for n in _catalog_form(Ranks))
    assert not any(n.startswith(names.EVAL_PREFIX) for n in _catalog_form(Drafter))  # eval-only records stay eval-only


def test_families_build_and_parse():
    assert Drafter.ACC_POS(3) == "acc/pos_3" and Drafter.ACC_POS.parse("acc/pos_3") == "3"
    assert Eval.ACCEPT_POS(1) == "eval/accept/pos_1"
    assert Target.BUCKET_DEPTH(0) == "bucket_depth/0"
    assert names.DRAFTER_SOURCE("d0") == "drafter/d0" and names.DRAFTER_SOURCE.parse("drafter/d0") == "d0"
    assert names.DRAFTER_SOURCE.parse("drafter/d0/x") is None and names.DRAFTER_SOURCE.parse("drafter/") is None
    assert Drafter.ACC_POS.parse("acc/pos_x") is None and Drafter.ACC_POS.parse("loss") is None
    assert names.RANK_SOURCE("d0.1") == "rank/d0.1" and names.RANK_SOURCE.parse("rank/d.0.1") == "d.0.1"
    assert names.RANK_SOURCE.parse("rank/d0") is None and names.RANK_SOURCE.parse("rank/d0/x.1") is None
    assert names.TARGET_REPLICA_SOURCE.parse("target/1") == "1" and names.TARGET_REPLICA_SOURCE.parse("target/x") is None
    assert names.drafter_source("d0", 0, 1) == "drafter/d0" and names.drafter_source("d0", 1, 2) == "rank/d0.1"
    assert names.target_source(0, 1) == "target" and names.target_source(1, 2) == "target/1"
    assert Ranks.SKEW("d0") == "pipeline/rank_skew/d0" and Ranks.SKEW.parse("pipeline/rank_skew/d0") == "d0"


def _defined() -> tuple[set[str], tuple[str, ...], list[Family]]:
    """Plain names (sources included), prefixes, families."""
    families = [names.DRAFTER_SOURCE, names.TARGET_REPLICA_SOURCE, names.RANK_SOURCE]
    plain = {names.TARGET_SOURCE, names.PIPELINE_SOURCE, names.SIDECAR_SOURCE}
    for group in names.GROUPS:
        for m in names.members(group):
            (families.append if isinstance(m, Family) else plain.add)(m)
    prefixes = (names.PIPELINE_PREFIX, names.SIDECAR_PREFIX, names.EVAL_PREFIX, *(f.prefix for f in families))
    return plain, prefixes, families


def bare_names(path: Path, rel: str) -> list[str]:
    """`line: literal` for each string constant of `path` that spells a defined name (docstrings aside)."""
    plain, prefixes, families = _defined()
    allowed = {text for where, text in NOT_SERIES if where in ("*", rel)}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    pieces: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))  # a docstring
        if isinstance(node, ast.JoinedStr):
            pieces.update(id(v) for v in node.values if isinstance(v, ast.Constant))

    def spells(text: str) -> bool:
        if text in allowed:
            return False
        return text in plain or text in prefixes or any(f.parse(text) is not None for f in families)

    found = []
    for node in sorted(ast.walk(tree), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
        if not isinstance(node, ast.Constant) or id(node) in skip:
            continue
        value = node.value
        if isinstance(value, bytes):
            value = value.decode("latin-1").strip('"')
        if not isinstance(value, str):
            continue
        if id(node) in pieces:  # a piece of an f-string: f"acc/pos_{k}", f"{source}/loss"
            hit = spells(value.strip("/")) or any(value.endswith(p) for p in prefixes)
        else:
            hit = spells(value)
        if hit:
            found.append(f"{node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("rel", PRODUCERS_AND_CONSUMERS)
def test_no_bare_metric_names(rel):
    found = bare_names(ROOT / rel, rel)
    assert not found, (f"{rel} spells metric names as literals; use common/metric_names.py "
                       f"(add a new series there and to docs/metrics.md): {found}")


def test_the_scan_sees_literals_and_f_strings(tmp_path):
    # The scan itself: a test that can never fail would guard nothing.
    src = tmp_path / "m.py"
    src.write_text('"""loss in a docstring is fine"""\n'
                   'a = {"loss": 1, f"acc/pos_{k}": 2, f"{source}/eal": 3, "eval/accept/pos_2": 4}\n'
                   'b = b\'"tokens_per_s"\'\n'
                   'c = f"loss={x:.3f}" + "the loss" + "pipeline/loss_mean"\n')
    assert bare_names(src, "m.py") == [
        "2: 'loss'", "2: 'acc/pos_'", "2: '/eal'", "2: 'eval/accept/pos_2'", "3: b'\"tokens_per_s\"'",
        "4: 'pipeline/loss_mean'",
    ]
