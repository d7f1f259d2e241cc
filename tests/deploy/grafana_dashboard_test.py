#!/usr/bin/env python3
"""Offline checks of the Grafana dashboard (deploy/grafana/engram.json), in the spirit of manifests_test.py.

Structure as Grafana imports it: a title, a uid of at most 40 characters, an integer schemaVersion, a `datasource`
variable of type datasource for Prometheus (so the JSON names no installation's data source), unique panel ids, panels
on the 24-column grid, known panel types, every target with a refId and an expression using that variable. Queries:
every `engram_*` name a query uses is a family daemon/metrics_text.cc renders (a histogram through its _bucket, _sum
or _count series, a counter inside rate() or increase()), brackets and quotes balance, and every family the daemon
exports is on some panel (a new metric gets a panel, or this test says so).
Usage: grafana_dashboard_test.py REPO_ROOT (exit 0 when every check holds; each failure is printed)."""
import json
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


with open(os.path.join(root, "deploy", "grafana", "engram.json")) as f:
    dash = json.load(f)
with open(os.path.join(root, "daemon", "metrics_text.cc")) as f:
    source = f.read()

# The families the daemon renders: Family("name", "type", ...) and Seconds("name", ...) (a histogram).
families = {m.group(1): m.group(2) for m in re.finditer(r'Family\("(engram_[a-z0-9_]+)",\s*"([a-z]+)"', source)}
families.update({m.group(1): "histogram" for m in re.finditer(r'Seconds\("(engram_[a-z0-9_]+)"', source)})
check(len(families) >= 10 and "engram_build_info" in families and families.get("engram_attach_seconds") == "histogram",
      f"found the daemon's families in daemon/metrics_text.cc ({sorted(families)}); update this test's extraction")

check(isinstance(dash.get("title"), str) and dash["title"], "a title")
check(isinstance(dash.get("uid"), str) and 0 < len(dash["uid"]) <= 40, "a uid of 1-40 characters")
check(isinstance(dash.get("schemaVersion"), int), "an integer schemaVersion")
variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
dsvar = variables.get("datasource", {})
check(dsvar.get("type") == "datasource" and dsvar.get("query") == "prometheus",
      "a `datasource` variable of type datasource for Prometheus")
KNOWN = {"row", "timeseries", "stat", "table", "bargauge", "gauge", "text", "heatmap"}


def valid_datasource(ds):
    return isinstance(ds, dict) and ds.get("type") == "prometheus" and ds.get("uid") == "${datasource}"


def balanced(expr):
    stack, pairs, quoted = [], {")": "(", "]": "[", "}": "{"}, False
    for ch in expr:
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "([{":
            stack.append(ch)
        elif not quoted and ch in ")]}":
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and not quoted


def metric_names(expr):
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    return re.findall(r"\b(engram_[a-z0-9_]+)\b", without_strings)


used = set()
ids = set()
exprs = []
for v in variables.values():
    if v.get("type") == "query":
        check(valid_datasource(v.get("datasource")), f"variable {v.get('name')}: uses the datasource variable")
        q = v.get("query", {})
        exprs.append((f"variable {v.get('name')}", q.get("query", "") if isinstance(q, dict) else q))
for p in dash.get("panels", []):
    title = p.get("title", "?")
    check(p.get("type") in KNOWN, f"panel {title}: type {p.get('type')} is one Grafana ships")
    check(isinstance(p.get("id"), int) and p["id"] not in ids, f"panel {title}: a unique integer id")
    ids.add(p.get("id"))
    g = p.get("gridPos", {})
    check(all(isinstance(g.get(k), int) for k in "hwxy") and g.get("x", 0) + g.get("w", 0) <= 24,
          f"panel {title}: gridPos within the 24 columns ({g})")
    if p.get("type") == "row":
        continue
    check(valid_datasource(p.get("datasource")), f"panel {title}: uses the datasource variable")
    targets = p.get("targets", [])
    check(len(targets) > 0, f"panel {title}: has a query")
    refs = [t.get("refId") for t in targets]
    check(all(refs) and len(set(refs)) == len(refs), f"panel {title}: unique refIds")
    for t in targets:
        check(valid_datasource(t.get("datasource")), f"panel {title} {t.get('refId')}: uses the datasource variable")
        exprs.append((f"panel {title} {t.get('refId')}", t.get("expr", "")))

for where, expr in exprs:
    check(bool(expr) and balanced(expr), f"{where}: brackets and quotes balance in {expr!r}")
    names = metric_names(expr)
    check(len(names) > 0, f"{where}: names an engram metric ({expr!r})")
    for name in names:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if base in families and families[base] == "histogram" and base != name:
            used.add(base)
            if name.endswith("_bucket"):
                check("histogram_quantile(" in expr and "le" in expr, f"{where}: {name} in a histogram_quantile by le")
            continue
        check(name in families, f"{where}: {name} is not a metric engramd exports ({sorted(families)})")
        check(families.get(name) != "histogram", f"{where}: the histogram {name} is used without _bucket/_sum/_count")
        if families.get(name) == "counter":
            check(re.search(r"(rate|increase)\(\s*" + name, expr) is not None,
                  f"{where}: the counter {name} inside rate() or increase()")
        used.add(name)

check(used >= set(families), f"families on no panel: {sorted(set(families) - used)}")

for f in failures:
    print("FAIL:", f)
print(f"grafana_dashboard_test: {len(failures)} failures")
sys.exit(1 if failures else 0)
