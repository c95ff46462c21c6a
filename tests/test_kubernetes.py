"""deploy/kubernetes/: parsed and checked without a cluster. For each way
to run the workers (an indexed Job, Kubeflow's PyTorchJob) with the
scheduler and servers: every role has the variables it needs, with values
gradhub parses; names and ports match the headless Service; the sizes match
the replicas; the token comes from the Secret; each role's command line
parses as gradhub's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gradhub import _env
from gradhub.cli import build_parser

DEPLOY = Path(__file__).parent.parent / "deploy" / "kubernetes"
TOKEN_VARS = ("GRADHUB_JOB_TOKEN", "GRADHUB_JOB_TOKEN_FILE")
ANNOTATION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def pods(docs: list[dict]) -> list[tuple[str, int, dict]]:
    """(component, replicas, pod template) of every Job and PyTorchJob."""
    out = []
    for d in docs:
        if d["kind"] == "Job":
            t = d["spec"]["template"]
            out.append((t["metadata"]["labels"]["app.kubernetes.io/component"], d["spec"].get("completions", 1), t))
        elif d["kind"] == "PyTorchJob":
            for spec in d["spec"]["pytorchReplicaSpecs"].values():
                t = spec["template"]
                out.append((t["metadata"]["labels"]["app.kubernetes.io/component"], spec["replicas"], t))
    return out


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("workers_file", ["workers-job.yaml", "workers-pytorchjob.yaml"])
def test_manifests_give_every_role_what_it_needs(workers_file):
    docs = load("scheduler-and-servers.yaml") + load(workers_file)
    services = [d for d in docs if d["kind"] == "Service"]
    assert len(services) == 1
    svc = services[0]
    assert svc["spec"]["clusterIP"] == "None"  # headless: the name is the scheduler pod's address
    svc_ports = {p["port"] for p in svc["spec"]["ports"]}
    roles = pods(docs)
    by_role: dict[str, list[tuple[int, dict]]] = {}
    for component, replicas, t in roles:
        by_role.setdefault(component, []).append((replicas, t))
    assert set(by_role) == {"scheduler", "server", "worker"}
    # The Service selects the scheduler's pod and nothing else.
    sel = svc["spec"]["selector"]
    matches = [c for c, _, t in roles if all(t["metadata"]["labels"].get(k) == v for k, v in sel.items())]
    assert matches == ["scheduler"]
    n_workers = sum(r for r, _ in by_role["worker"])
    n_servers = sum(r for r, _ in by_role["server"])
    sched_addr = f"{svc['metadata']['name']}:{9000}"
    parser = build_parser()
    encrypt: set[str] = set()

    for component, replicas, t in roles:
        spec = t["spec"]
        # Servers are not restarted (a lost one's chunks move); the scheduler is, in its pod (members rejoin it).
        want = {"server": "Never", "scheduler": "OnFailure"}.get(component)
        assert want is None or spec.get("restartPolicy", "Never") == want, (component, spec.get("restartPolicy"))
        (c,) = spec["containers"]
        env = env_of(c)
        for name, e in env.items():
            if name.startswith("GRADHUB_"):
                s = _env.setting(name)  # a registered setting (KeyError otherwise)
                if "value" in e:
                    _env._parse(name, s.kind, e["value"], s.choices)  # a value gradhub accepts
        # The token: from the Secret, mounted where GRADHUB_JOB_TOKEN_FILE says.
        assert any(v in env for v in TOKEN_VARS), (component, env)
        # Encryption shown, and set alike on every role (a member that differs is refused).
        encrypt.add(env["GRADHUB_ENCRYPT"]["value"])
        path = env["GRADHUB_JOB_TOKEN_FILE"]["value"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        secret_vols = {v["name"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "gradhub-token"}
        assert any(path.startswith(mounts[v] + "/") for v in secret_vols), (component, path, mounts)
        if component != "worker":
            cmd = c["command"]
            assert cmd[0] == "gradhub" and cmd[1] == component
            args = parser.parse_args(cmd[1:])  # gradhub's own command line accepts it
            assert args.metrics_addr == "0.0.0.0:9100" and 9100 in svc_ports | {p["containerPort"] for p in c["ports"]}
        if component == "scheduler":
            assert args.bind.rsplit(":", 1)[1] == "9000" and 9000 in svc_ports
            assert int(env["GRADHUB_NUM_WORKERS"]["value"]) == n_workers
            assert int(env["GRADHUB_NUM_SERVERS"]["value"]) == n_servers
            assert replicas == 1
            continue
        # Servers and workers find the scheduler by the Service's name.
        assert env["GRADHUB_SCHEDULER"]["value"] == sched_addr
        if component == "worker":
            assert int(env["GRADHUB_NUM_SERVERS"]["value"]) == n_servers
            if "GRADHUB_NUM_WORKERS" in env:
                assert int(env["GRADHUB_NUM_WORKERS"]["value"]) == n_workers
            else:  # the PyTorchJob operator sets WORLD_SIZE (gradhub's fallback) to every replica
                assert workers_file == "workers-pytorchjob.yaml"
            if "GRADHUB_RANK" in env:  # else the operator's RANK
                assert env["GRADHUB_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == ANNOTATION_INDEX
            assert int(env["GRADHUB_LOCAL_SIZE"]["value"]) == 1  # one worker per pod
    assert len(encrypt) == 1, encrypt
    # An indexed Job's index is each worker's rank: ranks 0..N-1, once each.
    for d in docs:
        if d["kind"] == "Job" and d["spec"].get("completionMode") == "Indexed":
            assert d["spec"]["parallelism"] == d["spec"]["completions"]


def test_the_image_the_manifests_name_is_the_one_deploy_dockerfile_builds():
    """deploy/Dockerfile, checked as text (no container builder here): its
    documented tag is the package's version and every manifest's image; a
    Rust stage builds the wheel, a slim Python stage installs it and runs as
    an unprivileged user; it copies only paths that exist, none of the
    repository's tests, docs or lab beyond what the crate's manifest names."""
    import re
    import tomllib

    root = DEPLOY.parent.parent
    text = (DEPLOY.parent / "Dockerfile").read_text()
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    tag = f"gradhub:{version}"
    assert f"docker build -f deploy/Dockerfile -t {tag} ." in text
    images = {c["image"] for name in ("scheduler-and-servers.yaml", "workers-job.yaml", "workers-pytorchjob.yaml")
              for _, _, t in pods(load(name)) for c in t["spec"]["containers"]}
    assert images == {tag}, images
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    assert [s[0].split(":")[0] for s in stages] == ["rust", "python"], stages
    assert "maturin build --release" in text and "--from=wheel" in text
    final = text.split(f"FROM {stages[-1][0]}", 1)[1]
    users = re.findall(r"^USER (\S+)$", final, re.M)
    assert users and users[-1] not in ("root", "0"), users
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for path in src.split():
            assert (root / path).exists(), path
            assert path.split("/")[0] not in ("docs", "lab", "deploy", "fuzz") and path != "tests/", path
