#!/usr/bin/env python3
"""Offline checks of the deployment files (deploy/kubernetes, docker/compose.yaml): they parse, and they say what the
README promises. No cluster is needed; where `kubectl` is installed, `kubectl kustomize` must also build the set.

Promised (README "Kubernetes", "Docker"): engramd runs as a DaemonSet with the socket directory and its segment
directory as hostPath volumes, no host namespaces, not privileged, a readiness probe on `engramctl ready`, its shm
directory argument pointing at the mounted segment directory, a memory limit (the table is charged to it); the segment
directory is the node's huge-page tmpfs, which a second DaemonSet mounts (the one privileged container: Bidirectional
mount propagation requires it) and engramd waits for; the example
engine pod mounts only the socket directory (read-only) and the model, no /dev/shm, no host namespaces, runs as a
non-root member of the daemon's group; the kustomization lists every manifest; compose has no `ipc: host`.
Usage: manifests_test.py REPO_ROOT (exit 0 when every check holds; each failure is printed)."""
import os
import shutil
import subprocess
import sys

import yaml

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
kdir = os.path.join(root, "deploy", "kubernetes")
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


def load(name):
    with open(os.path.join(kdir, name)) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    check(len(docs) == 1, f"{name}: one document, found {len(docs)}")
    return docs[0]


def no_host_namespaces(spec, what):
    for key in ("hostIPC", "hostPID", "hostNetwork"):
        check(not spec.get(key, False), f"{what}: {key} must not be set")
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        check(not sc.get("privileged", False), f"{what}/{c['name']}: privileged")
        check(sc.get("allowPrivilegeEscalation") is False, f"{what}/{c['name']}: allowPrivilegeEscalation must be false")
        check("ALL" in sc.get("capabilities", {}).get("drop", []), f"{what}/{c['name']}: drops ALL capabilities")


def host_paths(spec):
    return {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", []) if "hostPath" in v}


kust = load("kustomization.yaml")
check(kust.get("kind") == "Kustomization", "kustomization.yaml: kind Kustomization")
resources = kust.get("resources", [])
manifests = sorted(f for f in os.listdir(kdir) if f.endswith(".yaml") and f != "kustomization.yaml")
check(sorted(resources) == manifests, f"kustomization lists {sorted(resources)}, the directory has {manifests}")

ds = load("engramd-daemonset.yaml")
check(ds.get("kind") == "DaemonSet" and ds.get("apiVersion") == "apps/v1", "engramd is an apps/v1 DaemonSet")
pod = ds["spec"]["template"]["spec"]
check(ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items(),
      "the DaemonSet's selector matches its pods")
no_host_namespaces(pod, "engramd")
(c,) = pod["containers"]
args = c.get("args", [])
hp = host_paths(pod)
mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
check(hp.get("socket") == "/run/engramd" and mounts.get("socket", {}).get("mountPath") == "/run/engramd",
      "engramd: hostPath /run/engramd mounted at /run/engramd")
check("--shm-dir" in args, "engramd: --shm-dir given")
if "--shm-dir" in args:
    shm = args[args.index("--shm-dir") + 1]
    check(any(m["mountPath"] == shm and m["name"] in hp for m in mounts.values()),
          f"engramd: its --shm-dir {shm} is a mounted hostPath (segments outlive the pod, and are adopted)")
check("--group" in args, "engramd: --group lets non-root engines in")
# Segments on the node's huge-page tmpfs by default (node-shm-daemonset.yaml mounts it), seen through HostToContainer
# propagation, and engramd waits for it rather than publishing onto the node's disk.
check(hp.get("segments") == "/var/lib/engram/shm", f"engramd: segments on /var/lib/engram/shm ({hp.get('segments')})")
check(mounts.get("segments", {}).get("mountPropagation") == "HostToContainer",
      "engramd: the segment directory mounted with HostToContainer propagation (the tmpfs may come later)")
inits = pod.get("initContainers", [])
check(any("/var/lib/engram/shm" in " ".join(i.get("command", [])) and "tmpfs" in " ".join(i.get("command", []))
          for i in inits), "engramd: an init container waits for the tmpfs")

nshm = load("node-shm-daemonset.yaml")
check(nshm.get("kind") == "DaemonSet", "node-shm-daemonset.yaml is a DaemonSet")
nspec = nshm["spec"]["template"]["spec"]
for key in ("hostIPC", "hostPID", "hostNetwork"):
    check(not nspec.get(key, False), f"node-shm: {key} must not be set")
(nc,) = nspec["containers"]
script = " ".join(nc.get("command", []))
check("mount -t tmpfs" in script and "huge=always" in script and "/host/shm" in script,
      "node-shm: mounts a huge=always tmpfs at /host/shm")
check(host_paths(nspec) == {"shm": "/var/lib/engram/shm"}, f"node-shm: only the segment directory ({host_paths(nspec)})")
check({m["name"]: m for m in nc.get("volumeMounts", [])}.get("shm", {}).get("mountPropagation") == "Bidirectional",
      "node-shm: Bidirectional propagation (the mount reaches the host)")
check(nshm["spec"]["template"]["spec"].get("nodeSelector") == pod.get("nodeSelector"),
      "node-shm runs on the nodes engramd runs on")
# Prometheus metrics on by default: --metrics-address on all of the pod's interfaces at the port the container names
# `metrics`, which the scrape annotations name too (docs/operations.md "Metrics").
check("--metrics-address" in args, "engramd: --metrics-address given (metrics on by default)")
if "--metrics-address" in args:
    metrics_port = int(args[args.index("--metrics-address") + 1].rsplit(":", 1)[1])
    ports = {p.get("name"): p for p in c.get("ports", [])}
    check(ports.get("metrics", {}).get("containerPort") == metrics_port,
          f"engramd: a container port named metrics at {metrics_port} ({c.get('ports')})")
    notes = ds["spec"]["template"]["metadata"].get("annotations", {})
    check(notes.get("prometheus.io/scrape") == "true" and notes.get("prometheus.io/port") == str(metrics_port),
          f"engramd: scrape annotations name port {metrics_port} ({notes})")
    check(metrics_port not in (9100, 9400), "engramd: the metrics port is not node_exporter's or DCGM exporter's")
probe = c.get("readinessProbe", {}).get("exec", {}).get("command", [])
check(len(probe) >= 2 and probe[0].endswith("engramctl") and probe[1] == "ready"
      and "/run/engramd/engramd.sock" in probe, f"engramd: readinessProbe runs `engramctl ready` ({probe})")
check("memory" in c.get("resources", {}).get("limits", {}), "engramd: a memory limit (the tables are charged here)")

eng = load("engine-pod.yaml")
check(eng.get("kind") == "Pod", "engine-pod.yaml is a Pod")
espec = eng["spec"]
no_host_namespaces(espec, "engine")
ehp = host_paths(espec)
check(set(ehp.values()) <= {"/run/engramd", "/models"}, f"engine: hostPaths only the socket dir and models ({ehp})")
check(not any("shm" in p for p in ehp.values()), "engine: no /dev/shm or segment directory")
check(not any(v.get("emptyDir", {}).get("medium") == "Memory" for v in espec.get("volumes", [])),
      "engine: no memory-backed emptyDir standing in for /dev/shm")
(ec,) = espec["containers"]
emounts = {m["name"]: m for m in ec.get("volumeMounts", [])}
sock = [n for n, p in ehp.items() if p == "/run/engramd"]
check(len(sock) == 1 and emounts.get(sock[0], {}).get("mountPath") == "/run/engramd"
      and emounts[sock[0]].get("readOnly") is True, "engine: the socket directory, read-only, at /run/engramd")
eargs = ec.get("command", []) + ec.get("args", [])
check("--socket" in eargs and eargs[eargs.index("--socket") + 1] == "/run/engramd/engramd.sock",
      "engine: talks to /run/engramd/engramd.sock")
check("--shm-dir" not in eargs, "engine: is not told any shm directory")
sc = espec.get("securityContext", {})
check(sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0, "engine: runs as a non-root uid")
check(4242 in sc.get("supplementalGroups", []) or sc.get("runAsGroup") == 4242,
      "engine: a member of the engram group (gid 4242)")

with open(os.path.join(root, "docker", "Dockerfile.engramd")) as f:
    check("--gid 4242 engram" in f.read(), "engramd's image creates group engram with gid 4242")
with open(os.path.join(root, "docker", "compose.yaml")) as f:
    compose = yaml.safe_load(f)
for name, svc in compose["services"].items():
    check("ipc" not in svc, f"compose {name}: no ipc setting (descriptors need no shared IPC namespace)")
replicas = {n: s for n, s in compose["services"].items() if n.startswith("replica")}
check(len(replicas) == 4, f"compose: four replicas, found {sorted(replicas)}")
ranks = set()
for name, svc in replicas.items():
    check(any(v.startswith("/run/engramd:/run/engramd") for v in svc["volumes"]), f"compose {name}: the socket dir")
    check(not any("shm" in v for v in svc["volumes"]), f"compose {name}: no shm mount")
    check(str(svc.get("user", "0")).split(":")[0] not in ("0", "root"), f"compose {name}: not root")
    cmd = svc["command"]
    ranks.add(cmd[cmd.index("--dp-rank") + 1] if "--dp-rank" in cmd else "0")
check(ranks == {"0", "1", "2", "3"}, f"compose: one replica per DP rank, ranks {sorted(ranks)}")

kubectl = shutil.which("kubectl")
if kubectl:
    r = subprocess.run([kubectl, "kustomize", kdir], capture_output=True, text=True)
    check(r.returncode == 0, f"kubectl kustomize: {r.stderr.strip()}")
    if r.returncode == 0:
        kinds = sorted(d["kind"] for d in yaml.safe_load_all(r.stdout) if d)
        check(kinds == ["DaemonSet", "DaemonSet", "Namespace", "Pod"], f"kustomize builds {kinds}")
else:
    print("manifests_test: kubectl not installed; `kubectl kustomize` skipped, the structural checks ran")

for f in failures:
    print("FAIL:", f)
print(f"manifests_test: {len(failures)} failures")
sys.exit(1 if failures else 0)
