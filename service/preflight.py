"""What `vitserve serve` checks before it binds its port, and the exit codes it stops with.

Loading the weights and capturing the graphs take long, so they run after the port is bound (in a
background thread: /health answers meanwhile, /ready turns 200 when they are done). Everything that
can be known wrong before that is checked first, so that a misconfigured server never binds its
port and stops with one line on stderr and a code that says whose problem it is:

- 2 (`EXIT_SETTINGS`): a flag or `VITSERVE_*` variable is invalid, the device is not there, `--attention`
  names a backend that cannot serve the model's head dim in the dtype on the device, the
  `--ec-shared-storage` folder is not writable, or the port cannot be bound (in use, not allowed);
- 3 (`EXIT_MODEL`): the model cannot be loaded: no such preset nor folder, an unreadable config.json
  or preprocessor config, an unsupported family, missing safetensors, or vision tensors missing,
  unexpected or mis-shaped for the config (read from the safetensors headers, not the weights);
- 1 (`EXIT_FAILED`): a failure after the port was bound (loading or capturing failed nevertheless,
  every engine of `--data-parallel` exited).
"""

from __future__ import annotations

import socket

from service.settings import ServeSettings

EXIT_FAILED = 1
EXIT_SETTINGS = 2
EXIT_MODEL = 3


class StartupError(Exception):
    """A reason not to start: `str()` is the line to print, `code` the exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(" ".join(message.split()))
        self.code = code


def check_device(device: str) -> None:
    """--device names a device this machine has (without creating a CUDA context)."""
    import torch

    if device in ("auto", "cpu"):
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise StartupError(f"--device {device!r}: use auto, cpu, cuda or cuda:N", EXIT_SETTINGS) from None
    if dev.type != "cuda":
        raise StartupError(f"--device {device!r}: use auto, cpu, cuda or cuda:N", EXIT_SETTINGS)
    if not torch.cuda.is_available():
        raise StartupError(f"--device {device}: CUDA is not available on this machine", EXIT_SETTINGS)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise StartupError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) are visible", EXIT_SETTINGS)


def check_model(model: str) -> str:
    """The model source, without reading its weights (models.loader.check_model); returns its family."""
    from models.loader import CheckpointError, check_model

    try:
        return check_model(model)
    except CheckpointError as exc:
        raise StartupError(f"--model: {exc}", EXIT_MODEL) from None


def check_attention(settings: ServeSettings) -> None:
    """--attention can serve the model's head dim in the served dtype on the device (models.loader)."""
    from models.loader import CheckpointError, check_attention

    try:
        check_attention(settings.model, settings.device, settings.dtype, settings.attention)
    except CheckpointError as exc:
        raise StartupError(f"--model: {exc}", EXIT_MODEL) from None
    except ValueError as exc:
        raise StartupError(f"--attention {settings.attention}: {exc}", EXIT_SETTINGS) from None


def check_storage(settings: ServeSettings) -> None:
    if settings.ec_shared_storage is None:
        return
    from service.handoff.ec_storage import ECSharedStorage

    try:
        ECSharedStorage(settings.ec_shared_storage).check()
    except OSError as exc:
        raise StartupError(f"--ec-shared-storage {settings.ec_shared_storage}: not a writable folder "
                           f"({exc.strerror or exc})", EXIT_SETTINGS) from None


def bind(host: str, port: int, count: int = 1) -> list[socket.socket]:
    """`count` listening sockets on one address, bound as uvicorn binds (address reuse for quick
    restarts). Several share the port through SO_REUSEPORT, one per front: the kernel spreads new
    connections evenly over them by their addresses. One shared socket instead left it to whichever
    front woke first, and 256 keep-alive connections opened together split up to 154/102 (2-core box).
    The port is first bound alone, so that a port another server listens on is refused even if that
    server shares its own through SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def open_one(port: int, share: bool) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if share:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host, --port)",
                               EXIT_SETTINGS) from None
        return sock

    alone = open_one(port, share=False)
    if count == 1:
        return [alone]
    port = alone.getsockname()[1]  # the port the kernel chose for port 0
    alone.close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(open_one(port, share=True))
    except StartupError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def preflight(settings: ServeSettings, fronts: int = 1) -> list[socket.socket]:
    """Every check above, then the bound sockets to serve on, one per front; raises StartupError."""
    check_device(settings.device)
    check_model(settings.model)
    check_attention(settings)
    check_storage(settings)
    return bind(settings.host, settings.port, fronts)
