"""The multi-host test bed itself (tests/netns_hosts.py): hosts with their own addresses and
names that reach each other over the bridge, private folders, a host killed, a link taken
down, and nothing left after teardown."""

from __future__ import annotations

import sys

import pytest
from netns_hosts import Testbed, can_create_namespaces

pytestmark = pytest.mark.skipif(can_create_namespaces() is not None, reason=str(can_create_namespaces()))

SERVE = ("import socket,sys;s=socket.socket();s.bind((sys.argv[1],7777));s.listen();print('up',flush=True);"
         "c,_=s.accept();c.sendall(socket.gethostname().encode());c.close()")
ASK = ("import socket,sys;c=socket.create_connection((sys.argv[1],7777),timeout=float(sys.argv[2]));"
       "print(c.recv(100).decode())")


def test_two_hosts_reach_each_other_by_address_and_teardown_leaves_nothing(tmp_path):
    private = str(tmp_path / "out")
    bed = Testbed(2, private={1: [private]})
    with bed:
        head, w1 = bed.hosts
        assert bed.run(0, ["hostname"]).stdout.strip() == head.name
        assert bed.run(1, ["hostname"]).stdout.strip() == w1.name
        addrs = bed.run(1, ["ip", "-o", "-4", "addr", "show"]).stdout
        assert w1.address in addrs and head.address not in addrs
        server = bed.spawn(1, [sys.executable, "-c", SERVE, w1.address])
        assert server.stdout.readline().strip() == "up"
        got = bed.run(0, [sys.executable, "-c", ASK, w1.address, "5"])
        assert got.stdout.strip() == w1.name, got.stderr
        # a folder private to host 1: what it writes there the head does not see
        bed.run(1, ["sh", "-c", f"echo x > {private}/marker"])
        assert bed.run(1, ["cat", f"{private}/marker"]).stdout.strip() == "x"
        assert not (tmp_path / "out" / "marker").exists()
        # a link down: the head cannot reach host 1 (a timeout, not a refusal)
        bed.spawn(1, [sys.executable, "-c", SERVE, w1.address]).stdout.readline()
        bed.link(1, up=False)
        down = bed.run(0, [sys.executable, "-c", ASK, w1.address, "1"])
        assert down.returncode != 0 and "timed out" in down.stderr
        bed.link(1, up=True)
        # a host killed: every process of it gone, its keeper (the machine) stays
        sleeper = bed.spawn(1, ["sleep", "300"])
        killed = bed.kill_host(1)
        assert sleeper.pid in killed or sleeper.wait(timeout=5) is not None
        assert bed.pids(1) == [w1.keeper.pid]
    assert bed.leftovers() == []
