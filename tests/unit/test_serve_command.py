"""`poolserve serve` on a machine of its own: the command line's router settings are the
config's, checked alike; the ports it needs may be taken."""

from __future__ import annotations

import pytest
import yaml

from deployments.config import ConfigError
from tests.unit.test_config import REPO, base, check, model_dir, set_path  # noqa: F401 (a fixture)


def test_the_command_lines_host_and_port_are_checked_and_used_as_the_configs(monkeypatch, capsys):
    """`poolserve serve --host 0.0.0.0` checked the shipped example keys against the config's
    127.0.0.1 and served them to the network; `--port` left the batch jobs posting to :8000."""
    import deployments.app
    from deployments.cli import main
    from deployments.config import load

    local = str(REPO / "deployments/configs/local.yaml")
    monkeypatch.setattr(deployments.app, "start_local_ray", lambda *a, **k: pytest.fail("Ray was started"))
    assert main(["serve", local, "--host", "0.0.0.0"]) == 1
    assert "a key poolserve ships in its examples, on a router other machines reach" in capsys.readouterr().err
    moved = load(local, {"port": 9000})
    assert moved.config.router.port == 9000 and moved.config.router.host == "127.0.0.1"


def test_a_taken_metrics_port_moves_to_the_next_free_one(model_dir):
    """With 8080 taken (by anything on the machine), Ray's agent could not bind its metrics port
    and `poolserve serve` failed after 30 s with "the node timed out during startup"."""
    import socket

    from deployments.app import on_free_metrics_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = set_path(set_path(base(), "ray", {"metrics_export_port": port}), "router", {"port": port + 1})
        moved = on_free_metrics_port(check(data, model_dir)).config.ray.metrics_export_port
        assert moved > port + 1, "not the router's port either: free until Serve binds it"
    assert on_free_metrics_port(check(set_path(base(), "ray", {"metrics_export_port": moved}), model_dir)
                                ).config.ray.metrics_export_port == moved, "a free port stays"


def test_serve_keeps_its_http_port_when_the_metrics_port_moves(monkeypatch):
    """The moved metrics port once took the HTTP port's variable: Serve's proxy bound it."""
    import deployments.app
    from ray import serve

    from deployments.cli import main

    started = {}
    monkeypatch.setattr(deployments.app, "free_port", lambda host, first, **kw: first + 1)  # every port taken
    monkeypatch.setattr(deployments.app, "start_local_ray", lambda ray_config, **kw: started.update(ray=ray_config))
    monkeypatch.setattr(serve, "start", lambda http_options: started.update(http=http_options))
    monkeypatch.setattr(deployments.app, "deploy", lambda *a: (_ for _ in ()).throw(SystemExit(7)))
    with pytest.raises(SystemExit):
        main(["serve", str(REPO / "deployments/configs/local.yaml")])
    assert started["http"] == {"host": "127.0.0.1", "port": 8000} and started["ray"].metrics_export_port == 8081


def test_the_command_lines_router_settings_leave_a_bad_router_section_to_validation(tmp_path):
    from deployments.config import load

    bad = tmp_path / "bad.yaml"
    for section in ([1], None):  # refused by `poolserve validate`: so with --port too
        bad.write_text(yaml.safe_dump({**yaml.safe_load((REPO / "deployments/configs/local.yaml").read_text()),
                                       "router": section}))
        with pytest.raises(ConfigError, match="router: .*valid dictionary"):
            load(bad, {"port": 9000})


def test_the_dashboard_never_takes_the_routers_port(monkeypatch):
    """The dashboard's port is picked before Serve binds the router's: with the router on a port
    at or after 8265, the dashboard took it while it was still free, and Serve could not bind."""
    import ray

    import deployments.app
    from deployments.app import start_local_ray
    from deployments.config import RayConfig

    skipped = {}
    monkeypatch.setattr(deployments.app, "free_port", lambda host, first, skip=(), **kw: skipped.update(skip=skip)
                        or next(p for p in range(first, first + 50) if p not in skip))
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    url = start_local_ray(RayConfig(), keep_free={8265}, include_dashboard=True)
    assert 8265 in skipped["skip"] and url.endswith(":8266")
    started = {}
    monkeypatch.setattr(deployments.app, "start_local_ray", lambda ray_config, **kw: started.update(kw))
    monkeypatch.setattr(deployments.app, "deploy", lambda *a: (_ for _ in ()).throw(SystemExit(7)))
    from ray import serve

    from deployments.cli import main
    monkeypatch.setattr(serve, "start", lambda http_options: None)
    with pytest.raises(SystemExit):
        main(["serve", "--port", "8270", str(REPO / "deployments/configs/local.yaml")])
    assert started["keep_free"] == {8270}


def test_the_start_up_summary_writes_an_ipv6_host_in_brackets(monkeypatch, capsys):
    """`--host ::1` printed http://::1:8000/..., which names no port to any client."""
    import signal

    import deployments.app
    import deployments.cli
    from ray import serve

    from deployments.cli import main
    from infra.wire import http_url

    assert http_url("::1", 8000) == "http://[::1]:8000" and http_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert http_url("[::1]", 8000) == "http://[::1]:8000"  # already bracketed
    monkeypatch.setattr(deployments.app, "start_local_ray", lambda ray_config, **kw: None)
    monkeypatch.setattr(deployments.app, "deploy", lambda *a: None)
    monkeypatch.setattr(deployments.cli, "_profile_lines", lambda: [])
    monkeypatch.setattr(serve, "start", lambda http_options: None)
    monkeypatch.setattr(signal, "pthread_sigmask", lambda *a: None)
    monkeypatch.setattr(signal, "sigwait", lambda s: (_ for _ in ()).throw(SystemExit(0)))
    with pytest.raises(SystemExit):
        main(["serve", "--host", "::1", str(REPO / "deployments/configs/local.yaml")])
    out = capsys.readouterr().out
    assert "http://[::1]:8000/online/v1/chat/completions" in out and "http://::1" not in out, out


def test_a_router_port_equal_to_the_metrics_port_is_refused_before_ray_starts(monkeypatch, capsys, model_dir):
    """`--port 8080` moved Ray's metrics to 8081 with a warning that 8080 was "taken", by
    nothing but the router's own port: the clash is the config's, and says so."""
    import deployments.app
    from deployments.cli import main

    monkeypatch.setattr(deployments.app, "start_local_ray", lambda *a, **k: pytest.fail("Ray was started"))
    assert main(["serve", str(REPO / "deployments/configs/local.yaml"), "--port", "8080"]) == 1
    err = capsys.readouterr().err
    assert "ray.metrics_export_port" in err and "router.port too" in err
    joined = set_path(set_path(base(), "ray", {"address": "ray://head:10001", "metrics_export_port": 9000}),
                      "router", {"port": 9000})
    assert check(joined, model_dir).config.router.port == 9000, "a Ray it joins binds no metrics port of poolserve's"


def test_the_port_rays_dashboard_agent_takes_is_refused_for_the_router_and_the_metrics(monkeypatch, capsys,
                                                                                       model_dir):
    """Ray's dashboard agent binds 52365 on every node the Ray poolserve starts runs, before
    Serve binds the router's port (found by a review, seen listening on 127.0.0.1:52365); a
    config for a cluster, or a manifest rendered from one, binds no such port."""
    from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT

    import deployments.app
    from deployments.cli import main
    from deployments.config import RAY_AGENT_PORT, local_ray_problems

    assert RAY_AGENT_PORT == DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
    monkeypatch.setattr(deployments.app, "start_local_ray", lambda *a, **k: pytest.fail("Ray was started"))
    assert main(["serve", str(REPO / "deployments/configs/local.yaml"), "--port", str(RAY_AGENT_PORT)]) == 1
    assert "router.port" in capsys.readouterr().err
    for section, key in (("router", "port"), ("ray", "metrics_export_port")):
        resolved = check(set_path(base(), section, {key: RAY_AGENT_PORT}), model_dir)  # validates: k8s may use it
        assert [p.key for p in local_ray_problems(resolved)] == [f"{section}.{key}"]
