"""Test-wide settings.

Triton kernels run under the interpreter on CPU tensors; the variable must be set before
``triton.jit`` decorates anything, so it is set here, before any test module imports the kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
