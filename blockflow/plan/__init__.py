"""Plans: which blocks exist, where they run, and which path each task takes.

``schema`` is the file format, ``load`` reads and checks a plan, ``checks`` holds the checks
that need the whole graph, ``deployment`` is the validated :class:`Plan` and how it deploys,
``packs`` which task heads run as one model, ``naming`` names the generated Triton models,
``direct_pairs`` says which neighbouring blocks may hand over directly, ``side_inputs`` which
task inputs besides the image each model, block and task takes, ``crossing`` a plan across servers,
``memory`` estimates what a plan needs.
"""

from blockflow.plan.deployment import Block, Deployed, Plan, Task
from blockflow.plan.load import load_plan, parse_plan, parse_plan_text
from blockflow.plan.packs import HeadPack

__all__ = ["Block", "Deployed", "HeadPack", "Plan", "Task", "load_plan", "parse_plan", "parse_plan_text"]
