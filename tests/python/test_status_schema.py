"""One status document, two doors: `engramctl status --json` and engram.status() (the C ABI's engram_status_json)
give the same JSON for one real engramd holding a shared and a fallback replica, in docs/status.md's schema."""
import json
import os
import re
import subprocess

import engram
from conftest import REPO, binary

def without_live(doc):
    """The document less what changes between two calls with nothing else happening (docs/status.md, "Rules")."""
    doc = json.loads(json.dumps(doc))
    del doc["shm"]["free_bytes"]
    for g in doc["segments"]:
        del g["prewarm"]  # settles on its own after READY (docs/status.md, "Rules")
    for r in doc["replicas"]:
        del r["attached_seconds"]
    return doc


def documented_paths():
    """{path: type} from docs/status.md's field tables (as tests/unit/status_json_test.cc reads them)."""
    out, obj, fields = {}, "", False
    with open(os.path.join(REPO, "docs", "status.md"), encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            fields = fields or line == "## Fields"
            if not fields:
                continue
            h = re.match(r"^### (?:`([^`]+)`|\(top level\))\s*$", line)
            if h:
                obj = h.group(1) + "." if h.group(1) else ""
                continue
            row = re.match(r"^\| `([a-z0-9_]+)` \| ([a-z ]+) \|", line)
            if row:
                out[obj + row.group(1)] = row.group(2)
    return out


def paths(doc, prefix=""):
    for k, v in doc.items():
        yield prefix + k, v
        if isinstance(v, dict):
            yield from paths(v, prefix + k + ".")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            yield from paths(v[0], prefix + k + "[].")


def type_of(v):
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, dict):
        return "object"
    return "array of object" if v and isinstance(v[0], dict) else "array of string"


def test_engramctl_and_the_c_abi_give_the_same_document(daemon, checkpoint):
    shared = engram.attach(checkpoint, dp_size=2, dp_rank=0, socket=daemon.socket, shm_dir=daemon.shm, backend="cpu")
    # The daemon serves TP 1 only: a TP 2 rank runs a private table and says why (reasons, hints, a recent fallback).
    private = engram.attach(checkpoint, tp_size=2, tp_rank=1, dp_size=2, socket=daemon.socket, shm_dir=daemon.shm,
                            backend="cpu")
    try:
        assert (shared.mode, private.mode) == ("SHARED", "PRIVATE_PINNED")
        ctl = subprocess.run([binary("tools/engramctl"), "status", "--json", "--socket", daemon.socket],
                             capture_output=True, text=True, timeout=30)
        assert ctl.returncode == 0, ctl.stderr
        from_ctl = json.loads(ctl.stdout)
        from_abi = engram.status(daemon.socket)
    finally:
        private.close()
        shared.close()
    assert from_ctl["schema_version"] == 1
    mine = {r["mode"]: r for r in from_abi["replicas"] if r["own_pid"] == os.getpid()}
    assert sorted(mine) == ["PRIVATE_PINNED", "SHARED"], from_abi
    assert "SEGMENT_NOT_READY" in mine["PRIVATE_PINNED"]["reasons"], from_abi
    assert [h["code"] for h in mine["PRIVATE_PINNED"]["hints"]] == mine["PRIVATE_PINNED"]["reasons"], from_abi
    assert from_abi["recent_fallbacks"], from_abi
    assert without_live(from_ctl) == without_live(from_abi)
    # Numbers are numbers through both doors (protobuf's JSON printed 64-bit fields as strings).
    for doc in (from_ctl, from_abi):
        assert isinstance(doc["shm"]["total_bytes"], int) and isinstance(doc["segments"][0]["bytes"], int), doc
        assert isinstance(doc["epoch"], int) and isinstance(doc["descriptors"]["sent"], int), doc
    # Every field of the live document is documented, with its type.
    documented = documented_paths()
    for path, value in paths(from_abi):
        if isinstance(value, list) and not value:
            continue  # an empty array says nothing about its elements' type
        assert path in documented, f"{path} is not in docs/status.md"
        want = documented[path]
        got = type_of(value)
        assert got == want or (want == "number" and got == "integer"), f"{path}: {got}, docs/status.md: {want}"
