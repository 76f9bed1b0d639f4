"""Compatibility shims for package combinations the toolkit meets in the wild. Import before numba.cuda.

NumPy 2.5 removed ``np.row_stack`` (an alias of ``np.vstack``), but some numba-cuda releases still register
an overload for it while ``numba.cuda`` is imported, which then fails with
``AttributeError: module 'numpy' has no attribute 'row_stack'``. The H200 image pairs numpy 2.5.2 with such
a numba-cuda; restoring the alias (nothing in this toolkit uses it) lets numba.cuda import.
"""

from __future__ import annotations

import numpy as np

if "row_stack" not in vars(np):
    np.row_stack = np.vstack  # noqa: NPY201
