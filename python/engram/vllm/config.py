"""The vLLM plugin's settings: additional_config["engram"] of a vLLM instance, else the environment (for
launchers that cannot pass it), and the names vLLM's own configuration gives the fields the plugin reads (they
differ between vLLM versions). Pure functions; thread-safe."""
import json
import os
import sys

from .. import _plugin

DEFAULT_SOCKET = "/run/engramd/engramd.sock"
_KEYS = {"socket": str, "require": bool, "checkpoint": str, "timeout_ms": int}
ENV = {"socket": "ENGRAM_VLLM_SOCKET", "require": "ENGRAM_VLLM_REQUIRE", "checkpoint": "ENGRAM_VLLM_CHECKPOINT",
       "timeout_ms": "ENGRAM_VLLM_TIMEOUT_MS"}

# vLLM's EngramConfig fields the plugin reads, each under every name a vLLM version has given it (first wins).
ENGRAM_CONFIG_FIELDS = {"cpu_offload": ("cpu_offload",), "dp_shared_memory": ("dp_shared_memory",)}
# Read only to say, in the log, that vLLM's transparent-huge-page packing applies to vLLM's own table.
THP_FIELDS = ("use_thp", "thp_packing")
PARALLEL_FIELDS = ("data_parallel_size", "data_parallel_rank", "data_parallel_size_local", "enable_elastic_ep")


class PluginConfig:
    """The plugin's settings for one vLLM instance."""

    def __init__(self, socket=DEFAULT_SOCKET, require=False, checkpoint=None, timeout_ms=10000, source=""):
        self.socket, self.require, self.checkpoint, self.timeout_ms = socket, require, checkpoint, timeout_ms
        self.source = source

    def __repr__(self):
        return (f"PluginConfig(socket={self.socket!r}, require={self.require}, checkpoint={self.checkpoint!r}, "
                f"timeout_ms={self.timeout_ms}, source={self.source})")


def _env_bool(name, text):
    try:
        return _plugin.env_bool(name, text)
    except ValueError as e:
        raise ValueError(f"engram.vllm: {e}") from None


def plugin_config(additional_config, environ=None):
    """The PluginConfig that vLLM's additional_config (a dict, a JSON text or None) and the environment give, or
    None when the plugin is not configured. ValueError for an unknown key or a value of the wrong type."""
    environ = os.environ if environ is None else environ
    extra = additional_config
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else {}
    section = extra.get("engram") if isinstance(extra, dict) else None
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"engram.vllm: additional_config['engram'] must be an object, got {type(section).__name__}")
    # The environment turns the plugin on with ENGRAM_VLLM=1 or any of its keys' variables (a REQUIRE alone must not
    # be ignored); ENGRAM_VLLM=0 turns that off (additional_config["engram"] still configures it).
    switch = environ.get("ENGRAM_VLLM", "")
    env_on = _env_bool("ENGRAM_VLLM", switch) or any(environ.get(v) for v in ENV.values())
    if switch.strip() and not _env_bool("ENGRAM_VLLM", switch):
        env_on = False
    if section is None and not env_on:
        return None
    section = dict(section or {})
    unknown = sorted(set(section) - set(_KEYS))
    if unknown:
        raise ValueError(f"engram.vllm: unknown key(s) {', '.join(unknown)} in additional_config['engram'] "
                         f"(known: {', '.join(_KEYS)})")
    values = {}
    for key, kind in _KEYS.items():
        if key in section:
            v = section[key]
            if kind is int and (isinstance(v, bool) or not isinstance(v, int)) or \
                    kind is not int and not isinstance(v, kind):
                raise ValueError(f"engram.vllm: additional_config['engram']['{key}'] must be {kind.__name__}, "
                                 f"got {v!r}")
            values[key] = v
        elif environ.get(ENV[key]):
            text = environ[ENV[key]]
            if kind is bool:
                values[key] = _env_bool(ENV[key], text)
            elif kind is int:
                try:
                    values[key] = int(text)
                except ValueError:
                    raise ValueError(f"engram.vllm: {ENV[key]}={text!r}: expected an integer") from None
            else:
                values[key] = text
    if "timeout_ms" in values and not 1 <= values["timeout_ms"] <= 2**31 - 1:
        raise ValueError(f"engram.vllm: timeout_ms must be in [1, 2147483647], got {values['timeout_ms']}")
    for key in ("socket", "checkpoint"):
        if key in values and "\0" in values[key]:
            raise ValueError(f"engram.vllm: {key} contains a NUL byte")
    source = "additional_config" if section or not env_on else "environment"
    return PluginConfig(source=source, **values)


def environment_config(environ=None):
    """The PluginConfig the environment alone gives (what register() can see: vLLM's configuration does not exist
    yet when plugins load), or None."""
    return plugin_config(None, environ)


def vllm_version():
    v = sys.modules.get("vllm")
    return getattr(v, "__version__", "unknown") if v is not None else "not imported"


def engram_config_values(ecfg):
    """{field: value} for the EngramConfig fields the plugin reads, and the list of those it lacks (under every
    name a vLLM version gave them)."""
    values, missing = {}, []
    for field, names in ENGRAM_CONFIG_FIELDS.items():
        for n in names:
            if ecfg is not None and hasattr(ecfg, n):
                values[field] = getattr(ecfg, n)
                break
        else:
            missing.append(field)
    return values, missing


def thp_setting(ecfg):
    """(field name, value) of vLLM's THP packing setting, or (None, None) where the version has none."""
    for n in THP_FIELDS:
        if ecfg is not None and hasattr(ecfg, n):
            return n, getattr(ecfg, n)
    return None, None
