"""What a member writes to a shared store, sealed with the key every member holds (`[cluster] key_file`): write
access to the store alone then moves nothing - a value without the key's HMAC is not the cluster's.

    seal = Seal(key)                                    # "": values are written and read as they are
    stored = seal.close("N:control", payload)           # "hmac-sha256:<hex> <payload>"
    payload = seal.open("N:control", stored)            # ValueError: not sealed with this key

The HMAC covers where the value is stored (its Redis key) with it, so a sealed value copied under another key - one
member's counts under another's name - does not open. A value copied back where it was (an older control state) does:
the control state's generation tells it from a newer one (coordination.py), and the members write theirs over it.
"""

from __future__ import annotations

import hashlib
import hmac

SEALED = "hmac-sha256:"


class Seal:
    def __init__(self, key: str) -> None:
        self._key = key.encode()

    def close(self, where: str, payload: str) -> str:
        if not self._key:
            return payload
        return f"{SEALED}{self._mac(where, payload)} {payload}"

    def open(self, where: str, value: str) -> str:
        """The payload of `value` stored under `where`; ValueError saying why it is not one of this cluster's."""
        if not self._key:
            if value.startswith(SEALED):
                raise ValueError("sealed with a cluster key this replica has not got ([cluster] key_file)")
            return value
        if not value.startswith(SEALED):
            raise ValueError("not sealed with the cluster's key ([cluster] key_file): written by someone without it")
        mac, _, payload = value[len(SEALED) :].partition(" ")
        if not hmac.compare_digest(mac, self._mac(where, payload)):
            raise ValueError("sealed with another key, or changed since: written by someone without the cluster's key")
        return payload

    def _mac(self, where: str, payload: str) -> str:
        return hmac.new(self._key, f"{where}\n{payload}".encode(), hashlib.sha256).hexdigest()
