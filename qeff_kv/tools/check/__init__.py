"""``qeff-kv check``'s library half: the named rules a retained-state graph must pass.

:func:`check` (a graph file) and :func:`check_model` (an in-memory ``onnx_ir.Model``) run the rules of
:mod:`~qeff_kv.tools.check.rules` (the retained-state rules in :mod:`~qeff_kv.tools.check.state_rules`) and return a
:class:`CheckReport` (:mod:`~qeff_kv.tools.check.report`: the verdicts, the JSON and the text table).
"""

from qeff_kv.tools.check.report import ANY, FAIL, PASS, RULES, SCHEMA, SKIP, CheckReport, RuleResult, Violation
from qeff_kv.tools.check.rules import check, check_model

__all__ = ["ANY", "FAIL", "PASS", "RULES", "SCHEMA", "SKIP", "CheckReport", "RuleResult", "Violation", "check",
           "check_model"]
