"""Row selection, one language for steering ("which tokens to steer") and capture ("which rows
to record"): the spec (``spec.py``), its fields and their validation (``fields.py``), and a spec
resolved for one prompt length (``sides.py``)."""

from steerable.selection.fields import SELECT_FIELDS, SHORTCUTS
from steerable.selection.spec import SelectLike, SelectSpec

__all__ = ["SelectSpec", "SelectLike", "SELECT_FIELDS", "SHORTCUTS"]
