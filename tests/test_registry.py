"""optimized/registry.py: preference is the registered priority (lower first), never the order
modules were imported in; a stage refuses a second implementation with a name or a priority it
already has."""

import pytest

from mla_verify.optimized import registry

FAMILIES = ["flash_mla", "triton", "torch-fp32"]


def registered() -> dict[str, list[registry.Implementation]]:
    return {stage: registry.implementations(stage) for stage in registry.stages()}


def test_every_stage_prefers_flash_mla_then_triton_then_torch_fp32():
    for stage, impls in registered().items():
        names = [i.name for i in impls if i.name in FAMILIES]
        assert names == sorted(names, key=FAMILIES.index), stage
        assert [i.priority for i in impls] == sorted({i.priority for i in impls}), stage


def test_registering_in_reverse_order_gives_the_same_preference(monkeypatch):
    table = registered()
    # Every stage registered last-preferred first, and the stages themselves in reverse.
    monkeypatch.setattr(registry, "_REGISTRY", {})
    for impls in reversed(table.values()):
        for impl in reversed(impls):
            registry.register(impl.stage, impl.name, priority=impl.priority, devices=impl.devices,
                              unavailable=impl.unavailable, deviations=impl.deviations, doc=impl.doc,
                              interpreted_on=impl.interpreted_on)(impl.fn)
    assert any(len(impls) > 1 for impls in table.values())  # so the reversal changes an order
    assert registered() == table


def test_a_shared_priority_or_name_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    registry.register("stage", "first", priority=registry.TRITON)(lambda: None)
    with pytest.raises(ValueError, match="both have priority"):
        registry.register("stage", "second", priority=registry.TRITON)(lambda: None)
    with pytest.raises(ValueError, match="already has an implementation named"):
        registry.register("stage", "first", priority=registry.EAGER)(lambda: None)
    # A second implementation left at the default priority meets the first one's default.
    registry.register("other", "only")(lambda: None)
    with pytest.raises(ValueError, match="both have priority"):
        registry.register("other", "forgot_its_priority")(lambda: None)
    assert [i.name for i in registry.implementations("stage")] == ["first"]
