"""The transport registry: a host's kind picks the transport, new kinds register by name,
and the host-side modules import nothing but the standard library."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuflex.config import HostConfig
from gpuflex.errors import TransportError
from gpuflex.hosts.transport import (CommandResult, LocalTransport, Transport, make_transport,
                                     register_transport)


class EchoTransport(Transport):
    """A transport of a kind gpuflex does not ship: answers every command with its argv."""

    def run(self, argv, *, input=None, timeout=None):
        return CommandResult(0, " ".join(argv), "")

    def control_request(self, path, message, timeout=5.0):
        return {"ok": True, "path": path}


class EchoHost(HostConfig):
    """A host whose config names the "echo" kind."""

    @property
    def transport(self) -> str:
        return "echo"


def test_the_address_picks_the_kind():
    assert HostConfig(name="here").transport == "local"
    assert HostConfig(name="there", address="gpu01.lab").transport == "ssh"


def test_a_local_host_gets_a_local_transport():
    t = make_transport(HostConfig(name="here"))
    assert type(t) is LocalTransport and t.host.name == "here"


def test_a_remote_host_gets_an_ssh_transport_without_connecting():
    from gpuflex.hosts.ssh import SSHTransport

    t = make_transport(HostConfig(name="there", address="192.0.2.1"))  # TEST-NET: never reached
    assert type(t) is SSHTransport and t.host.name == "there"
    t.close()


def test_a_kind_registered_from_outside_is_built_for_its_hosts():
    register_transport("echo", EchoTransport)
    t = make_transport(EchoHost(name="e1"))
    assert isinstance(t, EchoTransport) and t.host.name == "e1"
    assert t.run(["nvidia-smi", "-L"]).stdout == "nvidia-smi -L"


def test_registering_a_kind_again_replaces_its_factory():
    from gpuflex.hosts.ssh import SSHTransport

    register_transport("ssh", EchoTransport)
    try:
        assert isinstance(make_transport(HostConfig(name="r", address="r.lab")), EchoTransport)
    finally:
        register_transport("ssh", SSHTransport)
    assert isinstance(make_transport(HostConfig(name="r", address="r.lab")), SSHTransport)


def test_an_unknown_kind_is_an_error_naming_the_host_and_the_known_kinds():
    class NowhereHost(HostConfig):
        @property
        def transport(self) -> str:
            return "nowhere"

    with pytest.raises(TransportError) as info:
        make_transport(NowhereHost(name="n1"))
    msg = str(info.value)
    assert info.value.host == "n1"
    assert msg.startswith("n1: no transport of kind 'nowhere' (registered: ")
    assert "local" in msg and "ssh" in msg


@pytest.mark.parametrize("kind", ["", "SSH", "my-kind", "../x", "a.b"])
def test_a_kind_must_be_a_lowercase_identifier(kind):
    with pytest.raises(ValueError, match="lowercase identifier"):
        register_transport(kind, EchoTransport)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_ssh_module_is_loaded_only_for_the_first_ssh_host():
    before = _modules_after("import gpuflex.hosts.transport")
    assert "gpuflex.hosts.ssh" not in before and "paramiko" not in before
    after = _modules_after("from gpuflex.config import HostConfig\n"
                           "from gpuflex.hosts.transport import make_transport\n"
                           "make_transport(HostConfig(name='r', address='r.lab'))")
    assert "gpuflex.hosts.ssh" in after and "paramiko" in after


# the modules that run on a host, under its python (`python -m gpuflex.hosts.X`, or imported
# by one that does), where gpuflex's dependencies may be missing
HOST_SIDE = ["gpuflex.hosts.relay", "gpuflex.hosts.hostops", "gpuflex.hosts.supervisor", "gpuflex.hosts.private", "gpuflex.hosts.container",
             "gpuflex.hosts.gather", "gpuflex.hosts.unpack", "gpuflex.hosts.attach", "gpuflex.hosts.envsetup",
             "gpuflex.hosts.terminal"]


@pytest.mark.parametrize("module", HOST_SIDE)
def test_the_host_side_modules_need_only_the_standard_library(module):
    # each imports only the standard library and other host-side modules
    loaded = _modules_after(f"import {module}")
    assert {m for m in loaded if m.startswith("gpuflex")} <= {"gpuflex", "gpuflex.hosts", *HOST_SIDE}
    assert not {"pydantic", "paramiko", "sqlalchemy"} & loaded


def test_the_host_side_and_the_coordinator_name_process_group_marks_alike():
    from gpuflex.elastic.protocol import run_dir
    from gpuflex.hosts import supervisor
    assert supervisor.GROUP_MARK == run_dir.GROUP_MARK
