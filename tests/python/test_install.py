"""`cmake --install` puts the package and libengram_c.so where `import engram` works from any directory, with no
environment variables: the library is found beside the package."""
import os
import subprocess
import sys

from conftest import build_dir


def test_installed_package_imports_and_attaches(tmp_path, checkpoint):
    prefix = tmp_path / "prefix"
    subprocess.run(["cmake", "--install", build_dir(), "--prefix", str(prefix)], check=True,
                   stdout=subprocess.DEVNULL)
    found = [os.path.join(d, "engram") for d, dirs, _ in os.walk(prefix) if "engram" in dirs
             and d.endswith("-packages")]
    assert len(found) == 1, found
    site = os.path.dirname(found[0])
    assert os.path.exists(os.path.join(found[0], "libengram_c.so"))
    env = {k: v for k, v in os.environ.items() if k not in ("ENGRAM_LIB", "ENGRAM_BUILD_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = site
    code = ("import engram, sys; t = engram.attach(sys.argv[1], socket=sys.argv[2], timeout_ms=300, backend='cpu');"
            "print(engram._lib.path); print(t.mode)")
    r = subprocess.run([sys.executable, "-c", code, checkpoint, str(tmp_path / "none.sock")], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if not l.startswith("[")]
    assert lines[0].startswith(str(prefix)), lines
    assert lines[1] == "PRIVATE_PINNED"
    # vLLM finds the plugin through the installed distribution's entry points (group vllm.general_plugins).
    code = ("import importlib.metadata as m; eps = m.entry_points(group='vllm.general_plugins');"
            "e = [x for x in eps if x.name == 'engram']; print(e[0].value); f = e[0].load(); print(f.__module__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["engram.vllm:register", "engram.vllm"], r.stdout
    code = code.replace("vllm.general_plugins", "sglang.srt.plugins")
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["engram.sglang:register", "engram.sglang"], r.stdout
