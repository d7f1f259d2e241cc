"""The wheel is the whole installation. scripts/build-wheel.sh packs the build under test (ENGRAM_BUILD_DIR); pip
installs it into a clean virtual environment; there, with no ENGRAM_LIB, PYTHONPATH or LD_LIBRARY_PATH and outside
the checkout, `import engram` works and loads the wheel's own libengram_c.so and bundled libraries, every dependency
of that library resolves inside the wheel or to the system's C and C++ runtime, the plugins' entry points are
visible, the version is CMake's; `pip uninstall` removes every file. One environment for the module (its creation
is the slow part); the tests run in file order, the uninstall last."""
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from conftest import REPO, build_dir

# What the wheel leaves to the machine (as scripts/build-wheel.sh): the C library family, the C++ runtime, the CUDA
# driver, NCCL (dlopen()ed) and a sanitizer build's runtimes.
SYSTEM = re.compile(r"^(libc|libm|libdl|librt|libpthread|libutil|libresolv|libanl|libmvec|libnsl|ld-linux[-a-z0-9_]*|"
                    r"libstdc\+\+|libgcc_s|libcuda|libnccl|libasan|libubsan|libtsan|liblsan)\.so")


def cmake_version():
    with open(os.path.join(build_dir(), "CMakeCache.txt")) as f:
        m = re.search(r"^CMAKE_PROJECT_VERSION:STATIC=(\S+)$", f.read(), re.M)
    assert m, "CMakeCache.txt records no CMAKE_PROJECT_VERSION"
    return m.group(1)


def tool_env():
    """The environment of pip and venv: nothing of the checkout or the build, no pip configuration of this machine."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ENGRAM_", "PYTHON", "PIP_", "VIRTUAL_ENV", "LD_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PYTHONDONTWRITEBYTECODE="1")
    return env


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, env=kw.pop("env", tool_env()), **kw)


class Venv:
    def __init__(self, root, python, pip):
        self.root, self.python, self.pip = root, python, pip
        r = run([python, "-c", "import sysconfig, json; p = sysconfig.get_paths();"
                               "print(json.dumps(sorted({p['purelib'], p['platlib']})))"])
        assert r.returncode == 0, r.stderr
        self.sites = json.loads(r.stdout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    r = run([os.path.join(REPO, "scripts", "build-wheel.sh"), "--build", build_dir(), "--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    path = r.stdout.strip().splitlines()[-1]
    assert os.path.dirname(path) == str(out) and os.listdir(out) == [os.path.basename(path)], r.stdout
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("venv") / "env")
    python = os.path.join(root, "bin", "python")
    # A bare environment driven by this interpreter's pip (--python, pip >= 22.3) is created in a fraction of a
    # second; otherwise the environment's own pip from ensurepip's bundled wheel (python3-venv; no network either way).
    r = run([sys.executable, "-m", "venv", "--without-pip", root])
    if r.returncode != 0:
        pytest.skip(f"no virtual environment can be created here (`{sys.executable} -m venv`): {r.stderr.strip()}")
    pip = [sys.executable, "-m", "pip", "--python", python]
    if run(pip + ["--version"]).returncode != 0:
        r = run([sys.executable, "-m", "venv", "--clear", root])
        if r.returncode != 0:
            pytest.skip(f"no virtual environment with pip can be created here (`{sys.executable} -m venv`, "
                        f"python3-venv's ensurepip): {r.stderr.strip()}")
        pip = [python, "-m", "pip"]
    return Venv(root, python, pip)


class Installed:
    def __init__(self, pkg, venv):
        self.pkg, self.venv, self.python = pkg, venv, venv.python


@pytest.fixture(scope="module")
def installed(wheel, venv):
    r = run(venv.pip + ["install", "--no-deps", "--no-index", wheel])
    assert r.returncode == 0, r.stdout + r.stderr
    libs = [os.path.join(s, "engram", "libengram_c.so") for s in venv.sites]
    libs = [p for p in libs if os.path.isfile(p)]
    assert len(libs) == 1, (venv.sites, r.stdout)
    return Installed(os.path.dirname(libs[0]), venv)


def test_wheel_is_tagged_for_the_platform_and_its_record_is_true(wheel):
    name = os.path.basename(wheel)
    assert re.fullmatch(rf"engram-{re.escape(cmake_version())}-py3-none-linux_x86_64\.whl", name), name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"engram-{cmake_version()}.dist-info"
        assert {f"{info}/{n}" for n in ("METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt")} <= names
        record = {}
        for line in z.read(f"{info}/RECORD").decode().splitlines():
            path, digest, size = line.rsplit(",", 2)
            record[path] = (digest, size)
        assert set(record) == names
        for path, (digest, size) in record.items():
            if path == f"{info}/RECORD":
                continue
            data = z.read(path)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data), path
        wheel_meta = z.read(f"{info}/WHEEL").decode()
        assert "Tag: py3-none-linux_x86_64" in wheel_meta and "Root-Is-Purelib: false" in wheel_meta
        meta = z.read(f"{info}/METADATA").decode()
        assert f"Version: {cmake_version()}\n" in meta and "Requires-Dist: numpy\n" in meta, meta
        src = os.path.join(REPO, "python", "engram")
        sources = {"engram/" + os.path.relpath(os.path.join(d, n), src) for d, dirs, files in os.walk(src)
                   for n in files if "__pycache__" not in d and n.endswith(".py")}
        assert not [n for n in names if n.startswith("engram/") and not n.endswith((".py", ".so")) and
                    ".so." not in n], "only the package's Python sources and its libraries are packaged"
        assert sources | {"engram/libengram_c.so", "engram/_version.py"} <= names, sources - names
        bundled = [os.path.basename(n) for n in names if n.startswith("engram/.libs/")]
        assert bundled, "no library bundled"
        assert not [b for b in bundled if SYSTEM.match(b) or b.startswith("libcudart")], bundled
        assert not [n for n in names if not n.startswith(("engram/", info + "/"))], names


def test_import_loads_the_wheels_library(installed, checkpoint, tmp_path):
    # What the process maps before engram and after it has attached (the library loaded): everything engram brought
    # in is the wheel's, the system's C and C++ runtime, or the interpreter's own modules.
    code = ("import ctypes, glob, importlib.metadata as m, json, logging, sys, threading\n"
            "def maps():\n"
            "    return {l.split()[5] for l in open('/proc/self/maps') if len(l.split()) == 6 and '.so' in l}\n"
            "before = maps()\n"
            "import engram\n"
            "t = engram.attach(sys.argv[1], socket=sys.argv[2], timeout_ms=300, backend='cpu')\n"
            "print(json.dumps({'file': engram.__file__, 'version': engram.__version__, 'dist': m.version('engram'),"
            " 'mode': t.mode, 'before': sorted(before), 'after': sorted(maps())}))\n")
    env = tool_env()
    for k in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "TSAN_OPTIONS"):  # a sanitizer build's runtime
        if k in os.environ:
            env[k] = os.environ[k]
    r = subprocess.run([installed.python, "-c", code, checkpoint, str(tmp_path / "none.sock")], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["file"] == os.path.join(installed.pkg, "__init__.py"), out["file"]
    assert out["mode"] == "PRIVATE_PINNED"
    assert out["version"] == out["dist"] == cmake_version()
    here = os.path.realpath(installed.pkg)
    after = {os.path.realpath(p) for p in out["after"]}
    assert [p for p in after if os.path.basename(p) == "libengram_c.so"] == [os.path.join(here, "libengram_c.so")]
    bundled = os.listdir(os.path.join(installed.pkg, ".libs"))
    assert sorted(b for b in bundled if os.path.join(here, ".libs", b) in after) == sorted(bundled)
    new = after - {os.path.realpath(p) for p in out["before"]}
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])  # the venv's interpreter is this one
    foreign = [p for p in new if not p.startswith((here + os.sep, stdlib + os.sep))
               and not SYSTEM.match(os.path.basename(p))]
    assert not foreign, foreign


def test_installed_library_resolves_every_dependency(installed):
    r = run(["ldd", os.path.join(installed.pkg, "libengram_c.so")])  # tool_env: no LD_LIBRARY_PATH
    assert r.returncode == 0, r.stderr
    assert "not found" not in r.stdout, r.stdout
    here = os.path.realpath(installed.pkg)
    for line in r.stdout.splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m:
            assert os.path.realpath(m.group(2)).startswith(here + os.sep) or SYSTEM.match(m.group(1)), line


def test_entry_points_are_visible(installed, tmp_path):
    code = ("import importlib.metadata as m, json\n"
            "out = {}\n"
            "for g in ('vllm.general_plugins', 'sglang.srt.plugins'):\n"
            "    e = [x for x in m.entry_points(group=g) if x.name == 'engram']\n"
            "    out[g] = [e[0].value, e[0].load().__module__] if len(e) == 1 else [x.value for x in e]\n"
            "print(json.dumps(out))\n")
    r = run([installed.python, "-c", code], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"vllm.general_plugins": ["engram.vllm:register", "engram.vllm"],
                                    "sglang.srt.plugins": ["engram.sglang:register", "engram.sglang"]}


def test_uninstall_removes_every_file(installed):
    venv = installed.venv
    r = run(venv.pip + ["uninstall", "-y", "engram"])
    assert r.returncode == 0, r.stdout + r.stderr
    left = [os.path.join(s, n) for s in venv.sites if os.path.isdir(s) for n in os.listdir(s)
            if n.lower().startswith("engram")]
    assert not left, left
