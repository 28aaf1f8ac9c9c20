"""Settings: TOML file, environment overrides, and errors that name the field."""

from pathlib import Path

import pytest

from crossover.gateway.config import DEFAULT_CONNECT_TIMEOUT_S, Settings, SettingsError, load_settings

POOLS = """
[pools.speculative]
backends = ["http://127.0.0.1:30001/"]
[pools.plain]
backends = ["http://127.0.0.1:30002", "http://127.0.0.1:30003"]
"""


@pytest.fixture(autouse=True)
def no_crossover_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("CROSSOVER_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "crossover.toml"
    path.write_text(text)
    return path


def test_file_values_and_named_defaults(tmp_path):
    settings = load_settings(write(tmp_path, 'policy = "switch"\nthreshold = 10\n[timeouts]\ntotal = 60\n' + POOLS))
    assert settings.policy == "switch" and settings.threshold == 10
    assert settings.timeouts.total == 60
    assert settings.timeouts.connect == DEFAULT_CONNECT_TIMEOUT_S
    assert settings.pools.speculative.backends == ["http://127.0.0.1:30001"]  # trailing slash dropped
    assert len(settings.pools.plain.backends) == 2


def test_environment_overrides_the_file_with_nesting(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSOVER_THRESHOLD", "7")
    monkeypatch.setenv("CROSSOVER_TIMEOUTS__CONNECT", "1.5")
    monkeypatch.setenv("CROSSOVER_POOLS__PLAIN__BACKENDS", '["http://10.0.0.2:30000"]')
    settings = load_settings(write(tmp_path, "threshold = 10\n" + POOLS))
    assert settings.threshold == 7
    assert settings.timeouts.connect == 1.5
    assert settings.timeouts.total > 0  # the rest of the section keeps its defaults
    assert settings.pools.plain.backends == ["http://10.0.0.2:30000"]
    assert settings.pools.speculative.backends == ["http://127.0.0.1:30001"]


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("threshold = -1\n" + POOLS, "threshold", "greater than or equal to 0"),
        ("threshold = 4\nhysteresis = 4\n" + POOLS, "(top level)", "hysteresis (4) must be less than threshold (4)"),
        ('policy = "fastest"\n' + POOLS, "policy", "'switch' or 'spillover'"),
        ('load_signal = "psychic"\n' + POOLS, "load_signal", "'local', 'scraped' or 'max'"),
        ("[timeouts]\nconnect = 0\n" + POOLS, "timeouts.connect", "greater than 0"),
        ("[limits]\nmax_inflight = 'many'\n" + POOLS, "limits.max_inflight", "valid integer"),
        ("[health]\ninterval = -1\n" + POOLS, "health.interval", "greater than 0"),
        ("worker_timeout = 0.5\n" + POOLS, "worker_timeout", "greater than or equal to 1"),
        ("thresold = 3\n" + POOLS, "thresold", "unknown key (misspelt, or in the wrong section?)"),
        ("", "pools", "Field required"),
        (
            '[pools.speculative]\nbackends = ["localhost:30001"]\n[pools.plain]\nbackends = ["http://a:1"]\n',
            "pools.speculative.backends",
            "not an http(s) URL",
        ),
        (
            '[pools.speculative]\nbackends = ["http://a:1"]\n[pools.plain]\nbackends = ["http://127.0.0.1:abc"]\n',
            "pools.plain.backends",
            "the port must be a number from 1 to 65535",
        ),
        (
            '[pools.speculative]\nbackends = ["http://a:99999"]\n[pools.plain]\nbackends = ["http://a:1"]\n',
            "pools.speculative.backends",
            "the port must be a number from 1 to 65535",
        ),
        (
            '[pools.speculative]\nbackends = ["http://user:secret@a:1"]\n[pools.plain]\nbackends = ["http://a:2"]\n',
            "pools.speculative.backends",
            "takes no credentials; set the pool's api_key",
        ),
        ('admin_token = "  "\n' + POOLS, "admin_token", "admin_token is blank"),
        ('api_keys = ["sk-1", " "]\n' + POOLS, "api_keys", "an API key is blank"),
        ('api_keys = ["sk-1 "]\n' + POOLS, "api_keys", "leading or trailing whitespace"),
        (
            '[pools.speculative]\nbackends = ["http://a:1"]\napi_key = "\\t"\n[pools.plain]\nbackends = ["http://a:2"]\n',
            "pools.speculative.api_key",
            "api_key is blank",
        ),
        (
            '[pools.speculative]\nbackends = []\n[pools.plain]\nbackends = ["http://a:1"]\n',
            "pools.speculative.backends",
            "at least 1 item",
        ),
        (
            '[pools.speculative]\nbackends = ["http://a:1", "http://a:1/"]\n[pools.plain]\nbackends = ["http://b:1"]\n',
            "pools",
            "lists a backend twice",
        ),
        # The cluster's timings and URL: refused here, never a traceback at start.
        ("[cluster]\nlease = inf\n" + POOLS, "cluster.lease", "finite number"),
        ("[cluster]\nsync_interval = nan\n" + POOLS, "cluster.sync_interval", "finite number"),
        ("[cluster]\nlease = 3600\n" + POOLS, "cluster.lease", "less than or equal to 300"),
        ("[cluster]\nlease = 0.5\nsync_interval = 0.25\n" + POOLS, "cluster", "at most lease / 3"),
        ('[cluster]\nredis_url = "redis://r:6379/0?no_such_option=1"\n' + POOLS, "cluster.redis_url", "no_such_option"),
        ('[cluster]\nredis_url = "http://r:6379/0"\n' + POOLS, "cluster.redis_url", "redis://, rediss://, unix://"),
        ('[cluster]\nkey = "short"\n' + POOLS, "cluster.key", "use at least 32"),
        ('[cluster]\nkey_file = "/nonexistent/key"\n' + POOLS, "cluster", "key_file /nonexistent/key cannot be read"),
        ("[adaptive]\nmin = 10\nmax = 5\n" + POOLS, "adaptive", "min (10) must be at most max (5)"),
        ("[adaptive]\nmax_step = 0\n" + POOLS, "adaptive.max_step", "greater than or equal to 1"),
        ("[adaptive]\nwindow = 0\n" + POOLS, "adaptive.window", "greater than 0"),
        (
            "[adaptive]\nbench_accept_length = 0.5\n" + POOLS,
            "adaptive.bench_accept_length",
            "greater than or equal to 1",
        ),
        ('[adaptive]\ntable = "/nonexistent/results.json"\n' + POOLS, "adaptive", "cannot be read"),
    ],
)
def test_invalid_settings_name_the_field(tmp_path, text, field, words):
    with pytest.raises(SettingsError) as caught:
        load_settings(write(tmp_path, text))
    message = str(caught.value)
    assert f"  {field}: " in message, message
    assert words in message, message


def test_a_bad_environment_variable_is_blamed_on_itself_not_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSOVER_THRESHOLD", "lots")
    with pytest.raises(SettingsError) as caught:
        load_settings(write(tmp_path, "threshold = 10\n" + POOLS))
    message = str(caught.value)
    assert message.startswith(f"invalid settings in {tmp_path / 'crossover.toml'} or the environment:"), message
    assert "  threshold (from $CROSSOVER_THRESHOLD): " in message, message


def test_a_small_threshold_narrows_the_default_hysteresis(tmp_path):
    assert load_settings(write(tmp_path, "threshold = 3\n" + POOLS)).hysteresis == 2
    assert load_settings(write(tmp_path, "threshold = 0\n" + POOLS)).hysteresis == 0
    assert load_settings(write(tmp_path, "threshold = 64\n" + POOLS)).hysteresis == 4


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(SettingsError, match="cannot read config file"):
        load_settings(tmp_path / "missing.toml")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(write(tmp_path, "threshold = = 3"))


def test_settings_can_be_built_in_code():
    settings = Settings(pools={"speculative": {"backends": ["http://a:1"]}, "plain": {"backends": ["http://b:2"]}})
    assert settings.admin_token == "" and settings.served_model_names == []


def test_the_example_file_is_valid_and_shows_every_field():
    import crossover.gateway

    path = Path(crossover.gateway.__file__).parent / "example.toml"
    settings = load_settings(path)
    # The values the example shows are the real defaults.
    assert settings.model_dump(exclude={"pools"}) == Settings(pools=settings.pools).model_dump(exclude={"pools"})
    text = path.read_text()
    for name, field in Settings.model_fields.items():
        assert f"\n{name} =" in text or f"# {name} =" in text or f"[{name}" in text, name
        section = field.annotation
        for sub in getattr(section, "model_fields", {}):
            if name != "pools":  # a field whose default is unset shows commented out (TOML has no null)
                assert f"\n{sub} =" in text or f"\n# {sub} =" in text, f"{name}.{sub}"


def test_the_adaptive_table_is_read_at_load_and_refused_in_words(tmp_path):
    import json

    table = tmp_path / "results.json"
    levels = [
        {"target": target, "concurrency": c, "completed": 5, "output_throughput": tok}
        for target, points in (("eagle", ((1, 100), (16, 800))), ("plain", ((1, 60), (16, 900))))
        for c, tok in points
    ]
    table.write_text(json.dumps({"levels": levels, "crossover": {"speculative": "eagle", "plain": "plain"}}))
    section = f'[adaptive]\nenabled = true\ntable = "{table}"\n'
    with pytest.raises(SettingsError, match=r"records no acceptance.*set adaptive\.bench_accept_length"):
        load_settings(write(tmp_path, section + POOLS))
    settings = load_settings(write(tmp_path, section + "bench_accept_length = 2.5\n" + POOLS))
    assert settings.adaptive.bench_table().accept_length == 2.5
    assert settings.adaptive.limits().max_step == settings.adaptive.max_step
    table.write_text("not json")
    with pytest.raises(SettingsError, match="is not JSON"):
        load_settings(write(tmp_path, section + "bench_accept_length = 2.5\n" + POOLS))


def test_explore_is_for_the_partitioned_topology_only():
    pools = {"speculative": {"backends": ["http://127.0.0.1:9"]}}
    with pytest.raises(ValueError, match=r"adaptive\.explore .* topology 'partitioned' only, not 'in-engine'"):
        Settings(topology="in-engine", pools=pools, adaptive={"explore": True})
    both = {**pools, "plain": {"backends": ["http://127.0.0.1:10"]}}
    assert Settings(pools=both, adaptive={"explore": True, "explore_delta": 2}).adaptive.explore_delta == 2


def test_switch_settings_are_what_the_gateway_runs(tmp_path):
    """One set of switch settings for the controller and `crossover sim replay --gateway-config`: read from the
    file, the mechanism's prior cost unless one is given, the policy built with the live threshold."""
    from crossover.gateway.config import INITIAL_COSTS_S, SwitchSettings
    from crossover.gateway.policies.switcher import ThresholdRates

    text = 'topology = "time-shared"\nthreshold = 20\nhysteresis = 5\n[switching]\ndwell = 7\nadvantage = 0.3\n'
    switch = SwitchSettings.of(load_settings(write(tmp_path, text + POOLS.replace(', "http://127.0.0.1:30003"', ""))))
    assert (switch.threshold, switch.hysteresis, switch.dwell, switch.mechanism) == (20, 5, 7.0, "sleep")
    assert switch.initial_cost is None and switch.prior_s("restart") == INITIAL_COSTS_S["restart"]
    assert switch.switcher().cost.estimate_s == INITIAL_COSTS_S["sleep"]
    policy = switch.policy(threshold=24)
    assert (policy.threshold, policy.hysteresis, policy.min_dwell_s, policy.window_s) == (24, 5, 7.0, switch.window)
    assert policy.rates == ThresholdRates(24, 0.3)
    given = SwitchSettings.of(
        load_settings(write(tmp_path, text + "initial_cost = 2\n" + POOLS.replace(', "http://127.0.0.1:30003"', "")))
    )
    assert given.prior_s("restart") == given.prior_s("sleep") == 2.0
    # The defaults are the gateway's own, whoever builds them.
    defaults = SwitchSettings.of(load_settings(write(tmp_path, POOLS)))
    assert defaults.model_dump() == SwitchSettings().model_dump()
    with pytest.raises(ValueError, match="hysteresis"):
        SwitchSettings(threshold=4, hysteresis=4)


def test_a_pool_names_its_engine_and_in_engine_takes_either(tmp_path):
    settings = load_settings(write(tmp_path, POOLS.replace("[pools.plain]", 'engine = "vllm"\n[pools.plain]')))
    assert (settings.pools.speculative.engine, settings.pools.plain.engine) == ("vllm", "sglang")
    with pytest.raises(SettingsError, match="engine"):
        load_settings(write(tmp_path, POOLS.replace("[pools.plain]", 'engine = "tgi"\n[pools.plain]')))
    in_engine = 'topology = "in-engine"\n[pools.speculative]\nbackends = ["http://127.0.0.1:30001"]\nengine = "vllm"\n'
    settings = load_settings(write(tmp_path, in_engine))  # patches/vllm-0.32.0's gate, through the vLLM adapter
    assert (settings.topology, settings.pools.speculative.engine) == ("in-engine", "vllm")


def test_the_clusters_key_is_read_from_a_file_only_its_owner_and_group_may_read(tmp_path):
    key = tmp_path / "cluster.key"
    key.write_text("k" * 40 + "\n")
    key.chmod(0o640)
    settings = load_settings(write(tmp_path, f'[cluster]\nkey_file = "{key}"\n' + POOLS))
    assert settings.cluster.key == "k" * 40
    assert "k" * 40 not in repr(settings.cluster)
    key.chmod(0o644)
    with pytest.raises(SettingsError, match="open to every user of the host: run `chmod 600"):
        load_settings(write(tmp_path, f'[cluster]\nkey_file = "{key}"\n' + POOLS))


def test_a_keys_default_tier_names_a_configured_key_and_a_known_tier(tmp_path):
    keys = 'api_keys = ["sk-chat-0001", "sk-batch-0002"]\n'
    settings = load_settings(write(tmp_path, keys + 'api_key_tiers = { "sk-batch-0002" = "flex" }\n' + POOLS))
    assert settings.api_key_tiers == {"sk-batch-0002": "flex"}
    with pytest.raises(SettingsError, match=r"not in api_keys \('\.\.\.9999'\)") as caught:
        load_settings(write(tmp_path, keys + 'api_key_tiers = { "sk-other-9999" = "flex" }\n' + POOLS))
    assert "sk-other" not in str(caught.value)  # a key is a secret: only its tail is named
    with pytest.raises(SettingsError, match="api_key_tiers"):
        load_settings(write(tmp_path, keys + 'api_key_tiers = { "sk-batch-0002" = "batch" }\n' + POOLS))
    with pytest.raises(SettingsError, match="priority_headroom"):
        load_settings(write(tmp_path, "priority_headroom = -1\n" + POOLS))
