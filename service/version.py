"""The installed package's version (or the checkout's, when run from one)."""

from importlib import metadata

try:
    VERSION = metadata.version("vitserve")
except metadata.PackageNotFoundError:  # running from a checkout
    VERSION = "0.1.0"
