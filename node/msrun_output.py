"""What a node's msrun writes that the node agent acts on while msrun runs.

msrun (MindSpore 2.9, `parallel/cluster/process_entity/_api.py`) polls its workers once a
second; when one has exited with an error it writes `KILLED_OTHERS`
(`mindpulse/frameworks/msrun_text.py`) and SIGKILLs the rest.
The job is over then, but msrun still waits for its scheduler, and the scheduler waits for
the killed ranks' heartbeats to time out (MS_NODE_TIMEOUT, 30 s by default) before it
exits: measured, 37 s from the failure to msrun's exit on a 2-rank CPU run.
"""

from __future__ import annotations


class LogScanner:
    """Finds `needle` in a file another process appends to, reading each byte once."""

    def __init__(self, path: str, needle: str):
        self.path = path
        self.needle = needle.encode()
        self._offset = 0
        self._tail = b""

    def found(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return False
        if not chunk:
            return False
        self._offset += len(chunk)
        text = self._tail + chunk
        if self.needle in text:
            return True
        # keep what could be the start of a needle cut by this read
        self._tail = text[-(len(self.needle) - 1):] if len(self.needle) > 1 else b""
        return False
