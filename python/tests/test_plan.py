"""`import ferrotron` against the command line it wraps: the same documents, the same errors.

The command's output is the reference: `ferrotron plan --json` (the binary of this checkout,
$FERROTRON_BIN or target/release/ferrotron, which scripts/test_python.sh builds).
"""

import json
import os
import pathlib
import subprocess

import pytest

import ferrotron

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def _binary():
    given = os.environ.get("FERROTRON_BIN")
    if given:
        assert os.path.isfile(given), f"FERROTRON_BIN={given} does not exist"
        return given
    target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
    path = os.path.join(target, "release", "ferrotron")
    if not os.path.isfile(path):
        pytest.skip("no ferrotron binary: run scripts/test_python.sh (or set FERROTRON_BIN)")
    return path


def cli(*args):
    """`ferrotron ARGS`: (exit code, stdout, stderr)."""
    p = subprocess.run([_binary(), *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def cli_json(*args):
    code, out, err = cli(*args)
    assert code == 0, err
    return json.loads(out)


def cli_error(*args):
    """The command's one-line message for bad input (without its `error: ` prefix)."""
    code, out, err = cli(*args)
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0][len("error: "):]


def test_acceptance_peak_of_rank_0_is_the_commands():
    # The acceptance check, with the JSON keys the command prints.
    ours = ferrotron.plan(model="llama-3-8b", seq=4096, dp=8, zero=1, gpu="h100")["ranks"][0]["peak"]
    theirs = cli_json("plan", "--model", "llama-3-8b", "--seq", "4096", "--dp", "8", "--zero", "1",
                      "--gpu", "h100", "--json")["ranks"][0]["peak"]
    assert isinstance(ours, int) and ours == theirs
    # Not a number that any setting gives: ZeRO-1 over 8 ranks holds less than one rank alone.
    alone = ferrotron.plan(model="llama-3-8b", seq=4096, gpu="h100")["ranks"][0]["peak"]
    assert ours < alone


@pytest.mark.parametrize("kwargs,flags", [
    (dict(model="llama-3-8b", seq=4096, dp=8, zero=1, gpu="h100"),
     ["--model", "llama-3-8b", "--seq", "4096", "--dp", "8", "--zero", "1", "--gpu", "h100"]),
    (dict(model="llama-3-70b", tp=8, pp=4, dp=2, sp=True, pp_schedule="interleaved", pp_virtual=2,
          mbs=1, gbs=64, recompute="selective", precision="bf16", gpu="h200", gpus_per_node=8),
     ["--model", "llama-3-70b", "--tp", "8", "--pp", "4", "--dp", "2", "--sp", "--pp-schedule",
      "interleaved", "--pp-virtual", "2", "--mbs", "1", "--gbs", "64", "--recompute", "selective",
      "--precision", "bf16", "--gpu", "h200", "--gpus-per-node", "8"]),
    (dict(params=7.5e9, largest_layer="1e9", zero=3, dp=16, overhead_gib=0.5, fragmentation=0.1),
     ["--params", "7.5e9", "--largest-layer", "1e9", "--zero", "3", "--dp", "16",
      "--overhead-gib", "0.5", "--fragmentation", "0.1"]),
    (dict(model=str(FIXTURES / "tiny-mixtral" / "config.json"), ep=2, dp=2, capacity_factor=1.25,
          convention="megatron", flops_convention="6n"),
     ["--model", str(FIXTURES / "tiny-mixtral" / "config.json"), "--ep", "2", "--dp", "2",
      "--capacity-factor", "1.25", "--convention", "megatron", "--flops-convention", "6n"]),
])
def test_the_whole_document_is_the_commands(kwargs, flags):
    assert ferrotron.plan(**kwargs) == cli_json("plan", *flags, "--json")


def test_a_model_from_a_path_a_directory_or_a_dict():
    config = FIXTURES / "tiny-gqa" / "config.json"
    by_path = ferrotron.plan(model=str(config), seq=64)
    assert ferrotron.plan(model=config, seq=64) == by_path  # a pathlib.Path
    assert ferrotron.plan(model=str(config.parent), seq=64) == by_path  # the directory
    by_dict = ferrotron.plan(model=json.loads(config.read_text()), seq=64)
    # The same model, planned alike; only its name (the source it came from) differs.
    assert by_dict["ranks"] == by_path["ranks"]
    assert by_dict["params"] == by_path["params"]


def test_a_settings_file_as_config_and_keywords_win_over_it():
    toml = ROOT / "configs" / "plan-llama3-8b.toml"
    assert ferrotron.plan(config=str(toml)) == cli_json("plan", "--config", str(toml), "--json")
    assert ferrotron.plan(config=toml, seq=1024) == cli_json(
        "plan", "--config", str(toml), "--seq", "1024", "--json")


def test_a_cluster_file():
    cluster = ROOT / "configs" / "cluster-example.toml"
    assert ferrotron.plan(model="llama-3-8b", dp=8, cluster=str(cluster)) == cli_json(
        "plan", "--model", "llama-3-8b", "--dp", "8", "--cluster", str(cluster), "--json")


def test_none_is_an_unset_keyword():
    assert ferrotron.plan(model="llama-3-8b", seq=None, tp=None) == ferrotron.plan(model="llama-3-8b")


def test_html_report_is_written(tmp_path):
    out = tmp_path / "plan.html"
    ferrotron.plan(model="llama-3-8b", html=out)
    assert out.read_text().lstrip().lower().startswith("<!doctype html")


@pytest.mark.parametrize("kwargs,flags", [
    (dict(model="llama-9b"), ["--model", "llama-9b"]),
    (dict(model="llama-3-8b", zero=5), ["--model", "llama-3-8b", "--zero", "5"]),
    (dict(model="llama-3-8b", precision="fp7"), ["--model", "llama-3-8b", "--precision", "fp7"]),
    (dict(model="llama-3-8b", params="7e9"), ["--model", "llama-3-8b", "--params", "7e9"]),
    (dict(model="llama-3-8b", dp=8, gbs=12), ["--model", "llama-3-8b", "--dp", "8", "--gbs", "12"]),
    (dict(), []),
    (dict(config="/nonexistent/plan.toml"), ["--config", "/nonexistent/plan.toml"]),
])
def test_bad_input_raises_value_error_with_the_commands_line(kwargs, flags):
    with pytest.raises(ValueError) as e:
        ferrotron.plan(**kwargs)
    assert str(e.value) == cli_error("plan", *flags)


def test_a_bad_keyword_is_named():
    with pytest.raises(ValueError, match=r"^grad_accum = 8: unknown keyword `grad_accum`, expected one of .*`grad_acc`"):
        ferrotron.plan(model="llama-3-8b", grad_accum=8)
    with pytest.raises(ValueError, match=r'^seq = "long": invalid type: string "long", expected u64'):
        ferrotron.plan(model="llama-3-8b", seq="long")
    with pytest.raises(ValueError, match=r"^keywords: .*not a setting"):
        ferrotron.plan(model="llama-3-8b", seq=object())
    # The command's own flags are not settings: the result is always the JSON document.
    with pytest.raises(ValueError, match=r"^json = true: unknown keyword `json`"):
        ferrotron.plan(model="llama-3-8b", json=True)


def test_search_is_the_commands():
    ours = ferrotron.search(model="llama-3-8b", gpus=64, top=3)
    assert ours == cli_json("plan", "search", "--model", "llama-3-8b", "--gpus", "64", "--top", "3",
                            "--json")
    assert len(ours["top"]) == 3 and ours["top"][0]["rank"] == 1


def test_search_errors_are_the_commands():
    with pytest.raises(ValueError) as e:
        ferrotron.search(model="llama-3-8b")
    assert str(e.value) == cli_error("plan", "search", "--model", "llama-3-8b")
    with pytest.raises(ValueError, match=r"^config = x.toml: the search takes no settings file"):
        ferrotron.search(model="llama-3-8b", gpus=8, config="x.toml")


def test_presets_are_the_commands_list():
    _, out, _ = cli("plan", "--list-presets")
    listed = {line.split()[0]: int(line.split()[1]) for line in out.splitlines()}
    p = ferrotron.presets()
    assert {m["name"]: m["params"] for m in p["models"]} == listed
    assert "h100" in {g["name"] for g in p["gpus"]}
