"""What both sides of the bus share.

Owns the connection we open (``connection``: dbus-fast with a write path that waits
out a full send buffer), small helpers for the bus itself (``util``), the async client
the CLI, the shim and the demo use (``client``), the Admit-only peer socket
(``peer``; the shim's own lean client for it: ``peerlink``), Admit's call and reply
framed by hand for both ends (``frames``) and the numbered event stream behind
``watch`` and SSE (``events``).

May import: ``core``, ``files``.
"""
