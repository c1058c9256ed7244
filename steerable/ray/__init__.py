"""steerable on Ray: the one package that imports Ray (an optional extra, ``pip install
'steerable[ray]'``), so ``import steerable`` never does.

``Generate`` and ``Capture`` are Ray Data transforms (``Dataset.map_batches``, one engine per
actor); see ``steerable.ray.data``.
"""

from steerable.errors import InvalidRequestError

_MIN_RAY = (2, 40)


class RayNotInstalled(ImportError, InvalidRequestError):
    """Ray is missing or too old: the ``ImportError`` an import raises, and equally the
    ``InvalidRequestError`` (naming ``ray``) a call that asked for Ray reports."""


try:
    import ray
    import ray.data  # noqa: F401 (Ray Data: the ray[data] extra)
except ImportError as err:
    raise RayNotInstalled(f"ray: steerable.ray needs Ray with Ray Data ({err}): pip install 'steerable[ray]'") from err

if tuple(int(part) for part in ray.__version__.split(".")[:2] if part.isdigit()) < _MIN_RAY:
    raise RayNotInstalled(f"ray: steerable.ray needs ray >= {'.'.join(map(str, _MIN_RAY))}, found {ray.__version__}: "
                          "pip install 'steerable[ray]'")

from steerable.ray.data import Capture, Generate  # noqa: E402 (after the check, so a missing Ray says so)

__all__ = ["Capture", "Generate", "RayNotInstalled"]
