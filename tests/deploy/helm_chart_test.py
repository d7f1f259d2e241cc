#!/usr/bin/env python3
"""Offline checks of the Helm chart (deploy/helm/engramd), in the spirit of manifests_test.py.

Helm is not in Debian 12 and npm has no Go-template renderer, so CI renders the chart with template_subset.py, a
small renderer of exactly the template features the chart uses (anything else, or a value values.yaml lacks, is a
failure). Where `helm` is installed, `helm lint` and `helm template` run too and must give the same objects.

Promised (docs/operations.md "Helm"): with the default values the chart renders the DaemonSets of deploy/kubernetes
(the same pod specs and annotations; the chart's labels add the release's); every `.Values` a template names is in
values.yaml; the chart's version is the project's; metrics are on by default at the port the args, the container
port and the scrape annotations agree on; the ServiceMonitor toggle adds a headless Service and a ServiceMonitor that
select the DaemonSet's pods by the port named `metrics`; turning metrics off removes all of it; the shm, group,
port and image values reach the objects they name.
Usage: helm_chart_test.py REPO_ROOT (exit 0 when every check holds; each failure is printed)."""
import copy
import os
import re
import shutil
import subprocess
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from template_subset import Renderer, TemplateError  # noqa: E402

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
chart_dir = os.path.join(root, "deploy", "helm", "engramd")
kdir = os.path.join(root, "deploy", "kubernetes")
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


def read(path):
    with open(path) as f:
        return f.read()


chart = yaml.safe_load(read(os.path.join(chart_dir, "Chart.yaml")))
values = yaml.safe_load(read(os.path.join(chart_dir, "values.yaml")))
tdir = os.path.join(chart_dir, "templates")
templates = {n: read(os.path.join(tdir, n)) for n in sorted(os.listdir(tdir))}

m = re.search(r"project\(engram\b[^)]*\bVERSION\s+([0-9.]+)", read(os.path.join(root, "CMakeLists.txt")))
check(chart.get("apiVersion") == "v2" and chart.get("name") == "engramd", "Chart.yaml: apiVersion v2, name engramd")
check(m is not None and chart.get("version") == m.group(1) and chart.get("appVersion") == m.group(1),
      f"Chart.yaml: version and appVersion are the project's ({m and m.group(1)}), got {chart.get('version')}, "
      f"{chart.get('appVersion')}")

# Every .Values path any template names, taken or not in the default render, is in values.yaml.
for name, text in templates.items():
    for ref in sorted(set(re.findall(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text))):
        v = values
        for part in ref[1:].split("."):
            if not isinstance(v, dict) or part not in v:
                check(False, f"{name}: .Values{ref} is not in values.yaml")
                break
            v = v[part]
for key in ("image", "shm", "group", "adminGroup", "metrics", "resources", "nodeSelector"):
    check(key in values, f"values.yaml: has {key}")


def render(overrides=None, release="engramd", namespace="engram"):
    vals = copy.deepcopy(values)
    for path, v in (overrides or {}).items():
        d = vals
        *head, last = path.split(".")
        for p in head:
            d = d[p]
        d[last] = v
    r = Renderer(vals, {"Name": release, "Namespace": namespace, "Service": "Helm"},
                 {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]})
    for n, text in templates.items():
        if n.startswith("_"):
            r.load_helpers(text)
    objects = []
    for n, text in templates.items():
        if n.startswith("_"):
            continue
        out = r.render(text)
        if n.endswith(".yaml"):
            objects += [d for d in yaml.safe_load_all(out) if d]
    return objects


def by_kind(objects):
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def pod(o):
    return o["spec"]["template"]["spec"]


def container(o, name):
    return next(c for c in pod(o)["containers"] if c["name"] == name)


try:
    default = by_kind(render())
except TemplateError as e:
    print("FAIL: the chart does not render:", e)
    sys.exit(1)

check(sorted(default) == [("DaemonSet", "engram-node-shm"), ("DaemonSet", "engramd")],
      f"default values render the two DaemonSets only, got {sorted(default)}")
for name, file in (("engramd", "engramd-daemonset.yaml"), ("engram-node-shm", "node-shm-daemonset.yaml")):
    kust = yaml.safe_load(read(os.path.join(kdir, file)))
    mine = default.get(("DaemonSet", name))
    if mine is None:
        continue
    check(pod(mine) == pod(kust), f"{name}: the chart's pod spec differs from deploy/kubernetes/{file}:\n"
          f"  chart: {pod(mine)}\n  kustomize: {pod(kust)}")
    check(mine["spec"]["template"]["metadata"].get("annotations") ==
          kust["spec"]["template"]["metadata"].get("annotations"), f"{name}: the pod annotations differ from {file}")
    for where in (lambda o: o["metadata"]["labels"], lambda o: o["spec"]["template"]["metadata"]["labels"]):
        check(where(kust).items() <= where(mine).items(), f"{name}: the chart's labels keep {file}'s")
    check(mine["spec"]["selector"]["matchLabels"].items() <= mine["spec"]["template"]["metadata"]["labels"].items(),
          f"{name}: the selector matches its pods")

# The ServiceMonitor toggle: a headless Service over the metrics port and a ServiceMonitor selecting it.
sm = by_kind(render({"metrics.serviceMonitor.enabled": True, "metrics.serviceMonitor.labels": {"release": "kps"}}))
svc, mon, ds = sm.get(("Service", "engramd-metrics")), sm.get(("ServiceMonitor", "engramd")), sm[("DaemonSet", "engramd")]
check(svc is not None and mon is not None, f"serviceMonitor.enabled renders a Service and a ServiceMonitor ({sorted(sm)})")
if svc and mon:
    check(svc["spec"].get("clusterIP") == "None", "the metrics Service is headless (one endpoint per node)")
    check(svc["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"], "the Service selects the DaemonSet's pods")
    check(svc["spec"]["ports"] == [{"name": "metrics", "port": 9464, "targetPort": "metrics", "protocol": "TCP"}],
          f"the Service's port is the metrics port ({svc['spec']['ports']})")
    check(mon["apiVersion"] == "monitoring.coreos.com/v1", "ServiceMonitor of monitoring.coreos.com/v1")
    check(mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items(),
          "the ServiceMonitor selects the Service")
    check(mon["spec"]["endpoints"][0]["port"] == "metrics" and mon["spec"]["endpoints"][0]["path"] == "/metrics",
          "the ServiceMonitor scrapes the port named metrics at /metrics")
    check(mon["metadata"]["labels"].get("release") == "kps", "serviceMonitor.labels reach the ServiceMonitor")
    check(mon["spec"]["namespaceSelector"] == {"matchNames": ["engram"]}, "the ServiceMonitor looks in the release's namespace")
check(by_kind(render({"metrics.service.enabled": True})).get(("Service", "engramd-metrics")) is not None,
      "metrics.service.enabled alone renders the Service")

# Metrics off: no flag, no port, no annotations, no Service even with the ServiceMonitor asked for.
off = by_kind(render({"metrics.enabled": False, "metrics.serviceMonitor.enabled": True}))
c = container(off[("DaemonSet", "engramd")], "engramd")
check("--metrics-address" not in c["args"] and "ports" not in c, "metrics.enabled false: no --metrics-address, no port")
check("annotations" not in off[("DaemonSet", "engramd")]["spec"]["template"]["metadata"], "metrics off: no annotations")
check(sorted(k for k, _ in off) == ["DaemonSet", "DaemonSet"], f"metrics off: nothing else rendered ({sorted(off)})")

# Values reach what they name.
custom = by_kind(render({"metrics.port": 9500, "shm.hostPath": "/mnt/huge", "shm.mountNode": False,
                         "shm.size": "50%", "group": "engines", "adminGroup": "ops", "extraArgs": ["--tickets", "2"],
                         "image.repository": "registry.local/engramd", "image.tag": "0.2.0",
                         "checkpoints": ["/models/a", "/models/b"], "tp": "1,2"}))
ds = custom[("DaemonSet", "engramd")]
c = container(ds, "engramd")
a = c["args"]
check(a[a.index("--metrics-address") + 1] == "0.0.0.0:9500" and c["ports"][0]["containerPort"] == 9500 and
      ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9500",
      "metrics.port reaches the flag, the container port and the annotation")
check([a[i + 1] for i, x in enumerate(a) if x == "--checkpoint"] == ["/models/a", "/models/b"], "checkpoints")
check(a[a.index("--tp") + 1] == "1,2" and a[a.index("--group") + 1] == "engines" and
      a[a.index("--admin-group") + 1] == "ops" and a[-2:] == ["--tickets", "2"], f"tp, groups, extraArgs ({a})")
check({v["name"]: v["hostPath"]["path"] for v in pod(ds)["volumes"]}["segments"] == "/mnt/huge", "shm.hostPath")
check(c["image"] == "registry.local/engramd:0.2.0", f"image ({c['image']})")
check(("DaemonSet", "engram-node-shm") not in custom, "shm.mountNode false: no node-shm DaemonSet")
mounted = by_kind(render({"shm.size": "50%"}))[("DaemonSet", "engram-node-shm")]
check("size=50%" in " ".join(container(mounted, "mount")["command"]), "shm.size reaches the tmpfs mount")

helm = shutil.which("helm")
if helm:
    r = subprocess.run([helm, "lint", chart_dir], capture_output=True, text=True)
    check(r.returncode == 0, f"helm lint: {r.stdout}{r.stderr}")
    for overrides, flags in (({}, []), ({"metrics.serviceMonitor.enabled": True}, ["--set", "metrics.serviceMonitor.enabled=true"])):
        r = subprocess.run([helm, "template", "engramd", chart_dir, "--namespace", "engram"] + flags,
                           capture_output=True, text=True)
        check(r.returncode == 0, f"helm template: {r.stderr.strip()}")
        if r.returncode == 0:
            theirs = by_kind(d for d in yaml.safe_load_all(r.stdout) if d)
            check(theirs == by_kind(render(overrides)), f"helm template {flags} and the subset renderer disagree")
else:
    print("helm_chart_test: helm not installed; rendered with tests/deploy/template_subset.py only")

for f in failures:
    print("FAIL:", f)
print(f"helm_chart_test: {len(failures)} failures")
sys.exit(1 if failures else 0)
