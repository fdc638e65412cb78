"""`redserve up` hands its settings to the tiers through the environment: a round trip."""

from __future__ import annotations

import pytest

from shared.config import ApiSettings, SchedulerSettings, Settings, child_process_env


def test_child_process_env_round_trips_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(
        redis_url="redis://127.0.0.1:1/0",
        model="/models/x",
        api=ApiSettings(port=31234, api_keys=["k1", "k2"], served_model_name="m"),
        scheduler=SchedulerSettings(worker_id="w", dtype="float32", max_num_seqs=7),
    )
    for key, value in child_process_env(settings).items():
        if key.startswith("REDSERVE_"):
            monkeypatch.setenv(key, value)
    assert Settings() == settings
