"""Whether the model hub can be reached, asked once before loading a hub id.

Offline, ``from_pretrained`` of a hub id retries for about 30 seconds before it falls back to the local cache or
fails. A machine that cannot open a connection to the hub's host loads hub ids from the cache alone instead
(``local_files_only=True``): a cached model loads at once, a missing one fails at once.
"""

from __future__ import annotations

import socket
import urllib.parse
import urllib.request

from huggingface_hub import constants

CONNECT_TIMEOUT_S = 3.0


def hub_reachable(timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """False when ``HF_HUB_OFFLINE`` is set or the hub's host (``HF_ENDPOINT``) refuses or cannot be resolved;
    True behind a proxy (``HTTPS_PROXY`` and the like: the proxy, not this machine, reaches the hub)."""
    if constants.HF_HUB_OFFLINE:
        return False
    if urllib.request.getproxies():
        return True
    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False
