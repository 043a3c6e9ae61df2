"""`transfer.discovery.NodeAddresses`: fixed URLs plus DNS names followed as their addresses change."""

from __future__ import annotations

import asyncio

import pytest
from kvrelay.transfer.discovery import NodeAddresses, parse_dns_name


def test_addresses_join_and_leave_and_a_failed_lookup_keeps_the_last_ones():
    answers: dict[str, list[str] | OSError] = {"pods.ns.svc": ["10.0.0.2", "10.0.0.3"], "v6.svc": ["fd00::7"]}

    async def resolver(host: str, port: int) -> list[str]:
        answer = answers[host]
        if isinstance(answer, OSError):
            raise answer
        return answer

    async def main() -> None:
        nodes = NodeAddresses(["http://10.0.0.1:8100/"], ["pods.ns.svc:8100", "v6.svc:8100"], resolver=resolver)
        assert nodes.dynamic and nodes.urls == {"http://10.0.0.1:8100"}
        added, removed = await nodes.refresh()
        assert added == {"http://10.0.0.2:8100", "http://10.0.0.3:8100", "http://[fd00::7]:8100"} and removed == set()
        answers["pods.ns.svc"] = ["10.0.0.3", "10.0.0.4"]
        assert await nodes.refresh() == ({"http://10.0.0.4:8100"}, {"http://10.0.0.2:8100"})
        answers["pods.ns.svc"] = OSError("Temporary failure in name resolution")
        assert await nodes.refresh() == (set(), set())  # a DNS hiccup does not empty the cluster
        answers["pods.ns.svc"] = []
        assert await nodes.refresh() == (set(), {"http://10.0.0.3:8100", "http://10.0.0.4:8100"})
        assert nodes.urls == {"http://10.0.0.1:8100", "http://[fd00::7]:8100"}
        assert not NodeAddresses(["http://a:1"]).dynamic

    asyncio.run(main())


@pytest.mark.parametrize("bad", ["kvrelay-prefill", "kvrelay-prefill:", ":8100", "host:0", "host:70000", "host:x"])
def test_dns_names_must_be_host_and_port(bad):
    with pytest.raises(ValueError, match="is not host:port"):
        parse_dns_name(bad)
