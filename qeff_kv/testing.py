"""The documented public door ``qeff_kv.testing``: the same module object as :mod:`qeff_kv.tools.testing`, so
``from qeff_kv.testing import ...`` keeps working after the house moved into layer folders."""

import sys

from qeff_kv.tools import testing as _module

sys.modules[__name__] = _module
