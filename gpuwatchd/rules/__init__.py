"""Starvation rules: the rule file, the expression language, the engine (docs/rules.md)."""

from gpuwatchd.rules.engine import RULE_METRICS, RuleEngine, RuleFileWatcher, Transition
from gpuwatchd.rules.language import Catalog
from gpuwatchd.rules.ruleset import RulesError, RuleSet, load_rules, parse_rules

__all__ = [
    "RULE_METRICS",
    "Catalog",
    "RuleEngine",
    "RuleFileWatcher",
    "RuleSet",
    "RulesError",
    "Transition",
    "load_rules",
    "parse_rules",
]
