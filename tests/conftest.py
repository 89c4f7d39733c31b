"""Planning in a test keeps its predictions in the test's own folder, never in the user's plan cache."""

import pytest

from gcompile import plan_cache


@pytest.fixture(autouse=True)
def own_plan_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cache, "default_path", lambda: str(tmp_path / "plans.json"))
