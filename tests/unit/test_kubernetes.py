"""The Kubernetes examples (examples/kubernetes/): every field checked against the Kubernetes API's models (the
``kubernetes`` client's, and the Kubeflow training operator's for the PyTorchJob), and the environment the
operator gives a PyTorchJob's pods replayed into ftrun's flags."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftrun.cli import main as cli

kubernetes_models = pytest.importorskip("kubernetes.client.models")
training_models = pytest.importorskip("kubeflow.training.models")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "kubernetes"
SCALARS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float)}


def problems(value: Any, kind: str, at: str) -> list[str]:  # noqa: PLR0911 - one return per kind of type
    """What in ``value`` does not fit the API type ``kind`` (a model's name, ``list[X]``, ``dict(str, X)``, a
    scalar): unknown fields, wrong types, required fields missing (the models' own checks)."""
    if kind in SCALARS:
        ok = isinstance(value, SCALARS[kind]) and not (kind == "int" and isinstance(value, bool))
        return [] if ok else [f"{at}: {value!r} is not a {kind}"]
    if kind == "object":  # IntOrString, free-form
        return []
    if m := re.fullmatch(r"list\[(.+)\]", kind):
        if not isinstance(value, list):
            return [f"{at}: not a list"]
        return [p for i, v in enumerate(value) for p in problems(v, m[1], f"{at}[{i}]")]
    if m := re.fullmatch(r"dict\(str, (.+)\)", kind):
        if not isinstance(value, dict):
            return [f"{at}: not a mapping"]
        return [p for k, v in value.items() for p in problems(v, m[1], f"{at}.{k}")]
    model = getattr(training_models, kind, None) or getattr(kubernetes_models, kind)
    if not isinstance(value, dict):
        return [f"{at}: not a mapping ({kind})"]
    by_key = {key: name for name, key in model.attribute_map.items()}
    found = [f"{at}.{key}: no such field in {kind}" for key in value if key not in by_key]
    for key, v in value.items():
        if key in by_key:
            found += problems(v, model.openapi_types[by_key[key]], f"{at}.{key}")
    try:
        model(**{by_key[k]: v for k, v in value.items() if k in by_key})
    except ValueError as e:
        found.append(f"{at}: {e}")
    return found


def load(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    assert isinstance(doc, dict)
    return doc


def test_the_pytorchjob_fits_the_training_operators_api() -> None:
    job = load("pytorchjob-etcd.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert problems(job, "KubeflowOrgV1PyTorchJob", "PyTorchJob") == []


def test_the_jobset_fits_the_jobset_api_and_its_jobs_the_batch_api() -> None:
    """No JobSet models on the package registries: its own fields against its v1alpha2 API by hand, each
    replicated job's template against Kubernetes' batch/v1 JobTemplateSpec."""
    js = load("jobset-embedded-store.yaml")
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert set(js) <= {"apiVersion", "kind", "metadata", "spec"}
    assert problems(js["metadata"], "V1ObjectMeta", "metadata") == []
    spec_fields = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
                   "coordinator", "managedBy", "ttlSecondsAfterFinished"}  # fmt: skip
    assert set(js["spec"]) <= spec_fields
    assert set(js["spec"]["failurePolicy"]) <= {"maxRestarts", "restartStrategy", "rules"}
    for i, rjob in enumerate(js["spec"]["replicatedJobs"]):
        assert set(rjob) <= {"name", "groupName", "template", "replicas", "dependsOn"}
        assert problems(rjob["template"], "V1JobTemplateSpec", f"replicatedJobs[{i}].template") == []


def test_a_broken_manifest_is_caught() -> None:
    """The checks can fail: a misspelt field, a port as text where a number goes, a container without a name."""
    job = load("pytorchjob-etcd.yaml")
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["imagePullPolicyy"] = "Always"
    container["ports"][0]["containerPort"] = "29400"
    del container["name"]
    found = "\n".join(problems(job, "KubeflowOrgV1PyTorchJob", "PyTorchJob"))
    assert "imagePullPolicyy: no such field in V1Container" in found
    assert "containerPort: '29400' is not a int" in found
    assert "`name`, must not be `None`" in found


def operator_env(job: dict[str, Any]) -> dict[str, str]:
    """The variables the training operator (v1.8, pkg/controller.v1/pytorch) sets in a worker pod of an elastic
    PyTorchJob with only Worker replicas: its elastic generator's, PET_NNODES as MIN:MAX, and PYTHONUNBUFFERED."""
    policy = job["spec"]["elasticPolicy"]
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")  # the same for every pod
    env = {
        "PYTHONUNBUFFERED": "0",
        "PET_RDZV_ENDPOINT": f"{host}:{policy['rdzvPort']}",
        "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_NPROC_PER_NODE": str(policy["nProcPerNode"]),
        "PET_RDZV_ID": policy["rdzvId"],
    }
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    return env


def test_ftrun_starts_right_from_the_environment_a_pytorchjob_gives_its_pods(tmp_path: Path) -> None:
    job = load("pytorchjob-etcd.yaml")
    [container] = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    (tmp_path / "train.py").write_text("print('hi')\n")
    c = cli.parse(container["command"][1:], operator_env(job), tmp_path)  # every pod gets the same variables
    assert (c.nnodes.min, c.nnodes.max, c.nproc_per_node, c.max_restarts) == (2, 4, 8, 10)
    assert c.rdzv.store is not None
    assert (c.rdzv.backend, c.rdzv.store.display) == ("etcd", "etcd://etcd-client:2379")
    assert c.rdzv.run_id == "train"
    assert c.term_timeout_s == 90.0


def test_pet_standalone_set_empty_by_the_operator_means_standalone(tmp_path: Path) -> None:
    """The operator sets PET_STANDALONE to "" for `standalone: true` (torchrun fails on it: int(''))."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    assert cli.parse(["train.py"], {"PET_STANDALONE": ""}, tmp_path).standalone


def test_the_jobset_survives_a_lost_pod() -> None:
    """A node range below the pods' count (the others train on without one), and a Job that replaces a failed pod
    instead of failing at once (which would recreate every pod of the set)."""
    js = load("jobset-embedded-store.yaml")
    [rjob] = js["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    [container] = job["template"]["spec"]["containers"]
    [nnodes] = [a.split("=", 1)[1] for a in container["command"] if a.startswith("--nnodes=")]
    low, high = (int(n) for n in nnodes.split(":"))
    assert low < high == job["parallelism"] == job["completions"]
    assert job["backoffLimit"] >= 1
