"""The SGLang plugin's per-process state: what register() or install() put in place (SGLang's Engram module, its own
EngramEmbedding, ours, and which way: the hook registry or the module's attribute), the process's attachment to
engramd, and the fallback reasons logged already (each is logged once). Every read and write holds _lock (re-entrant:
a layer built while the lock is held attaches under it)."""
import logging
import threading

logger = logging.getLogger("sglang.engram")

_lock = threading.RLock()
_state = {"registered": False, "module": None, "original": None, "installed": None, "via": None, "attachment": None,
          "fallback_logged": set()}
