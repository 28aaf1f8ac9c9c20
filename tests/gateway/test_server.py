"""The uvicorn server `crossover serve` and `crossover demo` run the gateway on."""

from crossover.gateway.config import Settings
from crossover.gateway.server import make_server

POOLS = {"speculative": {"backends": ["http://s:1"]}, "plain": {"backends": ["http://p:2"]}}


def test_the_server_is_set_up_for_many_long_streams():
    config = make_server(Settings(pools=POOLS, timeouts={"client_keepalive": 75, "graceful_shutdown": 12})).config
    assert (config.loop, config.access_log) == ("uvloop", False)
    assert (config.http.max_head_bytes, config.http.head_timeout) == (64 * 1024, 10.0)  # bounded request heads
    assert config.timeout_keep_alive == 75 and config.timeout_graceful_shutdown == 12
    assert (config.host, config.port) == ("127.0.0.1", 8000)


def test_flags_override_the_listen_address():
    config = make_server(Settings(pools=POOLS, port=9001), host="0.0.0.0", port=9100).config
    assert (config.host, config.port) == ("0.0.0.0", 9100)
