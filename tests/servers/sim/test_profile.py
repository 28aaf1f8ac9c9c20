import json

import pytest

from crossover.servers.sim.profile import ProfileError, available_profiles, load_profile, with_overrides

SHIPPED = ["k25-eagle3", "k25-plain", "llama8b-h200-eagle3", "llama8b-h200-plain"]

MEASURED = """
kind = "measured"
model_name = "my/model"
[[points]]
concurrency = 10
per_request_throughput = 20.0
ttft_s = 0.5
[[points]]
concurrency = 1
per_request_throughput = 50.0
ttft_s = 0.1
"""


def test_shipped_profiles_load_with_pair_names():
    assert set(SHIPPED) <= set(available_profiles())
    profiles = {name: load_profile(name) for name in SHIPPED}
    assert profiles["k25-eagle3"].model_name == profiles["k25-plain"].model_name == "moonshotai/Kimi-K2.5"
    assert profiles["llama8b-h200-eagle3"].model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert profiles["llama8b-h200-plain"].model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert profiles["k25-eagle3"].limits.max_running_requests == 48  # SGLang's EAGLE default cap
    assert profiles["k25-plain"].limits.max_running_requests > 48
    assert profiles["k25-plain"].speculative is None
    assert profiles["llama8b-h200-eagle3"].speculative.accept_length == 2.5
    assert profiles["llama8b-h200-eagle3"].kind == "steptable"


def test_unknown_profile_names_the_shipped_ones():
    with pytest.raises(ProfileError, match="k25-eagle3"):
        load_profile("no-such-profile")


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "absent.toml"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind = 'magic'\nmodel_name = 'm'", "kind must be one of"),
        ("kind = 'parametric'", "missing key 'model_name'"),
        (
            "kind = 'parametric'\nmodel_name = 'm'\n[limits]\nmax_running_requests = 0\nmax_total_num_tokens = 10",
            "max_running_requests must be >= 1",
        ),
        (
            "kind = 'parametric'\nmodel_name = 'm'\n[limits]\nmax_running_requests = 4\nmax_total_num_tokens = 1000\n"
            "[prefill]\n[decode]\nfixed_s = -1",
            "fixed_s must be >= 0.0",
        ),
        (
            "kind = 'parametric'\nmodel_name = 'm'\n[limits]\nmax_running_requests = 4\nmax_total_num_tokens = 1000\n"
            "[prefill]\n[decode]\nfixed_s = 0.01\n[draft]\n[speculative]\nnum_steps = 3\naccept_length = 5.0",
            "accept_length must be between 1 and num_steps \\+ 1 = 4",
        ),
        (
            "kind = 'parametric'\nmodel_name = 'm'\n[limits]\nmax_running_requests = 4\nmax_total_num_tokens = 1000\n"
            "[prefill]\n[decode]\nfixed_s = 0.01\n[draft]\n[speculative]\nnum_steps = 3\nnum_draft_tokens = 8\n"
            "accept_length = 2.0",
            "num_draft_tokens must be num_steps \\+ 1",
        ),
        (
            "kind = 'steptable'\nmodel_name = 'm'\n[limits]\nmax_running_requests = 4\nmax_total_num_tokens = 1000\n"
            "[prefill]\n[[steps]]\ncontext = 1024\nbatch = [1, 8]\ndecode_ms = [5.0]",
            "decode_ms needs 2 positive",
        ),
        (
            "kind = 'steptable'\nmodel_name = 'm'\n[limits]\nmax_running_requests = 4\nmax_total_num_tokens = 1000\n"
            "[prefill]\n[[steps]]\ncontext = 1024\nbatch = [8, 1]\ndecode_ms = [5.0, 6.0]",
            "batch must be increasing",
        ),
        ("kind = 'measured'\nmodel_name = 'm'\npoints = []", "at least one point"),
        ("kind = = 1", "not valid TOML"),
    ],
)
def test_bad_profiles_get_precise_messages(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        load_profile(str(path))


def test_measured_toml_points_are_sorted(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(MEASURED)
    profile = load_profile(str(path))
    assert profile.kind == "measured" and profile.name == "mine"
    assert [p.concurrency for p in profile.points] == [1, 10]
    assert profile.limits.max_queued_requests is None


def _results(tmp_path, targets=("speculative", "plain")):
    levels = []
    for target in targets:
        for c, tpot, ttft in ((1, 10.0, 100.0), (8, 25.0, 300.0)):
            levels.append(
                {
                    "target": target,
                    "concurrency": c,
                    "completed": 10,
                    "failed": 0,
                    "output_throughput": 1.0,
                    "mean_ttft_ms": ttft,
                    "mean_tpot_ms": tpot,
                }
            )
    levels.append(
        {
            "target": targets[0],
            "concurrency": 64,
            "completed": 0,
            "failed": 5,
            "mean_ttft_ms": None,
            "mean_tpot_ms": None,
        }
    )
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema_version": 1, "metadata": {"model": "real/model"}, "levels": levels}))
    return path


def test_results_json_becomes_a_measured_profile(tmp_path):
    profile = load_profile(str(_results(tmp_path)), target="plain")
    assert profile.kind == "measured" and profile.model_name == "real/model"
    assert [(p.concurrency, p.per_request_throughput, p.ttft_s) for p in profile.points] == [
        (1, 100.0, 0.1),
        (8, 40.0, 0.3),
    ]


def test_results_json_needs_a_target_when_it_holds_several(tmp_path):
    path = _results(tmp_path)
    with pytest.raises(ProfileError, match="pick one with --target"):
        load_profile(str(path))
    with pytest.raises(ProfileError, match="no target 'other'"):
        load_profile(str(path), target="other")
    assert load_profile(str(_results(tmp_path, targets=("only",)))).points


def test_toml_can_point_at_results_and_override(tmp_path):
    _results(tmp_path)
    path = tmp_path / "replay.toml"
    path.write_text(
        'kind = "measured"\nresults = "results.json"\ntarget = "speculative"\n'
        'model_name = "renamed"\n[speculative]\nnum_steps = 3\naccept_length = 2.0\n'
    )
    profile = load_profile(str(path))
    assert profile.model_name == "renamed" and profile.speculative.accept_length == 2.0
    assert len(profile.points) == 2  # the level with no completed requests is skipped


def test_target_is_refused_for_other_profiles():
    with pytest.raises(ProfileError, match="--target only applies"):
        load_profile("k25-plain", target="plain")


def test_overrides_are_checked():
    profile = load_profile("k25-eagle3")
    changed = with_overrides(
        profile, accept_length=3.0, max_running_requests=128, max_queued_requests=0, model_name="alias"
    )
    assert changed.speculative.accept_length == 3.0 and changed.limits.max_running_requests == 128
    assert changed.limits.max_queued_requests == 0 and changed.model_name == "alias"
    assert profile.speculative.accept_length == 2.4  # the original is untouched
    with pytest.raises(ProfileError, match="not speculative"):
        with_overrides(load_profile("k25-plain"), accept_length=2.0)
    with pytest.raises(ProfileError, match="between 1 and"):
        with_overrides(profile, accept_length=9.0)
    with pytest.raises(ProfileError, match=">= 1"):
        with_overrides(profile, max_running_requests=0)


BASE = "kind = 'parametric'\nmodel_name = 'm'\n[prefill]\n[decode]\nfixed_s = 0.01\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # A misspelt key would otherwise fall back to its default without a word.
        (BASE + "[limits]\nmax_runing_requests = 4\nmax_total_num_tokens = 10", "unknown key 'limits.max_runing_"),
        (BASE + "[limits]\nmax_running_requests = true\nmax_total_num_tokens = 10", "must be an integer, got True"),
        (BASE + "[limits]\nmax_running_requests = '4'\nmax_total_num_tokens = 10", "must be an integer, got '4'"),
        (BASE + "[limits]\nmax_running_requests = 4\nmax_total_num_tokens = 10\n[memory]\nstartup_s = nan", "finite"),
        ("kind = 'parametric'\nmodel_name = 'm'\n[prefill]\n[decode]\nfixed_s = 0.01", "missing \\[limits\\] section"),
    ],
)
def test_profile_files_are_checked_strictly(tmp_path, text, message):
    path = tmp_path / "strict.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message) as raised:
        load_profile(str(path))
    assert str(raised.value).startswith(f"{path}: ")  # every message names the file


def test_switch_costs_are_read_in_profile_seconds(tmp_path):
    path = tmp_path / "costs.toml"
    path.write_text(
        BASE + "[limits]\nmax_running_requests = 4\nmax_total_num_tokens = 10\n"
        "[memory]\nstartup_s = 300\nrelease_s = 20.5\nresume_s = 25\n"
    )
    memory = load_profile(str(path)).memory
    assert (memory.startup_s, memory.release_s, memory.resume_s) == (300.0, 20.5, 25.0)
    for name in SHIPPED:  # every shipped profile states all three; loading weights costs more than a resume
        shipped = load_profile(name).memory
        assert shipped.startup_s > shipped.resume_s > 0 and shipped.release_s > 0, name
