"""deploy/kuberay/mlflow.yaml: a tracking server the jobs can reach and MLflow 3 will answer.

MLflow 3 rejects a request whose Host header is not in --allowed-hosts. The jobs address the
server by its Service's in-cluster DNS name, so that name (with the port) must be on the list;
the last tests start the real server with the manifest's own arguments and ask it, once for the
Host check and once (where Flask-WTF, mlflow[auth], is installed) for basic authentication.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from urllib.parse import urlparse

import pytest
from deploy_helpers import container_env, ray_container

SERVICE_DNS_FORMS = ("{name}", "{name}.{ns}", "{name}.{ns}.svc", "{name}.{ns}.svc.cluster.local")


def mlflow_container(find_object) -> dict:
    deployment = find_object("Deployment", "mlflow")
    (container,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "mlflow"
    ]
    return container


def server_args(container: dict) -> dict[str, str]:
    """`mlflow server` arguments as {flag: value}; value '' for a switch."""
    assert container["command"] == ["mlflow", "server"], container["command"]
    out = {}
    for arg in container["args"]:
        flag, _, value = arg.partition("=")
        out[flag] = value
    return out


def allowed_hosts(find_object) -> list[str]:
    return [
        h.strip() for h in server_args(mlflow_container(find_object))["--allowed-hosts"].split(",")
    ]


def service_port(service: dict, deployment: dict) -> int:
    (port,) = service["spec"]["ports"]
    container_ports = {
        p["name"]: p["containerPort"]
        for c in deployment["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    target = port["targetPort"]
    assert target in container_ports or target in container_ports.values(), (
        f"targetPort {target!r} is no container port"
    )
    return port["port"]


def test_service_selects_the_deployment_and_reaches_its_port(find_object):
    for name in ("mlflow", "mlflow-postgres"):
        deployment, service = find_object("Deployment", name), find_object("Service", name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), (
            f"Service {name} selects no pod of its Deployment"
        )
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        service_port(service, deployment)


def test_allowed_hosts_admit_every_in_cluster_name_of_the_service(find_object):
    from mlflow.server.security_utils import is_allowed_host_header

    service = find_object("Service", "mlflow")
    port = service_port(service, find_object("Deployment", "mlflow"))
    name, ns = service["metadata"]["name"], service["metadata"]["namespace"]
    hosts = allowed_hosts(find_object)
    for form in SERVICE_DNS_FORMS:
        host = f"{form.format(name=name, ns=ns)}:{port}"
        assert is_allowed_host_header(hosts, host), f"Host {host} would get 403 from MLflow"
    assert is_allowed_host_header(hosts, f"localhost:{port}"), "kubectl port-forward would get 403"
    assert "*" not in hosts and not is_allowed_host_header(hosts, f"evil.example.com:{port}")


def test_jobs_log_to_the_service_under_an_allowed_host(
    find_object, rayjob_overrides, ray_cluster_specs
):
    from mlflow.server.security_utils import is_allowed_host_header

    service = find_object("Service", "mlflow")
    expected = (
        f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:"
        f"{service['spec']['ports'][0]['port']}"
    )
    uris = {"rayjob.yaml entrypoint": rayjob_overrides["tracking.tracking_uri"]}
    for name, spec in ray_cluster_specs.items():
        templates = [spec["headGroupSpec"]["template"]] + [
            g["template"] for g in spec["workerGroupSpecs"]
        ]
        for i, t in enumerate(templates):
            uris[f"{name} pod {i}"] = container_env(ray_container(t))["MLFLOW_TRACKING_URI"][
                "value"
            ]
    assert set(uris.values()) == {expected}, uris
    assert is_allowed_host_header(allowed_hosts(find_object), urlparse(expected).netloc)


def test_server_has_a_database_backend_and_a_served_artifact_store(find_object):
    """The backend store URI comes from the environment mlflow reads (MLFLOW_BACKEND_STORE_URI)
    and holds no login: libpq takes it from PGUSER/PGPASSWORD, each read from the Secret."""
    container = mlflow_container(find_object)
    args = server_args(container)
    assert "--backend-store-uri" not in args, "the store URI belongs in the env, not in argv"
    env = container_env(container)
    backend = urlparse(env["MLFLOW_BACKEND_STORE_URI"]["value"])
    assert backend.scheme.startswith(("postgresql", "mysql")), (
        f"backend {backend.scheme}: use a database server"
    )
    assert backend.hostname == "mlflow-postgres", "backend host should be the PostgreSQL Service"
    assert backend.username is None and backend.password is None, "no login in the URI"
    for var in ("PGUSER", "PGPASSWORD"):
        assert env[var]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-db", var
    assert "--serve-artifacts" in args
    destination = args["--artifacts-destination"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {
        v["name"]: v
        for v in find_object("Deployment", "mlflow")["spec"]["template"]["spec"]["volumes"]
    }
    assert destination in mounts and "persistentVolumeClaim" in volumes[mounts[destination]], (
        f"artifacts go to {destination}, which is not a mounted claim"
    )
    postgres = find_object("Deployment", "mlflow-postgres")["spec"]["template"]["spec"]
    assert any("persistentVolumeClaim" in v for v in postgres["volumes"]), (
        "PostgreSQL data must be on a claim"
    )


def test_mlflow_cli_accepts_the_manifest_arguments(find_object):
    """Flag names checked by the installed mlflow's own parser (a renamed flag would crash-loop)."""
    from mlflow.cli import server

    container = mlflow_container(find_object)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    ctx = server.make_context("server", list(container["args"]))
    assert ctx.params["serve_artifacts"] is True
    assert ctx.params["port"] == 5000
    assert ctx.params["app_name"] == "basic-auth"
    assert env["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql://")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, host: str, auth: tuple[str, str] | None = None) -> int:
    headers = {"Host": host}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@contextmanager
def _serve(args: dict[str, str], tmp_path, env: dict[str, str]):
    """`mlflow server` with these arguments in its own session; yields its base URL once /health
    answers, and stops the whole group (uvicorn runs as a child) afterwards."""
    cmd = [sys.executable, "-m", "mlflow", "server"] + [
        f"{k}={v}" if v else k for k, v in args.items()
    ]
    base = f"http://127.0.0.1:{args['--port']}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # no readiness event to wait on: poll the port the server binds
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if _get(f"{base}/health", "10.1.2.3:5000") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not come up in 60 s"
            time.sleep(0.2)
        yield base
    finally:
        if proc.poll() is None:  # else it already exited, and the assertion above says why
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _local_args(find_object, tmp_path) -> dict[str, str]:
    """The manifest's arguments with the database and artifact paths swapped for local ones."""
    args = server_args(mlflow_container(find_object))
    args.update(
        {
            "--backend-store-uri": f"sqlite:///{tmp_path}/mlflow.db",
            "--artifacts-destination": str(tmp_path / "artifacts"),
            "--host": "127.0.0.1",
            "--port": str(_free_port()),
            "--workers": "1",
        }
    )
    return args


def _in_cluster_host(find_object) -> str:
    service = find_object("Service", "mlflow")
    return (
        f"mlflow.{service['metadata']['namespace']}.svc.cluster.local:"
        f"{service['spec']['ports'][0]['port']}"
    )


# The GenAI job runner is beside the point here and doubles start-up and shutdown time.
SERVER_ENV = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
API = "/api/2.0/mlflow/experiments/search?max_results=1"


def test_real_server_with_manifest_arguments_answers_the_service_name(find_object, tmp_path):
    """`mlflow server` with the manifest's arguments answers the in-cluster Service name and
    refuses an unknown host; /health answers any host, so the kubelet's probes by pod IP pass.
    The auth app is left out here (the next test runs it): this checks the Host rule alone."""
    args = _local_args(find_object, tmp_path)
    assert args.pop("--app-name") == "basic-auth"
    with _serve(args, tmp_path, SERVER_ENV) as base:
        assert _get(base + API, _in_cluster_host(find_object)) == 200
        assert _get(base + API, "evil.example.com") == 403


def test_real_server_with_basic_auth_refuses_anonymous_and_admits_the_admin(find_object, tmp_path):
    """The manifest's arguments, auth app included, with a basic_auth.ini like the README's (a
    local user store): no credentials -> 401, the admin -> 200, an unknown host still -> 403."""
    pytest.importorskip("flask_wtf", reason="mlflow[auth] (Flask-WTF) is not installed")
    password = "correct-horse-battery-staple"
    ini = tmp_path / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{tmp_path}/basic_auth.db\n"
        "admin_username = admin\n"
        f"admin_password = {password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    env = dict(
        SERVER_ENV, MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_FLASK_SERVER_SECRET_KEY="x" * 32
    )
    host = _in_cluster_host(find_object)
    with _serve(_local_args(find_object, tmp_path), tmp_path, env) as base:
        assert _get(base + API, host) == 401
        assert _get(base + API, host, auth=("admin", "wrong")) == 401
        assert _get(base + API, host, auth=("admin", password)) == 200
        assert _get(base + API, "evil.example.com", auth=("admin", password)) == 403
