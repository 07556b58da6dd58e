"""SLO classes, per-request resolution and validation."""

import pytest

from tandem.router.errors import InvalidRequest
from tandem.router.policy import BATCH, INTERACTIVE, Slo, SloClass, SloConfig


def test_presets():
    assert INTERACTIVE.slo.ttft_s and INTERACTIVE.slo.itl_s
    assert not BATCH.slo.has_target
    assert BATCH.priority < INTERACTIVE.priority
    config = SloConfig()
    assert min(c.priority for c in config.classes.values()) == BATCH.priority


def test_resolve_defaults_and_overrides():
    config = SloConfig()
    default = config.resolve()
    assert default.class_name == "interactive"
    assert default.slo == INTERACTIVE.slo and default.priority == INTERACTIVE.priority
    custom = config.resolve("interactive", ttft_s=0.25)
    assert custom.ttft_s == 0.25 and custom.itl_s == INTERACTIVE.slo.itl_s
    batch = config.resolve("batch")
    assert batch.is_best_effort and batch.priority == BATCH.priority
    assert config.resolve("batch", itl_s=0.5).itl_s == 0.5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        # Named as the APIs name the overrides (the request fields), not Slo's fields.
        ({"ttft_s": -1.0}, "ttft_slo_s"),
        ({"itl_s": 0.0}, "itl_slo_s"),
        ({"itl_s": float("nan")}, "itl_slo_s"),
        ({"priority": -3}, "priority"),
        ({"slo_class": "gold"}, "slo_class"),
    ],
)
def test_resolve_rejects_bad_input_naming_the_field(kwargs, field):
    slo_class = kwargs.pop("slo_class", None)
    with pytest.raises(InvalidRequest) as info:
        SloConfig().resolve(slo_class, **kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.param == field
    assert field in str(info.value)


def test_config_validation():
    with pytest.raises(ValueError, match="ttft_s"):
        Slo(ttft_s=0)
    with pytest.raises(ValueError, match="priority"):
        SloClass("x", Slo(), priority=-1)
    with pytest.raises(ValueError, match="default_class"):
        SloConfig(default_class="gold")
    with pytest.raises(ValueError, match="keys must match"):
        SloConfig(classes={"a": BATCH, "interactive": INTERACTIVE})


def test_attained():
    slo = Slo(ttft_s=1.0, itl_s=0.1)
    assert slo.attained(0.5, 0.05)
    assert not slo.attained(1.5, 0.05)
    assert not slo.attained(0.5, 0.2)
    assert Slo().attained(100.0, 100.0)
