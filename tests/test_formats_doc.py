"""The examples of docs/formats.md parse and fit together, so that the page cannot drift from the
code that reads the files."""

from __future__ import annotations

import re
from pathlib import Path

from hethub.spec import check_plan, load_cluster, load_model, load_plan

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
