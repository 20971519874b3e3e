"""``node.testing.cgroups_usable``: the one check the cgroup integration tests skip on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node.sandbox.cgroupfs import Host
from node.testing import cgroups_usable

V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MEMORY = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
V1_CPU = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"


def host_with(tmp_path: Path, mountinfo: str, proc_cgroup: str) -> Host:
    """A host whose /proc/self files are plain files under ``tmp_path``."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text(mountinfo)
    (tmp_path / "proc" / "self" / "cgroup").write_text(proc_cgroup)
    return Host(root=tmp_path, proc=tmp_path / "proc")


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the check is True only as root")


@root_only
@pytest.mark.parametrize(
    ("mountinfo", "proc_cgroup", "usable"),
    [
        (V2, "0::/\n", True),
        (V1_MEMORY, "4:memory:/\n", True),
        (V1_CPU, "3:cpu,cpuacct:/\n", False),
        ("", "", False),
    ],
    ids=["v2", "v1-memory", "v1-without-memory", "no-cgroups"],
)
def test_usable_means_a_v2_mount_or_a_v1_memory_controller(
    tmp_path: Path, mountinfo: str, proc_cgroup: str, usable: bool
) -> None:
    assert cgroups_usable(host_with(tmp_path, mountinfo, proc_cgroup)) is usable


@root_only
def test_an_unreadable_proc_is_not_usable(tmp_path: Path) -> None:
    assert cgroups_usable(Host(root=tmp_path, proc=tmp_path / "no-proc")) is False


def test_not_root_is_not_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cgroups_usable(host_with(tmp_path, V2, "0::/\n")) is False
