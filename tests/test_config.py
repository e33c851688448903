"""gpuflex.toml: where it is looked up, what the built-in default is, and how it fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuflex.config import BUILTIN, HostConfig, load_config, parse_config
from gpuflex.db.engine import sqlite_path
from gpuflex.errors import ConfigError, UsageError


def _toml(db: str) -> str:
    return f'[database]\nurl = "sqlite:///{db}"\n'


# ---- lookup order ---------------------------------------------------------------------
# Each row: which candidate files exist, whether --config / $GPUFLEX_CONFIG are given,
# and which one must win. Every candidate names its own DB so the winner is visible.
LOOKUP = [
    ("explicit beats everything", {"explicit", "env", "cwd", "user"}, "explicit"),
    ("env beats ./ and ~/.config", {"env", "cwd", "user"}, "env"),
    ("./gpuflex.toml beats ~/.config", {"cwd", "user"}, "cwd"),
    ("~/.config/gpuflex/gpuflex.toml", {"user"}, "user"),
    ("built-in default when none exists", set(), "builtin"),
]


@pytest.mark.parametrize("present,winner", [(p, w) for _, p, w in LOOKUP],
                         ids=[row[0] for row in LOOKUP])
def test_lookup_order(home, monkeypatch, present, winner):
    places = {
        "explicit": home / "explicit" / "my.toml",
        "env": home / "env" / "env.toml",
        "cwd": home / "gpuflex.toml",
        "user": home / ".config" / "gpuflex" / "gpuflex.toml",
    }
    for which in present:
        places[which].parent.mkdir(parents=True, exist_ok=True)
        places[which].write_text(_toml(f"/db/{which}.db"))
    if "env" in present:
        monkeypatch.setenv("GPUFLEX_CONFIG", str(places["env"]))
    cfg = load_config(str(places["explicit"]) if "explicit" in present else None)
    if winner == "builtin":
        assert cfg.path == BUILTIN
        assert cfg.database_url == "sqlite:///~/.local/state/gpuflex/gpuflex.db"
    else:
        assert Path(cfg.path).resolve() == places[winner].resolve()
        assert cfg.database_url == f"sqlite:////db/{winner}.db"


def test_explicit_path_expands_tilde(home):
    (home / "c.toml").write_text(_toml("/db/tilde.db"))
    cfg = load_config("~/c.toml")
    assert cfg.database_url == "sqlite:////db/tilde.db"
    assert cfg.path == str(home / "c.toml")


def test_builtin_default_is_one_local_host_with_cpu_slots(home):
    cfg = load_config(None)
    assert cfg.path == BUILTIN
    assert len(cfg.hosts) == 1
    host = cfg.hosts[0]
    assert (host.name, host.address, host.gpus) == ("local", "local", f"cpu:{os.cpu_count()}")
    assert host.is_local and host.cpu_slots == os.cpu_count()
    assert sqlite_path(cfg.database_url) == home / ".local" / "state" / "gpuflex" / "gpuflex.db"


def test_builtin_default_through_the_cli_makes_the_db_under_local_state(home):
    from tests.conftest import GpuflexCLI

    cli = GpuflexCLI(home, None)
    view = cli.json("hosts")
    assert [h["name"] for h in view] == ["local"]
    assert len(view[0]["devices"]) == os.cpu_count()
    assert (home / ".local" / "state" / "gpuflex" / "gpuflex.db").is_file()


def test_a_config_without_hosts_gets_the_local_default_host(home):
    cfg = parse_config({"database": {"url": "sqlite:////x.db"}}, "f.toml")
    assert [(h.name, h.gpus) for h in cfg.hosts] == [("local", f"cpu:{os.cpu_count()}")]


def test_every_documented_key_is_read(tmp_path):
    f = tmp_path / "full.toml"
    f.write_text("""
[database]
url = "sqlite:////srv/g.db"

[harvest]
interval_s = 30
idle_util_pct = 7
idle_memory_mib = 256
idle_samples = 4
reclaim_deadline_s = 20

[jobs]
cancel_grace_s = 2.5
sync = true
sync_cap_mib = 20

[[hosts]]
name = "gpu01"
address = "gpu01.lab"
port = 2222
user = "train"
identity_file = "~/.ssh/id_ed25519"
known_hosts = "~/.ssh/kh"
gpus = [0, 2]
owner = "alice"
nvidia_smi = "/usr/bin/nvidia-smi"
python = "python3.11"
workdir = "/scratch/gpuflex"
cpus = 64
sync = false
container = "docker"
container_args = ["-v", "/data:/data:ro"]

[[hosts]]
name = "local"
address = "local"
gpus = "cpu:3"
""")
    cfg = load_config(str(f))
    assert cfg.database_url == "sqlite:////srv/g.db"
    assert (cfg.harvest.interval_s, cfg.harvest.idle_util_pct, cfg.harvest.idle_memory_mib,
            cfg.harvest.idle_samples, cfg.harvest.reclaim_deadline_s) == (30, 7, 256, 4, 20)
    assert cfg.jobs.cancel_grace_s == 2.5
    assert (cfg.jobs.sync, cfg.jobs.sync_cap_mib) == (True, 20)
    gpu01 = cfg.host("gpu01")
    assert gpu01 == HostConfig(name="gpu01", address="gpu01.lab", port=2222, user="train",
                               identity_file="~/.ssh/id_ed25519", known_hosts="~/.ssh/kh",
                               gpus=[0, 2], owner="alice", nvidia_smi="/usr/bin/nvidia-smi",
                               python="python3.11", workdir="/scratch/gpuflex", cpus=64, sync=False,
                               container="docker", container_args=("-v", "/data:/data:ro"))
    assert not gpu01.syncs(cfg.jobs.sync) and cfg.host("local").syncs(cfg.jobs.sync)
    assert not gpu01.is_local and gpu01.cpu_slots is None and gpu01.cpu_count == 64
    assert cfg.host("local").cpu_slots == 3
    assert cfg.host("local").container == "podman"   # issue 33: the documented default engine
    with pytest.raises(ConfigError, match="no host named 'nope'"):
        cfg.host("nope")


def test_remote_hosts_default_to_python3_and_home_workdir():
    cfg = parse_config({"hosts": [{"name": "r", "address": "r.lab", "gpus": "all"}]}, "f.toml")
    assert (cfg.hosts[0].python, cfg.hosts[0].workdir) == ("python3", "~/gpuflex")


# ---- validation: every error names the file, the key and the bad value ------------------
BAD = [
    ("unknown top-level key", "[cluster]\nx = 1\n", "cluster", "unknown key"),
    ("unknown key in a table", "[database]\nuri = 'sqlite:///x'\n", "database.uri", "unknown key"),
    ("unknown host key", "[[hosts]]\nname = 'a'\ngpu = 'all'\n", "hosts[0].gpu", "unknown key"),
    ("string for a number", "[jobs]\ncancel_grace_s = 'three'\n", "jobs.cancel_grace_s", "'three'"),
    ("float for an integer", "[harvest]\nidle_samples = 1.5\n", "harvest.idle_samples", "1.5"),
    ("bool for an integer", "[[hosts]]\nname = 'a'\nport = true\n", "hosts[0].port", "True"),
    ("number for a string", "[database]\nurl = 5\n", "database.url", "5"),
    ("negative number", "[jobs]\ncancel_grace_s = -1\n", "jobs.cancel_grace_s", "-1"),
    ("port too large", "[[hosts]]\nname = 'a'\nport = 70000\n", "hosts[0].port", "70000"),
    ("not a URL", "[database]\nurl = '/tmp/g.db'\n", "database.url", "'/tmp/g.db'"),
    ("table expected", "database = 'x'\n", "database", "'x'"),
    ("bad gpus string", "[[hosts]]\nname = 'a'\ngpus = 'cpu:0'\n", "hosts[0].gpus", "'cpu:0'"),
    ("repeated gpu index", "[[hosts]]\nname = 'a'\ngpus = [1, 1]\n", "hosts[0].gpus", "[1, 1]"),
    ("negative gpu index", "[[hosts]]\nname = 'a'\ngpus = [-1]\n", "hosts[0].gpus", "[-1]"),
    ("missing host name", "[[hosts]]\naddress = 'x'\n", "hosts[0].name", "missing"),
    ("bad host name", "[[hosts]]\nname = 'a b'\n", "hosts[0].name", "'a b'"),
    ("second host bad", "[[hosts]]\nname = 'a'\n[[hosts]]\nname = 'b'\nport = 'x'\n",
     "hosts[1].port", "'x'"),
    ("duplicate host", "[[hosts]]\nname = 'a'\n[[hosts]]\nname = 'a'\n", "hosts", "'a'"),
    ("empty hosts", "hosts = []\n", "hosts", "non-empty"),
    ("no cpus", "[[hosts]]\nname = 'a'\ncpus = 0\n", "hosts[0].cpus", "0"),
    ("cpus as text", "[[hosts]]\nname = 'a'\ncpus = '8'\n", "hosts[0].cpus", "'8'"),
    ("sync as text", "[[hosts]]\nname = 'a'\nsync = 'yes'\n", "hosts[0].sync", "'yes'"),
    ("sync as a number", "[jobs]\nsync = 1\n", "jobs.sync", "1"),
    ("no sync cap", "[jobs]\nsync_cap_mib = 0\n", "jobs.sync_cap_mib", "0"),
    ("unknown container engine", "[[hosts]]\nname = 'a'\ncontainer = 'lxc'\n", "hosts[0].container", "'lxc'"),
    ("unknown harvest policy", "[harvest]\npolicy = 'fastest'\n", "harvest.policy", "'fair' or 'throughput'"),
    ("negative resize stall", "[harvest]\nresize_stall_s = -1\n", "harvest.resize_stall_s", "-1"),
    ("container args as text", "[[hosts]]\nname = 'a'\ncontainer_args = '-v /x:/x'\n",
     "hosts[0].container_args", "'-v /x:/x'"),
]


@pytest.mark.parametrize("text,key,value", [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_invalid_config_names_file_key_and_value(tmp_path, text, key, value):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(f))
    err = info.value
    assert isinstance(err, UsageError) and err.exit_code == 2
    assert err.path == str(f)
    assert err.key == key
    assert str(err).startswith(f"{f}: {key}: ")
    assert value in str(err)


def test_toml_syntax_error_gives_line_and_column(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text('[database]\nurl = "sqlite:///x.db"\n\n[jobs]\ncancel_grace_s = = 3\n')
    with pytest.raises(ConfigError) as info:
        load_config(str(f))
    msg = str(info.value)
    assert msg.startswith(f"{f}: TOML syntax error")
    assert "line 5" in msg and "column 18" in msg


def test_missing_explicit_file_is_an_error_not_the_default(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "nope.toml"))


def test_missing_env_file_is_an_error_not_the_default(home, monkeypatch):
    monkeypatch.setenv("GPUFLEX_CONFIG", str(home / "gone.toml"))
    with pytest.raises(ConfigError) as info:
        load_config(None)
    assert info.value.path == str(home / "gone.toml")


def test_a_directory_as_config_is_a_clean_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("text,key,value", [
    ("[jobs]\ncancel_grace_s = nan\n", "jobs.cancel_grace_s", "nan"),
    ("[harvest]\ninterval_s = inf\n", "harvest.interval_s", "inf"),
    ("[[hosts]]\nname = 'a'\ngpus = 'cpu:4097'\n", "hosts[0].gpus", "'cpu:4097'"),
    ("[[hosts]]\nname = 'a'\ngpus = 'cpu:" + "9" * 5000 + "'\n", "hosts[0].gpus", "cpu:999"),
], ids=["nan", "inf", "too-many-slots", "absurd-slots"])
def test_values_that_would_hang_or_misbehave_are_refused(tmp_path, text, key, value):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(f))
    assert info.value.key == key and value in str(info.value)


def test_the_largest_slot_count_is_accepted():
    cfg = parse_config({"hosts": [{"name": "a", "gpus": "cpu:4096"}]}, "f.toml")
    assert cfg.hosts[0].cpu_slots == 4096


def test_a_config_that_is_not_utf8_is_a_clean_error(tmp_path):
    f = tmp_path / "bin.toml"
    f.write_bytes(b"\xff\xfe[jobs]\n")
    with pytest.raises(ConfigError, match="not UTF-8") as info:
        load_config(str(f))
    assert info.value.path == str(f)


def test_cpus_default_to_this_machines_for_the_local_host_and_are_unknown_for_a_remote_one():
    cfg = parse_config({"hosts": [{"name": "here", "gpus": "cpu:2"},
                                  {"name": "r", "address": "r.lab", "gpus": "all"},
                                  {"name": "r2", "address": "r2.lab", "gpus": "all", "cpus": 12}]}, "f.toml")
    assert [h.cpu_count for h in cfg.hosts] == [os.cpu_count(), None, 12]


def test_paths_keep_their_tilde_until_used_where_they_belong():
    """A remote host's `~` is its own user's home: it cannot be expanded when the file is
    read (gpuflex.hosts expands it on the host; tests/control/test_launch_env.py runs it)."""
    cfg = parse_config({"hosts": [{"name": "r", "address": "r.lab", "workdir": "~/gf", "python": "~/v/bin/python",
                                   "nvidia_smi": "~/bin/nvidia-smi"}]}, "f.toml")
    h = cfg.hosts[0]
    assert (h.workdir, h.python, h.nvidia_smi) == ("~/gf", "~/v/bin/python", "~/bin/nvidia-smi")


@pytest.mark.parametrize("argv,command", [
    (["~/venv/bin/python", "-m", "x"], "~/venv/bin/python -m x"),
    (["~alice/my env/python", "a b"], "~alice/'my env/python' 'a b'"),
    (["/opt/my env/python"], "'/opt/my env/python'"),
    (["~"], "'~'"),
    (["python", "~/not-expanded"], "python '~/not-expanded'"),
    (["~-/p"], "'~-/p'"),
    (["~+/p"], "'~+/p'"),
    (["~-1/p"], "'~-1/p'"),
], ids=["home", "other-user-with-space", "no-tilde", "bare-tilde", "only-the-program",
        "oldpwd", "pwd", "dirstack"])
def test_a_remote_program_path_with_tilde_is_left_for_the_remote_shell(argv, command):
    from gpuflex.hosts.transport import shell_join

    assert shell_join(argv) == command
