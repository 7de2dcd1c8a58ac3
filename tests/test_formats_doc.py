"""The examples of docs/formats.md parse and fit together, so that the page cannot drift from the
code that reads the files."""

from __future__ import annotations

import dataclasses
import enum
import re
import typing
from pathlib import Path

from hethub.spec import check_plan, load_cluster, load_model, load_plan
from hethub.spec.plan import PLAN_KEYS, Plan

FORMATS = Path(__file__).resolve().parents[1] / "docs" / "formats.md"


def test_the_cluster_model_and_plan_examples_load_and_check(tmp_path: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", FORMATS.read_text(), re.DOTALL)
    assert len(blocks) == 3, "docs/formats.md: one YAML example each for cluster, model and plan"
    for name, text in zip(("cluster", "model", "plan"), blocks):
        (tmp_path / f"{name}.yaml").write_text(text)
    cluster = load_cluster(tmp_path / "cluster.yaml")
    plan = load_plan(tmp_path / "plan.yaml")
    model = load_model(plan.model, relative_to=tmp_path)
    assert model == load_model(tmp_path / "model.yaml")
    check_plan(plan, cluster, model, "plan.yaml")


def _table_after(text: str, heading: str) -> list[list[str]]:
    """The rows of the first markdown table after ``heading`` (a line of the doc), cells
    stripped, header and rule left out."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_plan_table_is_the_plans_declaration() -> None:
    """docs/formats.md's table of a plan's top-level fields says what spec.plan.Plan declares,
    which parse_plan reads (Fields.declared) and to_dict writes: the same fields in the same
    order, each's type and default."""
    text = FORMATS.read_text()
    section = text[text.index("## The plan file") :]
    rows = _table_after(section, "Top level:")
    assert [row[0].strip("`") for row in rows] == list(PLAN_KEYS)
    hints = typing.get_type_hints(Plan)
    for field, (_, kind, default, _) in zip(dataclasses.fields(Plan), rows, strict=True):
        declared = hints[field.name]
        if field.default is dataclasses.MISSING:
            assert default == "required", field.name
        elif isinstance(field.default, enum.Enum):
            assert default == f"`{field.default.value}`", field.name
        else:
            assert default == f"`{str(field.default).lower()}`", field.name
        if isinstance(declared, type) and issubclass(declared, enum.Enum):
            assert kind == "choice: " + ", ".join(f"`{m.value}`" for m in declared), field.name
        elif declared is bool:
            assert kind == "`true` or `false`", field.name
        elif declared is int:
            assert kind == "int > 0", field.name
