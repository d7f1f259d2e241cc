"""The installed package, from outside: `cmake --install` of the build's engram_dev component into a fresh prefix,
then an external project (tests/package/consumer) configured with find_package(engram) against that prefix alone and
built: every installed header compiled on its own, a C++ and a C program run, and the ```cpp snippets of README.md
and docs/*.md compiled, linked and, given --engramd and --mkckpt, run against a real engramd serving a test checkpoint
(the CPU backend; a stale call, a failing `.value()` or a header outside include/engram fails here).

    python3 tests/package/run_consumer.py --build BUILD_DIR --work SCRATCH_DIR [--engramd BIN --mkckpt BIN]
"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def fenced(path, lang):
    """The bodies of the ```<lang> blocks of a Markdown file, with their first line numbers."""
    out, body, start = [], None, 0
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if body is None and re.match(r"^```" + lang + r"\s*$", line):
            body, start = [], n + 1
        elif body is not None and line.startswith("```"):
            out.append((start, "\n".join(body)))
            body = None
        elif body is not None:
            body.append(line)
    return out


def write_snippets(dest):
    """Each ```cpp block as a function Snippet<i>() (its #includes hoisted), and snippets.h naming them."""
    dest.mkdir(parents=True)
    names = []
    for doc in DOCS:
        for line, body in fenced(doc, "cpp"):
            i = len(names)
            includes = [x for x in body.splitlines() if x.startswith("#include")]
            code = [x for x in body.splitlines() if not x.startswith("#include")]
            where = f"{doc.relative_to(REPO)}:{line}"
            code = [checked_calls(x.replace('"/run/engramd/engramd.sock"', SOCKET_MARK)
                                  .replace('"/models/DeepSeek-V4.1-Flash"', CHECKPOINT_MARK)) for x in code]
            if any(re.search(r"\bauto table = client->Attach\(", x) for x in code):
                code.append("expect_shared(*table);")
            includes = includes + ["#include <cstdlib>"]
            src = [f"// {where}"] + includes + ['#include "snippet_prelude.h"', f"void Snippet{i}() {{",
                                                 "  using namespace snippet_names;", f'#line {line} "{doc.relative_to(REPO)}"'] + code
            (dest / f"snippet{i}.cc").write_text("\n".join(src + ["}", ""]))
            names.append(f"Snippet{i}")
    header = ["#pragma once"] + [f"void {n}();" for n in names]
    header.append("inline void RunSnippets() {" + "".join(f" {n}();" for n in names) + " }")
    header.append(f"inline int SnippetCount() {{ return {len(names)}; }}")
    (dest / "snippets.h").write_text("\n".join(header) + "\n")
    return names


def checked_calls(line):
    """The line with each statement that is a bare `engine->F(...)` or `client->F(...)` call (its result dropped)
    wrapped in check(), so that a snippet's call that fails fails the run."""
    out, i = [], 0
    pat = re.compile(r"(^|;)(\s*)((?:engine|client)->\w+\()")
    while True:
        m = pat.search(line, i)
        if not m:
            out.append(line[i:])
            return "".join(out)
        start = m.start(3)
        depth, j = 0, start
        while j < len(line):  # the call's closing parenthesis
            if line[j] == "(":
                depth += 1
            elif line[j] == ")":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        call = line[start:j + 1]
        if depth != 0 or not line[j + 1:].lstrip().startswith(";"):  # not a whole statement: left as written
            out.append(line[i:j + 1])
        else:
            name = call[:call.index("(")]
            out.append(line[i:start] + f'check({call}, "{name}")')
        i = j + 1


# What the snippets' socket and checkpoint become: the driver's, read from the environment when they run.
SOCKET_MARK = 'std::getenv("ENGRAM_SNIPPET_SOCKET")'
CHECKPOINT_MARK = 'std::getenv("ENGRAM_SNIPPET_CHECKPOINT")'


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(map(str, cmd))}\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--cmake", default="cmake")
    # A sanitized build's library needs its runtime first in the process: the consumer is built with it too.
    ap.add_argument("--sanitize", default="")
    ap.add_argument("--engramd", default="")
    ap.add_argument("--mkckpt", default="")
    a = ap.parse_args()
    work = pathlib.Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    prefix = work / "prefix"
    run([a.cmake, "--install", a.build, "--prefix", prefix, "--component", "engram_dev"])
    # The public headers include only each other, the standard library and abseil.
    headers = sorted((prefix / "include" / "engram").glob("*.h"))
    assert headers, f"no headers under {prefix}/include/engram"
    for h in headers:
        for inc in re.findall(r'^#include "([^"]+)"', h.read_text(), re.M):
            if not (inc.startswith("engram/") or inc.startswith("absl/")):
                sys.exit(f"{h.name} includes {inc}, which is not installed")
    names = write_snippets(work / "snippets")
    assert names, "no ```cpp snippets found in README.md or docs/"
    build = work / "build"
    env = dict(os.environ)
    run([a.cmake, "-S", HERE / "consumer", "-B", build, "-G", "Ninja", f"-DCMAKE_PREFIX_PATH={prefix}",
         f"-DENGRAM_SNIPPETS_DIR={work / 'snippets'}", "-DCMAKE_BUILD_TYPE=Debug"]
        + ([f"-DCMAKE_CXX_FLAGS=-fsanitize={a.sanitize}", f"-DCMAKE_C_FLAGS=-fsanitize={a.sanitize}",
            f"-DCMAKE_EXE_LINKER_FLAGS=-fsanitize={a.sanitize}"] if a.sanitize else []), env=env)
    run([a.cmake, "--build", build], env=env)
    print(run([build / "consumer"]).strip())
    print(run([build / "consumer_c"]).strip())
    ran = run_snippets(a, work, build / "snippets") if a.engramd and a.mkckpt else "not run (no --engramd)"
    print(f"{len(headers)} headers compiled alone, {len(names)} C++ snippets compiled and linked; {ran}")


def run_snippets(a, work, binary):
    """Starts engramd on a fresh test checkpoint (TP 1 and 2, as the snippets ask) and runs the snippets there, on
    the CPU backend (no GPU is visible to them)."""
    ck, shm, sock = work / "ck", work / "shm", work / "run" / "engramd.sock"
    shm.mkdir(parents=True)
    run([a.mkckpt, "--out", ck])
    log_path = work / "engramd.log"
    with open(log_path, "w") as log:
        daemon = subprocess.Popen([a.engramd, "--checkpoint", ck, "--tp", "1,2", "--shm-dir", shm, "--socket", sock,
                                   "--log-level", "warn"], stdout=subprocess.DEVNULL, stderr=log)
    tail = lambda: log_path.read_text(errors="replace")[-4000:]
    try:
        for _ in range(600):
            if sock.exists() or daemon.poll() is not None:
                break
            time.sleep(0.05)
        if daemon.poll() is not None:
            sys.exit(f"engramd exited at start: {tail()}")
        if not sock.exists():
            sys.exit(f"engramd made no socket in 30 s: {tail()}")
        env = dict(os.environ, ENGRAM_SNIPPET_SOCKET=str(sock), ENGRAM_SNIPPET_CHECKPOINT=str(ck),
                   CUDA_VISIBLE_DEVICES="")
        r = subprocess.run([binary, "--run"], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(f"FAILED: the snippets (exit {r.returncode})\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}\n"
                     f"engramd's log:\n{tail()}")
        return r.stdout.strip()
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


if __name__ == "__main__":
    main()
