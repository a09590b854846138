"""kvxfer's own rules for deploy/kubernetes/, beyond the schemas.

scripts/check-deploy.sh k8s runs it (make check-k8s) with the manifests:

    check_k8s_rules.py --kvxferd BUILD/kvxferd --dockerfile Dockerfile FILE...

A DaemonSet of kvxferd must take no GPU and see them all, run as the
image's user (the Dockerfile's KVX_UID and KVX_GID), share the node's PID
namespace, mount the socket's directory from the node, have probes,
limits and a grace period longer than its drain, and name this
release's image; its ConfigMap's kvxferd.yaml must pass
``kvxferd --check-config``. Every other pod (an
engine) must mount the same directory, be in the image's group and share
the node's PID namespace. Prints one line per problem; exits 1 if any.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Tuple

import yaml

Doc = Dict[str, Any]
PROBLEMS: List[str] = []


def problem(where: str, msg: str) -> None:
    """Record one problem, naming the file and object."""
    PROBLEMS.append(f"check-k8s: {where}: {msg}")


def image_ids(dockerfile: str) -> Tuple[int, int]:
    """The KVX_UID and KVX_GID the Dockerfile gives the image's user."""
    text = open(dockerfile).read()
    ids = []
    for name in ("KVX_UID", "KVX_GID"):
        m = re.search(rf"^ARG {name}=(\d+)$", text, re.M)
        if not m:
            sys.exit(f"check-k8s: {dockerfile}: no ARG {name}=N")
        ids.append(int(m.group(1)))
    return ids[0], ids[1]


def version(header: str) -> str:
    """The release kvxfer.h names (KVX_VERSION_STRING)."""
    m = re.search(r'^#define KVX_VERSION_STRING "(.*)"$', open(header).read(),
                  re.M)
    if not m:
        sys.exit(f"check-k8s: {header}: no KVX_VERSION_STRING")
    return m.group(1)


def pod_specs(files: List[str]) -> Iterator[Tuple[str, Doc, Doc]]:
    """(where, object, pod spec) of every object that holds a pod."""
    for f in files:
        for doc in yaml.safe_load_all(open(f)):
            if not isinstance(doc, dict):
                continue
            where = f"{f}: {doc.get('kind')}/" \
                f"{doc.get('metadata', {}).get('name')}"
            spec = doc.get("spec") or {}
            if doc.get("kind") == "Pod":
                yield where, doc, spec
            elif isinstance(spec.get("template"), dict):
                yield where, doc, spec["template"].get("spec") or {}


def configmaps(files: List[str]) -> Dict[str, Doc]:
    """ConfigMaps by name."""
    out = {}
    for f in files:
        for doc in yaml.safe_load_all(open(f)):
            if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
                out[doc["metadata"]["name"]] = doc
    return out


def containers(spec: Doc) -> List[Doc]:
    """Init containers and containers."""
    return (spec.get("initContainers") or []) + (spec.get("containers")
                                                  or [])


def host_paths(spec: Doc) -> Dict[str, str]:
    """hostPath volumes: name -> path on the node."""
    return {v["name"]: v["hostPath"]["path"]
            for v in spec.get("volumes") or [] if "hostPath" in v}


def ids_of(spec: Doc, c: Doc) -> Tuple[Any, Any]:
    """runAsUser and runAsGroup of container c (its own, else the pod's)."""
    pod = spec.get("securityContext") or {}
    own = c.get("securityContext") or {}
    return (own.get("runAsUser", pod.get("runAsUser")),
            own.get("runAsGroup", pod.get("runAsGroup")))


def check_config(where: str, text: str, kvxferd: str) -> None:
    """The ConfigMap's kvxferd.yaml, node IP filled in, as kvxferd reads
    it."""
    if not os.access(kvxferd, os.X_OK):
        problem(where, f"{kvxferd} not built (make): cannot check "
                "kvxferd.yaml")
        return
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as t:
        t.write(text.replace("@NODE_IP@", "192.0.2.10"))
        t.flush()
        r = subprocess.run([kvxferd, "--check-config", "--config", t.name],
                           capture_output=True, text=True)
    if r.returncode:
        for line in (r.stderr or r.stdout).strip().splitlines():
            problem(where, "kvxferd.yaml: " + line.replace(t.name, "file"))


def check_daemon(where: str, spec: Doc, cms: Dict[str, Doc], uid: int,
                 gid: int, kvxferd: str) -> str:
    """The DaemonSet's rules; returns the socket directory's node path."""
    main = (spec.get("containers") or [{}])[0]
    for c in containers(spec):
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            if any(k.startswith("nvidia.com/") for k in res.get(part) or {}):
                problem(where, f"container {c['name']} takes GPUs "
                        f"(resources.{part} nvidia.com/...): they are the "
                        "engines'; NVIDIA_VISIBLE_DEVICES=all shows the "
                        "daemon every GPU")
        lim = res.get("limits") or {}
        if "cpu" not in lim or "memory" not in lim:
            problem(where, f"container {c['name']}: no cpu and memory "
                    "limits")
    env = {e["name"]: e.get("value") for e in main.get("env") or []}
    if env.get("NVIDIA_VISIBLE_DEVICES") != "all":
        problem(where, "kvxferd: NVIDIA_VISIBLE_DEVICES is not all (it "
                "finds each pool's GPU by UUID among those it sees)")
    if not spec.get("runtimeClassName"):
        problem(where, "no runtimeClassName (the NVIDIA runtime reads "
                "NVIDIA_VISIBLE_DEVICES)")
    if ids_of(spec, main) != (uid, gid):
        problem(where, f"kvxferd runs as {ids_of(spec, main)}, not the "
                f"image's user ({uid}, {gid})")
    if not (spec.get("securityContext") or {}).get("runAsNonRoot"):
        problem(where, "no runAsNonRoot: true")
    if spec.get("hostPID") is not True:
        problem(where, "hostPID is not true (legacy CUDA IPC handles, and "
                "the engines' groups in /proc)")
    for probe in ("livenessProbe", "readinessProbe"):
        if probe not in main:
            problem(where, f"kvxferd: no {probe}")
    # the configuration: kvxferd --check-config, and what the rules need
    conf: Doc = {}
    for v in spec.get("volumes") or []:
        name = (v.get("configMap") or {}).get("name")
        if name in cms:
            text = (cms[name].get("data") or {}).get("kvxferd.yaml", "")
            check_config(f"{where} ConfigMap/{name}", text, kvxferd)
            conf = yaml.safe_load(text.replace("@NODE_IP@", "192.0.2.10"))
    if not conf:
        problem(where, "no ConfigMap with a kvxferd.yaml among its volumes")
    sock = ((conf or {}).get("socket") or {}).get(
        "path", "/run/kvxfer/kvxferd.sock")
    hp = host_paths(spec)
    node_dir = ""
    for m in main.get("volumeMounts") or []:
        if m["mountPath"] == os.path.dirname(sock) and m["name"] in hp:
            node_dir = hp[m["name"]]
    if not node_dir:
        problem(where, f"the socket directory {os.path.dirname(sock)} is "
                "not a hostPath volume: engine pods cannot reach it")
    # the grace period covers preStop's drain deadline and the drain
    drain_ms = ((conf or {}).get("deadlines") or {}).get(
        "drain_timeout_ms", 5000)
    stop = ((main.get("lifecycle") or {}).get("preStop") or {}).get(
        "exec", {}).get("command", [])
    deadline = int(stop[stop.index("--deadline") + 1]) \
        if "--deadline" in stop else 0
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if grace * 1000 <= deadline * 1000 + drain_ms:
        problem(where, f"terminationGracePeriodSeconds {grace} s does not "
                f"cover preStop's drain deadline ({deadline} s) plus "
                f"deadlines.drain_timeout_ms ({drain_ms} ms)")
    return node_dir


def check_engine(where: str, spec: Doc, node_dir: str, gid: int) -> None:
    """An engine pod's rules."""
    if node_dir and node_dir not in host_paths(spec).values():
        problem(where, f"no hostPath {node_dir}: the daemon's socket "
                f"directory is not mounted")
    sc = spec.get("securityContext") or {}
    groups = list(sc.get("supplementalGroups") or [])
    if gid not in groups and all(ids_of(spec, c)[1] != gid
                                 for c in spec.get("containers") or []):
        problem(where, f"not in the daemon's group {gid} (supplementalGroups"
                " or runAsGroup): the socket is mode 0660")
    if spec.get("hostPID") is not True:
        problem(where, "hostPID is not true: legacy CUDA IPC handles "
                "(cudaMalloc pools, layer-wise events) do not open across "
                "PID namespaces")


def main() -> int:
    """Check the files; print the problems."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvxferd", default="build/kvxferd")
    ap.add_argument("--dockerfile", default="Dockerfile")
    ap.add_argument("--header", default="client/include/kvxfer.h")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    uid, gid = image_ids(a.dockerfile)
    cms = configmaps(a.files)
    pods = list(pod_specs(a.files))
    node_dir = ""
    daemons = [p for p in pods if p[1].get("kind") == "DaemonSet"]
    if len(daemons) != 1:
        problem(" ".join(a.files), f"{len(daemons)} DaemonSets (expected 1)")
    for where, _, spec in daemons:
        node_dir = check_daemon(where, spec, cms, uid, gid, a.kvxferd)
    engines = [p for p in pods if p[1].get("kind") != "DaemonSet"]
    for where, _, spec in engines:
        check_engine(where, spec, node_dir, gid)
    # the example's image is this release's
    want = version(a.header)
    for where, _, spec in daemons:
        for c in containers(spec):
            tag = c.get("image", "").rpartition(":")[2]
            if tag != want:
                problem(where, f"container {c['name']}: image "
                        f"{c.get('image')}: the tag is not this release, "
                        f"{want} (client/include/kvxfer.h)")
    for p in PROBLEMS:
        print(p)
    if not PROBLEMS:
        print(f"check-k8s: kvxfer's rules hold: the DaemonSet and "
              f"{len(engines)} engine pod(s); image user {uid}:{gid}")
    return 1 if PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main())
