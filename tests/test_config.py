"""Tests for gpuvirt.config: sizes, windows, validation messages, defaults, tokens, paths."""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuvirt
from gpuvirt import config, paths
from gpuvirt.config import (
    FB_ALIGN,
    GiB,
    HostConfig,
    HostSection,
    KiB,
    MiB,
    config_from_dict,
    default_runtime_dir,
    default_state_dir,
    format_size,
    load_config,
    load_or_create_token,
    parse_config,
    parse_size,
    parse_token,
    parse_window,
)
from gpuvirt.errors import ConfigError

# Captured before the isolation fixture repoints them at tmp_path.
REAL_PATHS = {
    "SYSTEM_RUNTIME_DIR": paths.SYSTEM_RUNTIME_DIR,
    "SYSTEM_STATE_DIR": paths.SYSTEM_STATE_DIR,
    "TMP_ROOT": paths.TMP_ROOT,
    "DEFAULT_CONFIG_PATH": paths.DEFAULT_CONFIG_PATH,
}


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every test away from /run, /var/lib, /tmp, /etc and the real environment."""
    root = tmp_path / "sys"
    for sub in ("run", "varlib", "tmp", "etc", "home"):
        (root / sub).mkdir(parents=True)
    # Where the rules read them: gpuvirt.paths (config re-exports the values only).
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", root / "run" / "gpuvirt")
    monkeypatch.setattr(paths, "SYSTEM_STATE_DIR", root / "varlib" / "gpuvirt")
    monkeypatch.setattr(paths, "TMP_ROOT", root / "tmp")
    monkeypatch.setattr(paths, "DEFAULT_CONFIG_PATH", root / "etc" / "gpuvirt.toml")
    for var in ("GPUVIRT_CONFIG", "XDG_RUNTIME_DIR", "XDG_STATE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(root / "home"))
    return root


def blocked(path: Path) -> Path:
    """A candidate directory that cannot be used, even by root: its parent is a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blocker = path.parent / "not-a-dir"
    blocker.write_text("")
    return blocker / "gpuvirt"


# --- defaults -------------------------------------------------------------------


def test_defaults_match_design() -> None:
    cfg = load_config()
    assert cfg.device.backend == "emu"
    assert cfg.device.fb_total is None
    assert cfg.effective_fb_total() == 2 * GiB
    assert cfg.device.pf_fb == 256 * MiB
    assert cfg.sriov.vf_num == 4
    assert cfg.scheduler.policy == "liquid"
    assert cfg.scheduler.time_slice_ms == 6
    assert cfg.scheduler.cmd_timeout_ms == 500
    assert cfg.scheduler.job_timeout_s == 10.0
    assert cfg.scheduler.fullaccess_timeout_ms == 1500
    assert cfg.reset.ready_to_reset_wait_ms == 10
    assert cfg.reset.guard_flr == "3/60s"
    assert (cfg.reset.guard_count, cfg.reset.guard_window_s) == (3, 60.0)
    assert cfg.vf == []
    assert REAL_PATHS["SYSTEM_RUNTIME_DIR"] == Path("/run/gpuvirt")
    assert REAL_PATHS["SYSTEM_STATE_DIR"] == Path("/var/lib/gpuvirt")
    assert REAL_PATHS["TMP_ROOT"] == Path("/tmp")
    assert REAL_PATHS["DEFAULT_CONFIG_PATH"] == Path("/etc/gpuvirt/gpuvirt.toml")
    assert cfg.host.socket_path() == paths.SYSTEM_RUNTIME_DIR / "host.sock"
    assert cfg.host.admin_address() == paths.SYSTEM_RUNTIME_DIR / "admin.sock"
    assert cfg.host.state_path() == paths.SYSTEM_STATE_DIR


def test_default_layout_splits_evenly() -> None:
    plans = HostConfig().vf_layout()
    assert [p.index for p in plans] == [0, 1, 2, 3]
    assert [p.fb for p in plans] == [448 * MiB] * 4  # (2 GiB - 256 MiB) / 4
    assert all(p.weight == 1.0 and p.allowed_uids is None for p in plans)
    assert [p.token_file for p in plans] == [
        paths.SYSTEM_STATE_DIR / f"vf{i}.token" for i in range(4)
    ]


def test_design_example_config_loads() -> None:
    cfg = parse_config(
        """
        [host]
        socket = "/run/gpuvirt/host.sock"
        admin = "127.0.0.1:9464"
        state_dir = "/var/lib/gpuvirt"
        [device]
        backend = "emu"
        fb_total = "2GiB"
        pf_fb = "256MiB"
        [sriov]
        vf_num = 4
        [scheduler]
        policy = "weighted"
        time_slice_ms = 6
        cmd_timeout_ms = 500
        job_timeout_s = 10
        fullaccess_timeout_ms = 1500
        [reset]
        ready_to_reset_wait_ms = 10
        guard_flr = "3/60s"
        [[vf]]
        index = 0
        fb = "512MiB"
        weight = 2
        token_file = "/run/gpuvirt/vf0.token"
        allowed_uids = [1000]
        """
    )
    assert cfg.host.admin_address() == ("127.0.0.1", 9464)
    assert cfg.scheduler.job_timeout_s == 10.0
    plans = cfg.vf_layout()
    assert plans[0].fb == 512 * MiB
    assert plans[0].weight == 2.0
    assert plans[0].token_file == Path("/run/gpuvirt/vf0.token")
    assert plans[0].allowed_uids == (1000,)
    # The other three share 2 GiB - 256 MiB - 512 MiB = 1280 MiB.
    assert [p.fb for p in plans[1:]] == [1280 * MiB // 3 // FB_ALIGN * FB_ALIGN] * 3


# --- sizes and windows ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * GiB),
        ("256MiB", 256 * MiB),
        ("512KiB", 512 * KiB),
        ("4096", 4096),
        (4096, 4096),
        ("1.5GiB", 3 * GiB // 2),
        ("1.5 GiB", 3 * GiB // 2),
        ("  2 gib ", 2 * GiB),
        ("1G", GiB),
        ("1g", GiB),
        ("1GB", 10**9),
        ("1gb", 10**9),
        ("3MB", 3 * 10**6),
        ("2KB", 2000),
        ("2K", 2048),
        ("4M", 4 * MiB),
        ("1TiB", 1 << 40),
        ("1500 B", 1500),
        ("0.5KiB", 512),
    ],
)
def test_parse_size_accepts(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("-1", "negative"),
        (-5, "negative"),
        ("-1GiB", "negative"),
        ("0", "greater than zero"),
        (0, "greater than zero"),
        ("abc", "not a size"),
        ("", "not a size"),
        ("GiB", "not a size"),
        ("1 5GiB", "not a size"),
        ("2XB", "unknown size unit"),
        ("1.3KiB", "whole number of bytes"),
        ("1.5", "whole number of bytes"),
        ("1e9", "not a size"),
        ("٣GiB", "not a size"),  # non-ASCII digits
        (1.5, "got a float"),
        (True, "got a boolean"),
        (None, "got nothing"),
        ("9" * 100, "too long"),
        ("99999999TiB", "16 EiB"),
    ],
)
def test_parse_size_refuses(value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_size(value)  # type: ignore[arg-type]


def test_parse_size_zero_where_allowed() -> None:
    assert parse_size("0", allow_zero=True) == 0
    assert parse_size("0 MiB", allow_zero=True) == 0


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1500, "1500 B"),
        (1024, "1 KiB"),
        (256 * MiB, "256 MiB"),
        (3 * GiB // 2, "1.5 GiB"),
        (GiB + GiB // 8, "1.125 GiB"),
        (GiB + GiB // 16, "1088 MiB"),  # 1.0625 GiB needs four decimals
        (1025 * KiB, "1025 KiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@given(st.integers(min_value=0, max_value=1 << 45))
def test_format_parse_round_trip_kib_multiples(k: int) -> None:
    n = k * KiB
    assert parse_size(format_size(n), allow_zero=True) == n


@given(st.integers(min_value=0, max_value=1 << 50))
def test_format_parse_round_trip_any_bytes(n: int) -> None:
    assert parse_size(format_size(n), allow_zero=True) == n


size_like = st.text(alphabet="0123456789.-+ eEbBkKmMgGiItT_/\t\n", max_size=20)


@given(st.one_of(st.text(max_size=40), size_like))
def test_parse_size_garbage_raises_only_value_error(text: str) -> None:
    try:
        n = parse_size(text)
    except ValueError:
        return
    assert isinstance(n, int) and n > 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3/60s", (3, 60.0)),
        ("3/2m", (3, 120.0)),
        ("5/500ms", (5, 0.5)),
        ("1/1h", (1, 3600.0)),
        (" 10 / 1.5s ", (10, 1.5)),
        ("2/30S", (2, 30.0)),
    ],
)
def test_parse_window_accepts(text: str, expected: tuple[int, float]) -> None:
    assert parse_window(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0/60s", "at least 1"),
        ("3/0s", "longer than zero"),
        ("3/60", "COUNT/WINDOW"),
        ("3/60x", "unknown time unit"),
        ("-1/60s", "COUNT/WINDOW"),
        ("three/60s", "COUNT/WINDOW"),
        ("", "COUNT/WINDOW"),
    ],
)
def test_parse_window_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_window(text)


@given(st.text(max_size=30))
def test_parse_window_garbage_raises_only_value_error(text: str) -> None:
    try:
        count, window = parse_window(text)
    except ValueError:
        return
    assert count >= 1 and window > 0


# --- validation messages -----------------------------------------------------------

BAD_CONFIGS = [
    ("[sriov]\nvf_num = 0", "sriov.vf_num = 0", "between 1 and 31"),
    ("[sriov]\nvf_num = 32", "sriov.vf_num = 32", "between 1 and 31"),
    ("[scheduler]\ntime_slice_ms = 0", "scheduler.time_slice_ms = 0", "between 1 and 500"),
    ("[scheduler]\ntime_slice_ms = 501", "scheduler.time_slice_ms = 501", "between 1 and 500"),
    ('[scheduler]\ntime_slice_ms = "6"', 'scheduler.time_slice_ms = "6"', "expected an integer"),
    ("[scheduler]\ntime_slice_ms = true", "scheduler.time_slice_ms = true", "integer"),
    ('[scheduler]\npolicy = "nope"', 'scheduler.policy = "nope"', "must be one of"),
    ("[scheduler]\ncmd_timeout_ms = 0", "scheduler.cmd_timeout_ms = 0", "at least 1"),
    ("[scheduler]\njob_timeout_s = 0", "scheduler.job_timeout_s = 0", "greater than 0"),
    ("[scheduler]\njob_timeout_s = inf", "scheduler.job_timeout_s = inf", "finite"),
    ("[scheduler]\nfullaccess_timeout_ms = -1", "scheduler.fullaccess_timeout_ms = -1", "least"),
    ("[reset]\nready_to_reset_wait_ms = -1", "reset.ready_to_reset_wait_ms = -1", "at least 0"),
    ('[device]\nbackend = "rocm"', 'device.backend = "rocm"', "must be one of"),
    ('[device]\nfb_total = "2XB"', 'device.fb_total = "2XB"', "unknown size unit"),
    ('[device]\nfb_total = "0"', 'device.fb_total = "0"', "greater than zero"),
    ('[device]\npf_fb = "-1MiB"', 'device.pf_fb = "-1MiB"', "negative"),
    ('[device]\npf_fb = "2GiB"', "device.pf_fb = 2 GiB", "less than device.fb_total"),
    (
        '[[vf]]\nindex = 0\nfb = "1GiB"\n[[vf]]\nindex = 1\nfb = "1GiB"',
        "vf[0].fb + vf[1].fb = 2 GiB",
        "exceeds device.fb_total",
    ),
    ('[[vf]]\nindex = 0\nfb = "512KiB"', 'vf[0].fb = "512KiB"', "at least 1 MiB"),
    (
        '[device]\nfb_total = "256MiB"\npf_fb = "240MiB"\n[sriov]\nvf_num = 31',
        "sriov.vf_num = 31",
        "below the minimum of 1 MiB",
    ),
    ("[[vf]]\nindex = 0\n[[vf]]\nindex = 0", "vf[1].index = 0", "duplicate"),
    ("[[vf]]\nindex = 4", "vf[0].index = 4", "below sriov.vf_num"),
    ("[[vf]]\nindex = -1", "vf[0].index = -1", "at least 0"),
    ("[[vf]]\nweight = 1", "vf[0].index", "missing"),
    ("[[vf]]\nindex = 0\nweight = 0", "vf[0].weight = 0", "greater than 0"),
    ("[[vf]]\nindex = 0\nallowed_uids = []", "vf[0].allowed_uids = []", "must not be empty"),
    ("[[vf]]\nindex = 0\nallowed_uids = [-1]", "vf[0].allowed_uids = [-1]", "out of range"),
    ('[[vf]]\nindex = 0\ntoken_file = "vf0.token"', 'vf[0].token_file = "vf0.token"', "absolute"),
    ("vf = {index = 0}", "vf = {index = 0}", "[[vf]]"),
    ("[scheduler]\ntime_slise_ms = 6", "scheduler.time_slise_ms = 6", "did you mean time_slice_ms"),
    ("[bogus]\nx = 1", "bogus = {x = 1}", "unknown key"),
    ("host = 5", "host = 5", "expected a table"),
    ('[reset]\nguard_flr = "3/60"', 'reset.guard_flr = "3/60"', "COUNT/WINDOW"),
    ('[reset]\nguard_flr = "0/60s"', 'reset.guard_flr = "0/60s"', "at least 1"),
    ('[host]\nsocket = "host.sock"', 'host.socket = "host.sock"', "absolute path"),
    ('[host]\nadmin = "nowhere"', 'host.admin = "nowhere"', "HOST:PORT"),
    ('[host]\nadmin = "127.0.0.1:0"', 'host.admin = "127.0.0.1:0"', "port"),
    ('[host]\nadmin = "::1:9464"', 'host.admin = "::1:9464"', "brackets"),
    ("[engine]\npoll_us = -1", "engine.poll_us = -1", "between 0 and 1000000"),
    ("[engine]\npoll_us = 2000000", "engine.poll_us = 2000000", "between 0 and 1000000"),
]


@pytest.mark.parametrize(("text", "key_and_value", "reason"), BAD_CONFIGS)
def test_bad_value_is_refused_with_key_value_and_reason(
    text: str, key_and_value: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    message = str(info.value)
    line = next((ln for ln in message.splitlines() if key_and_value in ln), None)
    assert line is not None, message
    assert reason in line, message


def test_every_problem_is_listed_one_per_line(tmp_path: Path) -> None:
    path = tmp_path / "gpuvirt.toml"
    path.write_text('[sriov]\nvf_num = 0\n[scheduler]\npolicy = "nope"\ntime_slice_ms = 501\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert str(path) in lines[0]
    assert sum("sriov.vf_num = 0" in ln for ln in lines) == 1
    assert sum('scheduler.policy = "nope"' in ln for ln in lines) == 1
    assert sum("scheduler.time_slice_ms = 501" in ln for ln in lines) == 1
    assert len(lines) == 4


def test_toml_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[sriov]\nvf_num = = 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert "line 2" in message and "column" in message


toml_values = st.recursive(
    st.one_of(
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.floats(),
        st.text(max_size=12),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=6,
)
section_keys = {
    name: list(field.annotation.model_fields)  # type: ignore[union-attr]
    for name, field in HostConfig.model_fields.items()
    if name != "vf"
}


@st.composite
def config_dicts(draw: st.DrawFn) -> dict[str, object]:
    data: dict[str, object] = {}
    for section, keys in section_keys.items():
        if draw(st.booleans()):
            chosen = draw(st.lists(st.sampled_from([*keys, "extra"]), max_size=3, unique=True))
            data[section] = {k: draw(toml_values) for k in chosen}
    if draw(st.booleans()):
        vf_keys = [*config.VFSection.model_fields, "extra"]
        data["vf"] = draw(
            st.lists(
                st.dictionaries(st.sampled_from(vf_keys), toml_values, max_size=4),
                max_size=3,
            )
        )
    if draw(st.booleans()):
        data[draw(st.text(max_size=6))] = draw(toml_values)
    return data


@settings(max_examples=300, deadline=None)
@given(config_dicts())
def test_validation_errors_never_escape(data: dict[str, object]) -> None:
    try:
        config_from_dict(data)
    except ConfigError as e:
        assert str(e).startswith("invalid configuration")


# --- loading and overrides ------------------------------------------------------


def test_overrides_apply_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "gpuvirt.toml"
    path.write_text('[sriov]\nvf_num = 2\n[scheduler]\npolicy = "fairness"\n')
    cfg = load_config(
        path,
        {"sriov.vf_num": 8, "host.socket": "/tmp/x.sock", "device.fb_total": None},
    )
    assert cfg.sriov.vf_num == 8
    assert cfg.host.socket_path() == Path("/tmp/x.sock")
    assert cfg.scheduler.policy == "fairness"  # untouched by the overrides
    assert cfg.device.fb_total is None  # None means "not overridden"


def test_overrides_without_a_file_and_with_path_objects() -> None:
    cfg = load_config(overrides={"host.state_dir": Path("/srv/gpuvirt"), "device.pf_fb": "1GiB"})
    assert cfg.host.state_path() == Path("/srv/gpuvirt")
    assert cfg.device.pf_fb == GiB


def test_bad_override_is_named_as_such() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"sriov.vf_num": 40})
    assert "sriov.vf_num = 40: must be between 1 and 31 (set by an override)" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"sriov.vf_nmu": 4}, "sriov.vf_nmu = 4: unknown key"),
        ({"sriov.vf_num.x": 4}, "sriov.vf_num"),
        ({"sriov..vf_num": 4}, "not a dotted key"),
    ],
)
def test_malformed_overrides_are_refused(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match="override") as info:
        load_config(overrides=overrides)
    assert fragment in str(info.value)


def test_config_search_order(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_config().sriov.vf_num == 4  # nothing anywhere: built-in defaults
    paths.DEFAULT_CONFIG_PATH.write_text("[sriov]\nvf_num = 5\n")
    assert load_config().sriov.vf_num == 5
    env_file = isolated / "env.toml"
    env_file.write_text("[sriov]\nvf_num = 6\n")
    monkeypatch.setenv("GPUVIRT_CONFIG", str(env_file))
    assert load_config().sriov.vf_num == 6
    explicit = isolated / "explicit.toml"
    explicit.write_text("[sriov]\nvf_num = 7\n")
    assert load_config(explicit).sriov.vf_num == 7
    assert load_config(str(explicit)).sriov.vf_num == 7


def test_missing_config_files_are_refused(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(isolated / "nope.toml")
    monkeypatch.setenv("GPUVIRT_CONFIG", str(isolated / "gone.toml"))
    with pytest.raises(ConfigError, match=r"gone\.toml \(from \$GPUVIRT_CONFIG\) does not exist"):
        load_config()


def test_unreadable_config_files_are_refused(isolated: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(isolated)
    binary = isolated / "binary.toml"
    binary.write_bytes(b"[sriov]\nvf_num = 4 # \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)


# --- layout -----------------------------------------------------------------------


def test_split_is_aligned_and_fits() -> None:
    cfg = parse_config('[device]\nfb_total = "1GiB"\npf_fb = "0"\n[sriov]\nvf_num = 3')
    plans = cfg.vf_layout()
    assert len({p.fb for p in plans}) == 1
    assert all(p.fb % FB_ALIGN == 0 for p in plans)
    assert GiB - 3 * FB_ALIGN < sum(p.fb for p in plans) <= GiB


def test_explicit_sizes_and_overrides_per_vf(isolated: Path) -> None:
    cfg = parse_config(
        f"""
        [host]
        state_dir = "{isolated}/state"
        [device]
        fb_total = "4GiB"
        pf_fb = "1GiB"
        [sriov]
        vf_num = 3
        [[vf]]
        index = 2
        fb = "1GiB"
        weight = 0.5
        allowed_uids = [1000, 1001]
        """
    )
    plans = cfg.vf_layout()
    assert [p.fb for p in plans] == [GiB, GiB, GiB]
    assert plans[2].weight == 0.5
    assert plans[2].allowed_uids == (1000, 1001)
    assert plans[0].token_file == isolated / "state" / "vf0.token"


def test_cuda_layout_needs_the_device_total() -> None:
    cfg = parse_config('[device]\nbackend = "cuda"\npf_fb = "1GiB"\n[[vf]]\nindex = 0\nfb = "2GiB"')
    with pytest.raises(ConfigError, match="device_total"):
        cfg.vf_layout()
    plans = cfg.vf_layout(device_total=11 * GiB)
    assert [p.fb for p in plans] == [2 * GiB] + [(8 * GiB // 3) // FB_ALIGN * FB_ALIGN] * 3
    with pytest.raises(ConfigError, match=r"exceeds device\.fb_total"):
        cfg.vf_layout(device_total=2 * GiB)


def test_explicit_fb_total_larger_than_the_device_is_refused() -> None:
    cfg = parse_config('[device]\nbackend = "cuda"\nfb_total = "80GiB"')
    assert cfg.effective_fb_total() == 80 * GiB
    with pytest.raises(ConfigError, match=r"device\.fb_total = 80 GiB: the device has only 40 GiB"):
        cfg.vf_layout(device_total=40 * GiB)


# --- dump -------------------------------------------------------------------------


def test_dump_has_every_key_and_round_trips() -> None:
    cfg = parse_config(
        """
        [host]
        admin = "[::1]:9464"
        socket_group = "root"
        admin_token_file = "/x/admin.token"
        max_frames_per_s = 50
        event_log_max = "1MiB"
        [device]
        fb_total = "3GiB"
        [sriov]
        vf_num = 3
        [engine]
        sandbox = "best-effort"
        memory = "2GiB"
        [scheduler]
        policy = "weighted"
        job_timeout_s = 2.5
        [reset]
        guard_flr = "5/2m"
        [[vf]]
        index = 1
        fb = "1.5GiB"
        weight = 3
        allowed_uids = [0]
        token_file = "/x/\\"odd\\" name.token"
        """
    )
    text = cfg.dump_toml()
    data = tomllib.loads(text)
    for section, keys in section_keys.items():
        assert set(data[section]) == set(keys), section
    assert [vf["index"] for vf in data["vf"]] == [0, 1, 2]
    again = parse_config(text)
    assert again.vf_layout() == cfg.vf_layout()
    assert again.engine == cfg.engine
    assert again.host.socket_group == "root" and again.host.socket_mode == cfg.host.socket_mode
    for section in section_keys:
        if section != "host":
            assert getattr(again, section) == getattr(cfg, section), section
    assert again.effective_fb_total() == cfg.effective_fb_total()
    assert again.host == cfg.host.model_copy(
        update={"socket": again.host.socket, "state_dir": again.host.state_dir}
    )
    assert again.host.admin_address() == ("::1", 9464)
    assert again.host.socket_path() == cfg.host.socket_path()
    assert again.host.state_path() == cfg.host.state_path()


def test_dump_on_cuda_without_a_total_still_parses() -> None:
    cfg = parse_config('[device]\nbackend = "cuda"\n[[vf]]\nindex = 1\nfb = "2GiB"')
    text = cfg.dump_toml()
    assert "# fb_total" in text
    again = parse_config(text)
    assert again.vf_layout(device_total=10 * GiB) == cfg.vf_layout(device_total=10 * GiB)
    assert "fb_total = " in cfg.dump_toml(device_total=10 * GiB)


def test_dump_resolves_defaults_without_creating_directories() -> None:
    text = HostConfig().dump_toml()
    assert f'socket = "{paths.SYSTEM_RUNTIME_DIR}/host.sock"' in text
    assert not paths.SYSTEM_RUNTIME_DIR.exists()
    assert not paths.SYSTEM_STATE_DIR.exists()


# --- admin address ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("localhost:1", ("localhost", 1)),
        ("[::1]:9464", ("::1", 9464)),
        ("/srv/gpuvirt/admin.sock", Path("/srv/gpuvirt/admin.sock")),
    ],
)
def test_admin_address_forms(text: str, expected: object) -> None:
    assert HostSection.model_validate({"admin": text}).admin_address() == expected


# --- runtime and state directories ----------------------------------------------------


def test_runtime_dir_is_the_system_dir_when_usable() -> None:
    path = default_runtime_dir()
    assert path == paths.SYSTEM_RUNTIME_DIR
    assert stat.S_IMODE(path.stat().st_mode) == 0o755


def test_runtime_dir_falls_back_to_xdg(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", blocked(isolated / "run2" / "gpuvirt"))
    xdg = isolated / "xdg"
    xdg.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert default_runtime_dir(create=False) == xdg / "gpuvirt"
    assert not (xdg / "gpuvirt").exists()  # deciding makes nothing
    assert default_runtime_dir() == xdg / "gpuvirt"
    assert stat.S_IMODE((xdg / "gpuvirt").stat().st_mode) == 0o700
    assert HostConfig().host.socket_path() == xdg / "gpuvirt" / "host.sock"


def test_runtime_dir_falls_back_to_private_tmp(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", blocked(isolated / "run2" / "gpuvirt"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/ignored")
    expected = paths.TMP_ROOT / f"gpuvirt-{os.getuid()}"
    assert default_runtime_dir(create=False) == expected
    assert not expected.exists()
    assert default_runtime_dir() == expected
    assert stat.S_IMODE(expected.stat().st_mode) == 0o700


def test_runtime_dir_skips_missing_xdg_dir(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", blocked(isolated / "run2" / "gpuvirt"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(isolated / "no-such-xdg"))
    assert default_runtime_dir() == paths.TMP_ROOT / f"gpuvirt-{os.getuid()}"
    assert not (isolated / "no-such-xdg").exists()


def test_private_tmp_dir_of_another_uid_is_refused(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", blocked(isolated / "run2" / "gpuvirt"))
    other = os.getuid() + 4242
    (paths.TMP_ROOT / f"gpuvirt-{other}").mkdir()  # owned by us, not by "other"
    monkeypatch.setattr(os, "getuid", lambda: other)
    for create in (True, False):
        with pytest.raises(ConfigError, match=f"belongs to uid {os.stat(isolated).st_uid}"):
            default_runtime_dir(create=create)


def test_private_tmp_dir_that_is_a_link_is_refused(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", blocked(isolated / "run2" / "gpuvirt"))
    target = isolated / "elsewhere"
    target.mkdir()
    (paths.TMP_ROOT / f"gpuvirt-{os.getuid()}").symlink_to(target)
    with pytest.raises(ConfigError, match="not a directory"):
        default_runtime_dir()


def test_own_private_tmp_dir_is_made_private(monkeypatch: pytest.MonkeyPatch) -> None:
    path = paths.TMP_ROOT / f"gpuvirt-{os.getuid()}"
    path.mkdir()
    os.chmod(path, 0o755)
    monkeypatch.setattr(paths, "SYSTEM_RUNTIME_DIR", blocked(paths.SYSTEM_RUNTIME_DIR))
    assert default_runtime_dir() == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_state_dir_fallbacks(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_state_dir(create=False) == paths.SYSTEM_STATE_DIR
    monkeypatch.setattr(paths, "SYSTEM_STATE_DIR", blocked(isolated / "varlib2" / "gpuvirt"))
    monkeypatch.setenv("XDG_STATE_HOME", str(isolated / "xdgstate" / "deep"))
    path = default_state_dir()
    assert path == isolated / "xdgstate" / "deep" / "gpuvirt"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_state_dir() == isolated / "home" / ".local" / "state" / "gpuvirt"


def test_explicit_paths_are_used_as_given() -> None:
    cfg = parse_config('[host]\nsocket = "/a/b.sock"\nadmin = "/a/admin.sock"\nstate_dir = "/s"')
    assert cfg.host.socket_path() == Path("/a/b.sock")
    assert cfg.host.admin_address() == Path("/a/admin.sock")
    assert cfg.host.state_path() == Path("/s")
    assert not paths.SYSTEM_RUNTIME_DIR.exists()


# --- tokens -------------------------------------------------------------------------


def test_token_is_created_private_and_reread(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sub" / "vf0.token"
    old_umask = os.umask(0o277)  # would strip the owner's write bit without fchmod
    try:
        token = load_or_create_token(path)
    finally:
        os.umask(old_umask)
    assert len(token) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    assert path.read_text() == token.hex() + "\n"
    assert load_or_create_token(path) == token
    assert load_or_create_token(tmp_path / "state" / "vf1.token") != token


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o666])
def test_token_file_others_can_reach_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "vf0.token"
    load_or_create_token(path)
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match=f"mode {mode:04o}"):
        load_or_create_token(path)


def test_token_file_owner_only_modes_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "vf0.token"
    token = load_or_create_token(path)
    os.chmod(path, 0o400)
    assert load_or_create_token(path) == token


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"abc\n",
        b"a" * 63 + b"\n",
        b"a" * 65,
        b"z" * 64,
        b"a" * 64 + b"\n\n",
        b"a" * 32 + b" " + b"a" * 32,
        bytes(range(32)),
        b"a" * 4096,
    ],
)
def test_token_file_with_bad_content_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "vf0.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(ConfigError, match="64 hex characters") as info:
        load_or_create_token(path)
    if len(content) >= 8:
        assert content[:8].decode("latin-1") not in str(info.value)  # never echo the secret


def test_token_file_accepts_crlf_and_uppercase(tmp_path: Path) -> None:
    path = tmp_path / "vf0.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"AB" * 32 + b"\r\n")
    os.close(fd)
    assert load_or_create_token(path) == b"\xab" * 32


def test_token_path_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        load_or_create_token(tmp_path)


def test_token_is_not_written_through_a_dangling_link(tmp_path: Path) -> None:
    target = tmp_path / "planted"
    path = tmp_path / "vf0.token"
    path.symlink_to(target)
    with pytest.raises(ConfigError):
        load_or_create_token(path)
    assert not target.exists()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("ab" * 32, b"\xab" * 32),
        ("AB" * 32 + "\n", b"\xab" * 32),
        (b"ab" * 32, b"\xab" * 32),
        (b"ab" * 32 + b"\n", b"\xab" * 32),
        (bytes(range(32)), bytes(range(32))),
        (b"\n" * 32, b"\n" * 32),  # 32 raw bytes are taken as they are
    ],
)
def test_parse_token_accepts(value: str | bytes, expected: bytes) -> None:
    assert parse_token(value) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("ab" * 31, "got 62 characters"),
        ("gq" * 32, "not all hex digits"),
        ("", "got 0 characters"),
        (bytes(31), "got 31 bytes"),
        (bytes(33), "got 33 bytes"),
        ("x" * 32, "got 32 characters"),  # 32 characters of text are not 32 raw bytes
        (12345, "str or bytes"),
    ],
)
def test_parse_token_refuses_without_echoing(value: object, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        parse_token(value)  # type: ignore[arg-type]
    if isinstance(value, str) and value:
        assert value[:6] not in str(info.value)


def test_a_guest_finds_the_socket_the_config_file_names(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """paths.mailbox_socket: the host's [host] socket, read without the config model."""
    assert paths.mailbox_socket() == default_runtime_dir(create=False) / "host.sock"
    cfg = isolated / "g.toml"
    cfg.write_text('[host]\nsocket = "/srv/gv/host.sock"\n')
    monkeypatch.setenv("GPUVIRT_CONFIG", str(cfg))
    assert paths.mailbox_socket() == Path("/srv/gv/host.sock")
    assert load_config().host.socket_path() == paths.mailbox_socket()
    cfg.write_text('[host]\nsocket = "relative.sock"\n')
    with pytest.raises(ConfigError, match=r"host\.socket = 'relative\.sock': not an absolute path"):
        paths.mailbox_socket()
    cfg.write_text("[host\n")
    with pytest.raises(ConfigError, match="cannot read"):
        paths.mailbox_socket()


# --- untrusted-input limits -------------------------------------------------------


@pytest.mark.parametrize("admin", ["0.0.0.0:9464", "10.1.2.3:80", "[::]:9464", "gpu1.example:9464"])
def test_a_non_loopback_admin_address_needs_a_token(admin: str) -> None:
    with pytest.raises(
        ConfigError, match=r"host\.admin = .*not a loopback address.*admin_token_file"
    ):
        parse_config(f'[host]\nadmin = "{admin}"')
    cfg = parse_config(f'[host]\nadmin = "{admin}"\nadmin_token_file = "/x/admin.token"')
    assert cfg.host.admin_token_file == Path("/x/admin.token")


@pytest.mark.parametrize("admin", ["127.0.0.1:9464", "127.9.9.9:1", "[::1]:9464", "localhost:9464"])
def test_a_loopback_admin_address_needs_no_token(admin: str) -> None:
    assert parse_config(f'[host]\nadmin = "{admin}"').host.admin_token_file is None


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("attach_timeout_ms", "0", "between 1 and 60000"),
        ("max_pending_attach", "0", "between 1 and 65536"),
        ("max_frames_per_s", "-5", "between 1 and 10000000"),
        ("event_log_files", "101", "between 1 and 100"),
        ("event_log_max", '"0B"', ""),
    ],
)
def test_limits_out_of_range_are_refused_with_key_and_value(key: str, value: str, why: str) -> None:
    with pytest.raises(ConfigError, match=rf"host\.{key}.*{why}"):
        parse_config(f"[host]\n{key} = {value}")


def test_the_host_defines_no_number_of_its_own_outside_defaults() -> None:
    # defaults.py's claim: the host's numbers live there (the wire format's in protocol/).
    number = re.compile(r"^[A-Z][A-Z0-9_]*(\s*,\s*[A-Z][A-Z0-9_]*)*\s*(:[^=\n]*)?=\s*[-0-9]", re.M)
    for package in ("host", "config"):
        for path in (Path(gpuvirt.__file__).parent / package).rglob("*.py"):
            assert not number.search(path.read_text()), (path, number.search(path.read_text()))
