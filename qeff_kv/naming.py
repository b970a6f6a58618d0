"""The documented public door ``qeff_kv.naming``: the same module object as :mod:`qeff_kv.contract.naming`, so
``from qeff_kv.naming import ...`` keeps working after the house moved into layer folders."""

import sys

from qeff_kv.contract import naming as _module

sys.modules[__name__] = _module
