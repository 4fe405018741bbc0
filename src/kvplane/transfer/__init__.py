"""L3 transfer: the transfer plan (frozen data that checks its own coverage), the pure vectorised
planner that builds it from two layouts and block tables, its wire codec, and the executor that
runs it over any transport."""

from kvplane.transfer.codec import decode_plan, encode_plan
from kvplane.transfer.coverage import Coverage
from kvplane.transfer.executor import PlanExecutor, PlanRunAbortedError
from kvplane.transfer.op import TransferOp
from kvplane.transfer.plan import TransferPlan, ValidatedPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.progress import OpProgress, OpState, PlanOutcome, PlanResult, latest_end
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide
from kvplane.transfer.run import PlanRun
from kvplane.transfer.stats import PlanStats

__all__ = [
    "Coverage",
    "OpGrouping",
    "OpProgress",
    "OpState",
    "PlanExecutor",
    "PlanOptions",
    "PlanOutcome",
    "PlanResult",
    "PlanRun",
    "PlanRunAbortedError",
    "PlanSide",
    "PlanStats",
    "TransferOp",
    "TransferPlan",
    "ValidatedPlan",
    "decode_plan",
    "encode_plan",
    "latest_end",
    "plan_transfer",
]
