"""ElasticTrainer's configuration: the ElasticConfig sections, their validation, and the
former flat keywords that still work for one release with a DeprecationWarning."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

import ckpt
import trainer
from trainer import (CheckpointConfig, DataConfig, ElasticConfig, FailureConfig, HealthGuard,
                     ObservabilityConfig, StepConfig)
from trainer.checkpointing import memory_job_id, memory_tier_options
from trainer.config import LEGACY_KEYWORDS, new_spelling
from trainer.elastic import ElasticTrainer

from tests.support.prom import free_port, listening


@pytest.fixture(autouse=True)
def plain_process(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "CKPT_ELASTIC_AUDIT_DIR",
              "CKPT_ELASTIC_RUN_DIR"):
        monkeypatch.delenv(k, raising=False)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def step_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def make(tmp_path, config: ElasticConfig | None = None, **kw) -> ElasticTrainer:
    return ElasticTrainer(lambda: torch.nn.Linear(4, 2),
                          lambda p: torch.optim.SGD(p, lr=0.1), Pairs(), step_fn,
                          checkpoint_root=tmp_path / "ckpt", checkpoint_every=2,
                          global_batch_size=4, micro_batch_size=2, config=config, **kw)


def test_the_trainer_package_exports_the_config_sections_in_a_sorted_all():
    assert trainer.__all__ == sorted(trainer.__all__)
    for name in ("CheckpointConfig", "DataConfig", "ElasticConfig", "FailureConfig",
                 "ObservabilityConfig", "StepConfig"):
        assert name in trainer.__all__ and getattr(trainer, name).__name__ == name


def test_a_trainer_configured_by_the_new_spelling_warns_nothing_through_a_whole_fit(tmp_path):
    """Neither the trainer nor the CheckpointManager it builds emits a DeprecationWarning
    when the user spells everything the current way."""
    config = ElasticConfig(
        seed=1, health=HealthGuard(window=5, min_history=2),
        step=StepConfig(max_grad_norm=1.0),
        checkpoint=CheckpointConfig(manager_options={"keep_last": 2}, verify="digest"),
        failure=FailureConfig(heartbeat_timeout=10.0, collective_timeout=30.0),
        observability=ObservabilityConfig(audit_dir=tmp_path / "audit", log_every=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        t = make(tmp_path, config)
        summary = t.fit(4)
    assert summary.final_step == 4 and t.step == 4 and t.config is config
    assert sorted(p.name for p in (tmp_path / "audit").iterdir())


def test_each_former_keyword_warns_with_its_new_spelling_and_lands_in_its_section(tmp_path):
    given = {"seed": 7, "heartbeat_timeout": 12.0, "probe": False, "log_every": None,
             "max_grad_norm": 0.5, "checkpoint_options": {"keep_last": 4},
             "collate_fn": lambda samples: samples}
    with pytest.warns(DeprecationWarning) as caught:
        t = make(tmp_path, ElasticConfig(seed=5), **given)
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    for keyword in given:
        assert any(f"ElasticTrainer({keyword}=...)" in m and new_spelling(keyword) in m
                   for m in messages), keyword
    assert any("pass config=ElasticConfig(failure=FailureConfig(heartbeat_timeout=...))" in m
               for m in messages)
    c = t.config
    assert c.seed == 7  # a former keyword overrides the config it is given with
    assert c.failure.heartbeat_timeout == 12.0 and c.checkpoint.probe is False
    assert c.observability.log_every is None and c.step.max_grad_norm == 0.5
    assert c.checkpoint.manager_options == {"keep_last": 4}
    assert c.data.collate_fn is given["collate_fn"] and t.collate_fn is given["collate_fn"]
    # every former keyword has a home, and the map names only real fields
    for keyword, (section, name) in LEGACY_KEYWORDS.items():
        owner = ElasticConfig() if section is None else getattr(ElasticConfig(), section)
        assert name in {f.name for f in dataclasses.fields(owner)}, keyword


def test_an_unknown_keyword_is_a_type_error_naming_it(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'heartbeat'"):
        make(tmp_path, heartbeat=3.0)
    with pytest.raises(TypeError, match="config must be a trainer.ElasticConfig"):
        make(tmp_path, {"seed": 1})


def test_config_sections_validate_when_built_and_are_frozen():
    with pytest.raises(ValueError, match="at least two heartbeat intervals"):
        FailureConfig(heartbeat_timeout=1.0, heartbeat_interval=1.0)
    with pytest.raises(ValueError, match="log_every must be a positive int"):
        ObservabilityConfig(log_every=0)
    with pytest.raises(TypeError, match="give it to your DataLoader"):
        DataConfig(collate_fn=list, data_loader=lambda s: s)
    with pytest.raises(ValueError, match="verify must be one of"):
        CheckpointConfig(verify="forwards")
    with pytest.raises(TypeError, match="may not set \\['every_steps'\\]"):
        CheckpointConfig(manager_options={"every_steps": 3})
    with pytest.raises(TypeError, match="ElasticConfig.failure must be a FailureConfig"):
        ElasticConfig(failure={"heartbeat_timeout": 3.0})
    with pytest.raises(TypeError, match="hooks must be a trainer.Hooks"):
        ElasticConfig(hooks=lambda t, step: None)
    config = ElasticConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 3
    assert FailureConfig(collective_timeout=5).collective_timeout == 5.0
    assert pickle.loads(pickle.dumps(config)) == config  # cheap to hand to another process


def test_checkpoint_every_stays_a_required_positive_argument(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every must be a positive int"):
        ElasticTrainer(lambda: None, lambda p: None, [0] * 4, step_fn,
                       checkpoint_root=tmp_path, checkpoint_every=0, global_batch_size=2,
                       micro_batch_size=2)


def test_memory_options_reach_the_manager_with_the_jobs_name_filled_in(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")
    got = memory_tier_options(True, root=tmp_path, elastic=True,
                              options=ckpt.MemoryTierOptions(persist_every=3))
    assert got == {"memory_tier": ckpt.MemoryTierOptions(
        persist_every=3, job=memory_job_id(tmp_path, "run7"))}
    own = ckpt.MemoryTierOptions(job="mine", replicas=2)
    assert memory_tier_options(True, root=tmp_path, elastic=True,
                               options=own)["memory_tier"] is own
    assert memory_tier_options(False, root=tmp_path, elastic=True, options=own) == {}
    with pytest.raises(TypeError, match="memory_options must be a ckpt.MemoryTierOptions"):
        CheckpointConfig(memory_options={"persist_every": 3})
    with pytest.raises(TypeError, match="may not set \\['schedule'\\]"):
        CheckpointConfig(manager_options={"schedule": ckpt.Schedule()})


def test_the_former_attributes_read_the_config_with_a_deprecation_warning(tmp_path):
    t = make(tmp_path, ElasticConfig(seed=4, failure=FailureConfig(heartbeat_timeout=9.0)))
    with pytest.warns(DeprecationWarning, match="read trainer.config.failure.heartbeat_timeout"):
        assert t.heartbeat_timeout == 9.0
    with pytest.warns(DeprecationWarning, match="read trainer.config.seed"):
        assert t.seed == 4
    with pytest.raises(AttributeError, match="no attribute 'heartbeat'"):
        t.heartbeat  # noqa: B018


@pytest.mark.parametrize("addr", [None, "127.0.0.1"])
def test_the_trainers_metrics_port_listens_on_the_configured_address(tmp_path, addr):
    port = free_port()
    given = {} if addr is None else {"metrics_addr": addr}
    t = make(tmp_path, ElasticConfig(observability=ObservabilityConfig(
        metrics_port=port, log_every=None, **given)))
    try:
        t.fit(2)
        assert listening(port) == {addr or "0.0.0.0"}
    finally:
        t.close()
    assert listening(port) == set()  # closed with the trainer


def test_the_metrics_address_must_be_a_host():
    for bad in ("", None, 7):
        with pytest.raises(ValueError, match="metrics_addr must be a host address"):
            ObservabilityConfig(metrics_addr=bad)
