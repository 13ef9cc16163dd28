import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from kvchat.config import (
    CONFIGS,
    DEFAULT_FILE,
    TABLES,
    ConfigError,
    Settings,
    all_keys,
    format_value,
    load_settings,
    replace_setting,
    resolve_key,
    settings_as_dict,
)
from kvchat.settings_schema import all_settings
from kvchat.settings_toml import render_default_toml


@pytest.fixture(autouse=True)
def no_user_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVCHAT_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_equal_the_dataclass_defaults() -> None:
    assert load_settings() == Settings()


def test_default_toml_holds_every_declared_default() -> None:
    # Keys whose default is unset (seed) are commented out; every other key has the declared default.
    toml = tomllib.loads(DEFAULT_FILE.read_text())
    for key, info in all_settings().items():
        table, name = key.split(".")
        if info.default is None:
            assert name not in toml[table], key
        else:
            assert normalize_toml(toml[table][name]) == info.default, key


def normalize_toml(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def test_the_shipped_default_toml_is_written_from_the_declarations() -> None:
    # After changing a setting: python scripts/make_default_toml.py
    assert DEFAULT_FILE.read_text() == render_default_toml()


def test_every_optional_setting_shows_an_example_of_its_type() -> None:
    for info in all_settings().values():
        if info.default is None:
            assert isinstance(info.spec.example, info.value_type), info.key


def test_top_level_configs_equal_the_packaged_ones() -> None:
    top = Path(__file__).resolve().parent.parent / "configs"
    names = sorted(p.name for p in top.glob("*.toml"))
    assert names == ["default.toml", "models.toml"]
    for name in names:
        assert (top / name).read_text() == (CONFIGS / name).read_text(), name


def test_default_toml_lists_every_field() -> None:
    # Keys without a TOML default (seed = None) appear commented out, as `# key = ...`.
    keys_by_table: dict[str, set[str]] = {}
    table = None
    for line in DEFAULT_FILE.read_text().splitlines():
        header = re.fullmatch(r"\[(\w+)\]", line.strip())
        key = re.match(r"#?\s*(\w+)\s*=", line)
        if header:
            table = header.group(1)
            keys_by_table[table] = set()
        elif key and table is not None:
            keys_by_table[table].add(key.group(1))
    expected = {name: {field.name for field in dataclasses.fields(cls)} for name, cls in TABLES.items()}
    assert keys_by_table == expected


def test_user_file_overrides_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path / "c.toml", '[sampling]\ntemperature = 0.7\nstop = ["###"]\n[model]\ndtype = "fp32"\n'
    )
    settings = load_settings(path)
    assert settings.sampling.temperature == 0.7
    assert settings.sampling.stop == ("###",)
    assert settings.model.dtype == "fp32"
    assert settings.cache == Settings().cache


def test_a_user_file_starting_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes("\ufeff[sampling]\ntemperature = 0.25\n".encode())  # as Notepad saves UTF-8
    assert load_settings(path).sampling.temperature == 0.25


def test_user_file_found_through_env_and_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    xdg_file = tmp_path / "xdg" / "kvchat" / "config.toml"
    xdg_file.parent.mkdir(parents=True)
    write(xdg_file, "[cache]\nblock_size = 32\n")
    assert load_settings().cache.block_size == 32
    monkeypatch.setenv("KVCHAT_CONFIG", str(write(tmp_path / "env.toml", "[cache]\nblock_size = 8\n")))
    assert load_settings().cache.block_size == 8


def test_overrides_beat_the_file_and_none_is_ignored(tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "[sampling]\ntemperature = 0.7\ntop_k = 40\n")
    settings = load_settings(path, {"sampling": {"temperature": 1.2, "top_k": None}, "model": {"threads": 1}})
    assert settings.sampling.temperature == 1.2
    assert settings.sampling.top_k == 40
    assert settings.model.threads == 1


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[sampling]\ntemprature = 0.5\n", ["temprature", "[sampling]"]),
        ("[sampling]\ntemperature = nan\n", ["sampling.temperature", "finite"]),
        ("[sampling]\nmin_p = 1.0\n", ["sampling.min_p", "[0, 1)"]),
        ("[smapling]\ntemperature = 0.5\n", ["[smapling]"]),
        ('[sampling]\ntemperature = "hot"\n', ["sampling.temperature", "a number"]),
        ("[model]\nthreads = true\n", ["threads", "an integer"]),
        ("[ui]\ncolor = 1\n", ["color", "true or false"]),
        ("[sampling]\ntop_p = 1.5\n", ["top_p", "(0, 1]"]),
        ("[cache]\nblock_size = 2048\n", ["cache.block_size", "[1, 1024]"]),
        ('[reuse]\nmode = "magic"\n', ["mode", "exact"]),
        ('[model]\ndevice = "tpu"\n', ["device"]),
        ("[sampling\n", []),
    ],
)
def test_bad_file_names_file_table_and_key(tmp_path: Path, text: str, names: list[str]) -> None:
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    message = str(info.value)
    assert str(path) in message
    for name in names:
        assert name in message


def test_a_removed_setting_is_named_as_removed(tmp_path: Path) -> None:
    path = write(tmp_path / "old.toml", "[model]\ncompile = true\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: model.compile was removed: "):
        load_settings(path)
    for key in ("model.compile", "compile"):
        with pytest.raises(ConfigError, match="^model.compile was removed: "):
            replace_setting(Settings(), key, "true")


def test_bad_override_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="temperature"):
        load_settings(overrides={"sampling": {"temperature": -1.0}})
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "missing.toml")


def test_int_is_accepted_for_a_float_setting(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path / "c.toml", "[sampling]\ntemperature = 1\n"))
    assert settings.sampling.temperature == 1.0
    assert isinstance(settings.sampling.temperature, float)


def test_replace_setting_parses_each_type() -> None:
    settings = Settings()
    assert replace_setting(settings, "sampling.temperature", "0.7").sampling.temperature == 0.7
    assert replace_setting(settings, "temperature", "1").sampling.temperature == 1.0
    assert replace_setting(settings, "top_k", "40").sampling.top_k == 40
    assert replace_setting(settings, "color", "off").ui.color is False
    assert replace_setting(settings, "ui.debug", "true").ui.debug is True
    assert replace_setting(settings, "seed", "7").sampling.seed == 7
    assert replace_setting(replace_setting(settings, "seed", "7"), "seed", "none").sampling.seed is None
    assert replace_setting(settings, "stop", '["</s>", "###"]').sampling.stop == ("</s>", "###")
    assert replace_setting(settings, "stop", "###").sampling.stop == ("###",)
    assert replace_setting(settings, "stop", "").sampling.stop == ()
    assert replace_setting(settings, "model", "qwen3-0.6b").model.model == "qwen3-0.6b"
    changed = replace_setting(settings, "reuse.mode", "repair")
    assert changed.reuse.mode == "repair"
    assert settings.reuse.mode == "exact"


@pytest.mark.parametrize(
    ("key", "text", "fragment"),
    [
        ("nope", "1", "unknown setting"),
        ("sampling.nope", "1", "unknown setting"),
        ("top_k", "many", "integer"),
        ("color", "maybe", "true or false"),
        ("top_p", "0", "(0, 1]"),
        ("dtype", "int8", "auto"),
        ("seed", "-3", "in [0, 18446744073709551615]"),
        ("stop", "[1, 2]", "list of strings"),
    ],
)
def test_replace_setting_rejects(key: str, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        replace_setting(Settings(), key, text)


def test_every_bare_key_resolves_and_dict_lists_all_keys() -> None:
    for key in all_keys():
        assert resolve_key(key) == tuple(key.split("."))
        assert resolve_key(key.split(".")[1]) == tuple(key.split("."))
    listing = settings_as_dict(Settings())
    assert [f"{table}.{name}" for table, entries in listing.items() for name in entries] == all_keys()
    assert listing["sampling"]["temperature"] == 0.0


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e999"])
def test_non_finite_floats_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="finite"):
        replace_setting(Settings(), "temperature", text)
    with pytest.raises(ConfigError, match="--temperature"):
        load_settings(flags={"--temperature": float(text)})


def test_dtype_takes_the_torch_names() -> None:
    for name, short in [("bfloat16", "bf16"), ("float32", "fp32"), ("float16", "fp16"), ("BF16", "bf16")]:
        assert replace_setting(Settings(), "dtype", name).model.dtype == short
        assert load_settings(flags={"--dtype": name}).model.dtype == short


def test_flag_errors_name_the_flag_and_set_errors_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(flags={"--top-p": 1.5})
    assert str(info.value).startswith("--top-p 1.5 must be in (0, 1]")
    with pytest.raises(ConfigError) as info:
        replace_setting(Settings(), "top_p", "1.5")
    assert str(info.value).startswith("sampling.top_p = 1.5 must be in (0, 1]")
    assert load_settings(flags={"--top-p": 0.5, "--seed": None}).sampling.top_p == 0.5


def test_format_value_is_toml() -> None:
    for value in (True, "bf16", ("a", 'q"uote'), 0.15, 16):
        assert tomllib.loads(f"v = {format_value(value)}")["v"] == (
            list(value) if isinstance(value, tuple) else value
        )
    assert format_value(None) == "none"
