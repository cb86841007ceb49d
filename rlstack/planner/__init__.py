"""Memory planner: per-GPU bytes of every role in every phase, from the model's config.json alone."""

from rlstack.planner.build import PHASES, Item, KvReport, Plan, plan_for_config
from rlstack.planner.report import format_plan, plan_to_dict, summarize_plan
from rlstack.planner.validate import plan_for_validate

__all__ = [
    "PHASES",
    "Item",
    "KvReport",
    "Plan",
    "plan_for_config",
    "plan_for_validate",
    "format_plan",
    "plan_to_dict",
    "summarize_plan",
]
