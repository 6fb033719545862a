"""What the host says and does about confinement it cannot give (no hosts needed)."""

from __future__ import annotations

import pytest

from gpuvirt.config import config_from_dict
from gpuvirt.device.sandbox import Mode, Report, Sandbox, Settings
from gpuvirt.device.sandbox.policy import enforce
from gpuvirt.errors import ConfigError, DeviceError


def _report(mode: Mode) -> Report:
    return Report(
        mode,
        active={"bwrap": "/usr/bin/bwrap", "cgroup": "v1 (memory, pids)"},
        missing={"seccomp": "libseccomp: not found", "landlock": "kernel without Landlock"},
    )


def test_required_refuses_naming_every_missing_part_but_landlock() -> None:
    with pytest.raises(DeviceError) as err:
        enforce(_report(Mode.REQUIRED))
    text = str(err.value)
    assert "seccomp: libseccomp: not found" in text and "landlock" not in text
    assert 'engine.sandbox = "best-effort"' in text and '"off"' in text


def test_best_effort_starts_and_says_what_is_missing() -> None:
    rep = _report(Mode.BEST_EFFORT)
    enforce(rep)  # no refusal
    assert rep.confined
    assert "MISSING seccomp: libseccomp: not found" in rep.line()


def test_off_confines_nothing_and_says_so() -> None:
    sb = Sandbox.off()
    assert not sb.report.confined and not sb.per_vf_identity
    assert "OFF" in sb.report.line()
    assert sb.report.as_dict() == {"mode": "off", "confined": False, "active": {}, "missing": {}}


def test_this_machine_confines_everything() -> None:
    """On the developers' and CI machines every protection is in force (nothing skips)."""
    sb = Sandbox.create(Settings())
    assert set(sb.report.active) >= {"bwrap", "identity", "seccomp", "cgroup", "landlock"}
    assert sb.report.missing == {}, sb.report.missing
    sb.close()


@pytest.mark.parametrize(
    ("engine", "needle"),
    [
        ({"sandbox": "maybe"}, "engine.sandbox"),
        ({"uid_base": 0}, "engine.uid_base"),
        ({"tasks": 1}, "engine.tasks"),
        ({"memory": "0"}, "engine.memory"),
    ],
)
def test_bad_engine_keys_are_refused_by_name(engine: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        config_from_dict({"engine": engine})
