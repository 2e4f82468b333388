"""`cb serve --replicas 2` on a local Ray: every listening socket of its processes is on loopback.

The whole process tree of the server (Ray's GCS, raylet, agents, the Serve
controller, proxy, ingress and engine replicas) is read with psutil once the
server answers; Ray Serve's replica gRPC servers, which Ray binds to all
interfaces, are among what is checked. A non-loopback host or a cluster is
refused without ``--accept-ray-exposure``.
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import openai
import psutil
import pytest

from cbcore.serve.launch import ServerProcess

pytestmark = pytest.mark.ray


def listening(root: psutil.Process) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of ``root`` and its descendants."""
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns, name = proc.net_connections(kind="inet"), " ".join(proc.cmdline())[:80]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def on_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def test_every_listener_of_two_replicas_is_on_loopback(cb_tiny_model_dir):
    args = ["--replicas", "2", "--cpus-per-replica", "0.5", "--ray-cpus", "2", "--threads", "1"]
    args += ["--model", str(cb_tiny_model_dir), "--served-model-name", "tiny", "--api-key", "k"]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=600) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=120)
        for _ in range(4):  # both engines and the ingress have served a request
            assert client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2).choices[0].text is not None
        sockets = listening(psutil.Process(server.proc.pid))
    replicas = {name for _, _, name in sockets if "ServeReplica" in name}
    assert len(replicas) >= 2, sockets  # the check saw the replicas' own servers (ingress and engines)
    outside = [s for s in sockets if not on_loopback(s[0])]
    assert not outside, outside


@pytest.mark.parametrize(
    ("flags", "what"),
    [(["--host", "0.0.0.0"], "the HTTP proxy on 0.0.0.0"), (["--ray-address", "10.1.2.3:6379"], "10.1.2.3:6379")],
)
def test_a_non_loopback_host_or_cluster_needs_accept_ray_exposure(flags, what):
    cmd = [sys.executable, "-m", "cbcore.cli.main", "serve", "--replicas", "2", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert what in done.stderr and "--accept-ray-exposure" in done.stderr, done.stderr
