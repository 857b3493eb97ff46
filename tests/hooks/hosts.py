"""A hosts file the tests write: `socket.getaddrinfo` answers its names from it, as the system's resolver
answers from /etc/hosts, so that `dns:` sources resolve through their real code path to addresses a test
controls. Names under `.test` (reserved for testing, RFC 2606) are answered from the file alone: one the
file does not list has no address (EAI_NONAME, as a headless Service with no ready pod); other names go to
the system's resolver.

    python -m tests.hooks.hosts [serve flags]     # the server, with VITSERVE_TEST_HOSTS naming the file

The file holds `ADDRESS NAME [NAME...]` lines; write it whole and rename it into place (readers see the old
or the new file, never half of one).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

_system_getaddrinfo = socket.getaddrinfo


def lookup(path: str, name: str) -> list[str] | None:
    """The addresses the file gives `name`, in file order; None when it is not a name the file answers."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        lines = []
    found = [line.split()[0] for line in lines if line.strip() and not line.startswith("#")
             and name in line.split()[1:]]
    if found or name.rstrip(".").endswith(".test"):
        return found
    return None


def getaddrinfo_from(path: str) -> Any:
    """`socket.getaddrinfo` answering from the file at `path` first."""

    def getaddrinfo(host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0
                    ) -> list[Any]:
        addresses = lookup(path, host) if isinstance(host, str) else None
        if addresses is None:
            return _system_getaddrinfo(host, port, family, type, proto, flags)
        out = []
        for address in addresses:
            kind = socket.AF_INET6 if ":" in address else socket.AF_INET
            if family in (0, kind):
                sockaddr = (address, int(port or 0)) if kind == socket.AF_INET else (address, int(port or 0), 0, 0)
                out.append((kind, type or socket.SOCK_STREAM, proto or socket.IPPROTO_TCP, "", sockaddr))
        if not out:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return out

    return getaddrinfo


def install(path: str) -> None:
    socket.getaddrinfo = getaddrinfo_from(path)


def write(path: str, names: dict[str, list[str]]) -> None:
    """The file listing each name's addresses, put in place at once."""
    lines = [f"{address} {name}" for name, addresses in names.items() for address in addresses]
    with open(path + ".new", "w") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(path + ".new", path)


if __name__ == "__main__":
    install(os.environ["VITSERVE_TEST_HOSTS"])
    from service.http.server import main

    sys.exit(main())
