"""The process group's choice of network interface (shard/runtime/process_group.py): ranks that meet at a loopback
address keep gloo's own connections on loopback, instead of the address this machine's hostname resolves to."""

from __future__ import annotations

from conveyor.shard.runtime.process_group import loopback_interface


def test_ranks_meeting_on_loopback_talk_over_the_loopback_interface() -> None:
    for master in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert loopback_interface(master) in ("lo", "lo0"), master


def test_ranks_meeting_elsewhere_keep_gloo_s_own_choice() -> None:
    for master in ("10.0.0.5", "0.0.0.0", "node-0.example", "fd00::2"):
        assert loopback_interface(master) is None, master
