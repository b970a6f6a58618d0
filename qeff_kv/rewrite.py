"""The documented public door ``qeff_kv.rewrite``: the same module object as :mod:`qeff_kv.tools.rewrite`, so
``from qeff_kv.rewrite import ...`` keeps working after the house moved into layer folders."""

import sys

from qeff_kv.tools import rewrite as _module

sys.modules[__name__] = _module
