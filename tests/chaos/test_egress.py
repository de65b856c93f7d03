"""The allow-list of hosts an experiment's http providers may reach: listed host:port pairs (or hosts on any
port), compared as written, never resolved; anything else is refused with the rule named."""

from __future__ import annotations

import pytest

from chaos.egress import HostAllowList, host_entry, loopback_entries, parse_entry


def test_listed_host_and_port_pass_and_every_neighbour_is_refused() -> None:
    allowed = HostAllowList(["127.0.0.1:8080", "status.example.com", "[::1]:9090"])
    for url in ("http://127.0.0.1:8080/api/v1/fleet", "https://status.example.com/x",
                "http://status.example.com:8443/", "http://[::1]:9090/-/ready", "http://STATUS.example.com/"):
        assert allowed.refusal(url) is None, url
    for url in ("http://127.0.0.1:8081/", "http://localhost:8080/", "http://127.1:8080/",
                "http://169.254.169.254/latest/meta-data/", "http://status.example.com.evil.net/",
                "file:///etc/passwd", "ftp://127.0.0.1:8080/", "http://[::1]:9091/"):
        reason = allowed.refusal(url)
        assert reason is not None, url
    assert "127.0.0.1:8081 is not an allowed host" in str(allowed.refusal("http://127.0.0.1:8081/"))
    assert "only http and https" in str(allowed.refusal("file:///etc/passwd"))


def test_dynamic_entries_are_read_at_every_check() -> None:
    ports = [8101]
    allowed = HostAllowList([], lambda: loopback_entries(ports))
    assert allowed.refusal("http://127.0.0.1:8101/metrics") is None
    ports[:] = [8102]  # the replica moved
    assert allowed.refusal("http://127.0.0.1:8101/metrics") is not None
    assert allowed.refusal("http://localhost:8102/metrics") is None


@pytest.mark.parametrize("text", ["", "http://x.example", "x.example/path", "user@x.example", "x:notaport"])
def test_malformed_entries_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a host or host:port"):
        parse_entry(text)


def test_entries_are_normalized() -> None:
    assert parse_entry("Example.COM:443") == ("example.com", 443)
    assert parse_entry("example.com") == ("example.com", None)
    assert parse_entry(host_entry("::1", 80)) == ("::1", 80)
