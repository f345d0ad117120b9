"""Each emulated node's CPU cap (``Cluster(cpus=...)``, tests/cluster.py): a CPU
cgroup per node, so that nodes on one machine do not lend each other its cores."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["CpuGroups"]


class CpuGroups:
    """One CPU cgroup per node under ``<prefix>`` (cgroup v2 ``cpu.max`` or v1's CFS
    quota), each capped at ``cpus`` cores in 10 ms periods (a capped node waits
    milliseconds, not a 100 ms period).  Bound at ``mount``, under the cluster's root,
    which the nodes see (node0's ``/sys/fs/cgroup`` is a private tmpfs, and hydra's
    launcher there puts each process it starts in its node's group)."""

    PERIOD_US = 10_000

    def __init__(self, prefix: str, hosts: list[str], cpus: float, mount: Path) -> None:
        v2 = Path("/sys/fs/cgroup")
        if (v2 / "cgroup.controllers").exists() and \
                "cpu" in (v2 / "cgroup.controllers").read_text().split():
            self.base, quota = v2 / prefix, None
            (v2 / "cgroup.subtree_control").write_text("+cpu")
        else:
            v1 = next((d for d in (v2 / "cpu", v2 / "cpu,cpuacct")
                       if (d / "cpu.cfs_quota_us").exists()), None)
            if v1 is None:
                raise RuntimeError("a CPU cap per node needs the cgroup cpu controller "
                                   "(v2 cpu.max or v1 cpu.cfs_quota_us); none here")
            self.base, quota = v1 / prefix, "cpu.cfs_quota_us"
        self.mount = mount
        self.base.mkdir()
        if quota is None:
            (self.base / "cgroup.subtree_control").write_text("+cpu")
        us = max(1000, round(cpus * self.PERIOD_US))
        for h in hosts:
            d = self.base / h
            d.mkdir()
            if quota is None:
                (d / "cpu.max").write_text(f"{us} {self.PERIOD_US}")
            else:
                (d / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (d / quota).write_text(str(us))
        mount.mkdir()
        subprocess.run(["mount", "--bind", str(self.base), str(mount)], check=True,
                       capture_output=True)

    def stat(self, host: str) -> dict[str, int]:
        """``host``'s group's ``cpu.stat`` (``nr_throttled``: periods it was held back)."""
        words = (self.base / host / "cpu.stat").read_text().split()
        return {k: int(v) for k, v in zip(words[::2], words[1::2])}

    def join_argv(self, host: str) -> list[str]:
        """A prefix that moves the command's process into ``host``'s group first."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"',
                str(self.mount / host / "cgroup.procs")]

    def remove(self) -> None:
        """Unbind and remove the groups (their processes are gone by then)."""
        subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
        for d in [*self.base.glob("*/"), self.base]:
            try:
                d.rmdir()
            except OSError:
                pass
